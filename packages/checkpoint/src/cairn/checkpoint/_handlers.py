"""Orbax's checkpoint handlers, as markers: each says which ``ocp.args`` an item gets when
a :class:`~cairn.checkpoint.Checkpointer` is called without ``args=`` (the storage is always
cairn.checkpoint's own)."""

from __future__ import annotations

from typing import Any, ClassVar

from cairn.checkpoint import _args


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
