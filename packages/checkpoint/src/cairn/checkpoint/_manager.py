"""CheckpointManager: numbered steps, several items per step, retention, two storage tiers."""

from __future__ import annotations

import datetime
import json
import logging
import os
import pathlib
import re
import signal
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cairn.checkpoint import (
    _fs,
    _json_item,
    _multihost,
    _ownership,
    _policies,
    _preemption,
    _restore,
    _tree,
)
from cairn.checkpoint._checkpointer import _Background, _BackgroundSaver, write_and_commit
from cairn.checkpoint._errors import CheckpointCorruptError, CheckpointError, StepAlreadyExistsError
from cairn.checkpoint._restore import LeafMetadata
from cairn.checkpoint._step_names import StandardNameFormat
from cairn.core_array import is_checkpointable

STEP_METADATA = "_STEP.json"
# "opaque": a folder written by someone else (a user's Orbax handler): the core keeps it in
# the step and commits it, but neither reads nor verifies what is inside
_KINDS = ("pytree", "state", "json", "opaque")
_log = logging.getLogger("cairn.checkpoint")
_ITEM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class AsyncOptions:
    """Options of the background part of a save (Orbax's ``AsyncOptions``).

    Args:
      timeout_secs: how long a process waits at a barrier of an async save; when given it
        sets ``CheckpointManagerOptions.timeout_secs``.
      post_finalization_callback: called (no arguments) after each save is committed, in
        the thread that committed it.
      create_directories_asynchronously: accepted; the step's temporary directory is
        always made before ``save`` returns (so a crash leaves it for the cleanup).
    """

    timeout_secs: float | None = None
    post_finalization_callback: Callable[[], None] | None = None
    create_directories_asynchronously: bool = True

    def __post_init__(self) -> None:
        if self.post_finalization_callback is not None and not callable(self.post_finalization_callback):
            raise TypeError("post_finalization_callback must be callable")


@dataclass(frozen=True)
class MultiprocessingOptions:
    """Which processes take part (Orbax's ``MultiprocessingOptions``).

    Args:
      primary_host: the process that writes shared metadata; only ``0`` (every
        ``jax.distributed`` process saves, process 0 commits).
      active_processes: only ``None`` (all processes).
      barrier_sync_key_prefix: accepted; barrier names already include the directory.
    """

    primary_host: int | None = 0
    active_processes: frozenset[int] | None = None
    barrier_sync_key_prefix: str | None = None

    def __post_init__(self) -> None:
        if self.primary_host != 0:
            raise NotImplementedError(f"MultiprocessingOptions(primary_host={self.primary_host!r}): only 0 is supported")
        if self.active_processes is not None:
            raise NotImplementedError("MultiprocessingOptions(active_processes=...) is not supported: all processes save")


@dataclass(frozen=True)
class FileOptions:
    """File-system options (Orbax's ``FileOptions``).

    Args:
      path_permission_mode: only ``None`` (directories get the process's umask).
      skip_sync_file_validations: accepted; every metadata file is always checksummed.
    """

    path_permission_mode: int | None = None
    skip_sync_file_validations: bool = False

    def __post_init__(self) -> None:
        if self.path_permission_mode is not None:
            raise NotImplementedError("FileOptions(path_permission_mode=...) is not supported")


@dataclass(frozen=True)
class CheckpointManagerOptions:
    """How often to save and what to keep (names follow Orbax's ``CheckpointManagerOptions``).

    Args:
      save_interval_steps: ``should_save(step)`` is true when ``step`` is a multiple of it.
      max_to_keep: keep at most this many steps (``None``: keep all; ``0``: none but those
        ``keep_period`` / ``keep_time_interval`` keep, as in Orbax). Without ``best_fn`` the
        newest are kept; with it, the best by metric. With ``best_fn`` or ``0``, the newest
        step is kept too when it was saved at or after a preemption notice, so a preempted
        run resumes where it stopped.
      keep_period: additionally keep every step that is a multiple of this.
      best_fn: maps a step's ``metrics`` dict to a number (the step's score for ``max_to_keep``).
      best_mode: ``"max"`` (a higher ``best_fn`` is better) or ``"min"``.
      keep_checkpoints_without_metrics: keep steps saved without metrics when ``best_fn``
        chooses what to keep.
      step_prefix: step directories are named ``<prefix>_<step>`` (or ``<step>`` if ``None``).
      enable_async: ``save`` returns once device data is on the host; the rest runs in the
        background.
      create: create ``directory`` if missing.
      cleanup_tmp_directories: remove leftovers of
        interrupted saves when the manager starts, but only those whose writer is provably
        gone: a process of this host that has exited, or (other hosts, unknown owners) a
        temporary directory whose lease was not renewed for ``tmp_lease_timeout_secs``
        (a live writer renews it every 10 s). A reader opened on a live trainer's directory
        never removes the trainer's save in progress.
      compression: ``None`` (raw bytes, default) or ``"zstd"`` / ``"zstd:<level>"``.
      local_directory: optional fast tier (local disk, RAM disk) saved every
        ``local_save_interval_steps`` and holding ``local_max_to_keep`` steps; restore takes
        the newest complete step from either tier.
        A local save that fails (a full RAM disk, an I/O error) is logged as a warning
        naming the step and the tier, never raised: the persistent tier still saves.
      local_save_interval_steps: how often the local tier saves (required with
        ``local_directory``, >= 1).
      local_max_to_keep: how many steps the local tier holds (>= 1).
      timeout_secs: how long a process waits at a multi-process barrier (and at a
        preemption sync point).
      tmp_lease_timeout_secs: see ``cleanup_tmp_directories``.
      enable_async_checkpointing: Orbax's name for ``enable_async``; when given it wins.
      preemption_signals: signals that announce a preemption (default ``SIGTERM``; ``()``
        watches none), watched from the first call of ``resume``, ``reached_preemption``,
        ``should_save`` or ``save`` (a manager that only reads leaves signals alone). The
        handler only records the signal and calls the handler installed before it; a second
        identical signal with no previous Python handler kills the process as before;
        :meth:`CheckpointManager.close` puts the previous handler back. Handlers can only be
        installed from the main thread (elsewhere: a warning, no signals).
      preemption_notice_file: a path whose existence announces a preemption (checked at
        every :meth:`CheckpointManager.reached_preemption`).
      preemption_check: a callable returning ``True`` once a preemption is announced
        (e.g. a query of the cloud's metadata server; called at every check, so it should
        be cheap or rate-limit itself).
      preemption_sync_interval_steps: with several processes, the notice is exchanged
        (one key-value-store round trip per process) at steps that are multiples of this;
        in between ``reached_preemption`` answers ``False``.
      save_on_steps: steps saved whatever ``save_interval_steps`` says (a frozenset).
        ``save_interval_steps=0`` saves no step by interval.
      should_save_fn: ``fn(step, latest_step) -> bool`` decides alone which steps are
        saved (a preemption is still saved).
      keep_time_interval: a ``datetime.timedelta``; retention also keeps the first step
        saved in each such interval (time from each step's metadata).
      todelete_subdir: retention and :meth:`CheckpointManager.delete` move steps into
        this subdirectory of ``directory`` instead of deleting them (for a storage
        system's own expiry, e.g. a TTL'd folder).
      step_format_fixed_length: step directories are named with the step zero-padded to
        this many digits (``00000010``); steps are listed whatever their padding.
      step_name_format: a :func:`cairn.checkpoint.step.standard_name_format` (it sets
        ``step_prefix`` and ``step_format_fixed_length``); another ``NameFormat`` is kept
        here but refused by the manager.
      single_host_load_and_broadcast: must agree with ``step_name_format``'s (``ValueError``
        otherwise, as in Orbax); every process lists the shared directory itself.
      enable_background_delete: accepted; with ``enable_async`` retention already deletes
        in the background thread that commits the save.
      async_options: an :class:`AsyncOptions` (its ``timeout_secs`` sets ``timeout_secs``).
      multiprocessing_options: a :class:`MultiprocessingOptions`.
      file_options: a :class:`FileOptions`.
      save_decision_policy: a ``checkpoint_managers`` save decision policy
        (``FixedIntervalPolicy``, ``ContinuousCheckpointingPolicy``...): it alone decides
        which steps are saved, in place of ``save_interval_steps``, ``save_on_steps`` and
        ``should_save_fn`` (a preemption is still saved; the local tier keeps its interval).
      preservation_policy: a ``checkpoint_managers`` preservation policy (``LatestN``,
        ``BestN``, ``EveryNSteps``...): it alone decides which persistent steps retention
        keeps, in place of ``max_to_keep``, ``best_fn``, ``keep_period`` and
        ``keep_time_interval``; the newest step is always kept.
      read_only: the manager never writes (``save`` answers ``False`` with a warning),
        creates or cleans nothing: ``save_interval_steps=0``, no retention, ``create`` and
        ``cleanup_tmp_directories`` false, as in Orbax.
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
    tmp_lease_timeout_secs: float = _ownership.DEFAULT_LEASE_TIMEOUT_S
    enable_async_checkpointing: bool | None = None
    preemption_signals: tuple[int, ...] = (signal.SIGTERM,)
    preemption_notice_file: str | None = None
    preemption_check: Callable[[], bool] | None = None
    preemption_sync_interval_steps: int = 1
    save_on_steps: frozenset[int] | None = None
    should_save_fn: Callable[[int, int | None], bool] | None = None
    keep_time_interval: datetime.timedelta | None = None
    todelete_subdir: str | None = None
    read_only: bool = False
    step_format_fixed_length: int | None = None
    enable_background_delete: bool = False
    step_name_format: Any = None
    single_host_load_and_broadcast: bool = False
    async_options: AsyncOptions | None = None
    multiprocessing_options: MultiprocessingOptions | None = None
    file_options: FileOptions | None = None
    save_decision_policy: _policies.SaveDecisionPolicy | None = None
    preservation_policy: _policies.PreservationPolicy | None = None

    def __post_init__(self) -> None:
        if self.read_only:  # what a read-only manager may not do, switched off (as in Orbax)
            for name, value in (("save_interval_steps", 0), ("max_to_keep", None), ("keep_period", None),
                                ("keep_time_interval", None), ("create", False), ("cleanup_tmp_directories", False),
                                ("save_on_steps", None), ("todelete_subdir", None), ("should_save_fn", None)):
                object.__setattr__(self, name, value)
        object.__setattr__(self, "save_on_steps", frozenset(int(s) for s in self.save_on_steps or ()))
        for name, cls in (("async_options", AsyncOptions), ("multiprocessing_options", MultiprocessingOptions),
                          ("file_options", FileOptions)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
        if self.async_options is not None and self.async_options.timeout_secs is not None:
            object.__setattr__(self, "timeout_secs", float(self.async_options.timeout_secs))
        for name, base in (("save_decision_policy", _policies.SaveDecisionPolicy),
                           ("preservation_policy", _policies.PreservationPolicy)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, base):
                raise TypeError(f"{name} must be a checkpoint_managers.{base.__name__}, got {type(value).__name__}")
        if self.should_save_fn is not None and not callable(self.should_save_fn):
            raise TypeError(f"should_save_fn must be callable, got {type(self.should_save_fn).__name__}")
        if self.keep_time_interval is not None and not isinstance(self.keep_time_interval, datetime.timedelta):
            raise TypeError(f"keep_time_interval must be a datetime.timedelta, got {self.keep_time_interval!r}")
        sub = self.todelete_subdir
        if sub is not None and (not sub or os.path.isabs(sub) or ".." in sub.replace("\\", "/").split("/")):
            raise ValueError(f"todelete_subdir {sub!r} must be a relative path inside the directory (no '..')")
        self._check_step_name()
        self._check_preemption()
        if self.enable_async_checkpointing is not None:
            object.__setattr__(self, "enable_async", bool(self.enable_async_checkpointing))
        object.__setattr__(self, "enable_async_checkpointing", self.enable_async)
        if not self.tmp_lease_timeout_secs > 2 * _ownership.HEARTBEAT_S:
            raise ValueError(
                f"tmp_lease_timeout_secs must exceed {2 * _ownership.HEARTBEAT_S:g} s (twice the "
                f"lease renewal interval), got {self.tmp_lease_timeout_secs}"
            )
        if self.save_interval_steps < 0:
            raise ValueError(f"save_interval_steps must be >= 0 (0: none by interval), got {self.save_interval_steps}")
        if self.max_to_keep is not None and self.max_to_keep < 0:
            raise ValueError(f"max_to_keep must be >= 0 or None, got {self.max_to_keep}")
        if self.max_to_keep == 0 and self.keep_period is None and self.keep_time_interval is None:
            warnings.warn(
                "CheckpointManagerOptions(max_to_keep=0) without keep_period or keep_time_interval "
                "deletes every step once it is committed: nothing is left to restore or resume from",
                UserWarning,
                stacklevel=3,
            )
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

    def _check_step_name(self) -> None:
        """Check the step-name options; a standard ``step_name_format`` sets the prefix and width."""
        fmt = self.step_name_format
        if fmt is not None:
            flag = getattr(fmt, "single_host_load_and_broadcast", None) if isinstance(fmt, StandardNameFormat) else None
            if self.single_host_load_and_broadcast and flag is None:
                raise ValueError("single_host_load_and_broadcast needs a standard_name_format step_name_format")
            if flag is not None and flag != self.single_host_load_and_broadcast:
                raise ValueError(
                    f"single_host_load_and_broadcast={self.single_host_load_and_broadcast} disagrees with the "
                    f"step_name_format's ({flag})")
            if isinstance(fmt, StandardNameFormat):
                object.__setattr__(self, "step_prefix", fmt.step_prefix)
                object.__setattr__(self, "step_format_fixed_length", fmt.step_format_fixed_length)
        if self.step_format_fixed_length is not None and self.step_format_fixed_length < 1:
            raise ValueError(f"step_format_fixed_length must be >= 1 or None, got {self.step_format_fixed_length}")

    def _check_preemption(self) -> None:
        """Check the preemption options (``preemption_signals`` becomes a tuple)."""
        object.__setattr__(self, "preemption_signals", tuple(self.preemption_signals))
        if self.preemption_sync_interval_steps < 1:
            raise ValueError(
                f"preemption_sync_interval_steps must be >= 1, got {self.preemption_sync_interval_steps}"
            )
        if self.preemption_check is not None and not callable(self.preemption_check):
            raise TypeError(f"preemption_check must be callable, got {type(self.preemption_check).__name__}")
        valid = set(signal.Signals)
        bad = [s for s in self.preemption_signals if s not in valid]
        if bad:
            raise ValueError(f"preemption_signals holds {bad}, which are not signals of this platform")


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
    step unlisted (and deleted when a manager next starts, once its writer is provably
    gone: a second manager opened by an evaluation job never deletes a live trainer's save).
    Every metadata file is checksummed; a damaged step is skipped by :meth:`latest_step`
    and :meth:`all_steps` and reported by :meth:`corrupt_steps`.

    :meth:`save` writes a step to the persistent tier when the step is a multiple of
    ``save_interval_steps`` (or ``force``, or once :meth:`reached_preemption`), otherwise to
    the local tier (whose failures are logged, not raised). With ``enable_async`` it returns
    once device data is on the host; a previous save is waited for first and its error, if
    any, is raised there. As in Orbax, ``save(step, args=ocp.args.Composite(name=...))``
    names each item with how to store it, and ``args=ocp.args.StandardSave(tree)`` saves one
    item (named ``"default"``; :meth:`restore` then returns it alone).

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

    def __init__(self, directory: str | os.PathLike, options: CheckpointManagerOptions | None = None) -> None:
        """Open (and with ``options.create``, make) the manager's directory.

        Args:
          directory: where the step directories live.
          options: how often to save and what to keep (default ``CheckpointManagerOptions()``).
        """
        if options is not None and not isinstance(options, CheckpointManagerOptions):
            raise TypeError(f"options must be a CheckpointManagerOptions, got {type(options).__name__}")
        self._options = options or CheckpointManagerOptions()
        o = self._options
        # a path object, as Orbax's (``manager.directory / "0"``, ``.iterdir()``)
        self.directory = pathlib.Path(os.path.abspath(os.fspath(directory)))
        self._tiers = [
            _Tier("persistent", str(self.directory), o.save_interval_steps, o.max_to_keep, True)
        ]
        if o.local_directory is not None:
            assert o.local_save_interval_steps is not None  # checked by the options
            self._tiers.append(
                _Tier(
                    "local",
                    os.path.abspath(os.fspath(o.local_directory)),
                    o.local_save_interval_steps,
                    o.local_max_to_keep,
                    False,
                )
            )
        if o.step_name_format is not None and not isinstance(o.step_name_format, StandardNameFormat):
            raise NotImplementedError(
                f"step_name_format {o.step_name_format!r}: only step.standard_name_format(...) is supported")
        self._names = StandardNameFormat(o.step_prefix, o.step_format_fixed_length)
        self._step_re = self._names.pattern()
        if _multihost.is_primary():
            for tier in self._tiers:
                if not os.path.isdir(tier.directory):
                    if not o.create:
                        raise FileNotFoundError(f"checkpoint directory {tier.directory} does not exist")
                    os.makedirs(tier.directory, exist_ok=True)
                if o.cleanup_tmp_directories:
                    _ownership.cleanup_incomplete(tier.directory, lease_timeout_s=o.tmp_lease_timeout_secs)
        _multihost.barrier(f"manager init {self.directory}", o.timeout_secs)
        self._bg = _Background()
        self._last_save_time: float | None = None  # time.monotonic() when the last save began
        self._preemption = _preemption.PreemptionWatcher(
            str(self.directory),
            o.preemption_signals,
            o.preemption_notice_file,
            o.preemption_check,
            o.preemption_sync_interval_steps,
            o.timeout_secs,
        )
        # step directory -> (its stat key, _STEP.json content or None, why it is corrupt or None,
        # time.monotonic() when verified)
        self._checked: dict[str, tuple[tuple, dict | None, str | None, float]] = {}

    # --- listing ---
    def _step_name(self, step: int) -> str:
        return self._names.build_name(step)

    def _committed(self, tier: _Tier) -> dict[int, str]:
        """Step directories with a ``COMMIT`` marker (intact or not)."""
        out: dict[int, str] = {}
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

    def _verify_step(self, d: str, step: int) -> dict:
        """Verify every metadata file of step directory ``d`` (checksums, content, the
        databases' manifests; no array data) and return its ``_STEP.json`` content."""
        path = os.path.join(d, STEP_METADATA)
        _fs.read_json(os.path.join(d, _fs.COMMIT_MARKER))
        if not os.path.isfile(path):
            raise _fs.corrupt(path, "the file is missing from a committed step")
        meta, checked = _fs.read_json_checked(path)
        ok = (
            isinstance(meta, dict)
            and meta.get("step") == step
            and isinstance(meta.get("items"), dict)
            and all(k in _KINDS for k in meta["items"].values())
            and isinstance(meta.get("process_count", 1), int)
            and isinstance(meta.get("version", 1), int)
        )
        if not ok:
            raise _fs.corrupt(path, f"its content is not the metadata of step {step}")
        version = meta.get("version", 1)
        if version > _tree.FORMAT_VERSION:
            raise _fs.corrupt(path, f"format version {version} is newer than this cairn.checkpoint reads")
        if version >= 2 and not checked:
            raise _fs.corrupt(path, "it lacks the checksum that format version 2 writes")
        for name, kind in meta["items"].items():
            sub = os.path.join(d, name)
            if kind == "pytree":
                _restore.check_dir(sub)
                continue
            if kind == "json":
                _json_item.read_json_item(sub)
                continue
            if kind == "opaque":
                if not os.path.isdir(sub):
                    raise _fs.corrupt(sub, f"item {name!r}'s folder is missing from a committed step")
                continue
            for i in range(meta.get("process_count", 1)):
                f = os.path.join(sub, f"state.process_{i}.json")
                if not os.path.isfile(f):
                    raise _fs.corrupt(f, f"item {name!r} lacks process {i}'s state")
                _fs.read_json(f, require_checksum=version >= 2)
        return meta

    def _check(self, d: str, step: int, *, since: float | None = None) -> tuple[dict | None, str | None]:
        """(``_STEP.json`` content, None) if step directory ``d`` is intact, else (None, why);
        remembered per directory until it changes (and with ``since``, a ``time.monotonic()``,
        verified again unless that was done after ``since``). A corrupt step is logged once."""
        try:
            st, cst = os.stat(d), os.stat(os.path.join(d, _fs.COMMIT_MARKER))
            key: tuple[int, ...] = (st.st_ino, st.st_mtime_ns, cst.st_mtime_ns, cst.st_size)
        except OSError:
            key = ()
        hit = self._checked.get(d)
        if hit is not None and hit[0] == key and (since is None or hit[3] > since):
            return hit[1], hit[2]
        now = time.monotonic()
        try:
            meta, why = self._verify_step(d, step), None
        except (CheckpointError, OSError) as err:
            meta, why = None, str(err)
            if not os.path.isdir(d):  # deleted meanwhile (retention): gone, not corrupt
                return None, f"step {step} was deleted ({d})"
            if hit is None or hit[2] is None:
                _log.warning(
                    "cairn.checkpoint: step %d of the %s tier (%s) is corrupt and skipped: %s",
                    step, self._tier_of(d), d, why,
                )
        self._checked[d] = (key, meta, why, now)
        return meta, why

    def _tier_of(self, d: str) -> str:
        parent = os.path.dirname(d)
        return next((t.name for t in self._tiers if t.directory == parent), "persistent")

    def _mark_corrupt(self, d: str, why: str) -> None:
        key, _, _, t = self._checked.get(d, ((), None, None, 0.0))
        self._checked[d] = (key, None, why, t)

    def _copies(self, step: int | None = None) -> dict[int, list[str]]:
        """Committed directories of each step (or of ``step``), local tier first."""
        out: dict[int, list[str]] = {}
        for tier in reversed(self._tiers):
            for s, d in self._committed(tier).items():
                if step is None or s == step:
                    out.setdefault(s, []).append(d)
        return out

    def _intact_dir(self, step: int, dirs: list[str]) -> str | None:
        for d in dirs:
            if self._check(d, step)[0] is not None:
                return d
        return None

    def all_steps(self) -> list[int]:
        """Intact committed steps in either tier, ascending.

        A save still running is not listed, nor is a corrupt step (a damaged or missing
        metadata file: see :meth:`corrupt_steps`). Each step's metadata files are verified
        once per manager (no array data is read).
        """
        return sorted(s for s, dirs in self._copies().items() if self._intact_dir(s, dirs))

    def corrupt_steps(self) -> dict[int, str]:
        """Committed steps with no intact copy, each with why (naming the damaged file).

        They are skipped by :meth:`latest_step`, :meth:`all_steps` and ``restore()``, logged
        once (logger ``cairn.checkpoint``), kept on disk until :meth:`delete` or until a save
        of the same step replaces them, and not counted by ``max_to_keep``.
        """
        out = {}
        for s, dirs in sorted(self._copies().items()):
            if self._intact_dir(s, dirs) is None:
                out[s] = "; ".join(self._check(d, s)[1] or "" for d in dirs)
        return out

    def latest_step(self) -> int | None:
        """The newest intact committed step (a corrupt newer one is skipped and logged)."""
        for s, dirs in sorted(self._copies().items(), reverse=True):
            if self._intact_dir(s, dirs) is not None:
                return s
        return None

    def _step_dir(self, step: int) -> str:
        dirs = self._copies(step).get(step, [])
        d = self._intact_dir(step, dirs)
        if d is not None:
            return d
        if dirs:
            why = "; ".join(self._check(x, step)[1] or "" for x in dirs)
            raise CheckpointCorruptError(
                f"step {step} in {self.directory} is corrupt: {why} (intact steps: {self.all_steps()})"
            )
        raise FileNotFoundError(
            f"step {step} is not a committed checkpoint in {self.directory}"
            f" (committed steps: {self.all_steps()})"
        )

    def _step_meta(self, step: int) -> dict:
        d = self._step_dir(step)
        meta, why = self._check(d, step)
        if meta is None:  # deleted or damaged since _step_dir verified it
            raise CheckpointError(f"step {step} in {self.directory} changed while being read: {why}")
        return meta

    def metrics(self, step: int) -> dict | None:
        """The metrics saved with ``step`` (``None`` if none were given).

        Args:
          step: a committed step.
        """
        return self._step_meta(step).get("metrics")

    def item_metadata(self, step: int | None = None) -> dict[str, dict[str, LeafMetadata] | str]:
        """Per item: its leaves' metadata (pytree items), ``"state"`` (Checkpointables) or
        ``"json"`` (``JsonSave`` items).

        Args:
          step: a committed step (default: :meth:`latest_step`).
        """
        step = self._resolve_step(step)
        d = self._step_dir(step)
        out: dict[str, Any] = {}
        for name, kind in self._step_meta(step)["items"].items():
            out[name] = _restore.metadata_of(os.path.join(d, name)) if kind == "pytree" else kind
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
        """True if ``step`` is newer than every committed step and due in some tier, or
        :meth:`reached_preemption` (asked first, so every process takes part in its sync).

        Args:
          step: the step the save would be numbered.
        """
        preempted = self.reached_preemption(step)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            return False
        if preempted:
            return True
        policy = self._options.save_decision_policy
        if policy is not None:
            context = _policies.DecisionContext(self._bg.busy(), self._last_save_time)
            return bool(policy.should_save(step, self.all_steps(), context)) or any(_due(t, step) for t in self._tiers[1:])
        if self._options.should_save_fn is not None:
            return bool(self._options.should_save_fn(step, latest))
        return step in (self._options.save_on_steps or ()) or any(_due(t, step) for t in self._tiers)

    # --- preemption ---
    def reached_preemption(self, step: int) -> bool:
        """True once a preemption notice arrived, from the same ``step`` on every process.

        A notice is one of ``options.preemption_signals`` (``SIGTERM`` by default), the
        existence of ``preemption_notice_file`` or ``preemption_check()`` returning true. The
        signal handler only records the signal, so one that arrives while the loop compiles,
        evaluates, waits for data or for a save is seen at the next call. With several
        ``jax.distributed`` processes, every process must call this at the same steps: the
        notices are exchanged through the distributed key-value store at each multiple of
        ``preemption_sync_interval_steps``, so all processes answer true from the same step
        even if only one was signalled; a process that does not arrive within
        ``timeout_secs`` makes the others raise :class:`SyncTimeoutError` naming it. Once
        true, it stays true for later steps.

        Args:
          step: the training step; every process passes the same steps.

        >>> import os, signal, tempfile
        >>> mngr = CheckpointManager(tempfile.mkdtemp())
        >>> mngr.reached_preemption(3)
        False
        >>> os.kill(os.getpid(), signal.SIGTERM)  # the process lives on: the flag is set
        >>> mngr.reached_preemption(4), mngr.should_save(4), mngr.preemption_step
        (True, True, 4)
        >>> mngr.close()  # puts the previous SIGTERM handler back
        """
        return self._preemption.reached(step)

    @property
    def preemption_step(self) -> int | None:
        """The step at which :meth:`reached_preemption` first answered true (else ``None``)."""
        return self._preemption.step

    def exit_if_preempted(
        self, step: int, items: Mapping[str, Any] | None = None, metrics: Mapping[str, Any] | None = None
    ) -> None:
        """At a step boundary: if :meth:`reached_preemption`, save ``items`` as ``step`` in the
        persistent tier (unless that tier already holds it: a copy in the local tier alone,
        e.g. a RAM disk, would not outlive the machine), wait until it is committed, close
        the manager and raise ``SystemExit(PREEMPTION_EXIT_CODE)``; otherwise return.

        ``items`` is what :meth:`save` takes: the model, the optimizer state and the data
        iterator (a Checkpointable), so the next start resumes exactly here (see
        :meth:`resume`). ``SystemExit`` unwinds the caller's ``finally`` blocks and context
        managers; a supervisor restarts the command on exit status
        :data:`PREEMPTION_EXIT_CODE`.

        Args:
          step: the step just finished.
          items: what to save (as :meth:`save` takes it).
          metrics: the step's metrics, as :meth:`save` takes them.
        """
        if not self.reached_preemption(step):
            return
        self._bg.wait()
        latest = self.latest_step()
        persistent = self._committed(self._tiers[0]).get(step)
        if items is not None and (latest is None or latest <= step):
            if persistent is None or self._check(persistent, step)[0] is None:
                self.save(step, items, metrics, force=True)
        self.wait_until_finished()
        _log.warning(
            "cairn.checkpoint: preempted (%s); step %d is committed in %s, exiting with status %d",
            self._preemption.reason or "notice", self.latest_step(), self.directory,
            _preemption.PREEMPTION_EXIT_CODE,
        )
        self.close()
        raise SystemExit(_preemption.PREEMPTION_EXIT_CODE)

    def resume(self, items: Mapping[str, Any], **restore_kwargs: Any) -> tuple[int | None, Any]:
        """``(step, restored)`` from the newest intact step in either tier, or ``(None, items)``
        when the directory holds no checkpoint yet: a run starts the same way the first
        time and after every preemption.

        ``items`` are the restore targets (as in :meth:`restore`: pytrees and
        Checkpointables, e.g. the freshly initialized model and optimizer state and the
        data iterator, whose ``set_state`` is called); ``restore_kwargs`` go to
        :meth:`restore`. A checkpoint that exists but does not match ``items`` raises, as
        :meth:`restore` does; it is never silently ignored.

        Args:
          items: the restore targets (pytrees and Checkpointables), returned as they are when there is no checkpoint.
          **restore_kwargs: :meth:`restore`'s keywords (``partial``, ``cast``, ``mesh``).

        >>> import tempfile, numpy as np
        >>> d = tempfile.mkdtemp()
        >>> with CheckpointManager(d) as mngr:
        ...     step, state = mngr.resume({"w": np.zeros(2)})
        ...     _ = mngr.save(5, {"w": np.ones(2)})
        >>> step, state["w"]
        (None, array([0., 0.]))
        >>> with CheckpointManager(d) as mngr:
        ...     step, state = mngr.resume({"w": np.zeros(2)})
        >>> step, state["w"]
        (5, array([1., 1.]))
        """
        self._preemption.watch()
        step = self.latest_step()
        if step is None:
            return None, items
        return step, self.restore(step, items, **restore_kwargs)

    def close(self) -> None:
        """Wait for the pending save and put back the signal handlers the manager replaced.

        A preemption notice that came after the run's last :meth:`reached_preemption` check
        (a ``SIGTERM`` during the final evaluation, say) is not dropped: when only the local
        tier holds the newest step, ``close`` copies it to the persistent tier, which outlives
        the machine. With several processes and a local tier, every process calls ``close``
        (it exchanges the notices once); leaving a ``with`` block by an exception skips that.
        """
        try:
            super().close()
            if len(self._tiers) > 1 and not self._options.read_only and self._preemption.late_notice():
                self._persist_newest_local_step()
        finally:
            self._preemption.close()

    def __exit__(self, *exc: object) -> None:
        if exc and exc[0] is not None:  # the other processes may not reach close: no end-of-run exchange
            self._preemption.skip_late_notice()
        self.close()

    def _persist_newest_local_step(self) -> None:
        """Copy the newest step to the persistent tier if only the local tier holds it intact
        (every process takes part: the commit has barriers)."""
        persistent, local = self._tiers
        step = -1
        if _multihost.is_primary():
            newest = self.latest_step()
            if newest is not None and self._intact_in(persistent, newest) is None:
                step = newest if self._intact_in(local, newest) is not None else -1
        step = int(_multihost.broadcast(f"persist newest {self.directory}", str(step), self._options.timeout_secs))
        if step < 0:
            return
        _log.warning("cairn.checkpoint: a preemption notice came after the last step's check; copying "
                     "step %d from the local tier to %s", step, persistent.directory)
        final = os.path.join(persistent.directory, self._step_name(step))
        copies = [d for d in self._copies(step).get(step, []) if os.path.dirname(d) == persistent.directory]
        tmp = self._claim_step(step, persistent, final, copies, {})

        def write() -> None:
            if _multihost.is_primary():
                src = self._intact_in(local, step)
                assert src is not None  # checked above; the run is over, nothing else writes it
                _fs.copy_tree_durable(src, tmp, skip=(_fs.COMMIT_MARKER, STEP_METADATA))
                meta = _fs.read_json(os.path.join(src, STEP_METADATA), require_checksum=True)
                _fs.write_json_durable(os.path.join(tmp, STEP_METADATA), {**meta, "tier": persistent.name})
                _fs.fsync_dir(tmp)

        def verify(d: str) -> None:
            if self._check(d, step, since=time.monotonic())[0] is None:
                raise CheckpointCorruptError(f"step {step} copied to {d} does not verify", None)

        write_and_commit(write, tmp, final, False, verify, self._options.timeout_secs)
        if _multihost.is_primary():
            self._apply_retention(persistent)

    def _intact_in(self, tier: _Tier, step: int) -> str | None:
        """The intact committed copy of ``step`` in ``tier`` (else ``None``)."""
        return self._intact_dir(step, [d for d in self._copies(step).get(step, [])
                                       if os.path.dirname(d) == tier.directory])

    # --- saving ---
    def save(
        self,
        step: int,
        items: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Save ``items`` as ``step`` if :meth:`should_save` (or ``force``); returns whether it did.

        ``items`` is a dict of named pytrees, Checkpointables and ``JsonItem`` s.
        The step goes to the persistent tier when ``step`` is a multiple of
        ``save_interval_steps`` (or ``force``, or once :meth:`reached_preemption`), otherwise
        to the local tier (whose failures are logged, not raised). With
        ``enable_async`` this returns once device data is on the host, and ``True`` means
        the save started (a local-tier write that fails later is logged, not reported
        here); a previous save is waited for first and its error, if any, is raised here.

        Args:
          step: the step number (>= 0).
          items: a dict of named pytrees, Checkpointables and ``JsonItem`` s.
          metrics: a JSON-able dict for ``best_fn`` (and :meth:`metrics`).
          force: save even if :meth:`should_save` is false.
        """
        if not isinstance(items, Mapping) or not items:
            raise TypeError("items must be a non-empty dict of {name: pytree or Checkpointable}")
        return self._save(step, lambda: items, metrics, force=force, single=False)

    def _save(
        self,
        step: int,
        get_items: Callable[[], Mapping[str, Any]],
        metrics: Mapping[str, Any] | None,
        *,
        force: bool,
        single: bool,
        custom_metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """:meth:`save`, with the items asked for only once the step is due; ``single``:
        one unnamed item (restored alone); ``custom_metadata``: a JSON-able dict kept in
        the step's metadata."""
        self._bg.wait()
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._options.read_only:
            _log.warning("cairn.checkpoint: the manager of %s is read-only; step %d not saved", self.directory, step)
            return False
        if not force and not self.should_save(step):
            return False
        items = get_items()
        self._last_save_time = time.monotonic()
        tier, copies = self._target_tier(step, force)
        o = self._options
        if metrics is not None:
            try:
                metrics = json.loads(json.dumps(dict(metrics)))
            except (TypeError, ValueError) as err:
                raise TypeError(f"metrics for step {step} must be JSON-able: {err}") from None
        snaps, states, jsons = self._capture(items)
        final = os.path.join(tier.directory, self._step_name(step))
        if (tmp := self._prepare_step(step, tier, final, copies, items)) is None:
            return False
        kinds = {n: "pytree" if n in snaps else "json" if n in jsons else "state" for n in items}
        step_meta = {
            "time": _now(),  # when save was called (keep_time_interval counts from it)
            "step": step,
            "version": _tree.FORMAT_VERSION,
            "tier": tier.name,
            "items": kinds,
            "metrics": metrics,
            "single": single,
            "custom_metadata": None if custom_metadata is None else _json_item.jsonable(
                dict(custom_metadata), f"custom_metadata of step {step}"),
        }

        def verify(d: str) -> None:  # remembered, so retention and listing need not re-read it
            meta, why = self._check(d, step, since=time.monotonic())
            if meta is None:
                raise CheckpointCorruptError(why or "", None)

        def write() -> None:
            self._write_step(tmp, snaps, states, step_meta)
            for name, value in jsons.items():
                _json_item.write_json_item(os.path.join(tmp, name), value)

        done = [True]

        def tail() -> None:
            try:
                write_and_commit(write, tmp, final, False, verify, o.timeout_secs)
                if _multihost.is_primary():
                    self._apply_retention(tier)
                if o.async_options is not None and o.async_options.post_finalization_callback is not None:
                    o.async_options.post_finalization_callback()
            except Exception as err:
                if tier.name != "local":
                    raise
                _local_failed(step, tier, err)
                done[0] = False

        if o.enable_async:
            # started: True whatever the tail does later (a failed local write is only
            # logged); reading ``done`` here would race with the tail's thread
            self._bg.start(tail, f"step {step} in {tier.directory}")
            return True
        tail()
        return done[0]

    def _target_tier(self, step: int, force: bool) -> tuple[_Tier, list[str]]:
        """The tier ``step`` goes to and that tier's committed copies of it (a corrupt one,
        which the save replaces); an intact copy there raises ``FileExistsError``."""
        tier = self._tiers[0]
        o = self._options
        local_only = (len(self._tiers) > 1 and not _due(tier, step) and _due(self._tiers[1], step)
                      and step not in (o.save_on_steps or ()) and o.should_save_fn is None)
        if not force and local_only and self.preemption_step is None:
            tier = self._tiers[1]
        copies = [d for d in self._copies(step).get(step, []) if os.path.dirname(d) == tier.directory]
        if self._intact_dir(step, copies) is not None:
            raise StepAlreadyExistsError(f"step {step} already exists in {tier.directory}")
        return tier, copies

    def _capture(
        self, items: Mapping[str, Any]
    ) -> tuple[dict[str, _tree.Snapshot], dict[str, Any], dict[str, Any]]:
        """(host snapshots of the pytree items, JSON states of the Checkpointable items,
        values of the ``JsonItem`` items)."""
        o = self._options
        snaps: dict[str, _tree.Snapshot] = {}
        states: dict[str, Any] = {}
        jsons: dict[str, Any] = {}
        for name, item in items.items():
            if not isinstance(name, str) or not _ITEM_NAME.fullmatch(name) or name == _fs.COMMIT_MARKER:
                raise ValueError(
                    f"item name {name!r} must be a plain file-name part (letters, digits, _ . -) "
                    f"other than {_fs.COMMIT_MARKER!r}"
                )
            if isinstance(item, _json_item.JsonItem):
                jsons[name] = _json_item.jsonable(item.value, f"item {name!r}")
                continue
            item = _checkpointable_of(item)
            if is_checkpointable(item):
                state = item.get_state()
                try:
                    states[name] = json.loads(json.dumps(state))
                except (TypeError, ValueError) as err:
                    raise TypeError(
                        f"item {name!r}: get_state() must return JSON-able data: {err}"
                    ) from None
            else:
                snaps[name] = _tree.snapshot(item, copy_host=o.enable_async, compression=o.compression)
        return snaps, states, jsons

    def _prepare_step(
        self, step: int, tier: _Tier, final: str, copies: list[str], items: Mapping[str, Any]
    ) -> str | None:
        """Claim the temporary directory of step directory ``final`` (primary: after
        removing a corrupt committed copy and dead writers' leftovers) with one
        subdirectory per item; every process learns its name. ``None``: the local tier
        failed (logged)."""
        try:
            return self._claim_step(step, tier, final, copies, items)
        except Exception as err:
            if tier.name != "local":
                raise
            _local_failed(step, tier, err)
            return None

    def _claim_step(
        self, step: int, tier: _Tier, final: str, copies: list[str], items: Mapping[str, Any]
    ) -> str:
        o = self._options
        tmp = ""
        if _multihost.is_primary():
            if final in copies:  # committed but corrupt: this save replaces it
                _log.warning("cairn.checkpoint: replacing corrupt step %d at %s", step, final)
                _fs.remove_tree(final)
                self._checked.pop(final, None)
            _ownership.cleanup_incomplete(
                tier.directory, lease_timeout_s=o.tmp_lease_timeout_secs, final=os.path.basename(final)
            )
            tmp = _ownership.claim(final)
            for name in items:
                os.makedirs(os.path.join(tmp, name))
        tmp = _multihost.broadcast(f"tmp {final}", tmp, o.timeout_secs)
        _multihost.barrier(f"prepare {final}", o.timeout_secs)
        return tmp

    def _write_step(
        self, tmp: str, snaps: dict[str, _tree.Snapshot], states: dict[str, Any], step_meta: dict
    ) -> None:
        """Write this process's part of every item into ``tmp``; the primary adds ``_STEP.json``."""
        o = self._options
        pidx = _multihost.process_index()
        for name, snap in snaps.items():
            _tree.write(snap, os.path.join(tmp, name), compression=o.compression)
        for name, state in states.items():
            sub = os.path.join(tmp, name)
            _fs.write_json_durable(os.path.join(sub, f"state.process_{pidx}.json"), state)
            _fs.fsync_dir(sub)
        if _multihost.is_primary():
            meta = {
                "step": step_meta["step"],
                "version": step_meta["version"],
                "time": step_meta["time"],
                "tier": step_meta["tier"],
                "items": step_meta["items"],
                "metrics": step_meta["metrics"],
                "process_count": _multihost.process_count(),
            }
            if step_meta["custom_metadata"] is not None:
                meta["custom_metadata"] = step_meta["custom_metadata"]
            if step_meta["single"]:
                meta["single"] = True
            _fs.write_json_durable(os.path.join(tmp, STEP_METADATA), meta)

    def _apply_retention(self, tier: _Tier) -> None:
        o = self._options
        steps: dict[int, tuple[str, dict]] = {}  # intact steps: (directory, _STEP.json)
        for s, d in self._committed(tier).items():
            meta = self._check(d, s)[0]
            if meta is not None:
                steps[s] = (d, meta)
        if tier.use_best and o.preservation_policy is not None:
            self._apply_preservation(tier, steps)
            return
        if tier.max_to_keep is None or len(steps) <= tier.max_to_keep:
            return
        ordered = sorted(steps)
        best_fn = o.best_fn
        by_metric = tier.use_best and best_fn is not None
        keep: set[int] = set()
        if tier.max_to_keep > 0 and not by_metric:
            keep.update(ordered[-tier.max_to_keep :])
        elif self.preemption_step is not None and ordered[-1] >= self.preemption_step:
            keep.add(ordered[-1])  # a preempted run resumes from its newest save
        if by_metric:
            assert best_fn is not None
            scored: list[tuple[int, Any]] = []
            unscored: list[tuple[int, Any]] = []
            for s in ordered:
                m = steps[s][1].get("metrics")
                (unscored if m is None else scored).append((s, m))
            sign = -1.0 if o.best_mode == "max" else 1.0
            scored.sort(key=lambda sm: (sign * float(best_fn(sm[1])), -sm[0]))
            keep.update(s for s, _ in scored[: tier.max_to_keep])
            if o.keep_checkpoints_without_metrics:
                keep.update(s for s, _ in unscored)
        if tier.use_best and o.keep_period:
            keep.update(s for s in ordered if s % o.keep_period == 0)
        if tier.use_best and o.keep_time_interval is not None:
            last = None  # the first step of each interval, by save time
            for s in ordered:
                t = steps[s][1].get("time")
                if isinstance(t, (int, float)) and (last is None or t - last >= o.keep_time_interval.total_seconds()):
                    keep.add(s)
                    last = t
        for s in ordered:
            if s not in keep:
                self._remove_step(tier, steps[s][0])

    def _apply_preservation(self, tier: _Tier, steps: dict[int, tuple[str, dict]]) -> None:
        """Retention by ``preservation_policy``: keep what it preserves and the newest step."""
        ordered = sorted(steps)
        infos = [_policies.CheckpointInfo(s, steps[s][1].get("time"), steps[s][1].get("metrics")) for s in ordered]
        policy = self._options.preservation_policy
        assert policy is not None  # called only when one is set
        keep = policy.should_preserve(infos)
        if len(keep) != len(ordered):
            raise ValueError(f"preservation_policy answered {len(keep)} values for {len(ordered)} steps")
        for s, k in zip(ordered[:-1], keep[:-1], strict=True):
            if not k:
                self._remove_step(tier, steps[s][0])

    def _remove_step(self, tier: _Tier, d: str) -> None:
        """Delete step directory ``d``, or move it into ``todelete_subdir``."""
        sub = self._options.todelete_subdir
        if sub is None:
            _fs.remove_tree(d)
            return
        dest = os.path.join(tier.directory, sub)
        os.makedirs(dest, exist_ok=True)
        target = os.path.join(dest, os.path.basename(d))
        if os.path.exists(target):
            _fs.remove_tree(target)
        os.replace(d, target)

    def delete(self, step: int) -> None:
        """Remove ``step`` from every tier (a corrupt step too); a ``read_only`` manager
        only logs a warning.

        Args:
          step: the step to remove.
        """
        self._bg.wait()
        if self._options.read_only:
            _log.warning("cairn.checkpoint: the manager of %s is read-only; step %d not deleted", self.directory, step)
            return
        if _multihost.is_primary():
            for tier in self._tiers:
                d = self._committed(tier).get(step)
                if d is not None:
                    self._remove_step(tier, d)
                    self._checked.pop(d, None)
        _multihost.barrier(f"delete {step} {self.directory}", self._options.timeout_secs)

    def reload(self) -> None:
        """Forget what this manager verified, so every step is checked again from disk.

        The step listing is read from the directory on every call (a step another process
        committed shows at once); this also re-verifies steps whose files changed in place.
        """
        self._checked.clear()

    # --- restoring ---
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
    ) -> Any:
        """Restore ``step`` (default: :meth:`latest_step`, the newest intact step in either tier).

        ``items`` maps item names to targets: a pytree target (see :func:`restore`), ``None``
        (as saved) or a Checkpointable (its ``set_state`` is called and it is returned).
        A list of names restores those items as saved; ``None`` restores every item. The
        result is a dict by item name.

        The step's metadata files are verified again first. A damaged file or array chunk
        raises :class:`CheckpointCorruptError` (:class:`ChecksumError` for array data)
        saying that the step is corrupt and naming the file or leaf; the step is then
        skipped by later calls of :meth:`latest_step` (so ``restore()`` again takes the
        newest intact step), and never silently replaced by another step in this call.

        Args:
          step: the step (default: the newest intact one).
          items: item names to targets, a list of names, or ``None`` (every item as saved).
          args: Orbax's restore arguments instead of ``items``.
          partial: skip checkpoint paths the targets lack.
          cast: allow target dtypes other than the saved ones.
          mesh: the ``jax.sharding.Mesh`` for ``ArraySpec`` targets with a sharding.
        """
        return self._restore(step, lambda meta: items, partial=partial, cast=cast, mesh=mesh)[0]

    def _restore(
        self, step: int | None, get_items: Callable[[dict], Any], **kw: Any
    ) -> tuple[dict[str, Any], dict]:
        """(items by name, the step's ``_STEP.json``); ``get_items(meta)`` gives the targets."""
        self._bg.wait()
        start = time.monotonic()  # verified again unless latest_step()/_step_dir just did
        step = self._resolve_step(step)
        d = self._step_dir(step)
        try:
            meta, why = self._check(d, step, since=start)
            if meta is None:
                raise CheckpointCorruptError(why or "", None)
            return self._restore_items(d, step, meta, get_items(meta), **kw), meta
        except CheckpointCorruptError as err:
            self._mark_corrupt(d, str(err))
            tier = self._tier_of(d)
            _log.warning("cairn.checkpoint: step %d of the %s tier (%s) is corrupt: %s", step, tier, d, err)
            raise type(err)(
                f"step {step} in {os.path.dirname(d)} ({tier} tier) is corrupt: {err}", err.path
            ) from err

    def _restore_items(self, d: str, step: int, meta: dict, items: Any, **kw: Any) -> dict[str, Any]:
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
        return {name: self._restore_item(os.path.join(d, name), name, kinds[name], target, step, meta, kw)
                for name, target in targets.items()}

    def _restore_item(self, sub: str, name: str, kind: str, target: Any, step: int, meta: dict,
                      kw: dict[str, Any]) -> Any:
        """One item of a step, onto ``target`` (``kw``: :func:`restore`'s options)."""
        if kind == "state":
            return self._restore_state(sub, name, step, meta, _checkpointable_of(target))
        if kind == "json":
            return _json_item.read_json_item(sub)
        if kind == "opaque":
            raise TypeError(f"item {name!r} of step {step} was written by a user's handler; restore it through "
                            "a manager that has that handler (Orbax's item_handlers or checkpointers)")
        if is_checkpointable(target):
            raise TypeError(f"item {name!r} is a pytree in step {step}, not a Checkpointable's state")
        return _restore.restore_dir(sub, target, **kw)

    def _restore_state(self, sub: str, name: str, step: int, meta: dict, target: Any) -> Any:
        """A Checkpointable item: its state, or ``target`` after ``set_state(state)``."""
        f = os.path.join(sub, f"state.process_{_multihost.process_index()}.json")
        if not os.path.isfile(f):
            raise CheckpointError(
                f"item {name!r} of step {step} has no state for process "
                f"{_multihost.process_index()} (saved by {meta.get('process_count')} processes)"
            )
        state = _fs.read_json(f, require_checksum=meta.get("version", 1) >= 2)
        if target is None:
            return state
        if not is_checkpointable(target):
            raise TypeError(
                f"item {name!r} was saved from a Checkpointable; its target must have "
                f"set_state, got {type(target).__qualname__}"
            )
        target.set_state(state)
        return target


def _now() -> float:
    """Seconds since the epoch, through ``datetime`` (the clock Orbax's tests set)."""
    return datetime.datetime.now(datetime.UTC).timestamp()


def _due(tier: _Tier, step: int) -> bool:
    """Whether ``step`` is due in ``tier`` by its interval (0: never)."""
    return tier.interval > 0 and step % tier.interval == 0


def _local_failed(step: int, tier: _Tier, err: BaseException) -> None:
    """A failed save of the local tier (a full RAM disk...) is logged, not raised: the run
    goes on and the persistent tier still saves."""
    _log.warning(
        "cairn.checkpoint: step %d was not saved in the local tier (%s): %s: %s; the run goes on "
        "and the persistent tier still saves (free space there or lower local_max_to_keep)",
        step, tier.directory, type(err).__name__, err,
    )


def _checkpointable_of(x: Any) -> Any:
    """``x``, or the Checkpointable an argument object wraps as ``.item`` (as Grain's
    ``grain.checkpoint.CheckpointSave(iterator)`` does), so such items save as states."""
    inner = getattr(x, "item", None)
    return inner if not is_checkpointable(x) and is_checkpointable(inner) else x
