"""Orbax's checkpointer classes: one item (or one ``Composite``) in one directory.

``Checkpointer(handler)`` saves synchronously; ``AsyncCheckpointer(handler)`` returns once
device data is on the host and commits in the background. ``StandardCheckpointer`` is an
``AsyncCheckpointer(StandardCheckpointHandler())`` and ``PyTreeCheckpointer`` a
``Checkpointer(PyTreeCheckpointHandler())``, as in Orbax. Without a handler an
``AsyncCheckpointer`` keeps cairn's own calling convention (``save(dir, tree)``,
``restore(dir, target, paths=..., partial=..., cast=...)``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import os
import time
from typing import Any, ClassVar

from cairn.checkpoint import _args, _fs, _items, _multihost
from cairn.checkpoint._checkpointer import (
    _Background,
    _BackgroundSaver,
    _prepare_tmp,
    _require_committed,
    restore,
    write_and_commit,
)
from cairn.checkpoint._handlers import (
    CheckpointHandler,
    CompositeCheckpointHandler,
    PyTreeCheckpointHandler,
    StandardCheckpointHandler,
    is_custom,
    item_typestrs,
)


class Checkpointer(_BackgroundSaver):
    """Saves and restores one item, or a ``Composite`` of named items, in ``directory``.

    ``save(directory, item)`` wraps ``item`` in the handler's save arguments
    (``StandardSave`` for a ``StandardCheckpointHandler``...); ``save(directory,
    args=ocp.args.Composite(...))`` stores several items. ``restore(directory)`` gives back
    what was saved (a ``Composite`` for several items); ``restore(directory, target)`` or
    ``args=`` restores onto a target (dtypes are cast to the target's, as in Orbax). An
    existing ``directory`` is refused unless ``force=True``. The commit is atomic, as for
    :func:`save`.

    >>> import tempfile, numpy as np
    >>> d = tempfile.mkdtemp()
    >>> ckptr = Checkpointer(PyTreeCheckpointHandler())
    >>> ckptr.save(d + "/a", {"w": np.arange(3), "ids": [1, 2]})
    >>> ckptr.restore(d + "/a")
    {'w': array([0, 1, 2]), 'ids': [1, 2]}
    """

    asynchronous: ClassVar[bool] = False

    def __init__(
        self,
        handler: CheckpointHandler | None = None,
        *,
        compression: str | None = None,
        timeout_secs: float | None = None,
        **options: Any,
    ) -> None:
        """Build a checkpointer.

        Args:
          handler: the item's handler (``ocp.StandardCheckpointHandler()``...), or ``None``
            (a pytree, or the handler the save/restore arguments imply).
          compression: ``None`` (default), ``"zstd"`` or ``"zstd:<level>"`` for array chunks.
          timeout_secs: for a user's own handler saved in the background, the seconds from
            ``save`` within which the futures its ``async_save`` returned must finish; past
            it the save fails with a ``TimeoutError`` (re-raised by the next call, as every
            background error). ``None``: no limit.
          **options: Orbax's checkpointer options (``multiprocessing_options``,
            ``file_options``...), accepted and ignored.
        """
        if timeout_secs is not None and not (isinstance(timeout_secs, (int, float)) and timeout_secs > 0):
            raise ValueError(f"timeout_secs must be a positive number of seconds or None, got {timeout_secs!r}")
        self._timeout_secs = timeout_secs
        if handler is not None and not isinstance(handler, CheckpointHandler):
            raise TypeError(
                f"handler must be an ocp.*CheckpointHandler() instance, got {type(handler).__name__}"
            )
        self._handler = handler
        self._compression = compression
        self._bg = _Background()

    def _save_args(self, item: Any, args: Any, save_args: Any) -> _args.CheckpointArgs | None:
        if isinstance(item, _args.CheckpointArgs) and args is None:
            item, args = None, item
        if args is not None:
            if item is not None:
                raise TypeError("pass either the item or args=, not both")
            return args
        if self._handler is None:
            return None if save_args is None else _args.PyTreeSave(item, save_args=save_args)
        return self._handler.save_args(item, **({"save_args": save_args} if save_args is not None else {}))

    @property
    def handler(self) -> CheckpointHandler | None:
        """The handler given at construction (``None``: cairn's own calling convention)."""
        return self._handler

    def _item_save_args(self, item: Any, save_args: Any) -> _args.CheckpointArgs:
        """The save args of ``item`` as this checkpointer's handler gives them (a
        CheckpointManager with Orbax's dict of checkpointers uses it); for a user's own
        handler, the args class registered with it (or ``item`` itself)."""
        if is_custom(self._handler) and save_args is None:
            return _args.wrap_for_handler(self._handler, item, for_save=True)
        return self._save_args(item, None, save_args) or _args.StandardSave(item)

    def _item_restore_args(self, item: Any, restore_args: Any) -> _args.CheckpointArgs | None:
        """The restore args of target ``item`` (``None``: restore as saved)."""
        if isinstance(item, _args.CheckpointArgs):
            return item
        if is_custom(self._handler) and restore_args is None:
            return _args.wrap_for_handler(self._handler, item, for_save=False)
        if restore_args is not None:
            return _args.PyTreeRestore(item, restore_args=restore_args)
        if item is None:
            return None
        return (self._handler or StandardCheckpointHandler()).restore_args(item)

    def save(
        self,
        directory: str | os.PathLike,
        item: Any = None,
        *extra_args: Any,
        args: _args.CheckpointArgs | None = None,
        force: bool = False,
        save_args: Any = None,
        custom_metadata: Any = None,
    ) -> None:
        """Save ``item`` (or what ``args`` describe) to ``directory``.

        Args:
          directory: the checkpoint directory to create.
          item: the tree to save (wrapped in the handler's save arguments), or save arguments.
          *extra_args: Orbax's older form for a user's own handler: passed on positionally,
            as ``handler.save(directory, item, *extra_args)`` (and ``async_save``).
          args: Orbax's save arguments (``ocp.args.StandardSave(tree)``, ``Composite(...)``).
          force: replace an existing ``directory``.
          save_args: a tree of per-leaf :class:`SaveArgs` for ``item``.
          custom_metadata: a JSON-able value stored with the item.

        Raises:
          CheckpointExistsError: ``directory`` exists and ``force`` is false (a ``FileExistsError`` and a ``ValueError``).
          TypeError: a leaf cannot be saved (naming its path), or ``args`` are not save args.
        """
        self._bg.wait()
        final = os.path.abspath(os.fspath(directory))
        if is_custom(self._handler):
            custom = _items.custom_metadata_of(args if args is not None else item, custom_metadata, f"save to {final}")
            self._save_custom(final, item if args is None else args, force, extra_args, custom)
            return
        if extra_args:
            raise TypeError(f"save() takes extra positional arguments only with a user's own handler, got {len(extra_args)}")
        a = self._save_args(item, args, save_args)
        copy = self.asynchronous
        if a is None:
            a = _args.StandardSave(item)
        custom = _items.custom_metadata_of(a, custom_metadata, f"save to {final}")
        captured = _items.capture(a, copy_host=copy, compression=self._compression)
        tmp = _prepare_tmp(final, force)
        compression, composite = self._compression, isinstance(a, _args.Composite)
        if composite and isinstance(self._handler, CompositeCheckpointHandler):
            self._handler._check_items(a)  # learn (or check) each item's handler, as the handler's own save does
        handlers = item_typestrs(a, self._handler)

        def tail() -> None:
            write_and_commit(
                lambda: _items.write(tmp, captured, compression=compression, composite=composite,
                                     custom_metadata=custom, handlers=handlers),
                tmp, final, force, _items.verify,
            )

        if self.asynchronous:
            self._bg.start(tail, final)
        else:
            tail()

    def _save_custom(self, final: str, args: Any, force: bool, legacy: tuple[Any, ...] = (),
                     custom: Any = None) -> None:
        """A user's handler writes a temporary directory (``async_save`` in the caller's
        thread when asynchronous, then its futures are awaited in the background), is
        finalized, and the directory is committed atomically with the JSON-able ``custom``
        metadata beside it. With ``legacy`` positional arguments (Orbax's older form) the
        handler gets ``(directory, item, *legacy)``."""
        handler = self._handler
        if legacy:
            call_args, call_kw = (args, *legacy), {}
        else:
            call_args, call_kw = (), {"args": _args.wrap_for_handler(handler, args, for_save=True)}
        deadline = None if self._timeout_secs is None else time.monotonic() + self._timeout_secs
        tmp = _prepare_tmp(final, force)
        pending: list[Any] = []
        if self.asynchronous:
            pending = list(asyncio.run(handler.async_save(tmp, *call_args, **call_kw)) or [])  # type: ignore[union-attr]

        def write() -> None:
            if not self.asynchronous:
                handler.save(tmp, *call_args, **call_kw)  # type: ignore[union-attr]
            await_futures(pending, deadline, self._timeout_secs)
            handler.finalize(tmp)  # type: ignore[union-attr]
            if custom is not None and _multihost.is_primary():
                _fs.write_json_durable(os.path.join(tmp, _items.CUSTOM_METADATA_FILE), custom)

        def tail() -> None:
            write_and_commit(write, tmp, final, force, lambda _d: None)

        if self.asynchronous:
            self._bg.start(tail, final)
        else:
            tail()

    def restore(
        self,
        directory: str | os.PathLike,
        item: Any = None,
        *,
        args: _args.CheckpointArgs | None = None,
        strict: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Restore ``directory``: as saved, onto ``item``, or as ``args`` describe.

        Without a handler (cairn's own convention) ``item`` is a :func:`restore` target and
        ``kwargs`` are :func:`restore`'s (``paths``, ``partial``, ``cast``, ``mesh``).

        Args:
          directory: the checkpoint to read.
          item: the restore target, or ``None`` (as saved).
          args: Orbax's restore arguments (``ocp.args.StandardRestore(abstract)``, ``Composite(...)``).
          strict: ``False`` truncates or zero-pads arrays whose target shape differs (as in Orbax).
          **kwargs: :func:`restore`'s keywords without a handler; with one, more fields of its
            restore arguments; with a user's own handler whose ``restore`` takes no
            ``args``, passed on to it with ``item`` (Orbax's older form).
        """
        self._bg.wait()
        directory = os.fspath(directory)
        if isinstance(item, _args.CheckpointArgs) and args is None:
            item, args = None, item
        if is_custom(self._handler):
            _require_committed(directory)
            takes_args = "args" in inspect.signature(self._handler.restore).parameters  # type: ignore[union-attr]
            if kwargs and args is None and not takes_args:  # Orbax's older form: the handler's own keywords
                return self._handler.restore(directory, item=item, **kwargs)  # type: ignore[union-attr]
            wanted = args if args is not None else _args.wrap_for_handler(self._handler, item, for_save=False)
            return self._handler.restore(directory, args=wanted)  # type: ignore[union-attr]
        if args is None and self._handler is None and not os.path.isfile(
            os.path.join(directory, _items.ITEMS_FILE)
        ):
            return restore(directory, item, **kwargs)
        handler = self._handler or StandardCheckpointHandler()
        # Orbax's older keyword form: the handler's restore-args fields (restore_args=, transforms=...)
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k in _restore_fields(handler)}
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)} (pass args=ocp.args...)")
        if args is None and (item is not None or fields):
            extra = {"strict": strict} if isinstance(self._handler, StandardCheckpointHandler) else {}
            args = handler.restore_args(item, **extra, **fields)
        _require_committed(directory)
        return _items.restore(directory, args)

    def metadata(self, directory: str | os.PathLike) -> Any:
        """Every saved path's :class:`LeafMetadata` (per item for a ``Composite``; ``"json"``
        for JSON items), without reading array data: a dict with Orbax's
        ``custom_metadata`` and ``item_metadata`` as attributes (``CheckpointMetadata``).

        Args:
          directory: the checkpoint to describe.
        """
        self._bg.wait()
        directory = os.fspath(directory)
        _require_committed(directory)
        own = getattr(type(self._handler), "metadata", None)
        if is_custom(self._handler) and own is not CheckpointHandler.metadata:
            return self._handler.metadata(directory)  # type: ignore[union-attr]  # a user's handler's own
        return _items.describe(directory)


class AsyncCheckpointer(Checkpointer):
    """Saves in the background: :meth:`save` returns once device data is on the host.

    Writing, metadata and the atomic commit run in a background thread. A second
    :meth:`save` first waits for the previous one; an error raised in the background is
    re-raised (as :class:`CheckpointError`) by the next call to any method. NumPy leaves are
    copied at ``save`` time so the caller may change them; ``jax.Array`` leaves are
    immutable and, on CPU, referenced without a copy.

    >>> import tempfile, numpy as np
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> ckptr = AsyncCheckpointer()
    >>> ckptr.save(d, {"w": np.ones(4)})
    >>> ckptr.wait_until_finished()
    >>> restore(d)["w"].sum()
    np.float64(4.0)
    """

    asynchronous = True


class StandardCheckpointer(AsyncCheckpointer):
    """``AsyncCheckpointer(StandardCheckpointHandler())``: ``save(dir, tree)``,
    ``restore(dir, abstract_tree=None, strict=True)``.

    Args:
      compression: ``None`` (default), ``"zstd"`` or ``"zstd:<level>"`` for array chunks.
      **options: Orbax's checkpointer options, accepted and ignored.
    """

    def __init__(self, *, compression: str | None = None, **options: Any) -> None:
        super().__init__(StandardCheckpointHandler(), compression=compression, **options)


class PyTreeCheckpointer(Checkpointer):
    """``Checkpointer(PyTreeCheckpointHandler())``: synchronous pytree saves with optional
    per-leaf ``save_args`` / ``restore_args``.

    Args:
      compression: ``None`` (default), ``"zstd"`` or ``"zstd:<level>"`` for array chunks.
      **options: Orbax's checkpointer options, accepted and ignored.
    """

    def __init__(self, *, compression: str | None = None, **options: Any) -> None:
        super().__init__(PyTreeCheckpointHandler(), compression=compression, **options)


def await_futures(pending: list[Any], deadline: float | None, timeout_secs: float | None) -> None:
    """Wait for a user's handler's futures, until ``deadline`` (``time.monotonic``) if set.

    Raises:
      TimeoutError: some are not done by the deadline (saying how many were).
    """
    for i, f in enumerate(pending):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            f.result(timeout=left)
        except concurrent.futures.TimeoutError:
            done = i + sum(1 for g in pending[i + 1:] if g.done())
            raise TimeoutError(
                f"the handler's commit futures: ChainedFuture completed {done}/{len(pending)} futures but timed "
                f"out after {timeout_secs} seconds (the checkpointer's timeout_secs)"
            ) from None


def _restore_fields(handler: CheckpointHandler) -> set[str]:
    """The field names of ``handler``'s restore args other than ``item``."""
    t = handler.restore_type
    return {f.name for f in dataclasses.fields(t)} - {"item"} if dataclasses.is_dataclass(t) else set()
