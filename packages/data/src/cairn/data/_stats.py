"""Statistics and profiling: per-iterator counters, per-stage ``MapDataset`` read
profiles, source bad-record counters and the ``summary()`` table.

A ``MapDataset`` stage's ``_getitems`` is wrapped by :func:`profiled` (done once per
class by ``MapDataset.__init_subclass__``); inside a :class:`profiling` block the reads
on that thread add their time and output count to a :class:`StageProfile`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np


class Stage(Protocol):
    """What the statistics need of a ``MapDataset`` stage: its input stages. (A protocol,
    so this module does not import the base classes that import it.)"""

    @property
    def _parents(self) -> Sequence[Any]: ...

__all__ = [
    "IteratorStats",
    "StageProfile",
    "add_bad_records",
    "bad_record_counts",
    "format_summary",
    "profiled",
    "profiling",
    "stage_list",
]

_TLS = threading.local()  # .profile: the StageProfile collecting reads on this thread


class StageProfile:
    """Per-stage totals of ``MapDataset`` reads for ``summary()``: inclusive seconds and
    elements out, indexed by the stage's position in :func:`stage_list` (the same in
    every process, so worker processes can send theirs back as a list)."""

    __slots__ = ("index", "time", "count", "_lock")

    def __init__(self, ds: Stage) -> None:
        stages = stage_list(ds)
        self.index = {id(d): k for k, d in enumerate(stages)}
        self.time = [0.0] * len(stages)
        self.count = [0] * len(stages)
        self._lock = threading.Lock()

    def as_list(self) -> list:
        return [self.time, self.count]

    def merge(self, other: list | StageProfile) -> None:
        times, counts = other.as_list() if isinstance(other, StageProfile) else other
        with self._lock:
            for k, (t, c) in enumerate(zip(times, counts)):
                self.time[k] += t
                self.count[k] += c


def stage_list(ds: Stage) -> list[Stage]:
    """The stages of a MapDataset graph, each once, output first (depth-first)."""
    out: list = []
    seen: set = set()
    todo = [ds]
    while todo:
        d = todo.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        out.append(d)
        todo.extend(reversed(d._parents))
    return out


def bad_record_counts(stages: list[Stage]) -> list[int]:
    """Each stage's source ``bad_records`` counter (0 for other stages). Worker processes
    send the growth of these counters back with each chunk, so the sources in the main
    process count the records skipped in every process."""
    out = []
    for d in stages:
        n = getattr(getattr(d, "_source", None), "bad_records", 0)
        out.append(n if isinstance(n, int) else 0)
    return out


def add_bad_records(stages: list[Stage], deltas: list[int]) -> None:
    """Add ``deltas`` (from :func:`bad_record_counts` in a worker) to the main process's
    source counters."""
    for d, n in zip(stages, deltas):
        src = getattr(d, "_source", None)
        if n and src is not None:
            with getattr(src, "_lock", None) or contextlib.nullcontext():
                src.bad_records += n


class profiling:  # noqa: N801 (a context manager used like a function)
    """Within the block, MapDataset reads on this thread add to ``profile``."""

    __slots__ = ("profile", "prev")

    def __init__(self, profile: StageProfile | None) -> None:
        self.profile = profile

    def __enter__(self) -> None:
        self.prev = getattr(_TLS, "profile", None)
        _TLS.profile = self.profile

    def __exit__(self, *exc: Any) -> None:
        _TLS.profile = self.prev


def _global_getitems(read: Callable, ds: Any, indices: Any, epoch: int) -> list:
    """``read`` (a stage's batched read) at Grain-style indices: any sequence, where an index
    past the length reads the next epoch (``len + i`` is element ``i`` of epoch 1)."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    n = len(ds)
    if idx.size == 0 or n == 0 or (idx.min() >= 0 and idx.max() < n):
        return read(ds, idx, epoch)
    epochs, local = np.divmod(idx, n)
    out: list = [None] * idx.size
    for e in np.unique(epochs).tolist():
        pos = np.flatnonzero(epochs == e)
        for p, v in zip(pos.tolist(), read(ds, local[pos], epoch + e)):
            out[p] = v
    return out


def profiled(f: Callable) -> Callable:
    """Wrap a stage's ``_getitems`` to add its time and output count to the active
    profile (one thread-local read per call, i.e. per chunk, when none is active)."""

    @functools.wraps(f)
    def _getitems(self, indices, epoch=0):
        if not isinstance(indices, np.ndarray):  # Grain's callers: any sequence, global indices
            return _global_getitems(_getitems, self, indices, epoch)
        prof = getattr(_TLS, "profile", None)
        if prof is None:
            return f(self, indices, epoch)
        t0 = time.perf_counter()
        out = f(self, indices, epoch)
        k = prof.index.get(id(self))
        if k is not None:
            prof.time[k] += time.perf_counter() - t0
            n = len(out)
            if self._may_filter:  # filtered-out elements read as None
                n -= sum(1 for x in out if x is None)  # identity only (arrays)
            prof.count[k] += n
        return out

    _getitems._profiled = True  # type: ignore[attr-defined]
    return _getitems


class IteratorStats:
    """One iterator's counters for ``summary()``: elements out, seconds inside ``next``,
    and the buffer fill seen at each ``next`` (prefetching stages)."""

    __slots__ = ("name", "count", "time", "created", "fill_sum", "fill_n", "capacity")

    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0
        self.time = 0.0
        self.created = time.perf_counter()
        self.fill_sum = 0.0
        self.fill_n = 0
        self.capacity = 0


def format_summary(rows: Sequence[tuple], extra: Sequence[str]) -> str:
    """The ``summary()`` table: one row per stage (name, records out, total and own
    seconds, wait share, buffer fill), then the ``extra`` lines."""
    head = ("stage", "out", "total_s", "self_s", "wait_share", "buffer_fill")
    table = [head] + [
        (r[0], str(r[1]), f"{r[2]:.4f}", f"{r[3]:.4f}", f"{r[4]:.1%}", r[5]) for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = []
    for j, row in enumerate(table):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            )
        )
        if j == 0:
            lines.append("-" * len(lines[0]))
    lines.extend(extra)
    return "\n".join(lines)
