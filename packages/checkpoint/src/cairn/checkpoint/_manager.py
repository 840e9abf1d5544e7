"""CheckpointManager: numbered steps, several items per step, retention, two storage tiers."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import _fs, _multihost, _restore, _tree
from ._checkpointer import _Background, _BackgroundSaver, _commit
from ._errors import CheckpointError
from ._restore import LeafMetadata

STEP_METADATA = "_STEP.json"
_ITEM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class CheckpointManagerOptions:
    """How often to save and what to keep (names follow Orbax's ``CheckpointManagerOptions``).

    Attributes:
      save_interval_steps: ``should_save(step)`` is true when ``step`` is a multiple of it.
      max_to_keep: keep at most this many steps (``None``: keep all). With ``best_fn`` the
        best steps by metric are kept, otherwise the newest. The newest step is always kept.
      keep_period: additionally keep every step that is a multiple of this.
      best_fn: maps a step's ``metrics`` dict to a number; ``best_mode`` is ``"max"`` or
        ``"min"``. Steps saved without metrics are kept if ``keep_checkpoints_without_metrics``.
      step_prefix: step directories are named ``<prefix>_<step>`` (or ``<step>`` if ``None``).
      enable_async: ``save`` returns once device data is on the host; the rest runs in the
        background.
      create: create ``directory`` if missing. cleanup_tmp_directories: remove leftovers of
        interrupted saves when the manager starts.
      compression: ``None`` (raw bytes, default) or ``"zstd"`` / ``"zstd:<level>"``.
      local_directory: optional fast tier (local disk, RAM disk) saved every
        ``local_save_interval_steps`` and holding ``local_max_to_keep`` steps; restore takes
        the newest complete step from either tier.
      timeout_secs: how long a process waits at a multi-process barrier.
    """

    save_interval_steps: int = 1
    max_to_keep: int | None = None
    keep_period: int | None = None
    best_fn: Callable[[Mapping[str, Any]], float] | None = None
    best_mode: str = "max"
    keep_checkpoints_without_metrics: bool = True
    step_prefix: str | None = None
    enable_async: bool = True
    create: bool = True
    cleanup_tmp_directories: bool = True
    compression: str | None = None
    local_directory: str | None = None
    local_save_interval_steps: int | None = None
    local_max_to_keep: int = 1
    timeout_secs: float = 600.0

    def __post_init__(self) -> None:
        if self.save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {self.save_interval_steps}")
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {self.max_to_keep}")
        if self.keep_period is not None and self.keep_period < 1:
            raise ValueError(f"keep_period must be >= 1 or None, got {self.keep_period}")
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}")
        if self.step_prefix is not None and not _ITEM_NAME.fullmatch(self.step_prefix):
            raise ValueError(f"step_prefix {self.step_prefix!r} must be a plain file-name part")
        if self.local_directory is not None:
            if self.local_save_interval_steps is None or self.local_save_interval_steps < 1:
                raise ValueError("local_directory needs local_save_interval_steps >= 1")
            if self.local_max_to_keep < 1:
                raise ValueError(f"local_max_to_keep must be >= 1, got {self.local_max_to_keep}")


def _is_checkpointable(x: Any) -> bool:
    return callable(getattr(x, "get_state", None)) and callable(getattr(x, "set_state", None))


@dataclass(frozen=True)
class _Tier:
    name: str
    directory: str
    interval: int
    max_to_keep: int | None
    use_best: bool


class CheckpointManager(_BackgroundSaver):
    """Saves numbered steps of several items under ``directory``; one step = one atomic commit.

    ``items`` passed to :meth:`save` is a dict of named pytrees (arrays, scalars, strings)
    and :class:`~cairn.core_array.Checkpointable` objects (anything with
    ``get_state()``/``set_state(state)``, e.g. a data iterator; each process stores its own
    state). A step directory appears only after all items, metadata and a ``COMMIT``
    marker are fsync'd, so a crash mid-save leaves earlier steps untouched and the partial
    step unlisted (and deleted when a manager next starts).

    >>> import tempfile, numpy as np
    >>> mngr = CheckpointManager(tempfile.mkdtemp(), CheckpointManagerOptions(max_to_keep=2))
    >>> for step in range(4):
    ...     _ = mngr.save(step, {"params": {"w": np.full(3, step)}}, metrics={"loss": 1 / (step + 1)})
    >>> mngr.wait_until_finished()
    >>> mngr.all_steps(), mngr.latest_step()
    ([2, 3], 3)
    >>> mngr.restore()["params"]["w"]
    array([3, 3, 3])
    >>> mngr.close()
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        options: CheckpointManagerOptions | None = None,
    ) -> None:
        self._options = options or CheckpointManagerOptions()
        o = self._options
        self.directory = os.path.abspath(os.fspath(directory))
        self._tiers = [
            _Tier("persistent", self.directory, o.save_interval_steps, o.max_to_keep, True)
        ]
        if o.local_directory is not None:
            self._tiers.append(
                _Tier(
                    "local",
                    os.path.abspath(os.fspath(o.local_directory)),
                    o.local_save_interval_steps,
                    o.local_max_to_keep,
                    False,
                )
            )
        prefix = re.escape(o.step_prefix + "_") if o.step_prefix else ""
        self._step_re = re.compile(prefix + r"(\d+)")
        if _multihost.is_primary():
            for tier in self._tiers:
                if not os.path.isdir(tier.directory):
                    if not o.create:
                        raise FileNotFoundError(f"checkpoint directory {tier.directory} does not exist")
                    os.makedirs(tier.directory, exist_ok=True)
                if o.cleanup_tmp_directories:
                    _fs.cleanup_incomplete(tier.directory)
        _multihost.barrier(f"manager init {self.directory}", o.timeout_secs)
        self._bg = _Background()

    # ----------------------------------------------------------------- listing
    def _step_name(self, step: int) -> str:
        p = self._options.step_prefix
        return f"{p}_{step}" if p else str(step)

    def _committed(self, tier: _Tier) -> dict[int, str]:
        out = {}
        if not os.path.isdir(tier.directory):
            return out
        for name in os.listdir(tier.directory):
            m = self._step_re.fullmatch(name)
            if m is None:
                continue
            full = os.path.join(tier.directory, name)
            if _fs.is_committed(full):
                out[int(m.group(1))] = full
        return out

    def all_steps(self) -> list[int]:
        """Committed steps in either tier, ascending (a save still running is not listed)."""
        steps: set[int] = set()
        for tier in self._tiers:
            steps.update(self._committed(tier))
        return sorted(steps)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _step_dir(self, step: int) -> str:
        found = {}
        for tier in self._tiers:
            d = self._committed(tier).get(step)
            if d is not None:
                found[tier.name] = d
        if not found:
            raise FileNotFoundError(
                f"step {step} is not a committed checkpoint in {self.directory}"
                f" (committed steps: {self.all_steps()})"
            )
        return found.get("local", found.get("persistent"))

    def _step_meta(self, step: int) -> dict:
        return _fs.read_json(os.path.join(self._step_dir(step), STEP_METADATA))

    def metrics(self, step: int) -> dict | None:
        """The metrics saved with ``step`` (``None`` if none were given)."""
        return self._step_meta(step).get("metrics")

    def item_metadata(self, step: int | None = None) -> dict[str, dict[str, LeafMetadata] | str]:
        """Per item: its leaves' metadata (pytree items) or ``"state"`` (Checkpointables)."""
        step = self._resolve_step(step)
        d = self._step_dir(step)
        out: dict[str, Any] = {}
        for name, kind in self._step_meta(step)["items"].items():
            out[name] = _restore.metadata_of(os.path.join(d, name)) if kind == "pytree" else "state"
        return out

    def best_step(self) -> int | None:
        """The step whose metrics are best by ``best_fn`` (``None`` without ``best_fn``)."""
        o = self._options
        if o.best_fn is None:
            return None
        scored = []
        for step in self.all_steps():
            m = self.metrics(step)
            if m is not None:
                scored.append((float(o.best_fn(m)), step))
        if not scored:
            return None
        pick = max if o.best_mode == "max" else min
        return pick(scored)[1]

    def should_save(self, step: int) -> bool:
        """True if ``step`` is due in some tier and newer than every committed step."""
        latest = self.latest_step()
        if latest is not None and step <= latest:
            return False
        return any(step % t.interval == 0 for t in self._tiers)

    # ----------------------------------------------------------------- saving
    def save(
        self,
        step: int,
        items: Mapping[str, Any],
        metrics: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Save ``items`` as ``step`` if :meth:`should_save` (or ``force``); returns whether it did.

        The step goes to the persistent tier when ``step`` is a multiple of
        ``save_interval_steps`` (or ``force``), otherwise to the local tier. With
        ``enable_async`` this returns once device data is on the host; a previous save is
        waited for first and its error, if any, is raised here.
        """
        self._bg.wait()
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not isinstance(items, Mapping) or not items:
            raise TypeError("items must be a non-empty dict of {name: pytree or Checkpointable}")
        if not force and not self.should_save(step):
            return False
        if step in self.all_steps():
            raise FileExistsError(f"step {step} already exists in {self.directory}")
        tier = self._tiers[0]
        if not force and step % tier.interval != 0:
            tier = self._tiers[1]
        o = self._options
        if metrics is not None:
            try:
                metrics = json.loads(json.dumps(dict(metrics)))
            except (TypeError, ValueError) as err:
                raise TypeError(f"metrics for step {step} must be JSON-able: {err}") from None
        snaps: dict[str, Any] = {}
        states: dict[str, Any] = {}
        for name, item in items.items():
            if not isinstance(name, str) or not _ITEM_NAME.fullmatch(name):
                raise ValueError(
                    f"item name {name!r} must be a plain file-name part (letters, digits, _ . -)"
                )
            if _is_checkpointable(item):
                state = item.get_state()
                try:
                    states[name] = json.dumps(state)
                except (TypeError, ValueError) as err:
                    raise TypeError(
                        f"item {name!r}: get_state() must return JSON-able data: {err}"
                    ) from None
            else:
                snaps[name] = _tree.snapshot(item, copy_host=o.enable_async, compression=o.compression)
        final = os.path.join(tier.directory, self._step_name(step))
        tmp = final + _fs.TMP_SUFFIX
        if _multihost.is_primary():
            if os.path.exists(tmp):
                import shutil

                shutil.rmtree(tmp)
            os.makedirs(tmp)
            for name in items:
                os.makedirs(os.path.join(tmp, name))
        _multihost.barrier(f"prepare {final}", o.timeout_secs)
        kinds = {name: ("pytree" if name in snaps else "state") for name in items}

        def tail() -> None:
            pidx = _multihost.process_index()
            for name, snap in snaps.items():
                _tree.write(snap, os.path.join(tmp, name), compression=o.compression)
            for name, text in states.items():
                sub = os.path.join(tmp, name)
                _fs.write_durable(os.path.join(sub, f"state.process_{pidx}.json"), text.encode())
                _fs.fsync_dir(sub)
            if _multihost.is_primary():
                _fs.write_json_durable(
                    os.path.join(tmp, STEP_METADATA),
                    {
                        "step": step,
                        "time": time.time(),
                        "tier": tier.name,
                        "items": kinds,
                        "metrics": metrics,
                        "process_count": _multihost.process_count(),
                    },
                )
            _commit(tmp, final, False)
            if _multihost.is_primary():
                self._apply_retention(tier)

        if o.enable_async:
            self._bg.start(tail, f"step {step} in {tier.directory}")
        else:
            tail()
        return True

    def _apply_retention(self, tier: _Tier) -> None:
        o = self._options
        steps = self._committed(tier)
        if tier.max_to_keep is None or len(steps) <= tier.max_to_keep:
            return
        ordered = sorted(steps)
        keep = {ordered[-1]}
        if tier.use_best and o.best_fn is not None:
            scored, unscored = [], []
            for s in ordered:
                m = _fs.read_json(os.path.join(steps[s], STEP_METADATA)).get("metrics")
                (unscored if m is None else scored).append((s, m))
            sign = -1.0 if o.best_mode == "max" else 1.0
            scored.sort(key=lambda sm: (sign * float(o.best_fn(sm[1])), -sm[0]))
            keep.update(s for s, _ in scored[: tier.max_to_keep])
            if o.keep_checkpoints_without_metrics:
                keep.update(s for s, _ in unscored)
        else:
            keep.update(ordered[-tier.max_to_keep :])
        if tier.use_best and o.keep_period:
            keep.update(s for s in ordered if s % o.keep_period == 0)
        for s in ordered:
            if s not in keep:
                _fs.remove_tree(steps[s])

    def delete(self, step: int) -> None:
        """Remove ``step`` from every tier."""
        self._bg.wait()
        if _multihost.is_primary():
            for tier in self._tiers:
                d = self._committed(tier).get(step)
                if d is not None:
                    _fs.remove_tree(d)
        _multihost.barrier(f"delete {step} {self.directory}", self._options.timeout_secs)

    # ----------------------------------------------------------------- restoring
    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
        return int(step)

    def restore(
        self,
        step: int | None = None,
        items: Mapping[str, Any] | Sequence[str] | None = None,
        *,
        partial: bool = False,
        cast: bool = False,
        mesh: Any = None,
    ) -> dict[str, Any]:
        """Restore ``step`` (default: the newest committed step in either tier).

        ``items`` maps item names to targets: a pytree target (see :func:`restore`), ``None``
        (as saved) or a Checkpointable (its ``set_state`` is called and it is returned).
        A list of names restores those items as saved; ``None`` restores every item.
        """
        self._bg.wait()
        step = self._resolve_step(step)
        d = self._step_dir(step)
        meta = _fs.read_json(os.path.join(d, STEP_METADATA))
        kinds: dict[str, str] = meta["items"]
        if items is None:
            targets: dict[str, Any] = {n: None for n in kinds}
        elif isinstance(items, Mapping):
            targets = dict(items)
        else:
            targets = {n: None for n in items}
        unknown = [n for n in targets if n not in kinds]
        if unknown:
            raise KeyError(
                f"step {step} has no item(s) {unknown}; it holds {sorted(kinds)}"
            )
        out: dict[str, Any] = {}
        for name, target in targets.items():
            sub = os.path.join(d, name)
            if kinds[name] == "state":
                f = os.path.join(sub, f"state.process_{_multihost.process_index()}.json")
                if not os.path.isfile(f):
                    raise CheckpointError(
                        f"item {name!r} of step {step} has no state for process "
                        f"{_multihost.process_index()} (saved by {meta.get('process_count')} processes)"
                    )
                state = _fs.read_json(f)
                if target is not None:
                    if not _is_checkpointable(target):
                        raise TypeError(
                            f"item {name!r} was saved from a Checkpointable; its target must have "
                            f"set_state, got {type(target).__qualname__}"
                        )
                    target.set_state(state)
                    out[name] = target
                else:
                    out[name] = state
            else:
                if _is_checkpointable(target):
                    raise TypeError(f"item {name!r} is a pytree in step {step}, not a Checkpointable's state")
                out[name] = _restore.restore_dir(sub, target, partial=partial, cast=cast, mesh=mesh)
        return out
