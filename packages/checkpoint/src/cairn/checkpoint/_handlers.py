"""Orbax's checkpoint handlers: each says which ``ocp.args`` an item gets when a
:class:`~cairn.checkpoint.Checkpointer` is called without ``args=``, and can itself
``save`` / ``restore`` / ``metadata`` a directory as Orbax's handlers do (the storage is
always cairn.checkpoint's own)."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from cairn.checkpoint import _args, _items, _restore


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
        captured = _items.capture(args, copy_host=False, compression=None)
        os.makedirs(directory, exist_ok=True)
        _items.write(directory, captured, compression=None, composite=isinstance(args, _args.Composite))

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
        composite; ``"json"`` for JSON items), without reading array data.

        Args:
          directory: the folder :meth:`save` wrote.
        """
        directory = os.fspath(directory)
        kinds = _items.item_kinds(directory)
        out = {n: (_restore.metadata_of(os.path.join(directory, n) if n else directory) if k == "pytree" else "json")
               for n, k in kinds.items()}
        return out[""] if "" in out else out

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
    """A JSON-able value (``args.JsonSave`` / ``JsonRestore``)."""

    save_type = _args.JsonSave
    restore_type = _args.JsonRestore


class CompositeCheckpointHandler(CheckpointHandler):
    """Several named items (``args.Composite``); a bare item is refused."""

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


def is_custom(handler: Any) -> bool:
    """Whether ``handler`` stores data itself (a user's subclass that overrides ``save``,
    ``async_save`` or ``restore``) rather than through cairn's formats."""
    if handler is None or type(handler) in BUILTIN_HANDLERS:
        return False
    cls = type(handler)
    return any(getattr(cls, m) is not getattr(CheckpointHandler, m) for m in ("save", "async_save", "restore"))
