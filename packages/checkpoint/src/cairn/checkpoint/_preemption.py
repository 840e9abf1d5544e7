"""Preemption notices: a signal, a notice file or a user check, agreed across processes."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

from cairn.checkpoint import _multihost

#: The exit status of a process that saved its state because of a preemption notice and
#: stopped (``EX_TEMPFAIL`` of sysexits.h: a temporary failure, to be retried). A supervisor
#: (a shell loop, a Kubernetes Job with ``podFailurePolicy``, Slurm's ``--requeue``) that sees
#: it restarts the same command, which resumes from the saved step.
PREEMPTION_EXIT_CODE = 75

_log = logging.getLogger("cairn.checkpoint")
_instances: dict[str, int] = {}


class PreemptionWatcher:
    """Watches for a preemption notice; :meth:`reached` agrees on it across processes.

    The handlers are installed by :meth:`watch` (the manager calls it from ``resume``,
    ``reached_preemption``, ``should_save`` and ``save``, so a manager that only reads
    never changes how the process reacts to signals). The handler only stores the signal
    number (nothing that can block or allocate beyond one attribute store: safe wherever
    the main thread was interrupted, in a compilation, a device wait or a save) and then
    calls the handler that was installed before it, if that was a Python callable. A second
    signal of the same kind while the previous handler was the default one restores that
    default and delivers the signal again (a loop that never stops still dies on the second
    SIGTERM). :meth:`close` puts the previous handlers back.
    """

    def __init__(
        self,
        name: str,
        signals: Sequence[int | signal.Signals],
        notice_file: str | None,
        check: Callable[[], bool] | None,
        sync_interval_steps: int,
        timeout_s: float,
    ) -> None:
        self._signum: int | None = None  # the one field the signal handler writes
        self._notice_file = notice_file
        self._check = check
        self._interval = sync_interval_steps
        self._timeout_s = timeout_s
        # the n-th watcher of this directory in this process: the same on every process (the
        # managers are created in the same order), so a later manager never reads old answers
        n = _instances[name] = _instances.get(name, 0) + 1
        self._key = f"cairn_checkpoint/preempt/{hashlib.sha256(name.encode()).hexdigest()[:16]}/{n}"
        self._agreed: int | None = None  # first step at which every process agreed
        self._answers: dict[int, bool] = {}
        self._last_sync: int | None = None
        self._reason = ""
        self._previous: dict[int, Any] = {}
        self._active = False
        self._signals = [int(s) for s in signals]
        self._watching = False
        self._finished = False

    def watch(self) -> None:
        """Install the signal handlers (once; later calls do nothing)."""
        if self._watching:
            return
        self._watching = True
        signals = self._signals
        if not signals:
            return
        if threading.current_thread() is not threading.main_thread():
            _log.warning(
                "cairn.checkpoint: the CheckpointManager was created outside the main thread, so "
                "signals %s are not watched (a notice file or preemption_check still work)",
                signals,
            )
            return
        for s in signals:
            self._previous[s] = signal.signal(s, self._handle)
        self._active = True

    def _handle(self, signum: int, frame: Any) -> None:
        prev = self._previous.get(signum)
        if self._active and self._signum == signum and prev in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)  # the second one: as if we were not here
            os.kill(os.getpid(), signum)
            return
        if self._active:
            self._signum = signum
        if callable(prev):
            prev(signum, frame)

    def close(self) -> None:
        """Put back the signal handlers that were installed before this watcher's."""
        self._active = False
        if threading.current_thread() is not threading.main_thread():
            return
        for s, prev in self._previous.items():
            if signal.getsignal(s) == self._handle:  # a later handler chained to ours stays
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous = {}

    def noticed(self) -> bool:
        """Whether this process has seen a notice (no communication)."""
        if self._signum is not None and not self._reason:
            self._reason = f"signal {signal.Signals(self._signum).name}"
        if self._reason:
            return True
        if self._notice_file is not None and os.path.exists(self._notice_file):
            self._reason = f"notice file {self._notice_file}"
        elif self._check is not None and self._check():
            self._reason = "preemption_check() returned True"
        return bool(self._reason)

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def step(self) -> int | None:
        """The first step at which every process agreed on a preemption (``None`` before)."""
        return self._agreed

    def reached(self, step: int) -> bool:
        """True from the first sync step at which some process had a notice (every process
        answers the same for the same ``step``; with several processes, asked again for a
        step, the answer is kept).

        With several processes every process must call this at the same steps; a sync step
        (a multiple of the sync interval) exchanges each process's notice through the
        distributed key-value store, and a process that does not arrive within the timeout
        makes every waiting process raise :class:`SyncTimeoutError` naming it.
        """
        step = int(step)
        self.watch()
        if self._agreed is not None:  # earlier steps keep their answer: no
            return step >= self._agreed
        local = self.noticed()
        if _multihost.process_count() == 1:
            agreed = local  # asked again in the same step, a notice that came meanwhile counts
        elif step in self._answers:  # the others asked once for this step: keep that answer
            return self._answers[step]
        elif step % self._interval != 0:
            return False
        else:
            agreed = self._sync(step, local)
        self._answers = {step: agreed}
        if agreed:
            self._agreed = step
            _log.warning(
                "cairn.checkpoint: preemption reached at step %d (%s)", step, self._reason or "another process"
            )
        return agreed

    def skip_late_notice(self) -> None:
        """Make :meth:`late_notice` answer ``False`` without a sync (an error ends the run)."""
        self._finished = True

    def late_notice(self) -> bool:
        """At the end of a run: whether some process has a notice that no :meth:`reached`
        agreed on (it came after the last step's check). With several processes every process
        must call this (the manager's ``close`` does); it exchanges the notices once, and only
        for a watcher that watched and agreed on nothing (then the processes are in step), so
        a later call, or a call after an agreed preemption, answers ``False`` without a sync.
        """
        if self._finished or not self._watching or self._agreed is not None:
            self._finished = True
            return False
        self._finished = True
        local = self.noticed()
        if _multihost.process_count() == 1:
            return local
        values = _multihost.all_gather(f"{self._key}/end", "1" if local else "0", self._timeout_s,
                                       "the end-of-run preemption check (CheckpointManager.close)")
        if not local and "1" in values:
            self._reason = f"process {values.index('1')} had a notice"
        return "1" in values

    def _sync(self, step: int, local: bool) -> bool:
        values = _multihost.all_gather(
            f"{self._key}/{step}", "1" if local else "0", self._timeout_s,
            f"the preemption check of step {step}",
        )
        if self._last_sync is not None:  # every process has read it: all posted this step
            _multihost.delete_key(f"{self._key}/{self._last_sync}/{_multihost.process_index()}")
        self._last_sync = step
        if not local and "1" in values:
            self._reason = f"process {values.index('1')} had a notice"
        return "1" in values
