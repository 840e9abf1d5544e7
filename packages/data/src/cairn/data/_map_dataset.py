"""``MapDataset``: a lazy, random-access dataset built from a source by transformations.

Every dataset answers ``len(ds)`` and ``ds[i]`` and, internally, ``_getitems(indices,
epoch)``: the elements at a whole NumPy array of indices in one call. Iteration, batching
and worker processes use that batched path, so a shuffled batch of 64 records costs one
vectorised permutation and ONE ``source.__getitems__`` call, never 64 separate reads.

``epoch`` is the repetition number handed down by ``repeat``: ``shuffle`` and the random
transformations key their randomness on ``(seed, epoch, index)``, so every element is a
pure function of those numbers.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from cairn.data._permutation import mix_seed, permute
from cairn.data._tree import stack_records

if TYPE_CHECKING:
    from cairn.data._iter_dataset import IterDataset, ReadOptions

__all__ = ["MapDataset"]

_EMPTY = np.zeros(0, np.int64)


def _int_at_least(v: Any, lo: int) -> bool:
    """Whether ``v`` is a Python int (not a bool) and ``>= lo``."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _check_seed(seed: Any, what: str) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"{what}: seed must be an int, got {type(seed).__name__} {seed!r}")
    return int(seed)


def _fn_name(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name
    owner = getattr(fn, "__self__", None)  # a bound method of a transform object
    return type(owner).__name__ if owner is not None else type(fn).__name__


def _rng_for(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The per-element generator of ``random_map``: Philox keyed by (seed, epoch, index)."""
    return np.random.Generator(np.random.Philox(key=mix_seed(seed, epoch, index)))


_TLS = threading.local()  # .profile: the StageProfile collecting reads on this thread


class StageProfile:
    """Per-stage totals of ``MapDataset`` reads for ``summary()``: inclusive seconds and
    elements out, indexed by the stage's position in :func:`stage_list` (the same in
    every process, so worker processes can send theirs back as a list)."""

    __slots__ = ("index", "time", "count", "_lock")

    def __init__(self, ds: MapDataset):
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


def stage_list(ds: MapDataset) -> list[MapDataset]:
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


def bad_record_counts(stages: list[MapDataset]) -> list[int]:
    """Each stage's source ``bad_records`` counter (0 for other stages). Worker processes
    send the growth of these counters back with each chunk, so the sources in the main
    process count the records skipped in every process."""
    out = []
    for d in stages:
        n = getattr(getattr(d, "_source", None), "bad_records", 0)
        out.append(n if isinstance(n, int) else 0)
    return out


def add_bad_records(stages: list[MapDataset], deltas: list[int]) -> None:
    """Add ``deltas`` (from :func:`bad_record_counts` in a worker) to the main process's
    source counters."""
    for d, n in zip(stages, deltas):
        if n:
            src = d._source
            with getattr(src, "_lock", None) or contextlib.nullcontext():
                src.bad_records += n


class profiling:  # noqa: N801 (a context manager used like a function)
    """Within the block, MapDataset reads on this thread add to ``profile``."""

    __slots__ = ("profile", "prev")

    def __init__(self, profile: StageProfile | None):
        self.profile = profile

    def __enter__(self) -> None:
        self.prev = getattr(_TLS, "profile", None)
        _TLS.profile = self.profile

    def __exit__(self, *exc: Any) -> None:
        _TLS.profile = self.prev


def _profiled(f: Callable) -> Callable:
    """Wrap a stage's ``_getitems`` to add its time and output count to the active
    profile (one thread-local read per call, i.e. per chunk, when none is active)."""

    @functools.wraps(f)
    def _getitems(self, indices, epoch):
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

    _getitems._profiled = True
    return _getitems


class _Pipeline:
    """What ``MapDataset`` and ``IterDataset`` share: ``pipe`` and the text rendering."""

    _parents: tuple  # the input stages; subclasses set them

    def pipe(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(self, *args, **kwargs)``: lets custom steps chain fluently."""
        return fn(self, *args, **kwargs)

    def _graph_head(self) -> str:
        return self._stage_name()

    def _graph_lines(self, indent: str) -> list[str]:
        lines = [f"{indent}{self._graph_head()}"]
        if len(self._parents) == 1:
            lines += self._parents[0]._graph_lines(indent)
        else:
            for k, p in enumerate(self._parents):
                lines.append(f"{indent}  <input {k}>")
                lines += p._graph_lines(indent + "    ")
        return lines

    def graph(self) -> str:
        """A text rendering of the pipeline, output stage first, one stage per line."""
        return "\n".join(self._graph_lines(""))


class MapDataset(_Pipeline):
    """A lazy dataset with random access: ``len(ds)``, ``ds[i]``, ``ds[a:b]``.

    Build one with :meth:`source` or :meth:`range` and chain transformations; nothing is
    read until an element is asked for. Filtered-out elements read as ``None``;
    iteration (:meth:`to_iter_dataset`) skips them.

    >>> ds = MapDataset.range(10).shuffle(seed=1).map(lambda x: x * 10).batch(4)
    >>> len(ds), sorted(np.concatenate(list(ds)).tolist()) == list(range(0, 100, 10))
    (3, True)
    """

    _parents: tuple[MapDataset, ...] = ()
    _may_filter = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        f = cls.__dict__.get("_getitems")
        if f is not None and not getattr(f, "_profiled", False):
            cls._getitems = _profiled(f)

    # ---------------------------------------------------------------- construction
    @staticmethod
    def source(source: Any) -> MapDataset:
        """A dataset over any random-access source (``__len__`` + ``__getitem__``).

        Sources with ``__getitems__(indices)`` are read one call per batch of indices;
        lists, tuples and NumPy arrays work directly.

        >>> MapDataset.source(["a", "b", "c"])[1]
        'b'
        """
        if isinstance(source, MapDataset):
            return source
        if not hasattr(source, "__len__") or not hasattr(source, "__getitem__"):
            raise TypeError(
                "MapDataset.source needs a random-access source with __len__ and "
                f"__getitem__ (optionally __getitems__), got {type(source).__name__}"
            )
        return _SourceMapDataset(source)

    @staticmethod
    def range(start: int, stop: int | None = None, step: int = 1) -> MapDataset:
        """The integers of ``range(start, stop, step)`` as a dataset.

        >>> list(MapDataset.range(2, 8, 3))
        [2, 5]
        """
        return _RangeMapDataset(range(start, stop, step) if stop is not None else range(start))

    @staticmethod
    def mix(datasets: Sequence[MapDataset], weights: Sequence[float] | None = None) -> MapDataset:
        """Interleave datasets deterministically in proportion to ``weights``.

        The pattern repeats every ``period`` (1000) elements and gives dataset ``k``
        ``round(weights[k] / sum(weights) * 1000)`` of them, spread evenly. The mixture
        ends just before the first dataset would run out (repeat the inputs first for an
        endless mixture).

        >>> ds = MapDataset.mix([MapDataset.range(0, 100), MapDataset.range(100, 200)], [3, 1])
        >>> [x for x in ds][:8]
        [0, 1, 100, 2, 3, 4, 101, 5]
        """
        return _MixMapDataset(list(datasets), weights)

    @staticmethod
    def concatenate(datasets: Sequence[MapDataset]) -> MapDataset:
        """The datasets one after another.

        >>> list(MapDataset.concatenate([MapDataset.range(2), MapDataset.range(5, 7)]))
        [0, 1, 5, 6]
        """
        return _ConcatenateMapDataset(list(datasets))

    # ---------------------------------------------------------------- access
    def __len__(self) -> int:
        raise NotImplementedError

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        """Elements at ``indices`` (int64 array of in-range, non-negative indices)."""
        raise NotImplementedError

    def _records_per_element(self) -> int:
        return self._parents[0]._records_per_element() if self._parents else 1

    def _stage_name(self) -> str:
        return type(self).__name__

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        n = len(self)
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise TypeError(
                f"{self._stage_name()} indices must be integers or slices, got {type(index).__name__}"
            )
        i = int(index)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"index {i} is out of range for {self._stage_name()} of length {n}")
        return self._getitems(np.array([j], np.int64), 0)[0]

    def __getitems__(self, indices: Sequence[int]) -> list:
        """The elements at ``indices`` in one batched read (the source protocol)."""
        n = len(self)
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        idx = np.where(idx < 0, idx + n, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = int(idx[(idx < 0) | (idx >= n)][0])
            raise IndexError(f"index {bad} is out of range for {self._stage_name()} of length {n}")
        return self._getitems(idx, 0)

    def __iter__(self):
        return iter(self.to_iter_dataset())

    def __repr__(self) -> str:
        return self.graph()

    # ---------------------------------------------------------------- transformations
    def seed(self, seed: int) -> MapDataset:
        """Set the default seed of the ``shuffle`` / ``random_map`` steps that follow."""
        return _SeedMapDataset(self, _check_seed(seed, "seed()"))

    def _default_seed(self) -> int | None:
        for p in self._parents:
            s = p._default_seed()
            if s is not None:
                return s
        return None

    def _resolve_seed(self, seed: int | None, what: str) -> int:
        if seed is None:
            seed = self._default_seed()
            if seed is None:
                raise ValueError(f"{what} needs a seed: pass seed=... or call .seed(...) upstream")
        return _check_seed(seed, what)

    def shuffle(self, seed: int | None = None) -> MapDataset:
        """A global shuffle: element ``i`` is ``parent[perm(seed, epoch)(i)]``.

        The permutation is a pure function of ``(seed, epoch)``, uses O(1) memory and is
        computed for a whole array of indices at once. Each repetition of ``repeat``
        gets a new permutation. Any int is a valid seed; negative seeds are taken
        modulo ``2**64``.

        >>> sorted(MapDataset.range(5).shuffle(seed=7)) == [0, 1, 2, 3, 4]
        True
        """
        return _ShuffleMapDataset(self, self._resolve_seed(seed, "shuffle()"))

    def slice(self, sl: slice) -> MapDataset:
        """The elements ``ds[sl]``, e.g. ``ds.slice(slice(1, None, 2))``."""
        if not isinstance(sl, slice):
            raise TypeError(f"slice() expects a slice object, got {type(sl).__name__}")
        return _SliceMapDataset(self, sl)

    def shard(self, index: int, count: int, drop_remainder: bool = False) -> MapDataset:
        """Shard ``index`` of ``count`` contiguous, near-equal shards.

        The first ``len % count`` shards get one extra element unless
        ``drop_remainder``; with more shards than elements some shards are empty.

        >>> [list(MapDataset.range(5).shard(i, 2)) for i in range(2)]
        [[0, 1, 2], [3, 4]]
        """
        count = operator.index(count)
        index = operator.index(index)
        if count < 1:
            raise ValueError(f"shard(): count must be >= 1, got {count}")
        if not 0 <= index < count:
            raise ValueError(f"shard(): index must be in [0, {count}), got {index}")
        n = len(self)
        if drop_remainder:
            per = n // count
            return self.slice(slice(index * per, (index + 1) * per))
        base, extra = divmod(n, count)
        start = index * base + min(index, extra)
        stop = start + base + (1 if index < extra else 0)
        return self.slice(slice(start, stop))

    def map(self, fn: Callable[[Any], Any]) -> MapDataset:
        """Apply ``fn`` to every element."""
        return _MapMapDataset(self, _as_callable(fn, "map"))

    def random_map(
        self, fn: Callable[[Any, np.random.Generator], Any], seed: int | None = None
    ) -> MapDataset:
        """Apply ``fn(element, rng)``; ``rng`` is a Philox generator keyed by (seed, epoch, index).

        >>> ds = MapDataset.range(3).random_map(lambda x, rng: x + rng.integers(100), seed=0)
        >>> list(ds) == list(ds)
        True
        """
        return _RandomMapMapDataset(
            self,
            _as_callable(fn, "random_map", "random_map"),
            self._resolve_seed(seed, "random_map()"),
        )

    def map_with_index(self, fn: Callable[[int, Any], Any]) -> MapDataset:
        """Apply ``fn(index, element)``."""
        return _MapWithIndexMapDataset(self, _as_callable(fn, "map_with_index"))

    def filter(self, predicate: Callable[[Any], bool]) -> MapDataset:
        """Keep elements where ``predicate`` is true; the others read as ``None``."""
        return _FilterMapDataset(self, _as_callable(predicate, "filter", "filter"))

    def batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        batch_fn: Callable[[Sequence[Any]], Any] | None = None,
    ) -> MapDataset:
        """Group consecutive elements into batches (stacked leaf by leaf by default).

        Filtered (``None``) elements are left out of their batch, so batches after a
        ``filter`` can be smaller; filter on an ``IterDataset`` for full batches.

        >>> MapDataset.range(5).batch(2)[2].tolist()
        [4]
        """
        if (
            isinstance(batch_size, bool)
            or not isinstance(batch_size, int | np.integer)
            or batch_size < 1
        ):
            raise ValueError(f"batch(): batch_size must be a positive integer, got {batch_size!r}")
        return _BatchMapDataset(self, int(batch_size), bool(drop_remainder), batch_fn)

    def shard_global_batches(
        self,
        global_batch_size: int,
        shard_index: int,
        shard_count: int,
        batch_fn: Callable | None = None,
    ) -> MapDataset:
        """This process's rows of each global batch: element ``i`` holds the records
        ``i * G + shard_index * G / shard_count ...`` of the parent (``G`` the global batch).

        Every process sees global batch ``i`` at step ``i``, so iterator states agree across
        processes and a run can resume on a different number of hosts (any count that
        divides ``G``) and train on the same global batches. A last partial global batch
        is dropped.

        >>> ds = MapDataset.range(8)
        >>> [b.tolist() for b in ds.shard_global_batches(4, 1, 2)]
        [[2, 3], [6, 7]]
        """
        g, i, c = (operator.index(v) for v in (global_batch_size, shard_index, shard_count))
        if g < 1 or c < 1 or not 0 <= i < c:
            raise ValueError(
                f"shard_global_batches(): need global_batch_size >= 1, shard_count >= 1 and 0 <= "
                f"shard_index < shard_count, got {g}, {i}, {c}"
            )
        if g % c:
            raise ValueError(
                f"shard_global_batches(): global_batch_size {g} is not divisible by shard_count {c}"
            )
        per = g // c
        return _BlockSliceMapDataset(self, g, i * per, per).batch(
            per, drop_remainder=True, batch_fn=batch_fn
        )

    def repeat(self, num_epochs: int | None = None, reseed_each_epoch: bool = True) -> MapDataset:
        """Repeat ``num_epochs`` times (forever if ``None``), reshuffling every epoch.

        >>> list(MapDataset.range(3).repeat(2))
        [0, 1, 2, 0, 1, 2]
        """
        if num_epochs is not None:
            num_epochs = operator.index(num_epochs)
            if num_epochs < 0:
                raise ValueError(f"repeat(): num_epochs must be >= 0 or None, got {num_epochs}")
        return _RepeatMapDataset(self, num_epochs, reseed_each_epoch)

    def to_iter_dataset(
        self, read_options: ReadOptions | None = None, *, debug: bool = False
    ) -> IterDataset:
        """An iterable, checkpointable view of this dataset (``None`` elements skipped).

        ``debug=True`` checks every element's structure against the first one and names
        the first mismatch.
        """
        from cairn.data._iter_dataset import MapRootIterDataset, ReadOptions

        return MapRootIterDataset(self, read_options or ReadOptions(), debug=debug)

    # ---------------------------------------------------------------- rendering
    def _graph_head(self) -> str:
        return f"{self._stage_name()}  [len={_fmt_len(self)}]"


def _fmt_len(ds: MapDataset) -> str:
    n = len(ds)
    return "inf" if n >= sys.maxsize else str(n)


def _as_callable(fn: Any, what: str, method: str = "map") -> Callable:
    """Accept a plain callable or a Grain-style transform object (``.map`` / ``.filter`` ...)."""
    if hasattr(fn, method) and not isinstance(fn, type) and callable(getattr(fn, method)):
        return getattr(fn, method)
    if callable(fn):
        return fn
    raise TypeError(f"{what}() expects a callable, got {type(fn).__name__}")


# ====================================================================== leaves


class _SourceMapDataset(MapDataset):
    def __init__(self, source: Any):
        self._source = source
        self._n = len(source)
        # Sources that skip corrupt records return None for them (read as filtered out).
        self._may_filter = bool(getattr(source, "skip_bad_records", False))
        if isinstance(source, np.ndarray):
            self._read = self._read_array
        elif hasattr(source, "__getitems__"):
            self._read = self._read_batched
        elif isinstance(source, list | tuple):
            self._read = self._read_list
        else:
            self._read = self._read_generic

    def __len__(self) -> int:
        return self._n

    def _read_array(self, idx: np.ndarray) -> list:
        return list(self._source[idx])

    def _read_batched(self, idx: np.ndarray) -> list:
        out = self._source.__getitems__(idx)
        if not isinstance(out, list):
            out = list(out)
        if len(out) != len(idx):
            raise ValueError(
                f"{type(self._source).__name__}.__getitems__ returned {len(out)} records for "
                f"{len(idx)} indices"
            )
        return out

    def _read_list(self, idx: np.ndarray) -> list:
        if len(idx) == 1:
            return [self._source[int(idx[0])]]
        return list(operator.itemgetter(*idx.tolist())(self._source))

    def _read_generic(self, idx: np.ndarray) -> list:
        src = self._source
        return [src[i] for i in idx.tolist()]

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        if indices.size == 0:
            return []
        return self._read(indices)

    def _stage_name(self) -> str:
        return f"source({type(self._source).__name__})"


class _RangeMapDataset(MapDataset):
    def __init__(self, r: range):
        self._range = r

    def __len__(self) -> int:
        return len(self._range)

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        r = self._range
        return (indices * r.step + r.start).tolist()

    def _stage_name(self) -> str:
        r = self._range
        return f"range({r.start}, {r.stop}, {r.step})"


# ====================================================================== one-parent steps


class _Unary(MapDataset):
    def __init__(self, parent: MapDataset):
        if not isinstance(parent, MapDataset):
            raise TypeError(f"expected a MapDataset, got {type(parent).__name__}")
        self._parent = parent
        self._parents = (parent,)
        self._may_filter = parent._may_filter

    def __len__(self) -> int:
        return len(self._parent)


class _SeededUnary(_Unary):
    def __init__(self, parent: MapDataset, seed: int):
        super().__init__(parent)
        self._seed = seed


class _SeedMapDataset(_SeededUnary):
    def _default_seed(self) -> int | None:
        return self._seed

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        return self._parent._getitems(indices, epoch)

    def _stage_name(self) -> str:
        return f"seed({self._seed})"


class _ShuffleMapDataset(_SeededUnary):
    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        return self._parent._getitems(permute(indices, len(self._parent), self._seed, epoch), epoch)

    def _stage_name(self) -> str:
        return f"shuffle(seed={self._seed})"


class _SliceMapDataset(_Unary):
    def __init__(self, parent: MapDataset, sl: slice):
        super().__init__(parent)
        self._range = range(*sl.indices(len(parent)))

    def __len__(self) -> int:
        return len(self._range)

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        r = self._range
        return self._parent._getitems(indices * r.step + r.start, epoch)

    def _stage_name(self) -> str:
        r = self._range
        return f"slice({r.start}:{r.stop}:{r.step})"


class _BlockSliceMapDataset(_Unary):
    """Records ``[start, start + size)`` of every block of ``block`` parent records."""

    def __init__(self, parent: MapDataset, block: int, start: int, size: int):
        super().__init__(parent)
        self._block, self._start, self._size = block, start, size

    def __len__(self) -> int:
        return len(self._parent) // self._block * self._size

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        q, r = np.divmod(indices, self._size)
        return self._parent._getitems(q * self._block + self._start + r, epoch)

    def _stage_name(self) -> str:
        return f"block_slice(block={self._block}, rows={self._start}:{self._start + self._size})"


class _FnUnary(_Unary):
    """A step that calls a user function; its stage is named ``<_verb>(<function name>)``."""

    _verb = ""

    def __init__(self, parent: MapDataset, fn: Callable):
        super().__init__(parent)
        self._fn = fn

    def _stage_name(self) -> str:
        return f"{self._verb}({_fn_name(self._fn)})"


class _MapMapDataset(_FnUnary):
    _verb = "map"

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        values = self._parent._getitems(indices, epoch)
        fn = self._fn
        if self._may_filter:
            return [None if v is None else fn(v) for v in values]
        return list(map(fn, values))


class _MapWithIndexMapDataset(_FnUnary):
    _verb = "map_with_index"

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        values = self._parent._getitems(indices, epoch)
        fn = self._fn
        return [None if v is None else fn(i, v) for i, v in zip(indices.tolist(), values)]


class _RandomMapMapDataset(_FnUnary):
    def __init__(self, parent: MapDataset, fn: Callable, seed: int):
        super().__init__(parent, fn)
        self._seed = seed

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        values = self._parent._getitems(indices, epoch)
        fn, seed = self._fn, self._seed
        return [
            None if v is None else fn(v, _rng_for(seed, epoch, i))
            for i, v in zip(indices.tolist(), values)
        ]

    def _stage_name(self) -> str:
        return f"random_map({_fn_name(self._fn)}, seed={self._seed})"


class _FilterMapDataset(_FnUnary):
    _verb = "filter"

    def __init__(self, parent: MapDataset, predicate: Callable):
        super().__init__(parent, predicate)
        self._may_filter = True

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        values = self._parent._getitems(indices, epoch)
        pred = self._fn
        return [v if v is not None and pred(v) else None for v in values]


class _BatchMapDataset(_Unary):
    def __init__(self, parent: MapDataset, batch_size: int, drop_remainder: bool, batch_fn):
        super().__init__(parent)
        self._bs = batch_size
        self._drop = drop_remainder
        self._batch_fn = batch_fn if batch_fn is not None else stack_records
        self._may_filter = parent._may_filter

    def __len__(self) -> int:
        n = len(self._parent)
        return n // self._bs if self._drop else -(-n // self._bs)

    def _records_per_element(self) -> int:
        return self._bs * self._parent._records_per_element()

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        if indices.size == 0:
            return []
        bs, n = self._bs, len(self._parent)
        starts = indices * bs
        stops = np.minimum(starts + bs, n)
        sizes = stops - starts
        if (sizes == bs).all():
            rec = (starts[:, None] + np.arange(bs)).reshape(-1)
        else:
            rec = np.concatenate([np.arange(a, b) for a, b in zip(starts.tolist(), stops.tolist())])
        values = self._parent._getitems(rec, epoch)
        fn = self._batch_fn
        out = []
        pos = 0
        for size in sizes.tolist():
            group = values[pos : pos + size]
            pos += size
            if self._may_filter:
                group = [v for v in group if v is not None]
                if not group:
                    out.append(None)
                    continue
            out.append(fn(group))
        return out

    def _stage_name(self) -> str:
        extra = ", drop_remainder=True" if self._drop else ""
        if self._batch_fn is not stack_records:
            extra += f", batch_fn={_fn_name(self._batch_fn)}"
        return f"batch({self._bs}{extra})"


class _RepeatMapDataset(_Unary):
    def __init__(self, parent: MapDataset, num_epochs: int | None, reseed: bool):
        super().__init__(parent)
        self._epochs = num_epochs
        self._reseed = reseed
        n = len(parent)
        if n == 0:
            self._len = 0
        elif num_epochs is None:
            self._len = sys.maxsize
        else:
            self._len = n * num_epochs

    def __len__(self) -> int:
        return self._len

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        if indices.size == 0:
            return []
        n = len(self._parent)
        local_epoch, local = np.divmod(indices, n)
        first, last = int(local_epoch[0]), int(local_epoch[-1])
        base = epoch * (self._epochs if self._epochs is not None else 1 << 32)
        if first == last and (local_epoch == first).all():
            return self._parent._getitems(local, base + first if self._reseed else epoch)
        parts = []
        for e in np.unique(local_epoch).tolist():
            pos = np.flatnonzero(local_epoch == e)
            parts.append(
                (pos, self._parent._getitems(local[pos], base + e if self._reseed else epoch))
            )
        return _gather(parts, len(indices))

    def _stage_name(self) -> str:
        return f"repeat({self._epochs if self._epochs is not None else 'None'})"


# ====================================================================== many parents


def _gather(parts: list[tuple[np.ndarray, list]], total: int) -> list:
    """Scatter ``(positions, values)`` parts back into one list of ``total`` values."""
    out: list = [None] * total
    for pos, vals in parts:
        for p, v in zip(pos.tolist(), vals):
            out[p] = v
    return out


class _ManyParents(MapDataset):
    """A step over several ``MapDataset`` inputs; ``what`` names it in error messages."""

    def __init__(self, datasets: list[MapDataset], what: str):
        if not datasets:
            raise ValueError(f"{what}() needs at least one dataset")
        for k, d in enumerate(datasets):
            if not isinstance(d, MapDataset):
                raise TypeError(
                    f"{what}(): input {k} is a {type(d).__name__}, expected a MapDataset"
                )
        self._parents = tuple(datasets)
        self._may_filter = any(d._may_filter for d in datasets)

    def _route(self, which: np.ndarray, local: np.ndarray, epoch: int) -> list:
        """Element ``j`` is element ``local[j]`` of input ``which[j]``: one read per input."""
        parts = []
        for k in np.unique(which).tolist():
            pos = np.flatnonzero(which == k)
            parts.append((pos, self._parents[k]._getitems(local[pos], epoch)))
        if len(parts) == 1:
            return parts[0][1]
        return _gather(parts, len(which))


class _ConcatenateMapDataset(_ManyParents):
    def __init__(self, datasets: list[MapDataset]):
        super().__init__(datasets, "concatenate")
        self._offsets = np.cumsum([0] + [len(d) for d in datasets])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        which = np.searchsorted(self._offsets, indices, side="right") - 1
        return self._route(which, indices - self._offsets[which], epoch)

    def _stage_name(self) -> str:
        return f"concatenate({len(self._parents)} datasets)"


class _MixMapDataset(_ManyParents):
    PERIOD = 1000

    def __init__(self, datasets: list[MapDataset], weights: Sequence[float] | None):
        super().__init__(datasets, "mix")
        self._weights, counts, self._pattern_k, self._pattern_j = mix_pattern(
            weights, len(datasets), self.PERIOD
        )
        self._counts = counts
        length = None
        for k, d in enumerate(datasets):
            c = int(counts[k])
            if c == 0:
                continue
            p, r = divmod(len(d), c)
            pos = int(np.flatnonzero((self._pattern_k == k) & (self._pattern_j == r))[0])
            end = p * self.PERIOD + pos
            length = end if length is None else min(length, end)
        self._len = min(int(length), sys.maxsize)

    def __len__(self) -> int:
        return self._len

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        period, off = np.divmod(indices, self.PERIOD)
        which = self._pattern_k[off]
        local = period * self._counts[which] + self._pattern_j[off]
        return self._route(which, local, epoch)

    def _stage_name(self) -> str:
        return "mix(weights=[" + ", ".join(f"{x:.3g}" for x in self._weights) + "])"


def mix_pattern(
    weights: Sequence[float] | None, n: int, period: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The repeating selection pattern of ``mix`` (shared by MapDataset and IterDataset).

    Returns ``(normalised weights, counts per input, input of each slot, the element
    number within its input of each slot)``; input ``k`` takes ``counts[k]`` of the
    ``period`` slots, its ``j``-th at time ``(j + 0.5) / counts[k]``, merged by time.
    """
    if weights is None:
        weights = [1.0] * n
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,):
        raise ValueError(f"mix(): got {n} datasets but {w.size} weights")
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"mix(): weights must be finite, >= 0 and not all 0, got {list(weights)}")
    w = w / w.sum()
    counts = _largest_remainder(w, period)
    times, ks, js = [], [], []
    for k, c in enumerate(counts.tolist()):
        if c:
            j = np.arange(c)
            times.append((j + 0.5) / c)
            ks.append(np.full(c, k))
            js.append(j)
    t = np.concatenate(times)
    k_all = np.concatenate(ks)
    order = np.lexsort((k_all, t))
    return w, counts, k_all[order], np.concatenate(js)[order]


def _largest_remainder(w: np.ndarray, total: int) -> np.ndarray:
    raw = w * total
    base = np.floor(raw).astype(np.int64)
    rest = total - int(base.sum())
    if rest > 0:
        order = np.argsort(-(raw - base), kind="stable")
        base[order[:rest]] += 1
    # A dataset with a positive weight always appears at least once per period.
    for k in np.flatnonzero((base == 0) & (w > 0)):
        base[k] = 1
        base[int(np.argmax(base))] -= 1
    return base
