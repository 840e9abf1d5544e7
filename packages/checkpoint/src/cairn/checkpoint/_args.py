"""Orbax's typed checkpoint arguments (``ocp.args``) as thin descriptions of our save/restore.

``StandardSave(tree)`` says "save this pytree", ``StandardRestore(abstract_tree)`` "restore
onto this target", ``JsonSave(d)`` "store this JSON-able value as JSON", ``Composite(a=...,
b=...)`` "several named items in one checkpoint". A :class:`~cairn.checkpoint.Checkpointer`
or :class:`~cairn.checkpoint.CheckpointManager` turns them into calls of :func:`save` and
:func:`restore`; nothing here reads or writes files except :func:`restore_pytree`, which
reads a checkpoint's metadata to build the target that per-leaf ``restore_args`` describe.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import numpy as np

from cairn.checkpoint._errors import TargetMismatchError
from cairn.checkpoint._restore import LeafMetadata, metadata_of, restore_dir, saved_sharding
from cairn.core_array import ArraySpec, as_numpy_dtype, flatten_with_paths, map_with_path

#: A leaf of a restore target that is skipped: it comes back as ``PLACEHOLDER`` (Orbax's
#: ``ocp.PLACEHOLDER``, the Ellipsis object).
PLACEHOLDER = ...


# --- per-leaf arguments ---
@dataclass(frozen=True)
class SaveArgs:
    """How to save one leaf (Orbax's ``SaveArgs``): ``dtype`` casts it before it is written.

    ``aggregate``, ``chunk_byte_size`` and ``shard_axes`` are accepted for compatibility;
    our chunking is automatic (at most 64 MiB per chunk, one chunk per shard or smaller).
    """

    aggregate: bool = False
    dtype: Any = None
    chunk_byte_size: int | None = None
    shard_axes: tuple[int, ...] = ()


@dataclass(frozen=True)
class RestoreArgs:
    """How to restore one leaf (Orbax's ``RestoreArgs``).

    ``restore_type``: ``np.ndarray`` for a NumPy array, ``jax.Array`` (or ``None``: as
    saved) for a device array, ``int``/``float``/``str`` for a Python scalar saved as one;
    ``dtype`` casts the value.
    """

    restore_type: Any = None
    dtype: Any = None


@dataclass(frozen=True)
class ArrayRestoreArgs(RestoreArgs):
    """Restore one leaf as a ``jax.Array`` with ``sharding`` (or ``NamedSharding(mesh,
    mesh_axes)``), optionally cast to ``dtype`` (Orbax's ``ArrayRestoreArgs``). ``global_shape``
    / ``shape``, when given, must equal the saved shape (no padding or truncation)."""

    restore_type: Any = jax.Array
    mesh: Any = None
    mesh_axes: Any = None
    sharding: Any = None
    global_shape: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    strict: bool = True

    def resolved_sharding(self) -> Any:
        if self.sharding is not None:
            return self.sharding
        if self.mesh is not None and self.mesh_axes is not None:
            return jax.sharding.NamedSharding(self.mesh, self.mesh_axes)
        return None


# --- checkpoint arguments ---
class CheckpointArgs:
    """Base of every ``ocp.args`` class: ``kind`` names how the item is stored
    (``"pytree"`` or ``"json"``) and ``saving`` whether it describes a save."""

    kind: ClassVar[str] = "pytree"
    saving: ClassVar[bool] = False


@dataclass(frozen=True)
class StandardSave(CheckpointArgs):
    """Save a pytree of arrays and scalars (Orbax's ``args.StandardSave``)."""

    item: Any
    save_args: Any = None
    custom_metadata: Any = None
    saving: ClassVar[bool] = True


@dataclass(frozen=True)
class StandardRestore(CheckpointArgs):
    """Restore a pytree, onto ``item`` (a tree of arrays, ``jax.ShapeDtypeStruct`` s or
    scalars) if given; ``strict=False`` lets the checkpoint hold paths the target lacks."""

    item: Any = None
    strict: bool = True
    support_layout: bool = False
    fallback_sharding: Any = None


@dataclass(frozen=True)
class PyTreeSave(CheckpointArgs):
    """Save a pytree with optional per-leaf :class:`SaveArgs` (Orbax's ``args.PyTreeSave``)."""

    item: Any
    save_args: Any = None
    ocdbt_target_data_file_size: int | None = None
    custom_metadata: Any = None
    saving: ClassVar[bool] = True


@dataclass(frozen=True)
class PyTreeRestore(CheckpointArgs):
    """Restore a pytree onto ``item`` and/or per-leaf ``restore_args`` (a tree of
    :class:`RestoreArgs`); ``partial_restore=True`` skips checkpoint paths the target lacks.
    ``transforms`` is not supported (it raises ``NotImplementedError``)."""

    item: Any = None
    restore_args: Any = None
    transforms: Any = None
    transforms_default_to_original: bool = True
    legacy_transform_fn: Any = None
    partial_restore: bool = False


@dataclass(frozen=True)
class ArraySave(CheckpointArgs):
    """Save one array (Orbax's ``args.ArraySave``)."""

    item: Any
    save_args: Any = None
    saving: ClassVar[bool] = True


@dataclass(frozen=True)
class ArrayRestore(CheckpointArgs):
    """Restore one array, onto ``item`` if given, per ``restore_args`` if given."""

    item: Any = None
    restore_args: Any = None


@dataclass(frozen=True)
class JsonSave(CheckpointArgs):
    """Save a JSON-able value as JSON (Orbax's ``args.JsonSave``)."""

    item: Any
    kind: ClassVar[str] = "json"
    saving: ClassVar[bool] = True


@dataclass(frozen=True)
class JsonRestore(CheckpointArgs):
    """Restore a value saved with :class:`JsonSave` (``item`` is ignored, as in Orbax)."""

    item: Any = None
    kind: ClassVar[str] = "json"


class Composite(CheckpointArgs, Mapping):
    """Several named items, each with its own arguments; also what a multi-item restore
    returns. Items are read by key (``c["state"]``) or attribute (``c.state``).

    >>> c = Composite(state=StandardSave({"w": 1}), meta=JsonSave({"lang": "en"}))
    >>> sorted(c), c.meta.item
    (['meta', 'state'], {'lang': 'en'})
    >>> c.nope
    Traceback (most recent call last):
    AttributeError: Composite has no item 'nope'; it holds ['meta', 'state']
    """

    kind: ClassVar[str] = "composite"

    def __init__(self, *args: Mapping[str, Any], **items: Any) -> None:
        merged: dict[str, Any] = {}
        for a in args:
            merged.update(a)
        merged.update(items)
        for name in merged:
            if not isinstance(name, str) or not name:
                raise ValueError(f"Composite item names must be non-empty strings, got {name!r}")
        object.__setattr__(self, "_items", merged)

    def __getitem__(self, name: str) -> Any:
        return self._items[name]

    def __getattr__(self, name: str) -> Any:
        items = self.__dict__.get("_items", {})
        if name in items:
            return items[name]
        raise AttributeError(f"Composite has no item {name!r}; it holds {sorted(items)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Composite is immutable")

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Composite({self._items!r})"


# --- applying the arguments ---
def to_saved_tree(args: CheckpointArgs, where: str) -> Any:
    """The tree (or JSON value) that ``args`` saves, with :class:`SaveArgs` dtypes applied."""
    if not isinstance(args, CheckpointArgs) or not args.saving or isinstance(args, Composite):
        raise TypeError(
            f"{where}: expected save arguments (ocp.args.StandardSave, PyTreeSave, ArraySave or "
            f"JsonSave), got {type(args).__name__}"
        )
    item = args.item  # type: ignore[attr-defined]
    save_args = getattr(args, "save_args", None)
    if save_args is None:
        return item
    if isinstance(save_args, SaveArgs):
        return _cast_leaf(item, save_args, where)
    flat = flatten_with_paths(save_args, is_leaf=lambda x: isinstance(x, SaveArgs))
    tree_paths = set(flatten_with_paths(item))
    unknown = sorted(set(flat) - tree_paths)
    if unknown:
        raise ValueError(f"{where}: save_args has paths {unknown} that the saved tree lacks")
    return map_with_path(lambda p, x: _cast_leaf(x, flat[p], f"{where} at {p!r}") if p in flat else x, item)


def _cast_leaf(x: Any, sa: Any, where: str) -> Any:
    if not isinstance(sa, SaveArgs):
        raise TypeError(f"{where}: save_args leaves must be ocp.SaveArgs, got {type(sa).__name__}")
    if sa.dtype is None:
        return x
    if isinstance(x, jax.Array):
        return x.astype(sa.dtype)
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x).astype(sa.dtype)
    raise TypeError(f"{where}: SaveArgs(dtype=...) needs an array leaf, got {type(x).__name__}")


def restore_options(args: CheckpointArgs) -> tuple[Any, Any, bool]:
    """(target item, per-leaf restore_args, partial) of pytree restore arguments."""
    if isinstance(args, PyTreeRestore):
        if args.transforms is not None or args.legacy_transform_fn is not None:
            raise NotImplementedError(
                "PyTreeRestore(transforms=...) is not supported by cairn.checkpoint; restore with "
                "partial_restore=True and rename the keys of the result instead"
            )
        return args.item, args.restore_args, args.partial_restore
    if isinstance(args, StandardRestore):
        return args.item, None, not args.strict
    if isinstance(args, ArrayRestore):
        return args.item, args.restore_args, False
    raise TypeError(f"expected pytree restore arguments, got {type(args).__name__}")


def _is_restore_leaf(x: Any) -> bool:
    return isinstance(x, RestoreArgs) or x is PLACEHOLDER


def _is_array_like(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic))


def build_target(
    item: Any, restore_args: Any, saved: Mapping[str, LeafMetadata], where: str
) -> tuple[Any, list[str] | None]:
    """A restore target in :func:`restore`'s terms from Orbax-style ``item`` and per-leaf
    ``restore_args``, given the checkpoint's ``metadata()``; also the path patterns to read
    (``None``: all), which leave out the ``PLACEHOLDER`` leaves (returned as they are).

    Raises:
      TargetMismatchError: ``restore_args`` alone names paths the checkpoint lacks.
    """
    if item is None and restore_args is None:
        return None, None
    base = item if item is not None else restore_args
    one = restore_args if isinstance(restore_args, RestoreArgs) else None
    flat_ra = {} if restore_args is None or one is not None else flatten_with_paths(
        restore_args, is_leaf=_is_restore_leaf
    )
    wanted: list[str] = []
    missing: list[str] = []
    skipped = False

    def leaf(path: str, t: Any) -> Any:
        nonlocal skipped
        ra = one if one is not None else flat_ra.get(path)
        if t is PLACEHOLDER or ra is PLACEHOLDER:
            skipped = True
            return PLACEHOLDER
        wanted.append(re.escape(path))
        user = None if isinstance(t, RestoreArgs) else t
        meta = saved.get(path)
        if meta is None:
            if user is None:
                missing.append(path)
            return user
        return _target_leaf(user, ra, meta, f"{where} at {path!r}")

    target = map_with_path(leaf, base, is_leaf=lambda x: _is_restore_leaf(x) or _is_array_like(x))
    if missing:
        raise TargetMismatchError(
            f"{where}: restore_args name paths the checkpoint lacks: {missing} "
            f"(it holds {sorted(saved)})"
        )
    return target, (wanted if skipped else None)


def _target_leaf(t: Any, ra: RestoreArgs | None, meta: LeafMetadata, where: str) -> Any:
    """One target leaf: the user's ``t`` adjusted by ``ra``. A ``jax.ShapeDtypeStruct``
    without sharding, or no target, follows the saved kind (NumPy stays NumPy, as in Orbax)."""
    if meta.kind == "scalar":
        return t if t is not None and not _is_array_like(t) else meta.value
    shape = tuple(t.shape) if hasattr(t, "shape") else tuple(meta.shape)
    if ra is not None and ra.dtype is not None:
        dtype = np.dtype(ra.dtype)
    elif getattr(t, "dtype", None) is not None:
        dtype = np.dtype(t.dtype)
    else:
        dtype = as_numpy_dtype(meta.dtype)
    if isinstance(ra, ArrayRestoreArgs):
        for given in (ra.global_shape, ra.shape):
            if given is not None and tuple(given) != tuple(meta.shape):
                raise ValueError(f"{where}: restore_args shape {tuple(given)} differs from the saved {meta.shape}")
        sharding = ra.resolved_sharding() or getattr(t, "sharding", None) or _default_sharding(meta)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    if ra is not None and ra.restore_type is np.ndarray:
        return ArraySpec(shape, dtype)
    if isinstance(t, jax.Array) or (isinstance(t, jax.ShapeDtypeStruct) and t.sharding is not None):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=t.sharding)
    if isinstance(t, np.generic):
        return np.zeros((), dtype)[()]
    if isinstance(t, np.ndarray):
        return ArraySpec(shape, dtype)
    if meta.kind == "jax" or (ra is not None and ra.restore_type is jax.Array):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=_default_sharding(meta))
    return ArraySpec(shape, dtype)


def _default_sharding(meta: LeafMetadata) -> Any:
    entry = {"kind": "jax", "sharding": {"mesh": meta.mesh}, "spec": meta.spec.to_json()}
    return saved_sharding(entry) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def restore_pytree(directory: str, args: CheckpointArgs, where: str) -> Any:
    """Restore the pytree checkpoint in ``directory`` as Orbax's restore ``args`` ask:
    dtypes are cast to the target's (as Orbax does), ``PLACEHOLDER`` leaves are not read."""
    item, restore_args, partial = restore_options(args)
    saved = metadata_of(directory) if item is not None or restore_args is not None else {}
    target, patterns = build_target(item, restore_args, saved, where)
    return restore_dir(directory, target, paths=patterns, partial=partial, cast=True)
