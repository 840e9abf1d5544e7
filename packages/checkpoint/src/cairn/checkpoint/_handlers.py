"""Orbax's checkpoint handlers: each says which ``ocp.args`` an item gets when a
:class:`~cairn.checkpoint.Checkpointer` is called without ``args=``, and can itself
``save`` / ``restore`` / ``metadata`` a directory as Orbax's handlers do (the storage is
always cairn.checkpoint's own)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import jax

from cairn.checkpoint import _args, _fs, _items, _multihost, _registry
from cairn.checkpoint._json_item import jsonable


class CheckpointHandler:
    """Base of the handler markers; ``save_args(item)`` / ``restore_args(item)`` wrap a bare
    item in this handler's arguments."""

    save_type: ClassVar[Any] = _args.StandardSave
    restore_type: ClassVar[Any] = _args.StandardRestore

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        """Orbax's handler options (``use_ocdbt``, ``use_zarr3``...) are accepted and
        ignored: the format is fixed (zarr3 + OCDBT)."""

    def save_args(self, item: Any, **kwargs: Any) -> _args.CheckpointArgs:
        """``item`` wrapped in this handler's save arguments (``StandardSave(item)``...).

        Args:
          item: what to save.
          **kwargs: more fields of the save arguments (``save_args=``...).
        """
        return self.save_type(item, **kwargs)

    def restore_args(self, item: Any, **kwargs: Any) -> _args.CheckpointArgs:
        """``item`` wrapped in this handler's restore arguments (``StandardRestore(item)``...).

        Args:
          item: the restore target, or ``None``.
          **kwargs: more fields of the restore arguments (``strict=``...).
        """
        return self.restore_type(item, **kwargs)

    def save(self, directory: Any, item: Any = None, *, args: _args.CheckpointArgs | None = None,
             **kwargs: Any) -> None:
        """Write ``item`` (or what ``args`` describe) into ``directory``, synchronously.

        As in Orbax, a handler writes and a checkpointer makes the write atomic: this
        writes no ``COMMIT`` marker (a :class:`~cairn.checkpoint.Checkpointer` around the
        handler does).

        Args:
          directory: the folder to write into (created if missing).
          item: the value, wrapped in this handler's save args.
          args: save args instead of ``item``.
          **kwargs: more save-args fields (``save_args=``...).
        """
        if args is None:
            args = self.save_args(item, **kwargs)
        elif item is not None:
            raise TypeError("pass either the item or args=, not both")
        directory = os.fspath(directory)
        custom = _items.custom_metadata_of(args, None, f"save to {directory}")
        captured = _items.capture(args, copy_host=False, compression=None)
        os.makedirs(directory, exist_ok=True)
        _items.write(directory, captured, compression=None, composite=isinstance(args, _args.Composite),
                     custom_metadata=custom, handlers=item_typestrs(args, self))

    def restore(self, directory: Any, item: Any = None, *, args: _args.CheckpointArgs | None = None,
                **kwargs: Any) -> Any:
        """Read back what :meth:`save` wrote into ``directory``.

        Args:
          directory: the folder :meth:`save` wrote.
          item: a restore target, wrapped in this handler's restore args.
          args: restore args instead of ``item``.
          **kwargs: more restore-args fields (``restore_args=``, ``strict=``...).
        """
        if args is None and (item is not None or kwargs):
            args = self.restore_args(item, **kwargs)
        return _items.restore(os.fspath(directory), args)

    async def async_save(self, directory: Any, args: _args.CheckpointArgs | None = None) -> list[Any]:
        """Orbax's asynchronous form of :meth:`save`: writes, then returns the futures of
        work still running (none: the write is done when the coroutine returns).

        Args:
          directory: the folder to write into.
          args: the save args.
        """
        self.save(directory, args=args)
        return []

    def metadata(self, directory: Any) -> Any:
        """Every saved path's :class:`~cairn.checkpoint.LeafMetadata` (per item for a
        composite; ``"json"`` for JSON items), without reading array data, with the saved
        ``custom_metadata`` as an attribute (``CheckpointMetadata``). A composite handler
        answers an empty ``CheckpointMetadata`` for a folder where nothing was saved yet.

        Args:
          directory: the folder :meth:`save` wrote.
        """
        directory = os.fspath(directory)
        if isinstance(self, CompositeCheckpointHandler) and (not os.path.isdir(directory) or not os.listdir(directory)):
            return _items.CheckpointMetadata({}, item_handlers={})
        return _items.describe(directory)

    def typestr(self) -> str:
        """The handler's class as ``"<module>.<class>"`` (what a composite's metadata
        records as each item's handler in ``item_handlers``)."""
        return f"{type(self).__module__}.{type(self).__qualname__}"

    def finalize(self, directory: Any) -> None:
        """Nothing to do after a save (Orbax's hook; the write is complete when ``save`` returns).

        Args:
          directory: the folder :meth:`save` wrote.
        """

    def close(self) -> None:
        """Nothing to release (Orbax's hook)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class StandardCheckpointHandler(CheckpointHandler):
    """Pytrees of arrays and scalars (``args.StandardSave`` / ``StandardRestore``)."""


class PyTreeCheckpointHandler(CheckpointHandler):
    """Pytrees with per-leaf arguments (``args.PyTreeSave`` / ``PyTreeRestore``)."""

    save_type = _args.PyTreeSave
    restore_type = _args.PyTreeRestore


class ArrayCheckpointHandler(CheckpointHandler):
    """One array (``args.ArraySave`` / ``ArrayRestore``)."""

    save_type = _args.ArraySave
    restore_type = _args.ArrayRestore


class JsonCheckpointHandler(CheckpointHandler):
    """A JSON-able value (``args.JsonSave`` / ``JsonRestore``).

    Args:
      filename: the file the value is stored in, inside the checkpoint directory
        (checksummed JSON, as every cairn JSON file); ``None``: cairn's own item file.
      **options: Orbax's other handler options, accepted and ignored.
    """

    save_type = _args.JsonSave
    restore_type = _args.JsonRestore

    def __init__(self, filename: str | None = None, **options: Any) -> None:
        if filename is not None and (not isinstance(filename, str) or not _items.plain_name(filename)):
            raise ValueError(f"filename must be a plain file name (letters, digits, _ . -), got {filename!r}")
        self._filename = filename

    @property
    def filename(self) -> str | None:
        """The file name given at construction (``None``: cairn's own item file)."""
        return self._filename

    def save(self, directory: Any, item: Any = None, *, args: _args.CheckpointArgs | None = None,
             **kwargs: Any) -> None:
        """Write the value into ``directory`` (into ``filename`` if given).

        Args:
          directory: the folder to write into (created if missing).
          item: the JSON-able value (or pass ``args``).
          args: a ``JsonSave`` instead of ``item``.
          **kwargs: ignored.
        """
        if self._filename is None:
            super().save(directory, item, args=args, **kwargs)
            return
        if args is not None and item is not None:
            raise TypeError("pass either the item or args=, not both")
        value = _args.to_saved_tree(args if args is not None else self.save_args(item), "JsonCheckpointHandler.save")
        value = jsonable(value, "JsonCheckpointHandler.save")
        directory = os.fspath(directory)
        if _multihost.is_primary():
            os.makedirs(directory, exist_ok=True)
            _fs.write_json_durable(os.path.join(directory, self._filename), value)
            _fs.fsync_dir(directory)

    def restore(self, directory: Any, item: Any = None, *, args: _args.CheckpointArgs | None = None,
                **kwargs: Any) -> Any:
        """Read the value back (from ``filename`` if given; its checksum verified).

        Args:
          directory: the folder :meth:`save` wrote.
          item: ignored (as in Orbax).
          args: a ``JsonRestore`` or ``None``.
          **kwargs: ignored.
        """
        if self._filename is None:
            return super().restore(directory, item, args=args, **kwargs)
        f = os.path.join(os.fspath(directory), self._filename)
        if not os.path.isfile(f):
            raise FileNotFoundError(f"no JSON file {self._filename!r} in {os.fspath(directory)}")
        return _fs.read_json(f, require_checksum=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(filename={self._filename!r})" if self._filename else super().__repr__()


class CompositeCheckpointHandler(CheckpointHandler):
    """Several named items (``args.Composite``); a bare item is refused.

    Each item's handler is known from ``items_and_handlers``, from ``handler_registry``, or
    from the args the item is first saved or restored with; args another handler takes
    are then refused for that item (``ValueError``, as in Orbax). Restoring without args
    (or with an empty ``Composite``) reads every saved item as saved.

    Args:
      *item_names: names of items whose handler is learnt from their first args.
      composite_options: Orbax's options, accepted and ignored.
      handler_registry: a ``DefaultCheckpointHandlerRegistry`` of handlers by item and args.
      **items_and_handlers: a handler per item name.
    """

    def __init__(self, *item_names: str, composite_options: Any = None, handler_registry: Any = None,
                 **items_and_handlers: Any) -> None:
        del composite_options  # Orbax's options: accepted, the format is fixed
        if handler_registry is not None and items_and_handlers:
            raise ValueError("pass either handler_registry or handlers by item name (items_and_handlers), not both")
        if handler_registry is not None and item_names:
            raise ValueError("pass either handler_registry or item_names, not both (register the items instead)")
        bad = [n for n in item_names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"CompositeCheckpointHandler item names must be strings, got {bad!r}")
        self._handler_registry = (handler_registry if handler_registry is not None
                                  else registry_from(items_and_handlers))
        self._learnt: dict[str, Any] = {}
        self._own_handlers = list(items_and_handlers.values())

    def close(self) -> None:
        """Close every item's handler (those given, registered or learnt), each once."""
        reg = self._handler_registry
        entries = list(reg.get_all_entries().values()) if hasattr(reg, "get_all_entries") else []
        seen: set[int] = set()
        for handler in [*self._own_handlers, *entries, *self._learnt.values()]:
            if id(handler) not in seen:
                seen.add(id(handler))
                handler.close()

    def metadata(self, directory: Any) -> Any:
        """The base class's metadata (each saved item's, by name); a folder of the checkpoint
        named after an item this handler has a handler for, but holding no saved item, is
        listed as ``None`` (as Orbax lists an item whose metadata cannot be read).

        Args:
          directory: the folder :meth:`save` wrote.
        """
        md = super().metadata(directory)
        reg = self._handler_registry
        entries = reg.get_all_entries() if hasattr(reg, "get_all_entries") else {}
        known = {item for item, _ in entries if item is not None} | set(self._learnt)
        for name in sorted(known - set(md)):
            if os.path.isdir(os.path.join(os.fspath(directory), name)):
                md[name] = None
                if md.item_handlers is not None:
                    md.item_handlers[name] = None
        return md

    def item_handler(self, name: str) -> Any:
        """The handler this composite knows for item ``name`` (given, registered or learnt
        from its first args), else ``None``.

        Args:
          name: the item name.
        """
        reg = self._handler_registry
        handlers = reg.handlers_of(name) if hasattr(reg, "handlers_of") else []
        return handlers[0] if handlers else self._learnt.get(name)

    def _check_items(self, args: Any) -> None:
        """Refuse an item's args that its known handler does not take; learn the handler of
        an item seen for the first time."""
        if not isinstance(args, _args.Composite):
            return
        for name, item_args in args.items():
            if item_args is None:
                continue
            handlers = self._handler_registry.handlers_of(name) if hasattr(self._handler_registry, "handlers_of") else []
            known = handlers or ([self._learnt[name]] if name in self._learnt else [])
            if known:
                if not any(takes(h, item_args) for h in known):
                    raise _registry.mismatch(name, item_args, known[0])
                continue
            cls = handler_class_of(item_args)
            if cls is not None:
                self._learnt[name] = cls()

    def save(self, directory: Any, item: Any = None, *, args: _args.CheckpointArgs | None = None,
             **kwargs: Any) -> None:
        """Write the items of an ``args.Composite`` into ``directory`` (one folder each).

        Args:
          directory: the folder to write into.
          item: the ``args.Composite`` (or pass it as ``args``).
          args: the ``args.Composite``.
          **kwargs: ignored.
        """
        self._check_items(args if args is not None else item)
        super().save(directory, item, args=args)

    def restore(self, directory: Any, item: Any = None, *, args: _args.CheckpointArgs | None = None,
                **kwargs: Any) -> Any:
        """Read the items of ``directory`` back as a ``Composite``: those ``args`` name
        (per their args; ``None`` values as saved), or every item.

        Args:
          directory: the folder :meth:`save` wrote.
          item: the ``args.Composite`` (or pass it as ``args``), or ``None``.
          args: the ``args.Composite``, or ``None``.
          **kwargs: ignored.
        """
        args = args if args is not None else item
        self._check_items(args)
        return super().restore(directory, args=args)

    def save_args(self, item: Any, **kwargs: Any) -> _args.CheckpointArgs:
        """``item`` itself, which must be an ``args.Composite``.

        Args:
          item: the ``args.Composite`` to save.
          **kwargs: ignored.
        """
        if isinstance(item, _args.Composite):
            return item
        raise TypeError(
            "a Checkpointer(CompositeCheckpointHandler()) saves args=ocp.args.Composite(...), "
            f"got {type(item).__name__}"
        )

    def finalize(self, directory: Any) -> None:
        """Finalize each saved item with its handler (a user's handler may have work left),
        reporting each item's time as Orbax's ``/jax/orbax/write/background_item_finalize_secs``
        ``jax.monitoring`` duration.

        Args:
          directory: the folder :meth:`save` wrote.
        """
        directory = os.fspath(directory)
        for name in _items.item_kinds(directory):
            handlers = self._handler_registry.handlers_of(name) if hasattr(self._handler_registry, "handlers_of") else []
            handler = handlers[0] if handlers else self._learnt.get(name)
            start = time.time()
            if handler is not None:
                handler.finalize(os.path.join(directory, name) if name else directory)
            jax.monitoring.record_event_duration_secs("/jax/orbax/write/background_item_finalize_secs",
                                                      time.time() - start)

    def restore_args(self, item: Any, **kwargs: Any) -> _args.CheckpointArgs | None:  # type: ignore[override]
        """``item`` itself: an ``args.Composite``, or ``None`` (every item as saved).

        Args:
          item: the ``args.Composite`` to restore with, or ``None``.
          **kwargs: ignored.
        """
        if item is None or isinstance(item, _args.Composite):
            return item
        raise TypeError(
            "a Checkpointer(CompositeCheckpointHandler()) restores with args=ocp.args.Composite(...) "
            f"or no args, got {type(item).__name__}"
        )


class AsyncCheckpointHandler(CheckpointHandler):
    """Base of a user's own handler (Orbax's ``AsyncCheckpointHandler``): subclass it and
    define ``save(directory, args)`` (or ``async def async_save`` returning futures),
    ``restore(directory, args)`` and optionally ``finalize(directory)``. A
    :class:`~cairn.checkpoint.Checkpointer` around it calls them on a temporary directory
    and commits it atomically, as for its own formats."""


BUILTIN_HANDLERS = (StandardCheckpointHandler, PyTreeCheckpointHandler, ArrayCheckpointHandler,
                    JsonCheckpointHandler, CompositeCheckpointHandler)

# cairn's own args belong to their handlers, as Orbax registers its own
for _handler in BUILTIN_HANDLERS[:-1]:
    _args.register_with_handler(_handler, for_save=True)(_handler.save_type)
    _args.register_with_handler(_handler, for_restore=True)(_handler.restore_type)
_args.register_with_handler(CompositeCheckpointHandler, for_save=True, for_restore=True)(_args.Composite)


def is_custom(handler: Any) -> bool:
    """Whether ``handler`` stores data itself (a user's subclass that overrides ``save``,
    ``async_save`` or ``restore``) rather than through cairn's formats."""
    if isinstance(handler, JsonCheckpointHandler) and handler.filename is not None:
        return True  # its own file name: the handler writes and reads it
    if handler is None or type(handler) in BUILTIN_HANDLERS:
        return False
    cls = type(handler)
    return any(getattr(cls, m) is not getattr(CheckpointHandler, m) for m in ("save", "async_save", "restore"))


def item_typestrs(args: Any, handler: Any = None) -> dict[str, str | None] | None:
    """For a ``Composite``, each item's handler ``typestr()``: the one ``handler`` (a
    ``CompositeCheckpointHandler``) knows for the item, else the handler class its args
    belong to; ``None`` for other args."""
    if not isinstance(args, _args.Composite):
        return None
    out: dict[str, str | None] = {}
    for name, item_args in args.items():
        known = handler.item_handler(name) if isinstance(handler, CompositeCheckpointHandler) else None
        cls = type(known) if known is not None else handler_class_of(item_args)
        out[name] = None if cls is None else f"{cls.__module__}.{cls.__qualname__}"
    return out


def handler_class_of(args: Any) -> type | None:
    """The handler class whose args ``args`` (a class or an instance) are: a class
    registered with ``register_with_handler``, or a subclass of a built-in handler's
    save or restore args."""
    cls = args if isinstance(args, type) else type(args)
    registered = _args.get_registered_handler_cls(cls)
    if registered is not None:
        return registered
    for handler in BUILTIN_HANDLERS:
        for base in (handler.save_type, handler.restore_type):
            if base is not None and issubclass(cls, base):
                return handler
    return None


def registry_from(handlers: Mapping[str, Any]) -> _registry.DefaultCheckpointHandlerRegistry:
    """A registry with each ``{item: handler}`` registered for its save and restore args."""
    reg = _registry.DefaultCheckpointHandlerRegistry()
    for name, handler in handlers.items():
        if not isinstance(handler, CheckpointHandler):
            raise TypeError(f"the handler of item {name!r} must be a checkpoint handler, got {type(handler).__name__}")
        if isinstance(handler, type):
            handler = handler()
        for t in (handler.save_type, handler.restore_type):
            if isinstance(t, type) and issubclass(t, _args.CheckpointArgs) and not reg.has(name, t):
                reg.add(name, t, handler)
    return reg


def takes(handler: Any, args: Any) -> bool:
    """Whether ``handler`` takes ``args`` (a class or instance): for cairn's handlers (and
    subclasses), their own save / restore args or subclasses of them, or a class registered
    with the handler's class; a user's own handler takes what is registered with it, or
    anything if nothing is (it cannot be told)."""
    cls = args if isinstance(args, type) else type(args)
    registered = _args.get_registered_handler_cls(cls)
    if registered is not None and isinstance(handler, registered):
        return True
    if isinstance(handler, BUILTIN_HANDLERS):
        own = (type(handler).save_type, type(handler).restore_type)
        return any(isinstance(t, type) and issubclass(cls, t) for t in own)
    return not _args.has_registered_args(type(handler))
