"""``cairn-autotune``: list and autotune the kernel ops of a function, offline, in one command.

Example::

    cairn-autotune mypkg.train:loss_fn --args-spec "f32[8,2048,16,64]" "f32[8,2048,4,64]" \\
        "f32[8,2048,4,64]" --mode fwd_bwd

imports ``loss_fn``, traces it on arrays of those shapes and dtypes, measures every
implementation and config of each kernel op it calls, and writes the winners to the user
cache file (``$CAIRN_KERNELS_CACHE_DIR``, else ``~/.cache/cairn/kernels``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from cairn.kernels import _autotune, _cache, _trace

_DTYPES = {
    "f32": jnp.float32,
    "f16": jnp.float16,
    "bf16": jnp.bfloat16,
    "f64": jnp.float64,
    "i32": jnp.int32,
    "i64": jnp.int64,
    "i8": jnp.int8,
    "u8": jnp.uint8,
    "bool": jnp.bool_,
}


def parse_spec(text: str) -> jax.ShapeDtypeStruct:
    """``"bf16[8,128,4,64]"`` -> ``jax.ShapeDtypeStruct((8, 128, 4, 64), bfloat16)``.

    Dtypes: the short names (f32, f16, bf16, f64, i32, i64, i8, u8, bool) or any NumPy name.

    Raises:
      ValueError: text that is not ``dtype[d0,d1,...]``.
    """
    match = re.fullmatch(r"\s*([A-Za-z0-9_]+)\[([0-9,\s]*)\]\s*", text)
    if not match:
        raise ValueError(
            f"--args-spec entry {text!r} is not of the form dtype[d0,d1,...], e.g. bf16[8,128,4,64]"
        )
    name, dims = match.groups()
    try:
        dtype = _DTYPES.get(name) or jnp.dtype(name)
    except TypeError as e:
        raise ValueError(f"--args-spec entry {text!r}: unknown dtype {name!r}") from e
    shape = tuple(int(d) for d in dims.split(",") if d.strip())
    return jax.ShapeDtypeStruct(shape, dtype)


def load_function(target: str) -> Any:
    """Import ``"package.module:attr.path"`` and return the object.

    Raises:
      ValueError: not of the form ``module:function``, or the attribute is missing.
    """
    if ":" not in target:
        raise ValueError(f"target {target!r} must be module:function (e.g. mypkg.train:loss_fn)")
    module_name, attr = target.split(":", 1)
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"target {target!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``cairn-autotune``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="cairn-autotune", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="module:function to trace (e.g. mypkg.train:loss_fn)")
    parser.add_argument(
        "--args-spec", nargs="*", default=[], help="one dtype[shape] per positional argument"
    )
    parser.add_argument(
        "--kwargs-json", default="{}", help="static keyword arguments as a JSON object"
    )
    parser.add_argument("--mode", choices=("fwd", "fwd_bwd"), default="fwd")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument(
        "--output", default=None, help="cache file to write (default: the user cache file)"
    )
    parser.add_argument("--list", action="store_true", help="only list the kernel ops found")
    ns = parser.parse_args(argv)
    try:
        fn = load_function(ns.target)
        specs = [parse_spec(s) for s in ns.args_spec]
        kwargs = json.loads(ns.kwargs_json)
    except (ValueError, ImportError) as e:
        print(f"cairn-autotune: {e}", file=sys.stderr)
        return 2
    calls = _trace.ops_in(fn, *specs, **kwargs)
    print(f"{len(calls)} kernel call(s) in {ns.target} on {_cache.device_kind()!r}:")
    for call in calls:
        print("  " + call.describe())
    if ns.list:
        return 0
    if not calls:
        return 0
    result = _autotune.autotune(fn, *specs, iterations=ns.iterations, mode=ns.mode, **kwargs)
    print(result.table())
    path = result.save(ns.output)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
