"""Orbax's ``CheckpointManager`` calling conventions, at the edge of the core manager.

The core (:mod:`cairn.checkpoint._manager`) saves ``{name: pytree | Checkpointable |
JsonItem}`` and knows nothing of ``ocp.args``; this subclass turns Orbax's ``args=``,
its positional dict of checkpointers and its legacy ``items=`` calls into core items, and
restores into ``Composite`` results.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from cairn.checkpoint import _args, _fs, _json_item, _manager, _multihost, _policies
from cairn.checkpoint._checkpointers import AsyncCheckpointer, Checkpointer, await_futures
from cairn.checkpoint._handlers import (
    CheckpointHandler,
    JsonCheckpointHandler,
    is_custom,
    registry_from,
    takes,
)
from cairn.checkpoint._json_item import JsonItem
from cairn.checkpoint._manager import CheckpointManagerOptions, _checkpointable_of
from cairn.checkpoint._registry import mismatch
from cairn.checkpoint.logging import AbstractLogger, StandardLogger
from cairn.checkpoint.logging.step_statistics import RestoreStepStatistics, SaveStepStatistics
from cairn.core_array import is_checkpointable

#: The item name of a step saved with non-Composite ``args`` (as in Orbax).
DEFAULT_ITEM_NAME = "default"
#: The item name Orbax reserves for a manager's metadata (refused as an item name, as there).
METADATA_ITEM_NAME = "metadata"


@dataclass(frozen=True)
class RootMetadata:
    """What ``CheckpointManager.metadata()`` returns (Orbax's ``RootMetadata``).

    Args:
      custom_metadata: the ``metadata`` dict given to the directory's first manager.
    """

    custom_metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepMetadata:
    """What ``CheckpointManager.metadata(step)`` returns (Orbax's ``StepMetadata``).

    Args:
      item_metadata: the leaves' metadata of a one-item step, or a ``Composite`` of them by item.
      metrics: the metrics saved with the step (``{}`` if none).
      custom_metadata: the ``custom_metadata`` saved with the step (``{}`` if none).
      init_timestamp_nsecs: when the save was called, in ns since the epoch.
    """

    item_metadata: Any = None
    metrics: dict[str, Any] = field(default_factory=dict)
    custom_metadata: dict[str, Any] = field(default_factory=dict)
    init_timestamp_nsecs: int | None = None


@dataclass
class _HandlerItem:
    """An item a user's own handler writes into its folder of the step (stored as an
    ``"opaque"`` item: the core commits the folder without reading it)."""

    handler: Any
    args: Any
    futures: list[Any] = field(default_factory=list)


class CheckpointManager(_manager.CheckpointManager):
    """:class:`cairn.checkpoint._manager.CheckpointManager` with Orbax's calling conventions.

    ``save(step, args=ocp.args.Composite(name=ocp.args.StandardSave(tree), ...))`` names
    each item with how to store it; ``args=ocp.args.StandardSave(tree)`` saves one item
    (named ``"default"``; :meth:`restore` then returns it alone). Orbax's older form,
    ``CheckpointManager(directory, {"state": Checkpointer(...)}, options)`` with
    ``save(step, {"state": tree})``, stores each item with its checkpointer's handler.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        checkpointers: Any = None,
        options: Any = None,
        metadata: Mapping[str, Any] | None = None,
        *,
        item_names: Sequence[str] | None = None,
        item_handlers: Any = None,
        handler_registry: Any = None,
        logger: AbstractLogger | None = None,
        **ignored: Any,
    ) -> None:
        """Open the manager of ``directory``.

        Args:
          directory: where the step directories live.
          checkpointers: Orbax's older form: one ``Checkpointer`` (steps hold one item) or a
            dict of them by item name. A ``CheckpointManagerOptions`` here is taken as
            ``options`` (cairn's ``CheckpointManager(directory, options)``). Saves then
            run in the background only if one of them is an ``AsyncCheckpointer``.
          options: a ``CheckpointManagerOptions``; a sequence of names here is taken as
            ``item_names`` (cairn's earlier positional order).
          metadata: a JSON-able dict kept with the manager (``metadata()`` reads it back).
          item_names: accepted (items are named by each ``save``'s ``args``).
          item_handlers: a handler, or a dict of handlers by item name: the arguments an
            item gets when ``restore`` is called without ``args``; args a handler does not
            take are refused for its item (``ValueError``, as in Orbax).
          handler_registry: a ``DefaultCheckpointHandlerRegistry`` instead of a dict of
            ``item_handlers`` (not both).
          logger: gets each save's and restore's statistics
            (:mod:`cairn.checkpoint.logging`); default: a ``StandardLogger`` (INFO logs).
          **ignored: Orbax's other keywords (``prevent_write_metadata``...), accepted and ignored.
        """
        if isinstance(checkpointers, CheckpointManagerOptions) and options is None:
            checkpointers, options = None, checkpointers
        if options is not None and not isinstance(options, CheckpointManagerOptions):
            if isinstance(options, Sequence) and not isinstance(options, str) and item_names is None:
                options, item_names = None, options
            else:
                raise TypeError(f"options must be a CheckpointManagerOptions, got {type(options).__name__}")
        _check_init_args(checkpointers, item_names, item_handlers, handler_registry, logger)
        if isinstance(item_handlers, Mapping):
            handler_registry = registry_from(item_handlers)
        if checkpointers is not None:
            # Orbax's older form: the checkpointers say whether saves run in the background
            ckpts = checkpointers.values() if isinstance(checkpointers, Mapping) else [checkpointers]
            background = any(isinstance(c, AsyncCheckpointer) for c in ckpts)
            options = dataclasses.replace(options or CheckpointManagerOptions(), enable_async_checkpointing=background)
        super().__init__(directory, options)
        self.item_names = tuple(item_names) if item_names is not None else None
        self._checkpointers = checkpointers
        self._item_handlers = item_handlers
        self._handler_registry = handler_registry
        self._metadata = None if metadata is None else _json_metadata(self.directory, metadata, self._options)
        # Orbax's rule: a manager holds either one unnamed item or named items, never both
        # (None: not known until the first save, or the newest step, says which)
        self._single: bool | None = None
        self._opaque: dict[str, _HandlerItem] = {}  # the save in progress's items of a user's handler
        self._opaque_deadline: float | None = None
        if item_names is not None or isinstance(item_handlers, Mapping) or handler_registry is not None:
            self._single = False
        elif isinstance(item_handlers, CheckpointHandler):
            self._single = True
        self._logger = logger if logger is not None else StandardLogger()
        self._previous_save: float | None = None
        # Orbax's jax.monitoring events, under Orbax's names (listeners keep working)
        jax.monitoring.record_event("/jax/orbax/checkpoint_manager/init")
        policy = self._options.save_decision_policy
        jax.monitoring.record_scalar("/jax/orbax/checkpoint_manager/continuous_checkpointing_enabled",
                                     int(isinstance(policy, _policies.ContinuousCheckpointingPolicy)))

    def is_saving_in_progress(self) -> bool:
        """Whether a save's background part (write, commit, retention) is still running."""
        return self._bg.busy()

    def metadata(self, step: int | None = None) -> RootMetadata | StepMetadata:
        """The manager's metadata, or one step's (Orbax's ``metadata(step=None)``).

        Args:
          step: ``None`` for the manager's :class:`RootMetadata` (the ``metadata`` given when
            the directory's first manager was made, ``{}`` if none); a step number for its
            :class:`StepMetadata`.
        """
        if step is None:
            return RootMetadata(dict(self._metadata or _read_metadata(self.directory) or {}))
        meta = self._step_meta(int(step))
        items = self.item_metadata(int(step))
        single = bool(meta.get("single")) and set(items) == {DEFAULT_ITEM_NAME}
        return StepMetadata(
            item_metadata=items[DEFAULT_ITEM_NAME] if single else _args.Composite(items),
            metrics=meta.get("metrics") or {}, custom_metadata=meta.get("custom_metadata") or {},
            init_timestamp_nsecs=int(meta["time"] * 1e9) if isinstance(meta.get("time"), (int, float)) else None,
        )

    # --- saving ---
    def save(
        self,
        step: int,
        items: Any = None,
        metrics: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
        args: _args.CheckpointArgs | None = None,
        custom_metadata: Mapping[str, Any] | None = None,
        save_kwargs: Mapping[str, Any] | None = None,
    ) -> bool:
        """Save ``step`` if it is due (or ``force``); returns whether it did.

        Args:
          step: the step number (>= 0).
          items: cairn's ``{name: pytree | Checkpointable}``; with ``checkpointers``, the
            item(s) those checkpointers save (Orbax's older form).
          metrics: JSON-able numbers for ``best_fn``.
          force: save even if the step is not due.
          args: Orbax's ``ocp.args``: one item's (stored as ``"default"``) or a ``Composite``.
          custom_metadata: a JSON-able dict kept with the step (``metadata(step).custom_metadata``).
          save_kwargs: Orbax's older per-item ``{"save_args": ...}``, by item name.
        """
        if args is None and items is not None and self._checkpointers is not None:
            args = self._legacy_args(items, save_kwargs)
            items = None
        elif isinstance(items, _args.CheckpointArgs):
            raise ValueError(f"ocp.args go in save(step, args=...), not as items (got {type(items).__name__})")
        named, single = _named_items(items, args)
        self._check_layout(single, named if args is not None else {})
        if args is not None:
            self._check_handlers(named, single)
        named = {n: _HandlerItem(h, v) if (h := self._custom_handler(n, single)) is not None else v
                 for n, v in named.items()}
        stats = SaveStepStatistics(step=int(step), directory=str(self.directory),
                                   synchronous=not self._options.enable_async,
                                   checkpoint_manager_blocking_start_time=time.time())
        stats.wait_for_prev_start_time = time.time()
        self._bg.wait()
        stats.wait_for_prev_duration_secs = time.time() - stats.wait_for_prev_start_time
        stats.get_old_steps_start_time = time.time()
        self.all_steps()
        stats.get_old_steps_duration_secs = time.time() - stats.get_old_steps_start_time
        t_block = stats.checkpointer_blocking_start_time = time.time()
        t_manager = stats.checkpoint_manager_blocking_start_time
        saved = self._save(step, lambda: _core_items(named), metrics, force=force, single=single,
                           custom_metadata=custom_metadata)
        if saved:
            end = time.time()
            stats.checkpointer_blocking_duration_secs = end - t_block
            stats.checkpoint_manager_blocking_duration_secs = None if t_manager is None else end - t_manager
            stats.reached_preemption = self.preemption_step is not None and int(step) >= self.preemption_step
            if self._previous_save is not None and t_manager is not None:
                stats.time_between_consecutive_saves_sec = t_manager - self._previous_save
            self._previous_save = stats.checkpoint_manager_blocking_start_time
            self._logger.log_entry(dataclasses.asdict(stats))
        return saved

    # --- items a user's own handler writes ---
    def _custom_handler(self, name: str, single: bool) -> Any:
        """The user's own handler (``is_custom``) that stores item ``name``, else ``None``:
        from Orbax's positional checkpointer(s), or ``item_handlers`` / ``handler_registry``."""
        ck = self._checkpointers
        if isinstance(ck, Checkpointer):
            handler = ck.handler
        elif isinstance(ck, Mapping):
            handler = ck[name].handler if name in ck else None
        else:
            found = self._handlers_of(name, single)
            handler = found[0] if found else None
        return handler if is_custom(handler) else None

    def _capture(self, items: Mapping[str, Any]) -> Any:
        """The core's capture of every item but those of a user's handler (kept for
        :meth:`_prepare_step` and :meth:`_write_step`)."""
        self._opaque = {n: v for n, v in items.items() if isinstance(v, _HandlerItem)}
        return super()._capture({n: v for n, v in items.items() if n not in self._opaque})

    def _prepare_step(self, step: int, tier: Any, final: str, copies: list[str], items: Mapping[str, Any]) -> Any:
        """The core's temporary step folder; then, for a background save, each user's
        handler's ``async_save`` into its item's folder, in the caller's thread (the
        blocking part: device data reaches the host), keeping the futures it returns."""
        tmp = super()._prepare_step(step, tier, final, copies, items)
        self._opaque_deadline = None
        timeout = self._options.async_options.timeout_secs if self._options.async_options else None
        if timeout is not None:
            self._opaque_deadline = time.monotonic() + timeout
        if tmp is not None and self._options.enable_async:
            for name, item in self._opaque.items():
                sub = os.path.join(tmp, name)
                item.futures = list(asyncio.run(item.handler.async_save(sub, args=item.args)) or [])
        return tmp

    def _write_step(self, tmp: str, snaps: Any, states: Any, step_meta: dict) -> None:
        """Each user's handler finishes its item (``save`` when synchronous, else its
        futures within ``async_options.timeout_secs``, then ``finalize``); then the core's
        write, with those items recorded as ``"opaque"``."""
        timeout = self._options.async_options.timeout_secs if self._options.async_options else None
        for name, item in self._opaque.items():
            sub = os.path.join(tmp, name)
            if not self._options.enable_async:
                item.handler.save(sub, args=item.args)
            await_futures(item.futures, self._opaque_deadline, timeout)
            item.handler.finalize(sub)
            step_meta["items"][name] = "opaque"
        super()._write_step(tmp, snaps, states, step_meta)

    def _check_layout(self, single: bool, named: Mapping[str, Any]) -> None:
        """Refuse (``ValueError``) a save whose layout (one unnamed item, or named items)
        differs from this manager's, or whose item names are not among ``item_names``."""
        if self._single is None and self._checkpointers is None:
            latest = self.latest_step()
            if latest is not None:
                meta = self._step_meta(latest)
                self._single = bool(meta.get("single")) and set(meta["items"]) == {DEFAULT_ITEM_NAME}
        if self._single is not None and self._single != single:
            if self._single:
                raise ValueError("this manager holds one unnamed item (args=StandardSave(...) and the like); "
                                 "save it the same way, not as a Composite")
            raise ValueError("Must provide `args` of type `Composite` when dealing with multiple checkpointable "
                             "objects. (This manager holds named items.)")
        self._single = single
        if not single and self.item_names is not None:
            unknown = sorted(set(named) - set(self.item_names))
            if unknown:
                raise ValueError(
                    f"item name(s) {unknown}: each does not match with any registered handler (item_names "
                    f"{list(self.item_names)})"
                )

    def _handlers_of(self, name: str, single: bool) -> list[Any]:
        """The handlers ``item_handlers`` / ``handler_registry`` give item ``name``."""
        if single:
            return [self._item_handlers] if isinstance(self._item_handlers, CheckpointHandler) else []
        reg = self._handler_registry
        return reg.handlers_of(name) if hasattr(reg, "handlers_of") else []

    def _check_handlers(self, named: Mapping[str, Any], single: bool) -> None:
        """Refuse (``ValueError``) args that the item's registered handler does not take."""
        for name, item_args in named.items():
            known = self._handlers_of(name, single)
            if known and isinstance(item_args, _args.CheckpointArgs) and not any(takes(h, item_args) for h in known):
                raise mismatch(name, item_args, known[0])

    def _legacy_args(self, items: Any, save_kwargs: Mapping[str, Any] | None) -> _args.CheckpointArgs:
        """Orbax's older ``save(step, items)``: each item wrapped in its checkpointer's args."""
        ckpt = self._checkpointers
        if isinstance(ckpt, Checkpointer):
            return ckpt._item_save_args(items, (save_kwargs or {}).get("save_args"))
        assert ckpt is not None  # a manager made without checkpointers never takes this path
        if not isinstance(items, Mapping):
            raise TypeError(f"with a dict of checkpointers, items must be a dict by item name, got {type(items).__name__}")
        unknown = sorted(set(items) - set(ckpt))
        if unknown:
            raise KeyError(f"no checkpointer for item(s) {unknown}; the manager has {sorted(ckpt)}")
        kwargs = save_kwargs or {}
        return _args.Composite({n: ckpt[n]._item_save_args(v, (kwargs.get(n) or {}).get("save_args"))
                                for n, v in items.items()})

    # --- restoring ---
    def restore(
        self,
        step: int | None = None,
        items: Any = None,
        *,
        args: _args.CheckpointArgs | None = None,
        partial: bool = False,
        cast: bool = False,
        mesh: Any = None,
        restore_kwargs: Mapping[str, Any] | None = None,
        directory: Any = None,
    ) -> Any:
        """Restore ``step`` (default: the newest intact step in either tier).

        Args:
          step: the step, or ``None`` for :meth:`latest_step`.
          items: cairn's ``{name: target}`` or names (answered with a dict); with
            ``checkpointers``, Orbax's older targets by item name.
          args: Orbax's ``ocp.args``: a ``Composite`` of restore args (answered with a
            ``Composite``) or one item's restore args for a step saved with one item.
          partial: see :func:`cairn.checkpoint.restore`.
          cast: see :func:`cairn.checkpoint.restore`.
          mesh: see :func:`cairn.checkpoint.restore`.
          restore_kwargs: Orbax's older per-item ``{"restore_args": ...}``, by item name.
          directory: restore from this other manager directory instead (read-only, with
            this manager's step naming, handlers and checkpointers).
        """
        if directory is not None:  # another run's checkpoints (a pretrained model): read-only, same naming
            options = dataclasses.replace(self._options, read_only=True)
            registry = None if isinstance(self._item_handlers, Mapping) else self._handler_registry
            with CheckpointManager(directory, self._checkpointers, options, item_handlers=self._item_handlers,
                                   handler_registry=registry) as other:
                return other.restore(step, items, args=args, partial=partial, cast=cast, mesh=mesh,
                                     restore_kwargs=restore_kwargs)
        if args is not None and items is not None:
            raise TypeError("pass either items or args=, not both")
        if isinstance(items, _args.CheckpointArgs):
            raise ValueError(f"ocp.args go in restore(step, args=...), not as items (got {type(items).__name__})")
        legacy = self._checkpointers is not None and args is None
        plain = args is None and not legacy and isinstance(items, Mapping) and _plain(items)
        box: dict[str, Any] = {}

        def targets(meta: dict) -> Any:
            single = bool(meta.get("single")) and set(meta["items"]) == {DEFAULT_ITEM_NAME}
            box["unwrap"] = single and (args is None and (items is None or legacy) or
                                        (args is not None and not isinstance(args, _args.Composite)))
            if legacy:
                return self._legacy_targets(items, restore_kwargs, meta, single)
            if args is not None and not isinstance(args, _args.Composite):
                if not single:
                    raise ValueError(f"the step holds the items {sorted(meta['items'])}; restore it with "
                                     "args=ocp.args.Composite(...)")
                self._check_handlers({DEFAULT_ITEM_NAME: args}, True)
                return {DEFAULT_ITEM_NAME: args}
            if args is not None:
                if single and set(args) - {DEFAULT_ITEM_NAME}:
                    raise ValueError(f"the step holds one unnamed item, not {sorted(args)}; restore it with that "
                                     "item's args (args=ocp.args.StandardRestore(...) and the like)")
                self._check_handlers(dict(args), False)
                return dict(args) if len(args) else self._handler_targets(meta)
            if items is None and (self._item_handlers is not None or self._handler_registry is not None):
                return self._handler_targets(meta)
            return items

        t_manager = time.time()
        stats = RestoreStepStatistics(directory=str(self.directory), checkpoint_manager_start_time=t_manager)
        t_read = stats.checkpointer_start_time = time.time()
        out, meta = self._restore(step, targets, partial=partial, cast=cast, mesh=mesh)
        end = time.time()
        stats.step = meta.get("step")
        stats.checkpointer_duration_secs = end - t_read
        stats.checkpoint_manager_duration_secs = end - t_manager
        self._logger.log_entry(dataclasses.asdict(stats))
        if box.get("unwrap"):
            return out[DEFAULT_ITEM_NAME]
        return out if plain and not legacy else _args.Composite(out)

    def _legacy_targets(self, items: Any, restore_kwargs: Any, meta: dict, single: bool) -> dict[str, Any]:
        ckpt = self._checkpointers
        if isinstance(ckpt, Checkpointer):
            ra = (restore_kwargs or {}).get("restore_args")
            return {DEFAULT_ITEM_NAME: ckpt._item_restore_args(items, ra)} if single else {}
        assert ckpt is not None  # a manager made without checkpointers never takes this path
        items = items if isinstance(items, Mapping) else dict.fromkeys(meta["items"])
        kw = restore_kwargs or {}
        return {n: ckpt[n]._item_restore_args(t, (kw.get(n) or {}).get("restore_args")) if n in ckpt else t
                for n, t in items.items()}

    def _handler_targets(self, meta: dict) -> dict[str, Any]:
        """Restore targets from ``item_handlers`` for a call without ``args``."""
        h = self._item_handlers
        out: dict[str, Any] = {}
        for name, kind in meta["items"].items():
            handlers = [h] if isinstance(h, CheckpointHandler) else self._handlers_of(name, False)
            handler = handlers[0] if handlers and isinstance(handlers[0], CheckpointHandler) else None
            out[name] = handler.restore_args(None) if handler is not None and kind != "state" else None
        return out

    def _restore_item(self, sub: str, name: str, kind: str, target: Any, step: int, meta: dict,
                      kw: dict[str, Any]) -> Any:
        if kind == "opaque":  # written by a user's handler: read back by the same handler
            handler = self._custom_handler(name, bool(meta.get("single")))
            if handler is not None:
                wanted = target if isinstance(target, _args.CheckpointArgs) else _args.wrap_for_handler(
                    handler, target, for_save=False)
                return handler.restore(sub, args=wanted)
            return super()._restore_item(sub, name, kind, target, step, meta, kw)
        if not isinstance(target, _args.CheckpointArgs):
            return super()._restore_item(sub, name, kind, target, step, meta, kw)
        if target.saving:
            raise TypeError(f"item {name!r} of step {step}: restore needs restore arguments, got {type(target).__name__}")
        if kind == "json":
            if target.kind != "json":
                raise TypeError(f"item {name!r} of step {step} was saved with JsonSave; restore it with JsonRestore")
            return super()._restore_item(sub, name, kind, None, step, meta, kw)
        if kind == "state":
            return super()._restore_item(sub, name, kind, _checkpointable_of(target), step, meta, kw)
        if target.kind != "pytree":
            raise TypeError(
                f"item {name!r} of step {step} is a pytree; restore it with StandardRestore, "
                f"PyTreeRestore or ArrayRestore, not {type(target).__name__}"
            )
        return _args.restore_pytree(sub, target, f"item {name!r} of step {step}")


def _check_init_args(checkpointers: Any, item_names: Any, item_handlers: Any, handler_registry: Any,
                     logger: Any) -> None:
    """Refuse ``CheckpointManager`` arguments of the wrong type or that contradict each other."""
    if checkpointers is not None and not isinstance(checkpointers, (Checkpointer, Mapping)):
        raise TypeError(
            f"checkpointers must be a Checkpointer or a dict of them by item name, got {type(checkpointers).__name__}"
        )
    if isinstance(checkpointers, Mapping):
        bad = [n for n, c in checkpointers.items() if not isinstance(c, Checkpointer)]
        if bad:
            raise TypeError(f"checkpointers {bad} are not Checkpointers")
    if item_handlers is not None and not isinstance(item_handlers, (CheckpointHandler, Mapping)):
        raise TypeError(f"item_handlers must be a handler or a dict of them, got {type(item_handlers).__name__}")
    if item_names is not None and isinstance(item_handlers, CheckpointHandler):
        raise ValueError("item_names name several items, but item_handlers is one handler (for one unnamed "
                         "item); pass a dict of handlers by item name")
    if handler_registry is not None and item_handlers is not None:
        raise ValueError("pass either handler_registry or item_handlers, not both")
    if logger is not None and not callable(getattr(logger, "log_entry", None)):
        raise TypeError(f"logger must have log_entry(entry) (a cairn.checkpoint.logging logger), "
                        f"got {type(logger).__name__}")


def _plain(items: Any) -> bool:
    """Whether ``items`` is cairn's own ``{name: target}`` or list of names (answered with a dict)."""
    values = items.values() if isinstance(items, Mapping) else ()
    return not any(isinstance(t, _args.CheckpointArgs) for t in values)


def _named_items(items: Any, args: Any) -> tuple[Mapping[str, Any], bool]:
    """``save``'s items by name (from ``items`` or Orbax's ``args``) and whether they are
    one non-Composite item (stored as ``"default"``)."""
    single = args is not None and not isinstance(args, _args.Composite)
    if args is not None:
        if items is not None:
            raise TypeError("pass either items or args=, not both")
        # Grain's grain.checkpoint.CheckpointSave(iterator) alone: an argument object wrapping
        # a Checkpointable as .item saves that object's state as the one item
        if not isinstance(args, _args.CheckpointArgs) and not is_checkpointable(_checkpointable_of(args)):
            raise TypeError(
                f"args must be ocp.args (StandardSave, Composite...) or wrap a Checkpointable as .item, "
                f"got {type(args).__name__}"
            )
        items = {DEFAULT_ITEM_NAME: args} if single else dict(args)
    if not isinstance(items, Mapping) or not items:
        raise TypeError("items must be a non-empty dict of {name: pytree or Checkpointable}")
    return items, single


def _core_items(items: Mapping[str, Any]) -> dict[str, Any]:
    """Items as the core manager takes them: ``ocp.args`` become pytrees (their
    ``SaveArgs`` applied) or :class:`JsonItem` s."""
    out: dict[str, Any] = {}
    for name, item in items.items():
        if isinstance(item, _args.CheckpointArgs):
            tree = _args.to_saved_tree(item, f"item {name!r}")
            item = JsonItem(tree) if item.kind == "json" else tree
        out[name] = item
    return out


_METADATA_FILE = "_MANAGER_METADATA.json"


def _json_metadata(directory: str | os.PathLike[str], metadata: Mapping[str, Any], options: CheckpointManagerOptions) -> dict:
    """Store ``metadata`` with the manager's directory (once; a later manager reads it)."""
    value = _json_item.jsonable(dict(metadata), "CheckpointManager(metadata=...)")
    existing = _read_metadata(directory)
    if existing is not None:
        return existing
    if _multihost.is_primary() and not options.read_only and os.path.isdir(directory):
        _fs.write_json_durable(os.path.join(directory, _METADATA_FILE), value)
    return value


def _read_metadata(directory: str | os.PathLike[str]) -> dict | None:
    """The manager's metadata: ``_MANAGER_METADATA.json``, else a JSON checkpoint in the
    ``metadata`` folder (where Orbax's older managers kept it), else ``None``."""
    f = os.path.join(directory, _METADATA_FILE)
    if os.path.isfile(f):
        return _fs.read_json(f)
    legacy = os.path.join(directory, METADATA_ITEM_NAME)
    if _fs.is_committed(legacy):
        value = Checkpointer(JsonCheckpointHandler()).restore(legacy)
        return value if isinstance(value, dict) else None
    return None
