"""The helpers Orbax's tutorials call first (``ocp.utils``, ``ocp.test_utils``)."""

from __future__ import annotations

import os
import pathlib
import shutil
from typing import Any

import jax
import numpy as np

from cairn.checkpoint import _fs, _tree
from cairn.checkpoint import metadata as value_metadata
from cairn.core_array import as_numpy_dtype


def to_shape_dtype_struct(x: Any, dtype: Any = None, scalar_dtype: Any = None) -> Any:
    """The abstract version of a leaf, to restore onto: a ``jax.Array`` becomes a
    ``jax.ShapeDtypeStruct`` with its sharding, a NumPy array one without, a Python scalar
    stays itself (or becomes a 0-d struct of ``scalar_dtype``); ``dtype`` replaces the dtype.

    Args:
      x: a leaf: ``jax.Array``, ``jax.ShapeDtypeStruct``, NumPy array or scalar, Orbax's
        ``metadata.ArrayMetadata`` / ``ScalarMetadata`` (its shape, dtype and a
        ``jax.sharding.Sharding``, if it holds one), or anything else (returned as is).
      dtype: the dtype of the result instead of ``x``'s, or ``None``.
      scalar_dtype: the dtype a Python scalar becomes a 0-d struct of, or ``None`` (kept as is).

    >>> to_shape_dtype_struct(np.zeros((2, 3), np.float32))
    ShapeDtypeStruct(shape=(2, 3), dtype=float32)
    >>> to_shape_dtype_struct(42)
    42
    """
    if isinstance(x, jax.ShapeDtypeStruct):
        return x if dtype is None else jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=x.sharding)
    if isinstance(x, (np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(np.shape(x), dtype or x.dtype)
    if isinstance(x, (int, float, complex)) and scalar_dtype is not None:
        return jax.ShapeDtypeStruct((), scalar_dtype)
    if isinstance(x, value_metadata.ArrayMetadata):  # Orbax's metadata of a saved leaf (a scalar's too)
        sharding = x.sharding if isinstance(x.sharding, jax.sharding.Sharding) else None
        scalar = isinstance(x, value_metadata.ScalarMetadata) and scalar_dtype is not None
        want = dtype or (scalar_dtype if scalar else x.dtype)
        return jax.ShapeDtypeStruct(tuple(x.shape), as_numpy_dtype(want), sharding=sharding)
    return x


def erase_and_create_empty(directory: str | os.PathLike) -> pathlib.Path:
    """Remove ``directory`` if it exists, create it empty, return it as a ``pathlib.Path``.

    Args:
      directory: the directory to (re)create, with its parents.

    >>> import tempfile
    >>> p = erase_and_create_empty(tempfile.mkdtemp() + "/ckpts")
    >>> list(p.iterdir())
    []
    """
    path = pathlib.Path(os.fspath(directory))
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _key_name(key: Any) -> str:
    """One JAX key-path entry as text: a dict key, a sequence index, an attribute name."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    raise ValueError(f"unsupported pytree key entry {key!r}")


def _is_empty_or_leaf(x: Any) -> bool:
    return x is None or (isinstance(x, (dict, list, tuple)) and len(x) == 0)


def to_flat_dict(tree: Any, sep: str | None = None, keep_empty_nodes: bool = False,
                 is_leaf: Any = None) -> dict[Any, Any]:
    """``tree`` as a flat dict keyed by the tuple of each leaf's keys (as text), or by the
    keys joined with ``sep`` (Orbax's ``tree.to_flat_dict``).

    Args:
      tree: any pytree (dicts, lists, tuples, registered nodes).
      sep: join each key tuple with this string; ``None`` keeps tuples.
      keep_empty_nodes: keep ``None`` and empty containers as leaves (dropped otherwise).
      is_leaf: a predicate that stops the walk (overrides ``keep_empty_nodes``).

    >>> to_flat_dict({"a": 1, "b": {"c": [2, 3], "d": {}}})
    {('a',): 1, ('b', 'c', '0'): 2, ('b', 'c', '1'): 3}
    >>> to_flat_dict({"b": {"c": 2, "d": {}}}, sep="/", keep_empty_nodes=True)
    {'b/c': 2, 'b/d': {}}
    """
    if is_leaf is None and keep_empty_nodes:
        is_leaf = _is_empty_or_leaf
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    out = {tuple(_key_name(k) for k in path): v for path, v in flat}
    return out if sep is None else {sep.join(k): v for k, v in out.items()}


def from_flat_dict(flat_dict: dict[Any, Any], target: Any = None, sep: str | None = None) -> Any:
    """Inverse of :func:`to_flat_dict`: nested dicts, or ``target``'s structure filled by path.

    Args:
      flat_dict: keys are tuples of key names (or ``sep``-joined strings).
      target: a pytree whose structure and key paths to fill; ``None`` builds nested dicts.
      sep: the separator the keys were joined with.

    >>> from_flat_dict({("a",): 1, ("b", "c"): 2})
    {'a': 1, 'b': {'c': 2}}
    """
    items = {tuple(k.split(sep)) if sep is not None else tuple(k): v for k, v in flat_dict.items()}
    if target is None:
        out: dict[str, Any] = {}
        for path, v in items.items():
            node = out
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = v
        return out
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    missing = [p for p, _ in flat if tuple(_key_name(k) for k in p) not in items]
    if missing:
        raise KeyError(f"from_flat_dict: the target's paths {missing[:5]} are not in the flat dict")
    return jax.tree_util.tree_unflatten(treedef, [items[tuple(_key_name(k) for k in p)] for p, _ in flat])


def is_gcs_path(path: Any) -> bool:
    """Whether ``path`` names Google Cloud Storage (``gs://...``); cairn.checkpoint writes
    only local or mounted file systems.

    Args:
      path: a path or a string.

    >>> is_gcs_path("gs://bucket/ckpt"), is_gcs_path("/tmp/ckpt")
    (True, False)
    """
    return os.fspath(path).startswith("gs://") if isinstance(path, (str, os.PathLike)) else False


def get_save_directory(step: int, directory: str | os.PathLike, name: str | None = None,
                       step_prefix: str | None = None, override_directory: str | os.PathLike | None = None,
                       step_format_fixed_length: int | None = None) -> pathlib.Path:
    """Where a manager puts ``step`` (and its item ``name``) under ``directory``: the step
    directory is ``<step_prefix>_<step>`` or ``<step>``, zero-padded to
    ``step_format_fixed_length`` digits (the manager's own naming).

    Args:
      step: the step number.
      directory: the manager's directory.
      name: an item name (its subdirectory), or ``None`` for the step directory.
      step_prefix: the manager's ``step_prefix``.
      override_directory: a step directory to use instead of computing one.
      step_format_fixed_length: the manager's ``step_format_fixed_length``.

    >>> get_save_directory(7, "/ckpt", "params", step_format_fixed_length=3).as_posix()
    '/ckpt/007/params'
    """
    if override_directory is not None:
        base = pathlib.Path(os.fspath(override_directory))
    else:
        digits = str(int(step)).zfill(step_format_fixed_length) if step_format_fixed_length else str(int(step))
        base = pathlib.Path(os.fspath(directory)) / (f"{step_prefix}_{digits}" if step_prefix else digits)
    return base / name if name else base


def is_pathways_backend() -> bool:
    """Whether JAX runs on Pathways (the devices' client says so, or the ``proxy`` platform
    is in use); cairn.checkpoint runs the same either way, Orbax's tests ask.

    >>> is_pathways_backend()  # CPU
    False
    """
    devices = jax.local_devices()
    if not devices:
        return False
    runtime = getattr(getattr(devices[0], "client", None), "runtime_type", "")
    return "pathways" in str(runtime) or devices[0].platform == "proxy"


def is_primary_host(primary_host: int | None = 0) -> bool:
    """Whether this process is ``primary_host`` (process 0 by default); ``None`` means every
    process is primary (Orbax's convention).

    Args:
      primary_host: the ``jax.process_index()`` of the primary process, or ``None``.

    >>> is_primary_host()  # one process
    True
    """
    return primary_host is None or jax.process_index() == primary_host


def is_checkpoint_finalized(path: str | os.PathLike) -> bool:
    """Whether the step folder ``path`` is committed (its ``COMMIT`` marker is written).

    Args:
      path: a step folder, e.g. ``utils.get_save_directory(step, directory)``.
    """
    return _fs.is_committed(os.fspath(path))


def _combine(trees: tuple[Any, ...], target: Any, keep: Any) -> Any:
    """Flatten ``trees`` by key path, keep the paths ``keep(flats)`` says (the last tree's
    value wins), and rebuild nested dicts or ``target``'s structure."""
    flats = [to_flat_dict(t) for t in trees]
    paths = keep(flats)
    merged = {p: next(f[p] for f in reversed(flats) if p in f) for p in paths}
    if () in merged:  # a bare leaf (the whole tree is one leaf)
        return merged[()]
    return from_flat_dict(merged, target=target)


def merge_trees(*trees: Any, target: Any = None) -> Any:
    """One tree holding every path of ``trees``; where several hold a path, the last wins
    (Orbax's ``transform_utils.merge_trees``).

    Args:
      *trees: pytrees (dicts, lists, registered nodes, or a bare leaf).
      target: a pytree whose structure the result takes (``None``: nested dicts).

    >>> merge_trees({"a": 1, "b": {"c": 2}}, {"b": {"c": 4, "e": 6}})
    {'a': 1, 'b': {'c': 4, 'e': 6}}
    """
    return _combine(trees, target, lambda flats: list(dict.fromkeys(p for f in flats for p in f)))


def intersect_trees(*trees: Any, target: Any = None) -> Any:
    """One tree holding only the paths every one of ``trees`` holds, with the last tree's
    values (Orbax's ``transform_utils.intersect_trees``).

    Args:
      *trees: pytrees (dicts, lists, registered nodes, or a bare leaf).
      target: a pytree whose structure the result takes (``None``: nested dicts).

    >>> intersect_trees({"a": 1, "b": {"c": 2}}, {"b": {"c": 4, "e": 6}})
    {'b': {'c': 4}}
    """
    return _combine(trees, target, lambda flats: [p for p in flats[0] if all(p in f for f in flats[1:])] if flats else [])


def is_ocdbt_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a pytree checkpoint in cairn's format, whose arrays always
    live in OCDBT databases (Orbax's ``type_handlers.is_ocdbt_checkpoint``; a checkpoint
    holding no array at all has no database but is still of that format).

    Args:
      path: a checkpoint directory (one item's).

    >>> import tempfile
    >>> is_ocdbt_checkpoint(tempfile.mkdtemp())
    False
    """
    return os.path.isfile(os.path.join(os.fspath(path), _tree.METADATA_FILE))


def is_scalar(x: Any) -> bool:
    """Whether ``x`` is a scalar leaf as Orbax's ``utils.is_scalar`` answers: a Python ``int``
    or ``float`` (``bool`` included, as a subclass of ``int``) or a NumPy number
    (``np.float32(1.0)``); arrays, 0-d arrays included, are not.

    Args:
      x: any value.
    """
    return isinstance(x, (int, float, np.number))


def tmp_checkpoints(checkpoint_dir: str | os.PathLike) -> list[str]:
    """The names of the saves in ``checkpoint_dir`` still being written or left by a writer
    that died (the ``*.cairn-tmp`` folders), sorted. A save that fails with an error is
    removed at once, so it is not listed; a manager removes leftovers whose writer is gone
    when it starts (``cleanup_tmp_directories``).

    Args:
      checkpoint_dir: a manager's directory (or any folder of checkpoints).
    """
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        return []
    return sorted(n for n in os.listdir(checkpoint_dir)
                  if n.endswith(_fs.TMP_SUFFIX) and os.path.isdir(os.path.join(checkpoint_dir, n)))


def is_tmp_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a save still being written (or abandoned): a temporary
    ``*.cairn-tmp`` folder, or a folder without its ``COMMIT`` marker.

    Args:
      path: a step folder.
    """
    path = os.fspath(path)
    return os.path.isdir(path) and (path.rstrip("/").endswith(_fs.TMP_SUFFIX) or not _fs.is_committed(path))

