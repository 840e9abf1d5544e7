"""``MapDataset.to_iter_dataset()``: the root of every ``IterDataset`` pipeline.

The root iterator hands out a ``MapDataset``'s non-``None`` elements in index order,
read chunk by chunk (one batched read per chunk; :func:`chunk_plan` sizes 1, 2, 4, ...
up to a cap for a fast first element), in the calling thread or in reader threads.
Its state is ``{"next_index": i}``, the index of the next element. Because worker
processes (``cairn.data._multiprocessing``) compute slices of that one global order
and the main process re-orders them, the state and the output do not depend on the
number of workers.
"""

from __future__ import annotations

import collections
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from cairn.data._arguments import FilterFn, MapFn, RandomMapFn

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import DatasetIterator, IterDataset, MapDataset, ReadOptions
from cairn.data._options import FilterRatioCheck, current_options
from cairn.data._state_validation import STATE_VERSION, check_state, int_field
from cairn.data._stats import StageProfile, profiling

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

__all__ = [
    "ChunkedRootIterator",
    "MapRootIterDataset",
    "MapRootIterator",
    "chunk_elements",
    "chunk_plan",
    "read_chunk",
]


def chunk_elements(ds: MapDataset, read_options: ReadOptions) -> int:
    """Elements per full chunk: about ``chunk_records`` records."""
    return max(1, read_options.chunk_records // max(1, ds._records_per_element()))


def read_chunk(
    ds: MapDataset, a: int, b: int, profile: StageProfile | None = None
) -> tuple[list, BaseException | None]:
    """Elements ``a..b-1`` in one batched read. If that fails, the elements are re-read
    one at a time, so the caller gets every element before the failing one, then the
    error (and the iterator state at the error points at the failing element). With
    ``profile``, each stage's time and output count are added to it."""
    with profiling(profile):
        return _read_chunk(ds, a, b)


def _read_chunk(ds: MapDataset, a: int, b: int) -> tuple[list, BaseException | None]:
    try:
        return ds._getitems(np.arange(a, b, dtype=np.int64), 0), None
    except Exception:
        out: list = []
        for i in range(a, b):
            try:
                out.extend(ds._getitems(np.array([i], np.int64), 0))
            except Exception as e:
                return out, e
        raise  # the batched read failed but every single read worked: report the batched error


def chunk_plan(start: int, length: int, cap: int) -> Iterator[tuple[int, int]]:
    """Chunk bounds from ``start``: sizes 1, 2, 4, ... up to ``cap`` (fast first element)."""
    pos, size = start, 1
    while pos < length:
        stop = min(length, pos + size)
        yield pos, stop
        pos = stop
        size = min(cap, size * 2)


class MapRootIterDataset(IterDataset):
    """``MapDataset.to_iter_dataset()``: iterates the elements in index order, skipping ``None``."""

    def __init__(
        self, ds: MapDataset, read_options: ReadOptions, debug: bool = False, allow_nones: bool = False
    ) -> None:
        if not isinstance(read_options, ReadOptions):
            raise TypeError(
                f"read_options must be a ReadOptions, got {type(read_options).__name__}"
            )
        self._ds = ds
        self._read_options = read_options
        self._debug_flag = debug
        self._allow_nones = bool(allow_nones)

    @property
    def parents(self) -> tuple:
        """The ``MapDataset`` this iterates (as Grain reports it)."""
        return (self._ds,)

    @property
    def _debug(self) -> bool:
        return self._debug_flag

    def _make_iter(self, root_factory: Callable | None) -> DatasetIterator:
        if root_factory is not None:
            it = root_factory(self)
        else:
            it = MapRootIterator(self._ds, self._read_options, self._debug_flag)
        it._allow_nones = self._allow_nones
        return it

    def _again(self, ds: MapDataset) -> MapRootIterDataset:
        return MapRootIterDataset(ds, self._read_options, self._debug_flag, self._allow_nones)

    # Per-element steps fold into the MapDataset: they stay functions of the index.
    def map(self, fn: MapFn) -> IterDataset:
        return self._again(self._ds.map(fn))

    def random_map(self, fn: RandomMapFn, seed: int | None = None) -> IterDataset:
        if seed is None:
            seed = self._ds._default_seed() or 0
        return self._again(self._ds.random_map(fn, seed=seed))

    def _default_seed(self) -> int | None:
        return self._ds._default_seed()

    def filter(self, predicate: FilterFn) -> IterDataset:
        return self._again(self._ds.filter(predicate))

    def _graph_lines(self, indent: str) -> list[str]:
        return [f"{indent}to_iter_dataset({self._read_options})"] + self._ds._graph_lines(indent)


def _filter_check(ds: MapDataset) -> FilterRatioCheck | None:
    """The dropped-share check of a ``MapDataset`` that filters (``DatasetOptions``), or None."""
    if not ds._may_filter:
        return None
    names, todo = [], [ds]
    while todo:
        d = todo.pop()
        if getattr(d, "_verb", None) == "filter":
            names.append(d._stage_name())
        todo.extend(d._parents)
    check = FilterRatioCheck(" / ".join(names) or ds._stage_name(), current_options())
    return check if check.active else None


class ChunkedRootIterator(DatasetIterator):
    """Hands out the non-``None`` elements of a ``MapDataset``, read chunk by chunk.

    The state is ``{"next_index": i}``. Subclasses load the next chunk in ``_fetch``
    (``False`` at the end) into ``_buf`` / ``_buf_start`` / ``_buf_pos``, with ``_error``
    set when the read stopped early; that error is raised after the chunk's elements,
    through ``_chunk_failed(err)``, with the state pointing at the failing element.
    """

    _who = ""  # names the iterator in set_state errors
    _allow_nones = False  # True: hand out the None (filtered) elements too
    _reads_in_next = True  # False when reads run elsewhere (threads, worker processes)

    def __init__(self, ds: MapDataset, read_options: ReadOptions, name: str, debug: bool) -> None:
        super().__init__((), name, debug)
        self._ds = ds
        self._len = len(ds)
        self._cap = chunk_elements(ds, read_options)
        self._profile = StageProfile(ds)
        self._filter_check = _filter_check(ds)

    def _summary_rows(self, depth: int, rows: list) -> float:
        """This stage's row, then one row per MapDataset stage below it: elements out,
        time inside its reads (inclusive and own; with workers, summed over the processes
        that ran it) and that time's share of this iterator's wall time."""
        own_row = len(rows)
        total = super()._summary_rows(depth, rows)
        wall = max(1e-9, time.perf_counter() - self._stats.created)
        prof, done = self._profile, set()

        def add(d: MapDataset, level: int) -> float:
            k = prof.index[id(d)]
            if k in done:
                return 0.0
            done.add(k)
            row = len(rows)
            rows.append(None)
            child = sum(add(p, level + 1) for p in d._parents)
            t = prof.time[k]
            rows[row] = (
                "  " * level + d._stage_name(),
                prof.count[k],
                t,
                max(0.0, t - child),
                t / wall,
                "-",
            )
            return t

        reads = add(self._ds, depth + 1)
        if self._reads_in_next:  # reads ran inside this iterator's next(): not its own time
            r = rows[own_row]
            rows[own_row] = r[:3] + (max(0.0, r[3] - reads),) + r[4:]
        return total

    def _reset(self, start: int) -> None:
        self._next_index = start
        self._buf: list = []
        self._buf_start = start
        self._buf_pos = 0
        self._plan = chunk_plan(start, self._len, self._cap)
        self._error: BaseException | None = None

    def _fetch(self) -> bool:
        raise NotImplementedError

    def _chunk_failed(self, err: BaseException) -> BaseException:
        raise NotImplementedError

    def _next(self) -> Any:
        while True:
            buf = self._buf
            while self._buf_pos < len(buf):
                v = buf[self._buf_pos]
                self._buf_pos += 1
                if v is not None or self._allow_nones:
                    self._next_index = self._buf_start + self._buf_pos
                    return v
            if self._error is not None:
                err, self._error = self._error, None
                self._next_index = self._buf_start + len(buf)
                raise self._chunk_failed(err)
            if not self._fetch():
                raise StopIteration
            if self._filter_check is not None:  # once per chunk, only below a filter
                dropped = sum(1 for v in self._buf if v is None)
                self._filter_check.add(len(self._buf) - dropped, dropped)

    def get_state(self) -> dict:
        # the literal is with_version(...) inlined: every pipeline's get_state ends here
        return {"version": STATE_VERSION, "next_index": self._next_index}

    def _checked_index(self, state: dict) -> int:
        return check_state(state, self._who, {"next_index": int_field(0, self._len)})["next_index"]

    def set_state(self, state: dict) -> None:
        self._reset(self._checked_index(state))


class MapRootIterator(ChunkedRootIterator):
    """Iterates a ``MapDataset`` chunk by chunk (one batched read per chunk)."""

    _who = "MapDataset iterator"

    def __init__(self, ds: MapDataset, read_options: ReadOptions, debug: bool = False) -> None:
        super().__init__(
            ds,
            read_options,
            f"MapDataset[{ds._stage_name()} ...]"
            if ds._parents
            else f"MapDataset[{ds._stage_name()}]",
            debug,
        )
        self._opts = read_options
        self._pool: ThreadPoolExecutor | None = None
        self._reads_in_next = read_options.num_threads == 0
        self._stats.name = "to_iter_dataset"
        self._reset(0)

    def _reset(self, start: int) -> None:
        super()._reset(start)
        if self._pool is not None:
            for _, f in self._inflight:
                f.cancel()
        self._inflight: collections.deque = collections.deque()

    def _read(self, a: int, b: int) -> tuple[list, BaseException | None]:
        if self._opts.num_threads == 0:
            return read_chunk(self._ds, a, b, self._profile)
        mine = StageProfile(self._ds)  # a reader thread's own totals, merged under a lock
        try:
            return read_chunk(self._ds, a, b, mine)
        finally:
            self._profile.merge(mine)

    def _fetch(self) -> bool:
        if self._opts.num_threads == 0:
            nxt = next(self._plan, None)
            if nxt is None:
                return False
            self._buf_start = nxt[0]
            self._buf, self._error = self._read(*nxt)
            self._buf_pos = 0
            return True
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(
                self._opts.num_threads, thread_name_prefix="cairn-data-read"
            )
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        want = self._opts.num_threads * self._opts.prefetch_buffer_size
        while len(self._inflight) < want:
            nxt = next(self._plan, None)
            if nxt is None:
                break
            self._inflight.append((nxt[0], self._pool.submit(self._read, *nxt)))
        self._stats.capacity = want
        self._stats.fill_sum += sum(f.done() for _, f in self._inflight)
        self._stats.fill_n += 1
        if not self._inflight:
            return False
        start, fut = self._inflight.popleft()
        self._buf, self._error = fut.result()
        self._buf_start = start
        self._buf_pos = 0
        return True

    def _chunk_failed(self, err: BaseException) -> BaseException:
        # The state points at the failing element: next() (or a restore) retries it;
        # set_state({"next_index": i + 1}) skips it. Reads in flight start after it.
        self._reset(self._next_index)
        return err

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
