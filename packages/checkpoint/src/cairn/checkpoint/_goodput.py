"""Goodput: how much of a training job's wall time, over all its restarts, made progress."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Self

from cairn.checkpoint import _fs, _multihost

#: The file, next to the step directories of the persistent tier, holding the job's totals.
GOODPUT_FILE = "_GOODPUT.json"
_FORMAT = "cairn.checkpoint.goodput"
_STEP = "step"  # the phase inside GoodputRecorder.step, recorded as productive
_DERIVED = ("productive", "restart_lost", "startup", "downtime", "other")
_BUILTIN = ("productive", "compile", "data", "checkpoint", "restart_lost", "startup", "downtime", "other")


class GoodputRecorder:
    """Records where a training job's time goes, across restarts, in ``directory``.

    Time is split into ``productive`` (inside :meth:`step`), ``compile``, ``data``,
    ``checkpoint`` and any other name given to :meth:`phase`, ``startup`` (from the
    recorder's ``start_time`` to the first phase: imports, initialization, the restore),
    ``restart_lost`` (productive time of steps that a restart had to redo: the steps after
    the one restored, up to the step the previous run had reached), ``downtime`` (between the
    previous run's last record and this run's start) and ``other`` (the rest). The goodput
    fraction is ``productive / total``, over every run of the job so far.

    The totals and the current run's per-step times (the last ``keep_steps`` of them) are
    written by process 0 to ``directory/_GOODPUT.json`` (checksummed, replaced atomically)
    every ``flush_interval_s`` at a phase's end, at :meth:`flush` and when the recorder is
    closed (``with`` block, also when :meth:`CheckpointManager.exit_if_preempted` raises
    ``SystemExit``). A run killed without closing loses what came after its last write: its
    redone work is then undercounted, never counted twice. The next run's :meth:`resumed`
    reads it back.

    Times are wall-clock (``clock``, default ``time.time``) around the code in each
    context; JAX dispatches asynchronously, so block on the step's result (fetching the
    loss does) inside :meth:`step`, or the device time lands in the next phase that waits.

    Args:
      directory: the persistent checkpoint directory (``CheckpointManager.directory``).
      start_time: when this run started (default: now); pass the process start time to
        count the imports as ``startup``.
      compile_first_step: the first :meth:`step` of each run compiles the step function,
        so its time is counted as ``compile`` (and not as work a later restart redoes).
      flush_interval_s: the least time between two writes of the file.
      keep_steps: how many recent per-step times are kept for computing redone work;
        older steps that a restart redoes are counted at the mean step time.
      clock: seconds since the epoch (tests pass a fake clock).

    >>> import tempfile
    >>> t = [100.0]
    >>> d = tempfile.mkdtemp()
    >>> with GoodputRecorder(d, clock=lambda: t[0], compile_first_step=False) as gp:
    ...     gp.resumed(None)
    ...     for step in range(1, 5):
    ...         with gp.phase("data"):
    ...             t[0] += 0.5
    ...         with gp.step(step):
    ...             t[0] += 2.0
    >>> gp.report()["goodput"], gp.report()["data_s"]
    (0.8, 2.0)
    >>> t[0] += 10.0  # the machine was away; the next run restored step 2
    >>> with GoodputRecorder(d, clock=lambda: t[0], compile_first_step=False) as gp:
    ...     gp.resumed(2)
    ...     for step in (3, 4):
    ...         with gp.step(step):
    ...             t[0] += 2.0
    >>> r = gp.report()
    >>> r["restart_lost_s"], r["downtime_s"], r["steps_redone"], r["productive_s"], r["total_s"]
    (4.0, 10.0, 2, 8.0, 24.0)
    >>> round(r["goodput"], 4)  # 8 s of progress; 4 s redone, 2 s data, 10 s away
    0.3333
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        start_time: float | None = None,
        compile_first_step: bool = True,
        flush_interval_s: float = 60.0,
        keep_steps: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if keep_steps < 1:
            raise ValueError(f"keep_steps must be >= 1, got {keep_steps}")
        if flush_interval_s < 0:
            raise ValueError(f"flush_interval_s must be >= 0, got {flush_interval_s}")
        self.path = os.path.join(os.path.abspath(os.fspath(directory)), GOODPUT_FILE)
        self._clock = clock
        self._start = clock() if start_time is None else float(start_time)
        self._compile_first = compile_first_step
        self._flush_interval = flush_interval_s
        self._keep = keep_steps
        self._prior: dict[str, float] = {}  # totals of earlier runs (and this run's restart accounting)
        self._now: dict[str, float] = {}  # this run's phases
        self._runs = 1
        self._redone = 0
        self._restored: int | None = None
        self._reached: int | None = None
        self._step_s: dict[int, float] = {}
        self._first_step: int | None = None
        self._first_phase: float | None = None
        self._in: str | None = None
        self._steps_seen = 0
        self._last_flush = self._start
        self._resumed = False

    # --- restarts ---
    def resumed(self, step: int | None) -> None:
        """Call once, after restoring ``step`` (``None``: a fresh start); charges the work the
        previous run did after ``step`` as ``restart_lost`` and the gap as ``downtime``.

        Args:
          step: the step restored, or ``None`` for a fresh start.
        """
        if self._resumed:
            raise RuntimeError("GoodputRecorder.resumed() was already called for this run")
        self._resumed = True
        self._restored = self._reached = None if step is None else int(step)
        saved = self._load()
        if saved is not None:
            self._restart(saved)
        self.flush()  # this run is on record even if it dies before its next write

    def _restart(self, saved: dict) -> None:
        totals = {k: float(v) for k, v in saved["totals"].items()}
        cur = saved.get("current") or {}
        lost, redone = _lost_work(cur, self._restored)
        totals["productive"] = totals.get("productive", 0.0) - lost
        totals["restart_lost"] = totals.get("restart_lost", 0.0) + lost
        gap = self._start - float(cur.get("last_update", self._start))
        totals["downtime"] = totals.get("downtime", 0.0) + max(gap, 0.0)
        self._prior = totals
        self._runs = int(saved.get("runs", 0)) + 1
        self._redone = int(saved.get("steps_redone", 0)) + redone

    def _load(self) -> dict | None:
        if not os.path.exists(self.path):
            return None
        saved = _fs.read_json(self.path, require_checksum=True)
        if not isinstance(saved, dict) or saved.get("format") != _FORMAT or not isinstance(saved.get("totals"), dict):
            raise _fs.corrupt(self.path, "it is not a cairn goodput record")
        return saved

    # --- recording ---
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the time inside the ``with`` block as ``name`` (``"compile"``, ``"data"``,
        ``"checkpoint"``, ``"eval"``...). Phases do not nest.

        Args:
          name: the phase's name (not ``"step"`` nor a derived category).
        """
        if not isinstance(name, str) or not name or name in (_STEP, *_DERIVED):
            raise ValueError(
                f"phase name must be a non-empty string other than {[_STEP, *_DERIVED]} "
                f"(use step() for productive time), got {name!r}"
            )
        with self._timed(name):
            yield
        self._maybe_flush()

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        if self._in is not None:
            raise RuntimeError(f"phase {name!r} started inside phase {self._in!r}; phases do not nest")
        self._in = name
        t0 = self._clock()
        if self._first_phase is None:
            self._first_phase = t0
        try:
            yield
        finally:
            self._in = None
            self._add("productive" if name == _STEP else name, self._clock() - t0)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Count the time inside the block as productive work that reaches ``step`` (the
        first step of a run counts as ``compile`` with ``compile_first_step``).

        Args:
          step: the step this block's work reaches.
        """
        first = self._steps_seen == 0 and self._compile_first
        self._steps_seen += 1
        t0 = self._clock()
        with self._timed("compile" if first else _STEP):
            yield
        secs = self._clock() - t0
        self._step_s[int(step)] = 0.0 if first else secs
        if self._first_step is None:
            self._first_step = int(step)
        if len(self._step_s) > self._keep:
            del self._step_s[min(self._step_s)]
        self._reached = int(step)
        self._maybe_flush()

    def record(self, name: str, seconds: float) -> None:
        """Add ``seconds`` measured elsewhere to ``name`` (then flush if it is time).

        Args:
          name: the phase's name.
          seconds: the time to add.
        """
        self._add(name, seconds)
        self._maybe_flush()

    def _add(self, name: str, seconds: float) -> None:
        self._now[name] = self._now.get(name, 0.0) + float(seconds)

    def _maybe_flush(self) -> None:
        if self._clock() - self._last_flush >= self._flush_interval:
            self.flush()

    # --- reporting ---
    def report(self) -> dict[str, Any]:
        """``{"goodput": productive / total, "<name>_s": seconds for each kind of time,
        "total_s", "steps_redone", "runs"}`` over every run so far, for a metrics log."""
        totals = self._totals()
        total = sum(totals.values())
        out: dict[str, Any] = {"goodput": totals["productive"] / total if total > 0 else 0.0}
        out.update({f"{k}_s": v for k, v in totals.items()})
        out.update(total_s=total, steps_redone=self._redone, runs=self._runs)
        return out

    def _totals(self) -> dict[str, float]:
        now = self._clock()
        run = dict(self._now)
        first = self._first_phase if self._first_phase is not None else now
        run["startup"] = run.get("startup", 0.0) + max(first - self._start, 0.0)
        accounted = sum(run.values())
        run["other"] = max(now - self._start - accounted, 0.0)
        keys = list(_BUILTIN) + sorted((set(run) | set(self._prior)) - set(_BUILTIN))
        return {k: self._prior.get(k, 0.0) + run.get(k, 0.0) for k in keys}

    def flush(self) -> None:
        """Write the totals and this run's per-step times (process 0; atomic replace)."""
        now = self._clock()
        self._last_flush = now
        if not _multihost.is_primary():
            return
        body = {
            "format": _FORMAT, "version": 1, "totals": self._totals(), "runs": self._runs,
            "steps_redone": self._redone,
            "current": {"started": self._start, "last_update": now, "restored_step": self._restored,
                        "first_step": self._first_step, "reached_step": self._reached,
                        "step_seconds": [[s, v] for s, v in sorted(self._step_s.items())]},
        }
        _fs.write_json_atomic(self.path, body)

    def close(self) -> None:
        """Write the record one last time."""
        self.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _lost_work(cur: dict, restored: int | None) -> tuple[float, int]:
    """(productive seconds, steps) the previous run spent beyond ``restored``."""
    reached, first = cur.get("reached_step"), cur.get("first_step")
    if reached is None or first is None:  # the previous run did no step
        return 0.0, 0
    start = int(first) if restored is None else max(int(restored) + 1, int(first))
    steps = {int(s): float(v) for s, v in cur.get("step_seconds", [])}
    redo = list(range(start, int(reached) + 1))
    known = [steps[s] for s in redo if s in steps]
    mean = sum(steps.values()) / len(steps) if steps else 0.0
    return sum(known) + mean * (len(redo) - len(known)), len(redo)
