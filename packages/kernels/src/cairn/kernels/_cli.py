"""``cairn-kernels``: list, autotune and inspect the kernel choices of a function, offline.

Example::

    cairn-kernels tune mypkg.train:loss_fn --args-spec "f32[8,2048,16,64]" \\
        "f32[8,2048,4,64]" "f32[8,2048,4,64]" --mode fwd_bwd [--force]

imports ``loss_fn``, traces it on arrays of those shapes and dtypes, lists each kernel
call with where its choice comes from, measures every implementation and config of each
kernel op it calls (a bucket already in the cache file is reused unless ``--force``), and
writes the winners, with the load and versions they were measured under, to the user
cache file (``$CAIRN_KERNELS_CACHE_DIR``, else ``$XDG_CACHE_HOME/cairn/kernels``, else
``~/.cache/cairn/kernels``). ``cairn-kernels show`` prints that file's entries and how
each was measured. ``cairn-autotune ARGS`` (0.1's command) is ``cairn-kernels tune --force ARGS``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cairn-kernels", description="List, autotune and inspect cairn.kernels choices."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    tune = sub.add_parser(
        "tune",
        help="trace module:function, list its kernel calls and autotune them",
        description="Trace module:function on arrays of --args-spec, list its kernel calls, "
        "measure every implementation and config of each (reusing entries already in the "
        "cache file unless --force) and write the winners to the user cache file.",
    )
    tune.add_argument("target", help="module:function to trace (e.g. mypkg.train:loss_fn)")
    tune.add_argument(
        "--args-spec", nargs="*", default=[], help="one dtype[shape] per positional argument"
    )
    tune.add_argument("--kwargs-json", default="{}", help="static keyword arguments as a JSON object")
    tune.add_argument("--mode", choices=("fwd", "fwd_bwd"), default="fwd")
    tune.add_argument("--iterations", type=int, default=5)
    tune.add_argument("--output", default=None, help="cache file to write (default: the user cache file)")
    tune.add_argument("--list", action="store_true", help="only list the kernel calls and their choices")
    tune.add_argument(
        "--force", action="store_true", help="re-measure buckets that already have a cached entry"
    )
    show = sub.add_parser("show", help="print the cache entries of this device and how each was measured")
    show.add_argument("--file", default=None, help="cache file to read (default: the user cache file)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``cairn-kernels`` (``tune`` and ``show``); returns the exit status."""
    ns = _parser().parse_args(argv)
    if ns.command == "show":
        return _show(ns.file)
    return _tune(ns)


def autotune_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``cairn-autotune`` (kept from 0.1): ``cairn-kernels tune --force``."""
    return main(["tune", "--force", *(sys.argv[1:] if argv is None else argv)])


def _tune(ns: argparse.Namespace) -> int:
    try:
        fn = load_function(ns.target)
        specs = [parse_spec(s) for s in ns.args_spec]
        kwargs = json.loads(ns.kwargs_json)
    except (ValueError, ImportError) as e:
        print(f"cairn-kernels: {e}", file=sys.stderr)
        return 2
    calls = _trace.ops_in(fn, *specs, **kwargs)
    print(f"{len(calls)} kernel call(s) in {ns.target} on {_cache.device_kind()!r}:")
    for call in calls:
        print(f"  {call.describe()}\n    chosen by {call.describe_source()}")
    if ns.list or not calls:
        return 0
    ctx = _cache.measurement_context()
    load = ctx["loadavg"]
    if load and ctx["cpu_count"] and load[0] > 0.5 * ctx["cpu_count"]:
        print(
            f"note: load average {load[0]:g} on {ctx['cpu_count']} CPUs: other work competes "
            "with the timings; they are recorded with this load. Re-run with --force on a "
            "quiet machine to re-measure."
        )
    result = _autotune.autotune(
        fn, *specs, iterations=ns.iterations, mode=ns.mode, force=ns.force, **kwargs
    )
    print(result.table())
    path = result.save(ns.output)
    print(f"wrote {path}")
    return 0


def _show(file: str | None) -> int:
    kind = _cache.device_kind()
    path = pathlib.Path(file) if file else _cache.cache_dir() / (_cache.file_stem(kind) + ".json")
    if not path.is_file():
        print(f"no cache file {path}: every kernel call uses the untuned default heuristic")
        return 0
    try:
        doc = _cache.load_file(path)
    except _cache.CacheFileError as e:
        print(f"cairn-kernels: {e}", file=sys.stderr)
        return 2
    print(f"{path} (schema {doc['schema_version']}, device {doc['device_kind']!r}):")
    for op, es in sorted(doc["entries"].items()):
        for key, entry in sorted(es.items()):
            how = _trace.describe_source("cache", entry.get("measured", {}))
            print(f"  {op} {key}: {entry['implementation']} {json.dumps(entry['config'])} "
                  f"{entry['time_ms']:.3f} ms, {how}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
