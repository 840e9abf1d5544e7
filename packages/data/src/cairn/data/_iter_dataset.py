"""``IterDataset``: sequential, checkpointable pipelines and their iterators.

An ``IterDataset`` usually starts from ``MapDataset.to_iter_dataset()``. Per-element steps
(``map``, ``random_map``, ``filter``) applied directly on top of that root are folded back
into the ``MapDataset``, so they stay pure functions of the element index and run in
worker processes; steps that carry state across elements (``batch``, packing, ``prefetch``,
``interleave``) run on iterators.

Iterator state is small and JSON-able. The root's state is ``{"next_index": i}``, the
index in the ``MapDataset`` of the next element; a step adds what it needs (a counter, a
packing offset). Because worker processes compute deterministic slices of that one global
order and the main process re-orders them, the state and the output do not depend on the
number of workers.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from cairn.data._map_dataset import (
    MapDataset,
    StageProfile,
    _as_callable,
    _check_seed,
    _fn_name,
    _int_at_least,
    _Pipeline,
    _rng_for,
    mix_pattern,
    profiling,
)
from cairn.data._state_validation import (
    STATE_VERSION,
    StateError,
    any_field,
    check_state,
    int_field,
    nested,
    with_version,
)
from cairn.data._tree import StructureChecker, stack_records

__all__ = [
    "DatasetIterator",
    "IterDataset",
    "MapRootIterDataset",
    "ReadOptions",
    "InterleaveIterDataset",
    "MixIterDataset",
]


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How a ``MapDataset`` is read when iterated.

    Attributes:
      num_threads: background threads reading chunks ahead (0 = read in the calling
        thread). Chunks are whole batches of records, so one or two threads are enough to
        overlap file I/O with the consumer.
      prefetch_buffer_size: chunks kept in flight per thread when ``num_threads > 0``.
      chunk_records: about how many records one chunk (one batched source read) covers.
    """

    num_threads: int = 0
    prefetch_buffer_size: int = 2
    chunk_records: int = 1024

    def __post_init__(self):
        for name in ("num_threads", "prefetch_buffer_size", "chunk_records"):
            v = getattr(self, name)
            lo = 0 if name == "num_threads" else 1
            if not _int_at_least(v, lo):
                raise ValueError(f"ReadOptions.{name} must be an int >= {lo}, got {v!r}")


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


# ====================================================================== statistics


class _Stats:
    __slots__ = ("name", "count", "time", "created", "fill_sum", "fill_n", "capacity")

    def __init__(self, name: str):
        self.name = name
        self.count = 0
        self.time = 0.0
        self.created = time.perf_counter()
        self.fill_sum = 0.0
        self.fill_n = 0
        self.capacity = 0


class DatasetIterator:
    """Base of every iterator: ``next``, ``get_state``/``set_state``, ``summary``, ``close``."""

    _checker: StructureChecker | None = None

    def __init__(self, parents: Sequence[DatasetIterator], name: str, debug: bool = False):
        self._parents = tuple(parents)
        self._stats = _Stats(name)
        if debug:
            self._checker = StructureChecker(name)

    def __iter__(self) -> DatasetIterator:
        return self

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        try:
            x = self._next()
        finally:
            self._stats.time += time.perf_counter() - t0
        if self._checker is not None:
            self._checker.check(x)
        self._stats.count += 1
        return x

    def _next(self) -> Any:
        raise NotImplementedError

    def get_state(self) -> dict:
        """A small JSON-able dict; ``set_state`` of it resumes exactly here."""
        raise NotImplementedError

    def set_state(self, state: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release threads / worker processes (idempotent; also done at exit)."""
        for p in self._parents:
            p.close()

    def __enter__(self) -> DatasetIterator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _summary_rows(self, depth: int, rows: list) -> float:
        """Append rows for this stage and its inputs; return this stage's inclusive time."""
        own_row = len(rows)
        rows.append(None)
        child = 0.0
        for p in self._parents:
            child += p._summary_rows(depth + 1, rows)
        s = self._stats
        wall = max(1e-9, time.perf_counter() - s.created)
        fill = f"{s.fill_sum / s.fill_n / s.capacity:.0%}" if s.fill_n and s.capacity else "-"
        rows[own_row] = (
            "  " * depth + s.name,
            s.count,
            s.time,
            max(0.0, s.time - child),
            s.time / wall,
            fill,
        )
        return s.time

    def summary(self) -> str:
        """A table of the stages: records out, time inside ``next`` (total and own), the
        share of wall time spent waiting for the stage, and buffer fill."""
        rows: list = []
        self._summary_rows(0, rows)
        head = ("stage", "out", "total_s", "self_s", "wait_share", "buffer_fill")
        table = [head] + [
            (r[0], str(r[1]), f"{r[2]:.4f}", f"{r[3]:.4f}", f"{r[4]:.1%}", r[5]) for r in rows
        ]
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines = []
        for j, row in enumerate(table):
            lines.append(
                "  ".join(
                    c.ljust(w) if i == 0 else c.rjust(w)
                    for i, (c, w) in enumerate(zip(row, widths))
                )
            )
            if j == 0:
                lines.append("-" * len(lines[0]))
        lines.extend(self._summary_extra())
        return "\n".join(lines)

    def _summary_extra(self) -> list[str]:
        out = []
        for p in self._parents:
            out.extend(p._summary_extra())
        return out


# ====================================================================== datasets


class IterDataset(_Pipeline):
    """A sequential dataset; ``iter(ds)`` gives a checkpointable :class:`DatasetIterator`."""

    _parents: tuple[IterDataset, ...] = ()

    def __iter__(self) -> DatasetIterator:
        return self._make_iter(None)

    def _make_iter(self, root_factory: Callable | None) -> DatasetIterator:
        raise NotImplementedError

    @property
    def _debug(self) -> bool:
        return any(p._debug for p in self._parents)

    def _stage_name(self) -> str:
        return type(self).__name__

    # ---------------------------------------------------------------- steps
    def map(self, fn: Callable[[Any], Any]) -> IterDataset:
        """Apply ``fn`` to every element."""
        return _MapIterDataset(self, _as_callable(fn, "map"))

    def random_map(
        self, fn: Callable[[Any, np.random.Generator], Any], seed: int = 0
    ) -> IterDataset:
        """Apply ``fn(element, rng)``; ``rng`` is keyed by (seed, element number)."""
        return _RandomMapIterDataset(
            self, _as_callable(fn, "random_map", "random_map"), _check_seed(seed, "random_map()")
        )

    def filter(self, predicate: Callable[[Any], bool]) -> IterDataset:
        """Keep the elements where ``predicate`` is true."""
        return _FilterIterDataset(self, _as_callable(predicate, "filter", "filter"))

    def batch(
        self, batch_size: int, drop_remainder: bool = False, batch_fn: Callable | None = None
    ) -> IterDataset:
        """Group ``batch_size`` consecutive elements (stacked leaf by leaf by default)."""
        if (
            isinstance(batch_size, bool)
            or not isinstance(batch_size, int | np.integer)
            or batch_size < 1
        ):
            raise ValueError(f"batch(): batch_size must be a positive integer, got {batch_size!r}")
        return _BatchIterDataset(
            self, int(batch_size), bool(drop_remainder), batch_fn or stack_records
        )

    def prefetch(self, buffer_size: int = 2) -> IterDataset:
        """Compute up to ``buffer_size`` elements ahead in a background thread."""
        if not _int_at_least(buffer_size, 1):
            raise ValueError(f"prefetch(): buffer_size must be a positive int, got {buffer_size!r}")
        return _PrefetchIterDataset(self, buffer_size)

    def mp_prefetch(
        self, options: Any = None, worker_init_fn: Callable[[int, int], None] | None = None
    ) -> IterDataset:
        """Compute the ``MapDataset`` part of the pipeline in worker processes.

        ``options`` is a :class:`MultiprocessingOptions` or an int (``num_workers``).
        Workers compute deterministic chunks of the global element order; the main
        process puts them back in order, so the output and the iterator state are the
        same for every worker count, including 0.
        """
        from cairn.data._multiprocessing import MPPrefetchIterDataset, MultiprocessingOptions

        if options is None:
            options = MultiprocessingOptions(num_workers=2)
        elif isinstance(options, int) and not isinstance(options, bool):
            options = MultiprocessingOptions(num_workers=options)
        if not isinstance(options, MultiprocessingOptions):
            raise TypeError(
                f"mp_prefetch(): options must be MultiprocessingOptions or an int, got {options!r}"
            )
        if options.num_workers == 0:
            return self
        return MPPrefetchIterDataset(self, options, worker_init_fn)

    @staticmethod
    def interleave(datasets: Sequence[IterDataset], cycle_length: int | None = None) -> IterDataset:
        """Round-robin over ``cycle_length`` datasets at a time (see InterleaveIterDataset)."""
        return InterleaveIterDataset(datasets, cycle_length)

    @staticmethod
    def mix(datasets: Sequence[IterDataset], weights: Sequence[float] | None = None) -> IterDataset:
        """Interleave iterators deterministically in proportion to ``weights``.

        The same pattern as :meth:`MapDataset.mix` (it repeats every 1000 elements and
        gives input ``k`` ``round(weights[k] / sum(weights) * 1000)`` of them, spread
        evenly), drawn from iterators, so inputs may filter, batch or pack. The mixture
        ends when the input whose turn it is runs out. The state is the position in the
        pattern plus every input's state.

        >>> from cairn.data import IterDataset, MapDataset
        >>> a = MapDataset.range(0, 100).to_iter_dataset()
        >>> b = MapDataset.range(100, 200).filter(lambda x: x % 2 == 0).to_iter_dataset()
        >>> list(IterDataset.mix([a, b], [3, 1]))[:8]
        [0, 1, 100, 2, 3, 4, 102, 5]
        """
        return MixIterDataset(datasets, weights)

    def __repr__(self) -> str:
        return self.graph()


class MapRootIterDataset(IterDataset):
    """``MapDataset.to_iter_dataset()``: iterates the elements in index order, skipping ``None``."""

    def __init__(self, ds: MapDataset, read_options: ReadOptions, debug: bool = False):
        if not isinstance(read_options, ReadOptions):
            raise TypeError(
                f"read_options must be a ReadOptions, got {type(read_options).__name__}"
            )
        self._ds = ds
        self._read_options = read_options
        self._debug_flag = debug

    @property
    def _debug(self) -> bool:
        return self._debug_flag

    def _make_iter(self, root_factory: Callable | None) -> DatasetIterator:
        if root_factory is not None:
            return root_factory(self)
        return MapRootIterator(self._ds, self._read_options, self._debug_flag)

    # Per-element steps fold into the MapDataset: they stay functions of the index.
    def map(self, fn: Callable[[Any], Any]) -> IterDataset:
        return MapRootIterDataset(self._ds.map(fn), self._read_options, self._debug_flag)

    def random_map(self, fn: Callable, seed: int = 0) -> IterDataset:
        return MapRootIterDataset(
            self._ds.random_map(fn, seed=seed), self._read_options, self._debug_flag
        )

    def filter(self, predicate: Callable[[Any], bool]) -> IterDataset:
        return MapRootIterDataset(self._ds.filter(predicate), self._read_options, self._debug_flag)

    def _graph_lines(self, indent: str) -> list[str]:
        return [f"{indent}to_iter_dataset({self._read_options})"] + self._ds._graph_lines(indent)


# ====================================================================== iterators


class _ChunkedRootIterator(DatasetIterator):
    """Hands out the non-``None`` elements of a ``MapDataset``, read chunk by chunk.

    The state is ``{"next_index": i}``. Subclasses load the next chunk in ``_fetch``
    (``False`` at the end) into ``_buf`` / ``_buf_start`` / ``_buf_pos``, with ``_error``
    set when the read stopped early; that error is raised after the chunk's elements,
    through ``_chunk_failed(err)``, with the state pointing at the failing element.
    """

    _who = ""  # names the iterator in set_state errors
    _reads_in_next = True  # False when reads run elsewhere (threads, worker processes)

    def __init__(self, ds: MapDataset, read_options: ReadOptions, name: str, debug: bool):
        super().__init__((), name, debug)
        self._ds = ds
        self._len = len(ds)
        self._cap = chunk_elements(ds, read_options)
        self._profile = StageProfile(ds)

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
                if v is not None:
                    self._next_index = self._buf_start + self._buf_pos
                    return v
            if self._error is not None:
                err, self._error = self._error, None
                self._next_index = self._buf_start + len(buf)
                raise self._chunk_failed(err)
            if not self._fetch():
                raise StopIteration

    def get_state(self) -> dict:
        # the literal is with_version(...) inlined: every pipeline's get_state ends here
        return {"version": STATE_VERSION, "next_index": self._next_index}

    def _checked_index(self, state: dict) -> int:
        return check_state(state, self._who, {"next_index": int_field(0, self._len)})["next_index"]

    def set_state(self, state: dict) -> None:
        self._reset(self._checked_index(state))


class MapRootIterator(_ChunkedRootIterator):
    """Iterates a ``MapDataset`` chunk by chunk (one batched read per chunk)."""

    _who = "MapDataset iterator"

    def __init__(self, ds: MapDataset, read_options: ReadOptions, debug: bool = False):
        super().__init__(
            ds,
            read_options,
            f"MapDataset[{ds._stage_name()} ...]"
            if ds._parents
            else f"MapDataset[{ds._stage_name()}]",
            debug,
        )
        self._opts = read_options
        self._pool = None
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


class _SameStateIterator(DatasetIterator):
    """One input, whose state is this iterator's state."""

    def __init__(self, parent, name, debug):
        super().__init__((parent,), name, debug)
        self._p = parent

    def get_state(self):
        return self._p.get_state()

    def set_state(self, state):
        self._p.set_state(state)


class _MapIterator(_SameStateIterator):
    def __init__(self, parent, fn, name, debug):
        super().__init__(parent, name, debug)
        self._fn = fn

    def _next(self):
        return self._fn(next(self._p))


class _RandomMapIterator(DatasetIterator):
    def __init__(self, parent, fn, seed, name, debug):
        super().__init__((parent,), name, debug)
        self._p, self._fn, self._seed = parent, fn, seed
        self._count = 0

    def _next(self):
        x = next(self._p)
        rng = _rng_for(self._seed, 0, self._count)
        self._count += 1
        return self._fn(x, rng)

    def get_state(self):
        return with_version({"parent": self._p.get_state(), "count": self._count})

    def set_state(self, state):
        check_state(state, "random_map iterator", {"parent": any_field, "count": int_field(0)})
        with nested("parent"):
            self._p.set_state(state["parent"])
        self._count = state["count"]


class _FilterIterator(_SameStateIterator):
    def __init__(self, parent, pred, name, debug):
        super().__init__(parent, name, debug)
        self._pred = pred

    def _next(self):
        while True:
            x = next(self._p)
            if self._pred(x):
                return x


class _BatchIterator(_SameStateIterator):
    def __init__(self, parent, bs, drop, fn, name, debug):
        super().__init__(parent, name, debug)
        self._bs, self._drop, self._fn = bs, drop, fn

    def _next(self):
        items = []
        p = self._p
        try:
            for _ in range(self._bs):
                items.append(next(p))
        except StopIteration:
            if not items or self._drop:
                raise
        return self._fn(items)


_END = object()


class ThreadPrefetchIterator(DatasetIterator):
    """Runs the parent iterator in a background thread, ``buffer_size`` elements ahead."""

    def __init__(
        self, parent: DatasetIterator, buffer_size: int, name: str = "prefetch", debug: bool = False
    ):
        super().__init__((parent,), name, debug)
        self._p = parent
        self._size = buffer_size
        self._stats.capacity = buffer_size
        self._state = parent.get_state()
        self._thread: threading.Thread | None = None
        self._done = False

    def _start(self) -> None:
        self._q: queue.Queue = queue.Queue(self._size)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._work, args=(self._q, self._stop), daemon=True, name="cairn-data-prefetch"
        )
        self._thread.start()

    def _work(self, q: queue.Queue, stop: threading.Event) -> None:
        p = self._p
        while not stop.is_set():
            try:
                x = next(p)
                item = (x, p.get_state(), None)
            except StopIteration:
                item = (_END, p.get_state(), None)
            except BaseException as e:  # handed to the consumer, which re-raises it
                item = (_END, None, e)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] is _END:
                return

    def _next(self):
        if self._done:
            raise StopIteration
        if self._thread is None:
            self._start()
        self._stats.fill_sum += self._q.qsize()
        self._stats.fill_n += 1
        x, state, err = self._q.get()
        if err is not None:
            self._halt()
            self._done = True
            raise err
        if x is _END:
            self._state = state
            self._done = True
            self._thread = None
            raise StopIteration
        self._state = state
        return x

    def get_state(self):
        return self._state

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            try:
                while True:
                    self._q.get_nowait()
            except queue.Empty:
                pass
            self._thread.join()
            self._thread = None

    def set_state(self, state):
        self._halt()
        try:
            self._p.set_state(state)
        except BaseException:  # the thread read ahead: put the input back where we are
            self._p.set_state(self._state)
            raise
        self._state = self._p.get_state()
        self._done = False

    def close(self) -> None:
        self._halt()
        super().close()


# ====================================================================== one-input steps


class _UnaryIterDataset(IterDataset):
    """One input; ``iter`` gives ``_iterator(input iterator, *args, stage name, debug)``."""

    _iterator: Callable[..., DatasetIterator]

    def __init__(self, parent: IterDataset, *args: Any):
        if not isinstance(parent, IterDataset):
            raise TypeError(f"expected an IterDataset, got {type(parent).__name__}")
        self._parent = parent
        self._parents = (parent,)
        self._args = args

    def _make_iter(self, rf):
        return self._iterator(
            self._parent._make_iter(rf), *self._args, self._stage_name(), self._debug
        )


class _MapIterDataset(_UnaryIterDataset):
    _iterator = _MapIterator

    def _stage_name(self):
        (fn,) = self._args
        return f"map({_fn_name(fn)})"


class _RandomMapIterDataset(_UnaryIterDataset):
    _iterator = _RandomMapIterator

    def _stage_name(self):
        fn, seed = self._args
        return f"random_map({_fn_name(fn)}, seed={seed})"


class _FilterIterDataset(_UnaryIterDataset):
    _iterator = _FilterIterator

    def _stage_name(self):
        (pred,) = self._args
        return f"filter({_fn_name(pred)})"


class _BatchIterDataset(_UnaryIterDataset):
    _iterator = _BatchIterator

    def _stage_name(self):
        bs, drop, _ = self._args
        return f"batch({bs}{', drop_remainder=True' if drop else ''})"


class _PrefetchIterDataset(_UnaryIterDataset):
    _iterator = ThreadPrefetchIterator

    def _stage_name(self):
        (size,) = self._args
        return f"prefetch({size})"


# ====================================================================== interleave


def _as_iter_datasets(datasets: Sequence[Any], who: str) -> list[IterDataset]:
    out = list(datasets)
    for k, d in enumerate(out):
        if isinstance(d, MapDataset):
            out[k] = d.to_iter_dataset()
        elif not isinstance(d, IterDataset):
            raise TypeError(f"{who}(): input {k} is a {type(d).__name__}, expected an IterDataset")
    return out


class InterleaveIterDataset(IterDataset):
    """Round-robin over ``cycle_length`` input datasets at a time.

    Slot ``s`` of the cycle yields one element in turn; when its dataset is exhausted the
    next unopened dataset takes the slot. The order is deterministic, and the state is
    the index of the next dataset to open plus the open datasets' states.

    >>> from cairn.data import InterleaveIterDataset, MapDataset
    >>> a = MapDataset.range(0, 3).to_iter_dataset()
    >>> b = MapDataset.range(10, 12).to_iter_dataset()
    >>> list(InterleaveIterDataset([a, b], cycle_length=2))
    [0, 10, 1, 11, 2]
    """

    def __init__(self, datasets: Sequence[IterDataset], cycle_length: int | None = None):
        datasets = _as_iter_datasets(datasets, "interleave")
        if cycle_length is None:
            cycle_length = max(1, len(datasets))
        if not _int_at_least(cycle_length, 1):
            raise ValueError(
                f"interleave(): cycle_length must be a positive int, got {cycle_length!r}"
            )
        self._datasets = datasets
        self._parents = tuple(datasets)
        self._cycle = cycle_length

    def _stage_name(self):
        return f"interleave(cycle_length={self._cycle})"

    def _make_iter(self, rf):
        return _InterleaveIterator(self._datasets, self._cycle, self._stage_name(), self._debug)


class _InterleaveIterator(DatasetIterator):
    def __init__(self, datasets, cycle, name, debug):
        super().__init__((), name, debug)
        self._datasets = datasets
        self._cycle = cycle
        self._reset({"next_to_open": 0, "slot": 0, "open": []})

    def _reset(self, state):
        opened: list = []
        try:
            for j, entry in enumerate(state["open"]):
                if entry is None:
                    opened.append(None)
                    continue
                k, st = entry
                it = iter(self._datasets[k])
                opened.append([k, it])
                with nested(f"open/{j}/1"):
                    it.set_state(st)
        except BaseException:
            for e in opened:
                if e is not None:
                    e[1].close()
            raise
        for e in getattr(self, "_open_iters", []):
            if e is not None:
                e[1].close()
        self._next_to_open = state["next_to_open"]
        self._slot = state["slot"]
        self._open_iters = opened
        while len(self._open_iters) < self._cycle:
            self._open_iters.append(self._open_next())

    def _open_next(self):
        if self._next_to_open >= len(self._datasets):
            return None
        k = self._next_to_open
        self._next_to_open += 1
        return [k, iter(self._datasets[k])]

    def _next(self):
        while any(e is not None for e in self._open_iters):
            s = self._slot
            entry = self._open_iters[s]
            if entry is None:
                self._slot = (s + 1) % self._cycle
                continue
            try:
                x = next(entry[1])
            except StopIteration:
                entry[1].close()
                self._open_iters[s] = self._open_next()
                if self._open_iters[s] is None:
                    self._slot = (s + 1) % self._cycle
                continue
            self._slot = (s + 1) % self._cycle
            return x
        raise StopIteration

    def get_state(self):
        return with_version(
            {
                "next_to_open": self._next_to_open,
                "slot": self._slot,
                "open": [None if e is None else [e[0], e[1].get_state()] for e in self._open_iters],
            }
        )

    def set_state(self, state):
        kind, n = "interleave iterator", len(self._datasets)
        check_state(
            state,
            kind,
            {
                "next_to_open": int_field(0, n),
                "slot": int_field(0, self._cycle - 1),
                "open": lambda v: (
                    None
                    if isinstance(v, list) and len(v) == self._cycle
                    else f"a list of {self._cycle} entries (one per cycle slot)"
                ),
            },
        )
        seen: set = set()
        for j, entry in enumerate(state["open"]):
            if entry is None:
                continue
            if not isinstance(entry, list | tuple) or len(entry) != 2:
                raise StateError(kind, f"open/{j}", "null or [input index, input state]", entry)
            k = entry[0]
            if int_field(0, state["next_to_open"] - 1)(k) is not None or k in seen:
                raise StateError(
                    kind,
                    f"open/{j}/0",
                    f"the index of an input opened before next_to_open={state['next_to_open']} "
                    "and not open in another slot",
                    k,
                )
            seen.add(k)
        self._reset(state)

    def close(self):
        for e in self._open_iters:
            if e is not None:
                e[1].close()


# ====================================================================== mix


class MixIterDataset(IterDataset):
    """``IterDataset.mix``: inputs drawn in a fixed, evenly spread weighted pattern."""

    PERIOD = 1000

    def __init__(self, datasets: Sequence[IterDataset], weights: Sequence[float] | None = None):
        self._datasets = _as_iter_datasets(datasets, "mix")
        if not self._datasets:
            raise ValueError("mix(): needs at least one dataset")
        self._parents = tuple(self._datasets)
        self._weights, _, self._pattern, _ = mix_pattern(weights, len(self._datasets), self.PERIOD)

    def _stage_name(self):
        return "mix(weights=[" + ", ".join(f"{x:.3g}" for x in self._weights) + "])"

    def _make_iter(self, rf):
        its = [iter(d) for d in self._datasets]
        return _MixIterator(its, self._pattern.tolist(), self._stage_name(), self._debug)


class _MixIterator(DatasetIterator):
    def __init__(self, its, pattern, name, debug):
        super().__init__(its, name, debug)
        self._its = its
        self._pattern = pattern
        self._index = 0

    def _next(self):
        x = next(self._its[self._pattern[self._index % len(self._pattern)]])
        self._index += 1
        return x

    def get_state(self):
        return with_version({"index": self._index, "inputs": [it.get_state() for it in self._its]})

    def set_state(self, state):
        n = len(self._its)
        check_state(
            state,
            "mix iterator",
            {
                "index": int_field(0),
                "inputs": lambda v: (
                    None
                    if isinstance(v, list) and len(v) == n
                    else f"a list of the states of the {n} inputs"
                ),
            },
        )
        before = [it.get_state() for it in self._its]
        try:
            for k, (it, st) in enumerate(zip(self._its, state["inputs"])):
                with nested(f"inputs/{k}"):
                    it.set_state(st)
        except BaseException:  # leave the iterator where it was
            for it, st in zip(self._its, before):
                it.set_state(st)
            raise
        self._index = state["index"]
