"""Import and export of ``.safetensors`` files; tensor names are core_array path strings."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import jax
import numpy as np

from cairn.checkpoint._errors import CheckpointError, TargetMismatchError
from cairn.core_array import (
    as_numpy_dtype,
    atomic_write,
    canonical_dtype,
    flatten_with_paths,
    unflatten,
)

# canonical dtype name <-> safetensors dtype tag
_TO_ST = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
    "complex64": "C64",
}
_FROM_ST = {v: k for k, v in _TO_ST.items()}


def save_safetensors(path: str | os.PathLike, tree: Any, metadata: dict[str, str] | None = None) -> None:
    """Write the arrays of ``tree`` to a ``.safetensors`` file named by their path strings.

    ``jax.Array`` leaves are gathered to the host (the whole array must be addressable).
    Every leaf must be an array of a dtype safetensors knows (``F32``, ``BF16``,
    ``F8_E4M3``...); ``metadata`` is an optional str->str dict stored in the header.
    The file is written atomically (:func:`cairn.core_array.atomic_write`: a temporary
    sibling, fsync'd, renamed, the directory fsync'd), so ``path`` is never half written.

    Args:
      path: the ``.safetensors`` file to write (replaced if it exists).
      tree: a pytree of NumPy arrays or fully addressable ``jax.Array`` s.
      metadata: an optional str->str dict for the file's header.

    >>> import tempfile, numpy as np
    >>> f = tempfile.mkdtemp() + "/w.safetensors"
    >>> save_safetensors(f, {"layers": [{"w": np.eye(2, dtype=np.float32)}]})
    >>> sorted(load_safetensors(f)["layers"]["0"])
    ['w']
    """
    import safetensors

    flat = flatten_with_paths(tree)
    tensors = {}
    keep_alive: list[np.ndarray] = []  # serialize_file reads raw pointers into these
    for name, leaf in flat.items():
        if isinstance(leaf, jax.Array):
            if not leaf.is_fully_addressable:
                raise ValueError(f"leaf {name!r}: a multi-process jax.Array cannot go to one safetensors file")
            arr = np.asarray(leaf)
        elif isinstance(leaf, (np.ndarray, np.generic)):
            arr = np.asarray(leaf)
        else:
            raise TypeError(
                f"leaf {name!r} of type {type(leaf).__qualname__} cannot be stored in safetensors "
                "(only arrays)"
            )
        dname = canonical_dtype(arr.dtype)
        if dname not in _TO_ST:
            raise TypeError(
                f"leaf {name!r}: dtype {dname} has no safetensors equivalent "
                f"(supported: {', '.join(sorted(_TO_ST))})"
            )
        arr = np.ascontiguousarray(arr)
        keep_alive.append(arr)
        tensors[name or "_"] = safetensors.TensorSpec(
            dtype=dname, shape=list(arr.shape), data_ptr=arr.ctypes.data, data_len=arr.nbytes
        )
    if metadata is not None:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise TypeError(f"safetensors metadata must map str to str; bad keys: {bad}")
    atomic_write(path, lambda tmp: safetensors.serialize_file(tensors, tmp, metadata))
    del keep_alive


def _read_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise CheckpointError(f"{path}: header length {n} is implausible; not a safetensors file")
        header = json.loads(f.read(n))
    return header, 8 + n


def load_safetensors(path: str | os.PathLike, target: Any = None) -> Any:
    """Read a ``.safetensors`` file into a pytree keyed by the tensor names as paths.

    Without ``target`` the result is nested dicts of NumPy arrays (``"a/0/w"`` becomes
    ``{"a": {"0": {"w": ...}}}``). With ``target`` the result has its structure; leaves that
    are ``jax.Array`` or ``jax.ShapeDtypeStruct`` with a sharding get that sharding, and
    every missing, extra or differently shaped tensor is listed in one
    :class:`TargetMismatchError`.

    Args:
      path: the ``.safetensors`` file to read.
      target: an optional pytree whose structure, shapes and shardings the result takes.
    """
    path = os.fspath(path)
    header, offset = _read_header(path)
    header.pop("__metadata__", None)
    arrays: dict[str, np.ndarray] = {}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for name, info in header.items():
            tag = info["dtype"]
            if tag not in _FROM_ST:
                raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {tag}")
            dtype = as_numpy_dtype(_FROM_ST[tag])
            start, stop = info["data_offsets"]
            count = int(np.prod(info["shape"], dtype=np.int64))
            if stop - start != count * dtype.itemsize or offset + stop > size:
                raise CheckpointError(f"{path}: tensor {name!r} has inconsistent data offsets")
            arr = np.empty(info["shape"], dtype)
            f.seek(offset + start)
            if f.readinto(arr.reshape(-1).view(np.uint8).data) != stop - start:
                raise CheckpointError(f"{path}: tensor {name!r} is truncated")
            arrays[name] = arr
    if target is None:
        return unflatten(arrays)
    tflat = flatten_with_paths(target, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    problems = [f"missing in file: {p!r}" for p in tflat if p not in arrays]
    problems += [f"not in target: {p!r}" for p in arrays if p not in tflat]
    for p, t in tflat.items():
        if p in arrays and hasattr(t, "shape") and tuple(t.shape) != arrays[p].shape:
            problems.append(f"shape differs at {p!r}: file {arrays[p].shape}, target {tuple(t.shape)}")
    if problems:
        raise TargetMismatchError(
            f"safetensors file {path} does not match the target: {len(problems)} difference(s):\n  - "
            + "\n  - ".join(problems)
        )
    out = {}
    for p, t in tflat.items():
        a = arrays[p]
        want = getattr(t, "dtype", None)
        if want is not None and np.dtype(want) != a.dtype:
            a = a.astype(want)
        sharding = getattr(t, "sharding", None)
        out[p] = jax.device_put(a, sharding) if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)) else a
    return unflatten(out, like=target, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
