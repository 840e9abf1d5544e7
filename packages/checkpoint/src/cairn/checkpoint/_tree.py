"""Snapshot a pytree to host buffers (the blocking part of a save) and write it (the rest)."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from cairn.checkpoint import _fs, _multihost, _storage, _structure
from cairn.checkpoint._errors import CheckpointError
from cairn.core_array import ArraySpec, canonical_dtype, flatten_with_paths

FORMAT = "cairn.checkpoint"
#: 2: every JSON file carries a SHA-256 checksum (version 1 files are still read).
FORMAT_VERSION = 2
METADATA_FILE = "_METADATA.json"


def is_prng_key(x: Any) -> bool:
    """Whether ``x`` (an array, ``jax.ShapeDtypeStruct`` or dtype) is a typed PRNG key
    (``jax.random.key(...)``), stored as its key data."""
    dtype = getattr(x, "dtype", x)
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def regions_file(process: int) -> str:
    return f"_REGIONS.process_{process}.json"


def norm_index(index: tuple, shape: tuple[int, ...]) -> list[list[int]]:
    """A JAX shard index (tuple of slices) as ``[[start, stop], ...]`` per dimension."""
    out = []
    for sl, dim in zip(index, shape):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise CheckpointError(f"strided shard index {index} is not supported")
        out.append([start, stop])
    for dim in shape[len(index) :]:
        out.append([0, dim])
    return out


def _sharding_json(sharding: Any) -> dict | None:
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        return {"mesh": dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape)))}
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return None
    return {"type": type(sharding).__name__}


def _encode_scalar(path: str, leaf: Any) -> dict:
    if isinstance(leaf, bool):
        return {"kind": "scalar", "type": "bool", "value": leaf}
    if isinstance(leaf, int):
        return {"kind": "scalar", "type": "int", "value": leaf}
    if isinstance(leaf, float):
        return {"kind": "scalar", "type": "float", "value": leaf.hex()}
    if isinstance(leaf, complex):
        return {"kind": "scalar", "type": "complex", "value": [leaf.real.hex(), leaf.imag.hex()]}
    if isinstance(leaf, str):
        return {"kind": "scalar", "type": "str", "value": leaf}
    raise TypeError(
        f"cannot checkpoint leaf {path!r} of type {type(leaf).__module__}.{type(leaf).__qualname__}: "
        "expected a jax.Array, a numpy array or scalar, or a Python bool/int/float/complex/str"
    )


def decode_scalar(entry: dict) -> Any:
    t, v = entry["type"], entry["value"]
    if t == "bool":
        return bool(v)
    if t == "int":
        return int(v)
    if t == "float":
        return float.fromhex(v)
    if t == "complex":
        return complex(float.fromhex(v[0]), float.fromhex(v[1]))
    return str(v)


@dataclass
class Snapshot:
    """Everything a save needs, on the host: safe to write from a background thread."""

    leaves: dict[str, dict]
    writes: list[tuple[str, list[list[int]], np.ndarray]] = field(default_factory=list)
    nbytes: int = 0
    structure: Any = None  # container kinds (see _structure), stored for target-less restores


def snapshot(tree: Any, *, copy_host: bool, compression: str | None) -> Snapshot:
    """Copy device data to host (zero-copy on CPU) and describe every leaf.

    ``copy_host`` copies NumPy leaves, so the caller may modify them while a background
    write runs. Every process records the whole tree's description; it writes only the
    shards it owns (``replica_id == 0`` among its addressable shards) and the primary
    process alone writes NumPy leaves.
    """
    _storage.codecs(compression)  # validate early, in the caller's thread
    flat = flatten_with_paths(tree)
    primary = _multihost.is_primary()
    snap = Snapshot(leaves={}, structure=_structure.describe(tree, flat))
    on_device: list[tuple[str, list[list[int]], Any]] = []
    for path, leaf in flat.items():
        impl = None
        if isinstance(leaf, jax.Array) and is_prng_key(leaf):
            if leaf.is_deleted():
                raise CheckpointError(f"cannot checkpoint leaf {path!r}: the jax.Array was deleted (donated?)")
            # a typed PRNG key array: its uint32 key data is stored, with the implementation's name
            impl, leaf = str(jax.random.key_impl(leaf)), jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array):
            if leaf.is_deleted():
                raise CheckpointError(f"cannot checkpoint leaf {path!r}: the jax.Array was deleted (donated?)")
            dtype = np.dtype(leaf.dtype)
            sd = _storage.storage_dtype(dtype)
            shape = tuple(int(d) for d in leaf.shape)
            chunk = _storage.chunk_shape_for(leaf.sharding.shard_shape(leaf.shape), dtype.itemsize)
            snap.leaves[path] = {
                "kind": "jax",
                "spec": ArraySpec.from_array(leaf).to_json(),
                "storage_dtype": sd,
                "chunk_shape": chunk,
                "sharding": _sharding_json(leaf.sharding),
            }
            if impl is not None:
                snap.leaves[path]["prng_impl"] = impl
            for shard in leaf.addressable_shards:
                if shard.replica_id != 0:
                    continue
                data = shard.data
                if shard.device.platform != "cpu":
                    data.copy_to_host_async()
                on_device.append((path, norm_index(shard.index, shape), data))
        elif isinstance(leaf, (np.ndarray, np.generic)):
            arr = np.asarray(leaf)
            dtype = arr.dtype
            try:
                dname = canonical_dtype(dtype)
            except (ValueError, TypeError, KeyError) as err:
                raise TypeError(
                    f"cannot checkpoint leaf {path!r}: numpy dtype {dtype} is not a supported "
                    f"array dtype ({err})"
                ) from None
            sd = _storage.storage_dtype(dtype)
            snap.leaves[path] = {
                "kind": "numpy" if isinstance(leaf, np.ndarray) else "numpy_scalar",
                "spec": ArraySpec(arr.shape, dname).to_json(),
                "storage_dtype": sd,
                "chunk_shape": _storage.chunk_shape_for(arr.shape, dtype.itemsize),
                "sharding": None,
            }
            if primary:
                host = np.array(arr, order="C", copy=True) if copy_host else np.require(arr, requirements="C")
                snap.writes.append((path, [[0, d] for d in arr.shape], host))
        else:
            snap.leaves[path] = _encode_scalar(path, leaf)
    for path, region, data in on_device:
        snap.writes.append((path, region, np.asarray(data)))
    snap.nbytes = sum(w[2].nbytes for w in snap.writes)
    return snap


def write(snap: Snapshot, directory: str, *, compression: str | None, extra: dict | None = None) -> None:
    """Write this process's share of ``snap`` under ``directory`` (data, regions, metadata).

    Every file is fsync'd (TensorStore syncs its data files and directories); the caller
    commits.
    """
    pidx = _multihost.process_index()
    db = _storage.db_dir(directory, pidx)
    by_path: dict[str, list[tuple[list[list[int]], np.ndarray]]] = {}
    for path, region, host in snap.writes:
        by_path.setdefault(path, []).append((region, host))
    opened = {}
    for path in by_path:
        e = snap.leaves[path]
        shape = e["spec"]["shape"]
        opened[path] = _storage.open_for_write(
            db, path, shape, e["storage_dtype"], e["chunk_shape"], compression
        )
    futures = []
    for path, items in by_path.items():
        try:
            store = opened[path].result()
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"cannot create storage for leaf {path!r} in {db}: {err}") from err
        sd = snap.leaves[path]["storage_dtype"]
        for region, host in items:
            if math.prod(b - a for a, b in region) == 0:
                continue
            src = _storage.to_storage(host, sd)
            view = store[_storage.region_slices(region)] if region else store
            futures.append((path, view.write(src, can_reference_source_data_indefinitely=True)))
    errors = []
    for path, fut in futures:
        try:
            fut.result()
        except Exception as err:  # noqa: BLE001
            errors.append(f"{path!r}: {err}")
    if errors:
        raise CheckpointError(
            f"writing checkpoint {directory} failed for {len(errors)} leaves: " + "; ".join(errors)
        )
    regions = {path: [r for r, _ in items] for path, items in by_path.items()}
    _fs.write_json_durable(os.path.join(directory, regions_file(pidx)), regions)
    if pidx == 0:
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "process_count": _multihost.process_count(),
            "compression": compression,
            "time": time.time(),
            "leaves": snap.leaves,
        }
        if snap.structure is not None:
            meta["structure"] = snap.structure
        if extra:
            meta["extra"] = extra
        _fs.write_json_durable(os.path.join(directory, METADATA_FILE), meta)
    _fs.fsync_dir(directory)
