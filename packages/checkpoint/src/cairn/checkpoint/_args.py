"""Orbax's typed checkpoint arguments (``ocp.args``) as thin descriptions of our save/restore.

``StandardSave(tree)`` says "save this pytree", ``StandardRestore(abstract_tree)`` "restore
onto this target", ``JsonSave(d)`` "store this JSON-able value as JSON", ``Composite(a=...,
b=...)`` "several named items in one checkpoint". A :class:`~cairn.checkpoint.Checkpointer`
or :class:`~cairn.checkpoint.CheckpointManager` turns them into calls of :func:`save` and
:func:`restore`; per-leaf arguments live in ``_leaf_args``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from cairn.checkpoint._leaf_args import RestoreRequest, apply_save_args, restore_tree


# --- checkpoint arguments ---
class CheckpointArgs:
    """Base of every ``ocp.args`` class: ``kind`` names how the item is stored
    (``"pytree"`` or ``"json"``) and ``saving`` whether it describes a save."""

    kind: ClassVar[str] = "pytree"
    saving: ClassVar[bool] = False


@dataclass
class StandardSave(CheckpointArgs):
    """Save a pytree of arrays and scalars (Orbax's ``args.StandardSave``).

    Args:
      item: the pytree to save (``jax.Array``, NumPy and Python scalar leaves).
      save_args: optional tree of :class:`~cairn.checkpoint.SaveArgs` matching ``item``
        (per-leaf dtype casts).
      custom_metadata: a JSON-able value stored beside the tree (Orbax's name).
    """

    item: Any
    save_args: Any = None
    custom_metadata: Any = None
    saving: ClassVar[bool] = True


@dataclass
class StandardRestore(CheckpointArgs):
    """Restore a pytree, onto ``item`` (a tree of arrays, ``jax.ShapeDtypeStruct`` s or
    scalars) if given. ``strict=False`` truncates, or pads with zeros, arrays whose target
    shape differs from the saved one (same rank), as in Orbax; a partial restore needs
    ``PyTreeRestore(partial_restore=True)``. ``fallback_sharding`` places device arrays
    whose saved sharding does not fit the devices and whose target has none.

    Args:
      item: the restore target (its structure, shapes, dtypes and shardings), or ``None``
        for the tree as saved.
      strict: ``False`` truncates or zero-pads arrays whose target shape differs.
      support_layout: not supported; ``True`` raises ``NotImplementedError``.
      fallback_sharding: a ``jax.sharding.Sharding`` for device arrays whose saved
        sharding does not fit this run's devices.
    """

    item: Any = None
    strict: bool = True
    support_layout: bool = False
    fallback_sharding: Any = None

    def __post_init__(self) -> None:
        if self.support_layout:
            raise NotImplementedError("StandardRestore(support_layout=True) is not supported")


@dataclass
class PyTreeSave(CheckpointArgs):
    """Save a pytree with optional per-leaf :class:`SaveArgs` (Orbax's ``args.PyTreeSave``).

    Args:
      item: the pytree to save.
      save_args: optional tree of :class:`~cairn.checkpoint.SaveArgs` matching ``item``.
      ocdbt_target_data_file_size: accepted for Orbax compatibility (a positive int, bytes);
        our chunking is automatic.
      custom_metadata: a JSON-able value stored beside the tree.
    """

    item: Any
    save_args: Any = None
    ocdbt_target_data_file_size: int | None = None
    custom_metadata: Any = None
    saving: ClassVar[bool] = True

    def __post_init__(self) -> None:
        size = self.ocdbt_target_data_file_size
        if size is not None and not (isinstance(size, int) and size > 0):
            raise ValueError(f"ocdbt_target_data_file_size must be a positive int, got {size!r}")


@dataclass
class PyTreeRestore(CheckpointArgs):
    """Restore a pytree onto ``item`` and/or per-leaf ``restore_args`` (a tree of
    ``RestoreArgs``); ``partial_restore=True`` skips checkpoint paths the target lacks;
    ``transforms`` (a tree of ``Transform``) read leaves from other checkpoint paths.

    Args:
      item: the restore target's structure and leaves, or ``None``.
      restore_args: a tree of :class:`~cairn.checkpoint.RestoreArgs` (per leaf: NumPy or
        device array, dtype, sharding), matched with ``item`` by path.
      transforms: a tree of :class:`~cairn.checkpoint.Transform` saying which checkpoint
        path each leaf is read from.
      transforms_default_to_original: leaves without a transform read their own path.
      legacy_transform_fn: not supported (use ``transforms``); set, it raises at restore.
      partial_restore: skip checkpoint paths the target lacks.
    """

    item: Any = None
    restore_args: Any = None
    transforms: Any = None
    transforms_default_to_original: bool = True
    legacy_transform_fn: Any = None
    partial_restore: bool = False


@dataclass
class ArraySave(CheckpointArgs):
    """Save one array (Orbax's ``args.ArraySave``).

    Args:
      item: the array.
      save_args: an optional :class:`~cairn.checkpoint.SaveArgs` for it.
    """

    item: Any
    save_args: Any = None
    saving: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.item, (str, bytes)) or not (
            hasattr(self.item, "shape") and hasattr(self.item, "dtype") or isinstance(self.item, (bool, int, float, complex))
        ):
            raise TypeError(f"ArraySave saves one array or number, got {type(self.item).__name__}")


@dataclass
class ArrayRestore(CheckpointArgs):
    """Restore one array, onto ``item`` if given, per ``restore_args`` if given.

    Args:
      item: the target array, ``jax.ShapeDtypeStruct`` or ``None`` (as saved).
      restore_args: an optional :class:`~cairn.checkpoint.RestoreArgs` for it.
    """

    item: Any = None
    restore_args: Any = None


@dataclass
class JsonSave(CheckpointArgs):
    """Save a JSON-able value as JSON (Orbax's ``args.JsonSave``).

    Args:
      item: the value (dicts, lists, strings, numbers, booleans, ``None``).
    """

    item: Any
    kind: ClassVar[str] = "json"
    saving: ClassVar[bool] = True


@dataclass
class JsonRestore(CheckpointArgs):
    """Restore a value saved with :class:`JsonSave` (``item`` is ignored, as in Orbax).

    Args:
      item: ignored.
    """

    item: Any = None
    kind: ClassVar[str] = "json"


class Composite(CheckpointArgs, Mapping):
    """Several named items, each with its own arguments; also what a multi-item restore
    returns. Items are read by key (``c["state"]``) or attribute (``c.state``).

    Args:
      *args: mappings of item name to arguments, merged in order.
      **items: more items by name (they win over ``args``); every name is a non-empty string.

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


# --- registration with a handler ---
_REGISTRY: dict[type, tuple[type, bool, bool]] = {}


def register_with_handler(handler_cls: type, for_save: bool = False, for_restore: bool = False) -> Callable[[type], type]:
    """Class decorator: the decorated ``CheckpointArgs`` subclass belongs to ``handler_cls``.

    A class registered with one of cairn's handlers saves or restores as that handler's
    own args do (``JsonCheckpointHandler``: as JSON; the others: as a pytree), reading the
    value from the instance's ``item`` (and ``save_args`` / ``restore_args`` if present).

    Args:
      handler_cls: the ``*CheckpointHandler`` class the args belong to.
      for_save: the class describes a save.
      for_restore: the class describes a restore (both may be true).

    Returns:
      The decorator, which returns the class itself.

    >>> from dataclasses import dataclass
    >>> from cairn.checkpoint import JsonCheckpointHandler
    >>> @register_with_handler(JsonCheckpointHandler, for_save=True)
    ... @dataclass
    ... class ConfigSave(CheckpointArgs):
    ...     item: dict
    >>> ConfigSave.kind, ConfigSave.saving, get_registered_handler_cls(ConfigSave) is JsonCheckpointHandler
    ('json', True, True)
    """
    if not (for_save or for_restore):
        raise ValueError("register_with_handler needs for_save=True and/or for_restore=True")

    def register(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, CheckpointArgs)):
            raise TypeError(f"register_with_handler: the class must subclass CheckpointArgs, got {cls!r}")
        save_type = getattr(handler_cls, "save_type", None)
        if save_type is not None and "kind" not in vars(cls):
            cls.kind = save_type.kind
        if "saving" not in vars(cls):  # save-only args are refused by a restore
            cls.saving = for_save and not for_restore
        _REGISTRY[cls] = (handler_cls, for_save, for_restore)
        return cls

    return register


def has_registered_args(handler_cls: type) -> bool:
    """Whether any args class is registered with exactly ``handler_cls``."""
    return any(h is handler_cls for h, _, _ in _REGISTRY.values())


def get_registered_handler_cls(args: Any) -> type | None:
    """The handler class an args class (or instance) was registered with, else ``None``.

    Args:
      args: a ``CheckpointArgs`` subclass or instance.
    """
    cls = args if isinstance(args, type) else type(args)
    for c in cls.__mro__:
        if c in _REGISTRY:
            return _REGISTRY[c][0]
    return None


def wrap_for_handler(handler: Any, item: Any, for_save: bool) -> Any:
    """``item`` wrapped in the args class registered with ``handler``'s class (or a base)
    for a save (or a restore); ``item`` itself if it already is args or none is registered."""
    if isinstance(item, CheckpointArgs):
        return item
    for base in type(handler).__mro__:
        for cls, (h, save, restore) in _REGISTRY.items():
            if h is base and (save if for_save else restore):
                return cls(item)
    wrap = getattr(handler, "save_args" if for_save else "restore_args", None)
    if callable(wrap) and (for_save or item is not None):  # cairn's handlers (and subclasses)
        return wrap(item)
    return item


def get_registered_args_cls(handler: Any) -> tuple[type, type]:
    """(save args class, restore args class) registered with a handler class or instance.

    Args:
      handler: a handler class or instance.

    Raises:
      ValueError: no class is registered for the save or for the restore.
    """
    handler_cls = handler if isinstance(handler, type) else type(handler)
    found: dict[bool, type] = {}
    for cls, (h, save, restore) in _REGISTRY.items():
        if h is handler_cls:
            if save:
                found.setdefault(True, cls)
            if restore:
                found.setdefault(False, cls)
    if True not in found or False not in found:
        raise ValueError(f"{handler_cls.__name__} has no args class registered for "
                         f"{'saving' if True not in found else 'restoring'}")
    return found[True], found[False]


def _registered_for_save(args: Any) -> bool:
    for c in type(args).__mro__:
        if c in _REGISTRY:
            return _REGISTRY[c][1]
    return False


# --- applying the arguments ---
def to_saved_tree(args: CheckpointArgs, where: str) -> Any:
    """The tree (or JSON value) that save ``args`` save, with their ``SaveArgs`` applied."""
    saving = isinstance(args, CheckpointArgs) and (args.saving or _registered_for_save(args))
    if not saving or isinstance(args, Composite):
        raise TypeError(
            f"{where}: expected save arguments (ocp.args.StandardSave, PyTreeSave, ArraySave or "
            f"JsonSave), got {type(args).__name__}"
        )
    return apply_save_args(args.item, getattr(args, "save_args", None), where)  # type: ignore[attr-defined]


def restore_request(args: CheckpointArgs) -> RestoreRequest:
    """What pytree restore ``args`` ask for."""
    if isinstance(args, PyTreeRestore):
        if args.legacy_transform_fn is not None:
            raise NotImplementedError("PyTreeRestore(legacy_transform_fn=...) is not supported; use transforms")
        return RestoreRequest(
            args.item, args.restore_args, args.transforms, args.transforms_default_to_original,
            partial=args.partial_restore,
        )
    if isinstance(args, StandardRestore):
        return RestoreRequest(args.item, strict=args.strict, fallback_sharding=args.fallback_sharding)
    if isinstance(args, ArrayRestore):
        return RestoreRequest(args.item, args.restore_args)
    if get_registered_handler_cls(args) is not None:  # a user's args class, registered
        return RestoreRequest(getattr(args, "item", None), getattr(args, "restore_args", None))
    raise TypeError(f"expected pytree restore arguments, got {type(args).__name__}")


def restore_pytree(directory: str, args: CheckpointArgs, where: str) -> Any:
    """Restore the pytree checkpoint in ``directory`` as Orbax's restore ``args`` ask."""
    return restore_tree(directory, restore_request(args), where)
