"""Restore: compare the target with the checkpoint, then read only the needed regions."""

from __future__ import annotations

import collections
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from cairn.checkpoint import _fs, _ownership, _storage, _structure, _tree
from cairn.checkpoint._errors import CheckpointCorruptError, CheckpointError, TargetMismatchError
from cairn.core_array import (
    ArraySpec,
    PathError,
    as_numpy_dtype,
    compile_pattern,
    flatten_with_paths,
    path_matches,
    unflatten,
)

#: Upper bound on bytes of reads outstanding at once (one larger buffer may exceed it).
READ_WINDOW_BYTES = 48 * 1024 * 1024


class DTypeName(str):
    """A saved dtype's canonical name (``"float32"``, ``"bfloat16"``) that also compares equal
    to the dtype objects it names (``np.float32``, ``jnp.bfloat16``, ``np.dtype("float32")``),
    as Orbax's metadata dtypes do; it stays a ``str`` (JSON, ``==`` with names)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str) or other is None:
            return str.__eq__(self, other)
        try:
            return as_numpy_dtype(str(self)) == as_numpy_dtype(other)
        except (TypeError, ValueError):
            return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = str.__hash__


@dataclass(frozen=True)
class LeafMetadata:
    """What a checkpoint holds at one path, read from its JSON metadata (no array data).

    ``kind`` is ``"jax"``, ``"numpy"``, ``"numpy_scalar"`` or ``"scalar"`` (Python
    bool/int/float/complex/str, whose ``value`` is stored inline). ``sharding`` is the
    partition spec at save time and ``mesh`` its mesh axis sizes (``None`` if unsharded).

    Args:
      path: the leaf's path string (``"layers/0/w"``).
      kind: ``"jax"``, ``"numpy"``, ``"numpy_scalar"`` or ``"scalar"``.
      shape: the saved shape.
      dtype: the saved dtype's canonical name (``"float32"``, ``"bfloat16"``...), a
        :class:`DTypeName`: it also compares equal to ``np.float32``, ``jnp.bfloat16``...
      sharding: the partition spec at save time, or ``None``.
      mesh: the mesh axis sizes at save time (``{"data": 2}``), or ``None``.
      chunk_shape: the on-disk chunk shape of an array, or ``None``.
      value: a Python scalar's value (stored inline), else ``None``.
    """

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    sharding: tuple | None = None
    mesh: dict | None = None
    chunk_shape: tuple[int, ...] | None = None
    value: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DTypeName):  # equal to the dtype objects it names too
            object.__setattr__(self, "dtype", DTypeName(self.dtype))

    @property
    def spec(self) -> ArraySpec:
        return ArraySpec(self.shape, self.dtype, sharding=self.sharding)

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes if self.kind != "scalar" else 0


def _leaf_metadata(path: str, e: dict) -> LeafMetadata:
    if e["kind"] == "scalar":
        value = _tree.decode_scalar(e)
        dtype = _SCALAR_TYPES[e["type"]]
        return LeafMetadata(path, "scalar", (), dtype, value=value)
    spec = ArraySpec.from_json(e["spec"])
    sh = e.get("sharding") or {}
    return LeafMetadata(
        path,
        e["kind"],
        _concrete(spec),
        spec.dtype,
        sharding=spec.sharding,
        mesh=sh.get("mesh"),
        chunk_shape=tuple(e["chunk_shape"]),
    )


def _concrete(spec: ArraySpec) -> tuple[int, ...]:
    """A saved array's shape: always concrete (symbolic dims exist only in specs, not on disk)."""
    return tuple(int(d) for d in spec.shape)


def load_metadata(directory: str) -> dict:
    """Read and verify ``_METADATA.json`` (checksum; each leaf's entry for unchecksummed
    format 1 files); damage raises :class:`CheckpointCorruptError` naming the file."""
    directory = os.fspath(directory)
    path = os.path.join(directory, _tree.METADATA_FILE)
    if not os.path.isfile(path):
        if _ownership.pending(directory):
            raise CheckpointError(f"checkpoint {directory} is incomplete (its save never committed)")
        if _fs.is_committed(directory) or _fs.is_committed(os.path.dirname(os.path.abspath(directory))):
            raise _fs.corrupt(path, "the file is missing from a committed checkpoint")
        raise FileNotFoundError(f"no checkpoint at {directory}: {_tree.METADATA_FILE} not found")
    meta, checked = _fs.read_json_checked(path)
    if not isinstance(meta, dict) or meta.get("format") != _tree.FORMAT:
        raise _fs.corrupt(path, "not a cairn.checkpoint metadata file")
    version = meta.get("version", 0)
    if not isinstance(version, int) or version < 1:
        raise _fs.corrupt(path, f"bad format version {version!r}")
    if version > _tree.FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {version}; this cairn.checkpoint reads up to "
            f"{_tree.FORMAT_VERSION}"
        )
    if version >= 2 and not checked:
        raise _fs.corrupt(path, "it lacks the checksum that format version 2 writes")
    pc, leaves = meta.get("process_count"), meta.get("leaves")
    if not isinstance(pc, int) or pc < 1 or not isinstance(leaves, dict):
        raise _fs.corrupt(path, "process_count or leaves is missing or malformed")
    for p, e in leaves.items() if not checked else ():  # a verified file is as written
        try:
            _check_entry(p, e)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
            raise _fs.corrupt(path, f"the entry of leaf {p!r} is malformed ({err!r})") from None
    return meta


def _check_entry(path: str, e: dict) -> None:
    kind = e["kind"]
    if kind == "scalar":
        if e["type"] not in _SCALAR_TYPES:
            raise ValueError(f"scalar type {e['type']!r}")
        _tree.decode_scalar(e)
        return
    if kind not in ("jax", "numpy", "numpy_scalar"):
        raise ValueError(f"kind {kind!r}")
    spec = ArraySpec.from_json(e["spec"])
    if e["storage_dtype"] != _storage.storage_dtype(spec.numpy_dtype):
        raise ValueError(f"storage_dtype {e['storage_dtype']!r} for dtype {spec.dtype}")
    chunk = e["chunk_shape"]
    if len(chunk) != len(spec.shape) or not all(isinstance(c, int) and c >= 1 for c in chunk):
        raise ValueError(f"chunk_shape {chunk!r} for shape {spec.shape}")
    if kind == "numpy_scalar" and spec.shape != ():
        raise ValueError(f"numpy_scalar of shape {spec.shape}")


_SCALAR_TYPES = {"bool": "bool", "int": "int64", "float": "float64", "complex": "complex128", "str": "str"}
_SCALAR_GROUP = {"bool": "bool", "int": "number", "float": "number", "complex": "number", "str": "str"}


def _scalar_group(x: Any) -> str:
    if isinstance(x, bool):
        return "bool"
    return "str" if isinstance(x, str) else "number"


def check_dir(directory: str) -> dict:
    """Verify every metadata file of a checkpoint directory (no array data is read).

    Returns its metadata; raises :class:`CheckpointCorruptError` naming the damaged file.
    The OCDBT manifest of each process that wrote array data must exist.
    """
    meta = load_metadata(directory)
    for i, reg in enumerate(regions_all(directory, meta)):
        if any(reg.values()):
            manifest = os.path.join(_storage.db_dir(directory, i), "manifest.ocdbt")
            if not os.path.isfile(manifest):
                raise _fs.corrupt(manifest, f"process {i}'s array database has no manifest")
    return meta


def metadata_of(directory: str) -> dict[str, LeafMetadata]:
    meta = load_metadata(directory)
    return {p: _leaf_metadata(p, e) for p, e in meta["leaves"].items()}


def _is_target_leaf(x: Any) -> bool:
    return isinstance(x, (ArraySpec, jax.ShapeDtypeStruct, jax.sharding.Sharding, LeafMetadata))


@dataclass
class _Want:
    kind: str  # "jax" | "numpy" | "numpy_scalar" | "scalar" | "keep"
    dtype: np.dtype | None = None
    sharding: Any = None
    keep: Any = None


def _key_data_target(t: Any, entry: dict) -> jax.ShapeDtypeStruct:
    """The key data a typed PRNG key target ``t`` is read as: its shape plus the saved
    trailing key dimensions, ``uint32``, its sharding with those dimensions unsharded."""
    if not entry.get("prng_impl"):
        raise TypeError(f"the target is a PRNG key array, the checkpoint {_describe(entry)} (not a key)")
    saved = tuple(entry["spec"]["shape"])
    shape = tuple(t.shape) + saved[len(t.shape):]
    sharding = getattr(t, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    elif sharding is not None and not isinstance(sharding, jax.sharding.SingleDeviceSharding):
        sharding = None  # another kind of sharding cannot be widened: placed as saved
    return jax.ShapeDtypeStruct(shape, np.dtype(np.uint32), sharding=sharding)


def _want_from_target(t: Any, entry: dict, mesh: Any) -> tuple[_Want, tuple | None, Any]:
    """(what to build, expected shape or None, expected dtype or None) for a target leaf."""
    if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)) and _tree.is_prng_key(t):
        t = _key_data_target(t, entry)
        if t.sharding is None:
            return _Want("jax", t.dtype, saved_sharding(entry)), tuple(t.shape), t.dtype
    if isinstance(t, jax.Array):
        return _Want("jax", np.dtype(t.dtype), t.sharding), tuple(t.shape), np.dtype(t.dtype)
    if isinstance(t, jax.ShapeDtypeStruct):
        return _Want("jax", np.dtype(t.dtype), t.sharding), tuple(t.shape), np.dtype(t.dtype)
    if isinstance(t, ArraySpec):
        sharding = None
        if mesh is not None:
            sharding = jax.sharding.NamedSharding(mesh, t.partition_spec())
        kind = "jax" if sharding is not None else "numpy"
        return _Want(kind, t.numpy_dtype, sharding), t.shape, t.numpy_dtype
    if isinstance(t, LeafMetadata):
        return _want_from_target(t.spec, entry, mesh)
    if isinstance(t, jax.sharding.Sharding):
        return _Want("jax", None, t), None, None
    if isinstance(t, np.ndarray):
        return _Want("numpy", t.dtype), tuple(t.shape), t.dtype
    if isinstance(t, np.generic):
        return _Want("numpy_scalar", t.dtype), (), t.dtype
    if isinstance(t, (bool, int, float, complex, str)):
        if entry["kind"] == "scalar":
            if _SCALAR_GROUP[entry["type"]] != _scalar_group(t):
                raise TypeError(
                    f"checkpoint has a {entry['type']} scalar, the target a {type(t).__name__}"
                )
            return _Want("scalar"), None, None
        if isinstance(t, str):
            raise TypeError(f"checkpoint has an array ({_describe(entry)}), the target a str")
        return _Want("numpy_scalar" if entry["kind"] != "jax" else "jax"), (), None
    raise TypeError(
        f"unsupported restore target leaf of type {type(t).__qualname__}: expected a jax.Array, "
        "jax.ShapeDtypeStruct, ArraySpec, Sharding, numpy array or Python scalar"
    )


def saved_sharding(entry: dict) -> Any:
    """The ``NamedSharding`` a ``jax`` leaf was saved with, rebuilt over ``jax.devices()``
    in order when their number equals the saved mesh's size (else ``None``: one device)."""
    axes = (entry.get("sharding") or {}).get("mesh") if entry["kind"] == "jax" else None
    if not axes:
        return None
    sizes = [int(n) for n in axes.values()]
    devices = jax.devices()
    if math.prod(sizes) != len(devices):
        return None
    mesh = jax.sharding.Mesh(np.array(devices).reshape(sizes), tuple(axes))
    return jax.sharding.NamedSharding(mesh, ArraySpec.from_json(entry["spec"]).partition_spec())


def _compile_patterns(paths: str | re.Pattern | Sequence[str | re.Pattern] | None) -> list[re.Pattern] | None:
    """``paths`` (one pattern or a list) compiled by :func:`cairn.core_array.compile_pattern`."""
    if paths is None:
        return None
    if isinstance(paths, (str, re.Pattern)):
        paths = [paths]
    out = []
    for p in paths:
        if not isinstance(p, (str, re.Pattern)):
            raise TypeError(f"paths must be a regex string or a list of them, got {p!r}")
        try:
            out.append(compile_pattern(p))
        except PathError as err:  # a ValueError, as documented for a bad ``paths=``; keep re's words
            detail = err.__context__ if err.__context__ is not None else err
            raise PathError(f"paths pattern {p!r} is not a valid regular expression: {detail}") from None
    return out


def _selected(patterns: list[re.Pattern] | None, path: str) -> bool:
    return patterns is None or any(path_matches(p, path) for p in patterns)


def _describe(entry: dict) -> str:
    if entry["kind"] == "scalar":
        return f"{entry['type']} scalar"
    return f"shape {tuple(entry['spec']['shape'])} {entry['spec']['dtype']}"


def plan(
    meta: dict,
    target: Any,
    *,
    paths: str | re.Pattern | Sequence[str | re.Pattern] | None,
    partial: bool,
    cast: bool,
    mesh: Any,
    where: str,
) -> tuple[dict[str, tuple[dict, _Want]], Any]:
    """Decide what to read for each path; raise one error listing every mismatch."""
    saved: dict[str, dict] = meta["leaves"]
    patterns = _compile_patterns(paths)
    todo: dict[str, tuple[dict, _Want]] = {}
    if target is None:
        for p, e in saved.items():
            if _selected(patterns, p):
                todo[p] = (e, _Want(e["kind"], None, saved_sharding(e)))
        if patterns is not None and not todo:
            raise TargetMismatchError(f"no path of checkpoint {where} matches {paths!r}")
        return todo, None
    tflat = flatten_with_paths(target, is_leaf=_is_target_leaf)
    problems: list[str] = []
    for p, t in tflat.items():
        if not _selected(patterns, p):
            todo[p] = ({}, _Want("keep", keep=t))
            continue
        if p not in saved:
            problems.append(f"missing in checkpoint: {p!r} (the target has {_target_desc(t)})")
            continue
        e = saved[p]
        try:
            want, shape, dtype = _want_from_target(t, e, mesh)
        except TypeError as err:
            problems.append(f"{p!r}: {err}")
            continue
        if e["kind"] != "scalar":
            sshape = tuple(e["spec"]["shape"])
            sdtype = as_numpy_dtype(e["spec"]["dtype"])
            if shape is not None and shape != sshape:
                problems.append(f"shape differs at {p!r}: checkpoint {sshape}, target {shape}")
            if dtype is not None and dtype != sdtype and not cast:
                problems.append(
                    f"dtype differs at {p!r}: checkpoint {sdtype.name}, target {dtype.name} "
                    "(pass cast=True to convert)"
                )
        elif want.kind != "scalar":
            problems.append(f"kind differs at {p!r}: checkpoint has a {_describe(e)}, target {_target_desc(t)}")
        todo[p] = (e, want)
    if not partial:
        for p, e in saved.items():
            if p not in tflat and _selected(patterns, p):
                problems.append(
                    f"not in target: {p!r} ({_describe(e)}; pass partial=True to skip it)"
                )
    if problems:
        raise TargetMismatchError(
            f"restore target does not match checkpoint {where}: {len(problems)} difference(s):\n  - "
            + "\n  - ".join(problems)
        )
    return todo, target


def _target_desc(t: Any) -> str:
    if hasattr(t, "shape") and hasattr(t, "dtype"):
        return f"shape {tuple(t.shape)} {np.dtype(t.dtype).name}"
    return type(t).__qualname__


def regions_all(directory: str, meta: dict) -> list[dict[str, list]]:
    """Every process's ``_REGIONS`` file, verified (checksum; the content's shape for
    unchecksummed format 1 files)."""
    out = []
    for i in range(meta["process_count"]):
        f = os.path.join(directory, _tree.regions_file(i))
        if not os.path.isfile(f):
            raise _fs.corrupt(f, f"process {i}'s part of checkpoint {directory} is missing")
        reg, checked = _fs.read_json_checked(f, require_checksum=meta["version"] >= 2)
        ok = isinstance(reg, dict) and (
            checked  # a verified file is as written; an old unchecksummed one is checked here
            or all(
                isinstance(rs, list)
                and all(
                    isinstance(r, list)
                    and all(isinstance(ab, list) and len(ab) == 2 and all(isinstance(v, int) for v in ab) for ab in r)
                    for r in rs
                )
                for rs in reg.values()
            )
        )
        if not ok:
            raise _fs.corrupt(f, "its content is not {path: [region, ...]}")
        out.append(reg)
    return out


@dataclass(frozen=True)
class _Buffer:
    """A host buffer for one region of a leaf, and the devices it goes to."""

    region: list[list[int]]
    devices: list[Any]  # empty for an unsharded leaf
    array: np.ndarray


@dataclass(frozen=True)
class _ReadJob:
    """One array leaf to read: its buffers and the saved regions (per store) that fill them."""

    path: str
    storage_dtype: str
    kind: str  # "jax" | "numpy" | "numpy_scalar"
    shape: tuple[int, ...]
    saved_dtype: np.dtype
    out_dtype: np.dtype
    sharding: Any
    buffers: list[_Buffer]
    sources: list[tuple[tuple[int, str], list]]  # ((process, path), saved region)


class _Stores:
    """The TensorStores of one restore, one per (process, path), opened as first needed."""

    def __init__(self, directory: str, regions: list[dict[str, list]]) -> None:
        self.directory = directory
        self.regions = regions
        self.futures: dict[tuple[int, str], Any] = {}
        self._cache_ctx: Any = None

    def sources(self, path: str, needed: list[list[list[int]]], cached: bool) -> list[tuple[tuple[int, str], list]]:
        """Each saved region of ``path`` that one of ``needed`` intersects, with its store's key;
        ``cached`` stores share one chunk cache (a fresh one per restore)."""
        if cached and self._cache_ctx is None:
            self._cache_ctx = _storage.cached_context()
        out = []
        for i, reg in enumerate(self.regions):
            for saved in reg.get(path, ()):
                if any(_storage.intersect(n, saved) is not None or not n for n in needed):
                    key = (i, path)
                    if key not in self.futures:
                        db = _storage.db_dir(self.directory, i)
                        ctx = self._cache_ctx if cached else None
                        self.futures[key] = _storage.open_for_read(db, path, ctx)
                    out.append((key, saved))
        return out

    def open_all(self, todo: dict[str, tuple[dict, _Want]]) -> dict[tuple[int, str], Any]:
        """Wait for every store to open and check it against its metadata entry."""
        opened = {}
        for key, fut in self.futures.items():
            try:
                opened[key] = fut.result()
            except Exception as err:  # noqa: BLE001
                raise _storage.translate_error(err, key[1]) from err
            _check_store(self.directory, key, opened[key], todo[key[1]][0])
        return opened


def _buffers(kind: str, sharding: Any, shape: tuple[int, ...], saved_dtype: np.dtype) -> list[_Buffer]:
    """One buffer per distinct region the local devices of ``sharding`` hold (or one whole)."""
    if kind == "jax" and sharding is not None:
        by_region: dict[tuple, list] = {}
        for dev, index in sharding.addressable_devices_indices_map(shape).items():
            reg = _tree.norm_index(index, shape)
            by_region.setdefault(tuple(map(tuple, reg)), []).append(dev)
        return [
            _Buffer([list(r) for r in reg], devs, _storage.aligned_empty([b - a for a, b in reg], saved_dtype))
            for reg, devs in by_region.items()
        ]
    return [_Buffer([[0, d] for d in shape], [], _storage.aligned_empty(shape, saved_dtype))]


def _plan_job(path: str, e: dict, want: _Want, stores: _Stores) -> _ReadJob:
    spec = ArraySpec.from_json(e["spec"])
    saved_dtype = spec.numpy_dtype
    kind = want.kind if want.kind != "scalar" else e["kind"]
    shape = _concrete(spec)
    bufs = _buffers(kind, want.sharding, shape, saved_dtype)
    needed = [b.region for b in bufs]
    # finer target shards than saved chunks: share one read of each chunk through a cache
    cached = len(bufs) > 1 and _storage.chunks_shared(needed, e["chunk_shape"])
    return _ReadJob(
        path=path,
        storage_dtype=e["storage_dtype"],
        kind=kind,
        shape=shape,
        saved_dtype=saved_dtype,
        out_dtype=want.dtype if want.dtype is not None else saved_dtype,
        sharding=want.sharding,
        buffers=bufs,
        sources=stores.sources(path, needed, cached),
    )


def _read_windowed(jobs: list[_ReadJob], opened: dict[tuple[int, str], Any]) -> None:
    """Fill every job's buffers, issuing reads in order with at most ``READ_WINDOW_BYTES``
    outstanding: TensorStore holds each chunk's file bytes until decoded into its buffer,
    so an unbounded burst would cost memory proportional to the whole checkpoint."""
    pending: collections.deque[tuple[str, Any, int]] = collections.deque()
    in_flight = 0

    def drain(limit: int) -> None:
        nonlocal in_flight
        while pending and in_flight > limit:
            path, fut, nbytes = pending.popleft()
            try:
                fut.result()
            except Exception as err:  # noqa: BLE001
                raise _storage.translate_error(err, path) from err
            in_flight -= nbytes

    for job in jobs:
        src = [(opened[k], saved) for k, saved in job.sources]
        for b in job.buffers:
            buf = b.array
            if buf.size == 0:
                continue
            for fut in _storage.read_into(_storage.to_storage(buf, job.storage_dtype), b.region, src, job.path):
                drain(max(0, READ_WINDOW_BYTES - buf.nbytes))
                pending.append((job.path, fut, buf.nbytes))
                in_flight += buf.nbytes
    drain(0)


def _finish(job: _ReadJob) -> Any:
    """The restored value of a job whose buffers are filled (cast, placed on devices)."""
    bufs = job.buffers
    if job.out_dtype != job.saved_dtype:
        bufs = [_Buffer(b.region, b.devices, _cast_aligned(b.array, job.out_dtype)) for b in bufs]
    if job.kind == "jax":
        if job.sharding is None:
            return jax.device_put(bufs[0].array, jax.local_devices()[0])
        on_device = {}
        for b in bufs:
            for dev in b.devices:
                on_device[dev] = jax.device_put(b.array, dev)
        arrays = [on_device[dev] for dev in job.sharding.addressable_devices_indices_map(job.shape)]
        return jax.make_array_from_single_device_arrays(job.shape, job.sharding, arrays)
    if job.kind == "numpy_scalar":
        return bufs[0].array[()]
    return bufs[0].array


def read(directory: str, meta: dict, todo: dict[str, tuple[dict, _Want]]) -> dict[str, Any]:
    """Read every planned leaf; all reads run concurrently inside TensorStore."""
    directory = os.fspath(directory)
    regions = regions_all(directory, meta)
    stores = _Stores(directory, regions)
    results: dict[str, Any] = {}
    jobs: list[_ReadJob] = []
    for path, (e, want) in todo.items():
        if want.kind == "keep":
            results[path] = want.keep
        elif e["kind"] == "scalar":
            results[path] = _tree.decode_scalar(e)
        else:
            jobs.append(_plan_job(path, e, want, stores))
    _prefetch(directory, regions, jobs)
    _read_windowed(jobs, stores.open_all(todo))
    for job in jobs:
        results[job.path] = _finish(job)
    return results


def _check_store(directory: str, key: tuple[int, str], store: Any, e: dict) -> None:
    """The array TensorStore opened (its zarr.json) must be what ``_METADATA.json`` says."""
    got = (store.dtype.name, tuple(store.shape))
    want = (e["storage_dtype"], tuple(e["spec"]["shape"]))
    if got != want:
        raise CheckpointCorruptError(
            f"leaf {key[1]!r}: the array stored in process {key[0]}'s database is {got[0]} "
            f"{got[1]} but {_tree.METADATA_FILE} says {want[0]} {want[1]}; checkpoint "
            f"{directory} is corrupt",
            os.path.join(_storage.db_dir(directory, key[0]), "manifest.ocdbt"),
        )


def _prefetch(directory: str, regions: list[dict], jobs: list[_ReadJob]) -> None:
    """Ask the kernel to read ahead a process database's files when we need most of it.

    TensorStore issues one positioned read per chunk; a WILLNEED hint lets the disk stream
    the files at full speed meanwhile. Skipped for small partial restores.
    """
    needed = sum(b.array.nbytes for job in jobs for b in job.buffers)
    for i, reg in enumerate(regions):
        saved = 0
        for _path, rs in reg.items():
            saved += sum(_storage.volume(r) for r in rs)
        if saved == 0 or needed < saved // 4:
            continue
        data = os.path.join(_storage.db_dir(directory, i), "d")
        if not os.path.isdir(data):
            continue
        for name in os.listdir(data):
            try:
                fd = os.open(os.path.join(data, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)


def _cast_aligned(buf: np.ndarray, dtype: np.dtype) -> np.ndarray:
    out = _storage.aligned_empty(buf.shape, dtype)
    out[...] = buf
    return out


def build(results: dict[str, Any], target: Any) -> Any:
    if target is None:
        return unflatten(results)
    return unflatten(results, like=target, is_leaf=_is_target_leaf)


def restore_dir(
    directory: str | os.PathLike,
    target: Any = None,
    *,
    paths: str | re.Pattern | Sequence[str | re.Pattern] | None = None,
    partial: bool = False,
    cast: bool = False,
    mesh: Any = None,
) -> Any:
    """Restore the checkpoint in ``directory``: verify, plan against ``target``, read, build."""
    directory = os.fspath(directory)
    meta = load_metadata(directory)
    todo, tgt = plan(meta, target, paths=paths, partial=partial, cast=cast, mesh=mesh, where=directory)
    results = read(directory, meta, todo)
    for p, value in results.items():  # typed PRNG keys were stored as their key data
        impl = meta["leaves"].get(p, {}).get("prng_impl")
        if impl and isinstance(value, jax.Array):
            results[p] = jax.random.wrap_key_data(value, impl=impl)
    if target is None and paths is None and meta.get("structure") is not None:
        try:
            return _structure.rebuild(meta["structure"], results)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
            raise _fs.corrupt(
                os.path.join(directory, _tree.METADATA_FILE),
                f"its tree structure does not match its leaves ({err!r})",
            ) from None
    return build(results, tgt)

