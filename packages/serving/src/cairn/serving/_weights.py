"""Weights on disk: flat leaves keyed by their core_array path, one TensorStore zarr3
array each (crc32c on every chunk), and ``QArray`` leaves split into their parts.

A ``QArray`` at path ``p`` crosses the export boundary as ``p/qvalue``, ``p/scale`` and
(when present) ``p/zero_point``; sub-byte values are packed two or four to a byte (stored
and held in memory packed), and its qtype, dtype and layout go in the manifest, so the
exported function rebuilds the same ``QArray`` inside.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from cairn.core_array import (
    QArray,
    QuantLayout,
    as_numpy_dtype,
    canonical_dtype,
    flatten_with_paths,
    join_path,
    unflatten,
)
from cairn.serving._hashing import ModelFormatError, ModelIntegrityError

__all__ = ["split_params", "rebuild_params", "write_weights", "read_weights", "WEIGHTS_DIR", "BOUNDARY_DTYPES"]

WEIGHTS_DIR = "weights"
_PARTS = ("qvalue", "scale", "zero_point")


def _is_qarray(x: Any) -> bool:
    return isinstance(x, QArray)


def _host_array(path: str, x: Any) -> np.ndarray:
    import jax

    try:
        arr = np.asarray(jax.device_get(x))
    except Exception as e:  # noqa: BLE001 - any conversion failure is a bad leaf
        raise ValueError(f"params leaf {path!r}: cannot be converted to an array ({e})") from None
    if arr.dtype.kind in "OUSV" and not _is_ml_dtype(arr.dtype):
        raise ValueError(f"params leaf {path!r}: dtype {arr.dtype} is not numeric; weights must be arrays")
    # store what JAX will actually hold: float64 becomes float32 unless x64 is enabled
    canon = jax.dtypes.canonicalize_dtype(arr.dtype)
    return arr.astype(canon) if canon != arr.dtype else arr


def _is_ml_dtype(dt: np.dtype) -> bool:
    try:
        canonical_dtype(dt)
    except ValueError:
        return False
    return True


# dtypes jax.export cannot serialize, and the exact, same-size stand-in each crosses the
# export boundary as (ml_dtypes holds them one per byte, so nothing grows); the exported
# function casts back inside
BOUNDARY_DTYPES = {"int2": "int8", "uint2": "uint8", "float6_e2m3fn": "float8_e4m3fn", "float6_e3m2fn": "float8_e5m2"}


def split_params(params: Any) -> tuple[dict[str, np.ndarray], dict[str, dict], dict[str, str]]:
    """Flat host arrays keyed by path, the ``QArray`` metadata keyed by the QArray's path,
    and ``{path: dtype}`` for leaves stored as a stand-in (:data:`BOUNDARY_DTYPES`).

    Raises:
      ValueError: a leaf that is not an array, naming its path.
    """
    flat: dict[str, np.ndarray] = {}
    qmeta: dict[str, dict] = {}
    for path, leaf in flatten_with_paths(params, is_leaf=_is_qarray).items():
        if not isinstance(leaf, QArray):
            flat[path] = _host_array(path, leaf)
            continue
        was_packed = leaf.packed_length is not None
        q = leaf.pack()
        for part in _PARTS:
            value = getattr(q, part)
            if value is not None:
                flat[join_path(path, part)] = _host_array(join_path(path, part), value)
        qmeta[path] = {
            **q.metadata(),
            # packed for storage only: the model saw one value per element, so unpack inside
            "unpack": not was_packed and q.packed_length is not None,
        }
    casts: dict[str, str] = {}
    for path, arr in flat.items():
        name = canonical_dtype(arr.dtype)
        if name in BOUNDARY_DTYPES:
            casts[path] = name
            flat[path] = arr.astype(as_numpy_dtype(BOUNDARY_DTYPES[name]))
    return flat, qmeta, casts


def rebuild_params(flat: Mapping[str, Any], qmeta: Mapping[str, Mapping], like: Any,
                   casts: Mapping[str, str] | None = None) -> Any:
    """The params tree (shaped like ``like``) from flat leaves, stand-ins cast back to
    their dtypes (``casts``) and ``QArray`` leaves rebuilt from their parts (works on
    tracers: this runs inside the exported function)."""
    if casts:
        flat = {p: v.astype(as_numpy_dtype(casts[p])) if p in casts else v for p, v in flat.items()}
    items: dict[str, Any] = {p: v for p, v in flat.items() if not any(p.startswith(q + "/") for q in qmeta)}
    for path, m in qmeta.items():
        q = QArray(
            flat[join_path(path, "qvalue")],
            flat[join_path(path, "scale")],
            flat.get(join_path(path, "zero_point")),
            qtype=m["qtype"],
            layout=QuantLayout.from_json(m["layout"]),
            dtype=m["dtype"],
            packed_length=m["packed_length"],
        )
        items[path] = q.unpack() if m.get("unpack") else q
    return unflatten(items, like=like, is_leaf=_is_qarray)


_CHUNK_BYTES = 64 << 20


def _chunk_shape(shape: tuple[int, ...], itemsize: int) -> list[int]:
    """Whole rows, at most ~64 MiB a chunk (one chunk for anything smaller): big weights
    are read in parallel and a crc32c failure names a smaller piece."""
    dims = [max(1, d) for d in shape]
    if dims:
        row = max(1, itemsize) * (int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1)
        dims[0] = max(1, min(dims[0], _CHUNK_BYTES // row))
    return dims


def _ts_spec(path: str, shape: tuple[int, ...], dtype: str | None, itemsize: int = 1) -> dict:
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
    if dtype is not None:
        spec["metadata"] = {
            "shape": list(shape),
            "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": _chunk_shape(shape, itemsize)}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        }
    return spec


def _contiguous(a: np.ndarray) -> np.ndarray:
    # np.ascontiguousarray would make a 0-d array 1-d
    a = np.asarray(a)
    return a if a.flags.c_contiguous else a.copy(order="C")


def _stored_form(arr: np.ndarray) -> np.ndarray:
    """``arr`` as bytes (uint8, one trailing axis of itemsize when > 1), for dtypes zarr3
    has no name for (uint4, uint2)."""
    raw = arr.view(np.uint8) if arr.dtype.itemsize == 1 else arr.reshape(*arr.shape, 1).view(np.uint8)
    return _contiguous(raw)


def write_weights(root: str, flat: Mapping[str, np.ndarray]) -> list[dict]:
    """Write every array under ``root/weights/<i>`` and return the manifest entries
    ``{"path", "key", "dtype", "shape", "stored_dtype"}`` (in path order)."""
    import tensorstore as ts

    entries, pending = [], []
    ctx = ts.Context()
    for i, path in enumerate(sorted(flat)):
        arr = _contiguous(flat[path])
        key = f"{WEIGHTS_DIR}/{i}"
        dtype = canonical_dtype(arr.dtype)
        data, stored = arr, dtype
        try:
            spec = _ts_spec(os.path.join(root, key), arr.shape, dtype, arr.dtype.itemsize)
            store = ts.open(spec, create=True, context=ctx).result()
        except ValueError:
            data = _stored_form(arr)
            stored = "uint8"
            spec = _ts_spec(os.path.join(root, key), data.shape, stored)
            store = ts.open(spec, create=True, context=ctx).result()
        pending.append(store.write(data))
        entries.append({"path": path, "key": key, "dtype": dtype, "shape": list(arr.shape), "stored_dtype": stored})
    for f in pending:
        f.result()
    return entries


def _check_entry(e: Any) -> None:
    ok = isinstance(e, dict) and all(k in e for k in ("path", "key", "dtype", "shape", "stored_dtype"))
    if not ok or not isinstance(e["key"], str) or not e["key"].startswith(WEIGHTS_DIR + "/"):
        raise ModelFormatError(f"manifest: malformed weight entry {e!r}", "manifest.json")


def read_weights(root: str, entries: list) -> dict[str, np.ndarray]:
    """Read the arrays back as ``{path: np.ndarray}`` in their original dtypes.

    Raises:
      ModelIntegrityError: an array that TensorStore cannot read (e.g. a crc32c
        mismatch) or whose dtype or shape differs from the manifest's, naming its key.
    """
    import tensorstore as ts

    ctx = ts.Context()
    opened = []
    for e in entries:
        _check_entry(e)
        try:
            opened.append((e, ts.open(_ts_spec(os.path.join(root, e["key"]), (), None), open=True, context=ctx)))
        except ValueError as err:
            raise ModelIntegrityError(f"{e['key']}: cannot open the weight array {e['path']!r}: {err}", e["key"]) from None
    out: dict[str, np.ndarray] = {}
    for e, fut in opened:
        try:
            store = fut.result()
            data = store.read().result()
        except Exception as err:  # noqa: BLE001 - TensorStore raises ValueError subclasses and others
            raise ModelIntegrityError(f"{e['key']}: cannot read the weight array {e['path']!r}: {err}", e["key"]) from None
        want = as_numpy_dtype(e["dtype"])
        shape = tuple(e["shape"])
        if e["stored_dtype"] != e["dtype"]:
            data = _contiguous(data).view(want).reshape(shape)
        if data.dtype != want or data.shape != shape:
            raise ModelIntegrityError(
                f"{e['key']}: weight {e['path']!r} is {data.dtype}{list(data.shape)}, the manifest says "
                f"{e['dtype']}{list(shape)}", e["key"]
            )
        out[e["path"]] = data
    return out
