"""TensorStore layer: zarr3 arrays (crc32c per chunk) inside one OCDBT database per process."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from cairn.checkpoint._errors import CheckpointError, ChecksumError

#: Chunks are at most this many bytes: big enough for disk-speed I/O with little per-chunk
#: overhead, small enough that a reader needing part of an array does not read much more.
CHUNK_BYTES = 64 * 1024 * 1024

_ZARR_DTYPES = {
    "bool", "int2", "int4", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
    "uint64", "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
    "float8_e3m4", "float8_e8m0fnu", "float4_e2m1fn",
}

#: Chunk cache used only when several local target shards need the same saved chunk
#: (restoring onto finer shards than were saved): each such chunk is then read once.
SHARED_CHUNK_CACHE_BYTES = 4 * CHUNK_BYTES

_context: ts.Context | None = None


def _make_context(cache_bytes: int) -> ts.Context:
    return ts.Context(
        {
            "cache_pool": {"total_bytes_limit": cache_bytes},
            "file_io_concurrency": {"limit": max(8, 2 * (os.cpu_count() or 2))},
            "file_io_sync": True,
        }
    )


def context() -> ts.Context:
    """The shared TensorStore context: no chunk cache (data is streamed, never kept)."""
    global _context
    if _context is None:
        _context = _make_context(0)
    return _context


def cached_context() -> ts.Context:
    """A fresh context with a small chunk cache, for one restore: dropped when it ends, so
    nothing read stays in memory or is served stale to a later restore."""
    return _make_context(SHARED_CHUNK_CACHE_BYTES)


def chunks_shared(regions: Sequence[Sequence[Sequence[int]]], chunk: Sequence[int]) -> bool:
    """Whether two of ``regions`` touch the same chunk of a regular grid of ``chunk`` shape."""
    boxes = [[(lo // c, (hi - 1) // c) for (lo, hi), c in zip(r, chunk)] for r in regions]
    boxes = [b for b, r in zip(boxes, regions) if all(hi > lo for lo, hi in r)]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if all(max(a0, b0) <= min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b)):
                return True
    return False


def storage_dtype(dtype: np.dtype) -> str:
    """zarr3 data type used on disk for ``dtype`` (raw unsigned bytes when zarr lacks it)."""
    name = dtype.name
    if name in _ZARR_DTYPES:
        return name
    return {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}[dtype.itemsize]


def to_storage(x: np.ndarray, sdtype: str) -> np.ndarray:
    if x.dtype.name == sdtype:
        return x
    return x.view(np.dtype(sdtype))


def chunk_shape_for(shard_shape: Sequence[int], itemsize: int) -> list[int]:
    """Chunk = the shard, halved along its leading dimensions until it fits ``CHUNK_BYTES``."""
    chunk = [max(1, int(s)) for s in shard_shape]
    dim = 0
    while math.prod(chunk) * itemsize > CHUNK_BYTES and dim < len(chunk):
        if chunk[dim] > 1:
            chunk[dim] = (chunk[dim] + 1) // 2
        else:
            dim += 1
    return chunk


def codecs(compression: str | None) -> list[dict]:
    out: list[dict] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if compression is None:
        pass
    elif compression == "zstd" or compression.startswith("zstd:"):
        level = int(compression.split(":")[1]) if ":" in compression else 3
        out.append({"name": "zstd", "configuration": {"level": level, "checksum": False}})
    else:
        raise ValueError(f"compression must be None, 'zstd' or 'zstd:<level>', got {compression!r}")
    out.append({"name": "crc32c"})
    return out


def db_dir(ckpt_dir: str, process: int) -> str:
    return os.path.join(ckpt_dir, "d", f"process_{process}")


def _spec(db: str, path: str) -> dict:
    return {
        "driver": "zarr3",
        "kvstore": {
            "driver": "ocdbt",
            "base": f"file://{os.path.abspath(db)}/",
            "path": f"{path}/" if path else "",
            "config": {"max_inline_value_bytes": 1024},
        },
    }


def open_for_write(
    db: str,
    path: str,
    shape: Sequence[int],
    sdtype: str,
    chunk: Sequence[int],
    compression: str | None,
) -> ts.Future:
    """Start creating the zarr3 array of leaf ``path`` in database ``db`` (chunked, crc32c)."""
    spec = _spec(db, path)
    spec["metadata"] = {
        "shape": list(shape),
        "data_type": sdtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": codecs(compression),
        "fill_value": _fill(sdtype),
    }
    return ts.open(spec, create=True, context=context())


def _fill(sdtype: str) -> bool | float | int | list[float]:
    if sdtype == "bool":
        return False
    if sdtype.startswith("complex"):
        return [0.0, 0.0]
    if sdtype.startswith(("float", "bfloat")):
        return 0.0
    return 0


def open_for_read(db: str, path: str, ctx: ts.Context | None = None) -> ts.Future:
    return ts.open(_spec(db, path), open=True, read=True, context=ctx or context())


def region_slices(region: Sequence[Sequence[int]]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def intersect(
    a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]
) -> list[tuple[int, int]] | None:
    """The region two regions (``[[start, stop], ...]``) share, or ``None`` if empty."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return out


def volume(region: Sequence[Sequence[int]]) -> int:
    return math.prod(b - a for a, b in region)


def translate_error(err: BaseException, path: str) -> Exception:
    text = str(err)
    if "checksum" in text.lower() or "crc32c" in text.lower() or "DATA_LOSS" in text:
        return ChecksumError(f"checksum mismatch while reading leaf {path!r}: {text}")
    return CheckpointError(f"failed to read leaf {path!r}: {text}")


def read_into(
    out: np.ndarray,
    region: Sequence[Sequence[int]],
    sources: Sequence[tuple[Any, Sequence[Sequence[int]]]],
    path: str,
) -> list[ts.WriteFutures]:
    """Start reads filling ``out`` (covering ``region`` of the global array) from ``sources``.

    ``sources`` are (opened TensorStore, saved region) pairs with disjoint regions; only the
    intersections with ``region`` are read, so a process reads just the chunks it needs.
    """
    futures = []
    covered = 0
    dst = ts.array(out, copy=False, write=True)
    for store, saved in sources:
        inter = intersect(region, saved)
        if inter is None:
            continue
        covered += volume(inter)
        local = tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(inter, region))
        futures.append(dst[local].write(store[region_slices(inter)]))
    if covered != volume(region):
        raise CheckpointError(
            f"leaf {path!r}: the checkpoint holds {covered} of the {volume(region)} elements "
            f"needed for region {list(map(tuple, region))} (a process's data is missing)"
        )
    return futures


def aligned_empty(shape: Sequence[int], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is ``align``-byte aligned.

    JAX's CPU backend adopts aligned NumPy buffers without copying, so a restored array costs
    no second copy of the data.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(tuple(shape))
