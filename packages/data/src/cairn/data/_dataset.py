"""The base classes: ``MapDataset``, ``IterDataset`` and ``DatasetIterator``.

A ``MapDataset`` is lazy and random-access: ``len(ds)``, ``ds[i]`` and, internally,
``_getitems(indices, epoch)``, the elements at a whole NumPy array of indices in one
call. Iteration, batching and worker processes use that batched path, so a shuffled
batch of 64 records costs one vectorised permutation and ONE ``source.__getitems__``
call, never 64 separate reads. ``epoch`` is the repetition number handed down by
``repeat``: ``shuffle`` and the random transformations key their randomness on
``(seed, epoch, index)``, so every element is a pure function of those numbers.

An ``IterDataset`` usually starts from ``MapDataset.to_iter_dataset()``. Per-element
steps (``map``, ``random_map``, ``filter``) applied directly on top of that root are
folded back into the ``MapDataset``, so they stay pure functions of the element index and
run in worker processes; steps that carry state across elements (``batch``, packing,
``prefetch``, ``interleave``) run on iterators. Iterator state is small and JSON-able.

The method sugar (``ds.map(...)``, ``ds.batch(...)``, ...) builds the transformation
classes of ``cairn.data._transforms`` (one module per step), which subclass the classes
here. That is the package's one import cycle: each sugar method imports its
transformation when called, on a line labelled ``import cycle (labelled)``.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from cairn.data._arguments import (
    FilterFn,
    MapFn,
    RandomMapFn,
    as_callable,
    check_seed,
    int_at_least,
)
from cairn.data._stats import IteratorStats, format_summary, profiled
from cairn.data._tree import StructureChecker, stack_records

__all__ = ["DatasetIterator", "IterDataset", "MapDataset", "ReadOptions"]

T = TypeVar("T")


def _as_parents(parents: Any, kind: type | tuple[type, ...]) -> tuple:
    """``parents`` (one dataset or a sequence of them) as a tuple, each checked to be ``kind``."""
    names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
    try:
        out = (parents,) if isinstance(parents, kind) else tuple(parents)
    except TypeError:
        raise TypeError(f"parents must be a {names} or a sequence of them, got {type(parents).__name__}") from None
    for k, p in enumerate(out):
        if not isinstance(p, kind):
            raise TypeError(f"parents[{k}] is a {type(p).__name__}, expected a {names}")
    return out


class _Pipeline:
    """What ``MapDataset`` and ``IterDataset`` share: ``pipe``, ``apply`` and the text rendering."""

    _parents: tuple  # the input stages; subclasses set them

    def _stage_name(self) -> str:
        return type(self).__name__

    def pipe(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(self, *args, **kwargs)``: lets custom steps chain fluently.

        Args:
          fn: called as ``fn(self, *args, **kwargs)``.
          args: more positional arguments for ``fn``.
          kwargs: keyword arguments for ``fn``.
        """
        return fn(self, *args, **kwargs)

    def apply(self, transformations: Any) -> Any:
        """Apply Grain transform objects (one or a sequence) as the matching steps; see
        ``cairn.data.experimental.apply_transformations``.

        Args:
          transformations: one Grain-style transform object (``MapTransform``, ``Batch``...) or a
            sequence of them.

        Returns:
          the dataset with the matching steps appended.
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.apply import apply_transformations

        return apply_transformations(self, transformations)  # type: ignore[arg-type]

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


class MapDataset(_Pipeline, Generic[T]):
    """A lazy dataset with random access: ``len(ds)``, ``ds[i]``, ``ds[a:b]``.

    Build one with :meth:`source` or :meth:`range` and chain transformations; nothing is
    read until an element is asked for. Filtered-out elements read as ``None``;
    iteration (:meth:`to_iter_dataset`) skips them. ``MapDataset[int]`` annotates the
    element type, as in Grain.

    A custom step subclasses it as in Grain: call ``super().__init__(parents)`` and
    define ``__len__`` and ``__getitem__`` (an index past ``len`` reads the next epoch);
    the batched reads then call that ``__getitem__`` once per index.

    >>> ds = MapDataset.range(10).shuffle(seed=1).map(lambda x: x * 10).batch(4)
    >>> len(ds), sorted(np.concatenate(list(ds)).tolist()) == list(range(0, 100, 10))
    (3, True)
    >>> import cairn.data as grain
    >>> class Twice(grain.MapDataset[int]):
    ...     def __init__(self, parent):
    ...         super().__init__(parent)
    ...     def __len__(self):
    ...         return len(self._parent)
    ...     def __getitem__(self, index):
    ...         return 2 * self._parent[index]
    >>> ds = Twice(grain.MapDataset.range(3))
    >>> list(ds), ds[4], ds.batch(2)[1].tolist()
    ([0, 2, 4], 2, [4])
    """

    _parents: tuple[MapDataset, ...] = ()
    _may_filter = False

    def __init__(self, parents: MapDataset | Sequence[MapDataset] = ()) -> None:
        """A step over ``parents`` (one dataset or a sequence; none for a source).

        Args:
          parents: one ``MapDataset`` or a sequence of them (none for a source).

        Raises:
          TypeError: if a parent is not a ``MapDataset``.
        """
        self._parents = _as_parents(parents, MapDataset)
        if len(self._parents) == 1:
            self._parent = self._parents[0]
        self._may_filter = any(p._may_filter for p in self._parents)

    @property
    def parents(self) -> Sequence[MapDataset]:
        """The input datasets of this step (empty for a source)."""
        return self._parents

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        f = cls.__dict__.get("_getitems")
        if f is None and "__getitem__" in cls.__dict__:
            f = _items_via_getitem  # a Grain-style step: __getitem__ is its batched read too
        if f is not None and not getattr(f, "_profiled", False):
            cls._getitems = profiled(f)  # type: ignore[method-assign]

    # --- construction ---
    @staticmethod
    def source(source: Any) -> MapDataset:
        """A dataset over any random-access source (``__len__`` + ``__getitem__``).

        Sources with ``__getitems__(indices)`` are read one call per batch of indices;
        lists, tuples and NumPy arrays work directly.

        Args:
          source: a random-access source (``__len__`` and ``__getitem__``, optionally
            ``__getitems__``); a ``MapDataset`` is returned as is.

        >>> MapDataset.source(["a", "b", "c"])[1]
        'b'

        Raises:
          TypeError: ``source`` has no ``__len__``/``__getitem__``.
        """
        if isinstance(source, MapDataset):
            return source
        if not hasattr(source, "__len__") or not hasattr(source, "__getitem__"):
            raise TypeError(
                "MapDataset.source needs a random-access source with __len__ and "
                f"__getitem__ (optionally __getitems__), got {type(source).__name__}"
            )
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.source import SourceMapDataset

        return SourceMapDataset(source)

    @staticmethod
    def range(start: int, stop: int | None = None, step: int = 1) -> MapDataset:
        """The integers of ``range(start, stop, step)`` as a dataset.

        Args:
          start: the first integer (or the stop when ``stop`` is None, as for ``range``).
          stop: the end (exclusive); None makes ``start`` the end and 0 the start.
          step: the increment (nonzero).

        >>> list(MapDataset.range(2, 8, 3))
        [2, 5]
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.source import RangeMapDataset

        return RangeMapDataset(range(start, stop, step) if stop is not None else range(start))

    @staticmethod
    def mix(datasets: Sequence[MapDataset], weights: Sequence[float] | None = None) -> MapDataset:
        """Interleave datasets deterministically in proportion to ``weights``.

        The pattern repeats every ``period`` (1000) elements and gives dataset ``k``
        ``round(weights[k] / sum(weights) * 1000)`` of them, spread evenly. The mixture
        ends just before the first dataset would run out (repeat the inputs first for an
        endless mixture).

        Args:
          datasets: the ``MapDataset`` s to mix.
          weights: relative weights, one per dataset; None weighs them equally.

        >>> ds = MapDataset.mix([MapDataset.range(0, 100), MapDataset.range(100, 200)], [3, 1])
        >>> [x for x in ds][:8]
        [0, 1, 100, 2, 3, 4, 101, 5]
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.mix import MixMapDataset

        return MixMapDataset(list(datasets), weights)

    @staticmethod
    def select_from_datasets(datasets: Sequence[MapDataset], selection_map: Any) -> MapDataset:
        """Element ``i`` is element ``j`` of ``datasets[k]``, where ``(k, j) = selection_map[i]``.

        A more general mixture than :meth:`mix`; the length is ``len(selection_map)``.

        Args:
          datasets: the inputs.
          selection_map: a ``DatasetSelectionMap`` (``__len__`` and ``__getitem__``
            returning ``(dataset_index, index_in_dataset)``).

        Raises:
          TypeError: for a selection map without ``__len__`` / ``__getitem__`` or an input
            that is not a ``MapDataset``.
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.select import SelectMapDataset

        return SelectMapDataset(datasets, selection_map)

    @staticmethod
    def concatenate(datasets: Sequence[MapDataset]) -> MapDataset:
        """The datasets one after another.

        Args:
          datasets: the ``MapDataset`` s to join, in order.

        >>> list(MapDataset.concatenate([MapDataset.range(2), MapDataset.range(5, 7)]))
        [0, 1, 5, 6]
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.concatenate import ConcatenateMapDataset

        return ConcatenateMapDataset(list(datasets))

    # --- access ---
    def __len__(self) -> int:
        raise NotImplementedError

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        """Elements at ``indices`` (int64 array of in-range, non-negative indices)."""
        raise NotImplementedError

    def _records_per_element(self) -> int:
        return self._parents[0]._records_per_element() if self._parents else 1

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
        if n == 0 or j < 0:
            raise IndexError(f"index {i} is out of range for {self._stage_name()} of length {n}")
        # As in Grain, an index past the end reads the next epoch (reshuffled, new randomness).
        epoch, j = divmod(j, n)
        return self._getitems(np.array([j], np.int64), epoch)[0]

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

    # --- transformations ---
    def seed(self, seed: int) -> MapDataset:
        """Set the default seed of the ``shuffle`` / ``random_map`` steps that follow.

        Args:
          seed: any int (negative seeds are taken modulo ``2**64``).

        Raises:
          TypeError: for a bool or a non-integer seed.

        >>> ds = MapDataset.range(5).seed(7)
        >>> list(ds.shuffle()) == list(MapDataset.range(5).shuffle(seed=7))
        True
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.seed import SeedMapDataset

        return SeedMapDataset(self, check_seed(seed, "seed()"))

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
        return check_seed(seed, what)

    def shuffle(self, seed: int | None = None) -> MapDataset:
        """A global shuffle: element ``i`` is ``parent[perm(seed, epoch)(i)]``.

        The permutation is a pure function of ``(seed, epoch)``, uses O(1) memory and is
        computed for a whole array of indices at once. Each repetition of ``repeat``
        gets a new permutation. Any int is a valid seed; negative seeds are taken
        modulo ``2**64``.

        Args:
          seed: any int; None uses the one set by :meth:`seed` upstream.

        >>> sorted(MapDataset.range(5).shuffle(seed=7)) == [0, 1, 2, 3, 4]
        True
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.shuffle import ShuffleMapDataset

        return ShuffleMapDataset(self, self._resolve_seed(seed, "shuffle()"))

    def slice(self, sl: slice) -> MapDataset:
        """The elements ``ds[sl]``, with Python's slice semantics (negative bounds and steps).

        Args:
          sl: a ``slice`` (start, stop and step may be negative or None).

        Raises:
          TypeError: if ``sl`` is not a ``slice``.

        >>> list(MapDataset.range(6).slice(slice(1, None, 2)))
        [1, 3, 5]
        """
        if not isinstance(sl, slice):
            raise TypeError(f"slice() expects a slice object, got {type(sl).__name__}")
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.slice import SliceMapDataset

        return SliceMapDataset(self, sl)

    def shard(self, index: int, count: int, drop_remainder: bool = False) -> MapDataset:
        """Shard ``index`` of ``count`` contiguous, near-equal shards.

        The first ``len % count`` shards get one extra element unless
        ``drop_remainder``; with more shards than elements some shards are empty.

        Args:
          index: this shard's index, in ``[0, count)``.
          count: the number of shards, >= 1.
          drop_remainder: give every shard ``len // count`` elements (the rest is dropped).

        >>> [list(MapDataset.range(5).shard(i, 2)) for i in range(2)]
        [[0, 1, 2], [3, 4]]

        Raises:
          ValueError: ``count < 1`` or ``index`` out of range.
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

    def map(self, fn: MapFn) -> MapDataset:
        """Element ``i`` becomes ``fn(self[i])`` (filtered ``None`` elements stay ``None``).

        Args:
          fn: a function of one element, or an object with a ``.map`` method (Grain's
            ``MapTransform``).

        Raises:
          TypeError: if ``fn`` is neither callable nor has a ``.map`` method.

        >>> list(MapDataset.range(3).map(lambda x: x * 10))
        [0, 10, 20]
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.map import MapMapDataset

        return MapMapDataset(self, as_callable(fn, "map"))

    def random_map(self, fn: RandomMapFn, seed: int | None = None) -> MapDataset:
        """Apply ``fn(element, rng)``; ``rng`` is a Philox generator keyed by (seed, epoch, index).

        Args:
          fn: ``fn(element, rng) -> element`` with ``rng`` a ``numpy.random.Generator``, or an
            object with a ``.random_map`` method.
          seed: the int seed; None uses the one set by :meth:`seed` upstream, else 0.

        >>> ds = MapDataset.range(3).random_map(lambda x, rng: x + rng.integers(100), seed=0)
        >>> list(ds) == list(ds)
        True
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.map import RandomMapMapDataset

        return RandomMapMapDataset(
            self,
            as_callable(fn, "random_map", "random_map"),
            self._resolve_seed(seed, "random_map()"),
        )

    def map_with_index(self, fn: Callable[[int, Any], Any]) -> MapDataset:
        """Element ``i`` becomes ``fn(i, self[i])``.

        Args:
          fn: ``fn(index, element) -> element``, or an object with a ``.map_with_index`` method.

        Raises:
          TypeError: if ``fn`` is not callable.

        >>> list(MapDataset.source(["a", "b"]).map_with_index(lambda i, x: f"{i}{x}"))
        ['0a', '1b']
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.map import MapWithIndexMapDataset

        return MapWithIndexMapDataset(self, as_callable(fn, "map_with_index", "map_with_index"))

    def filter(self, predicate: FilterFn) -> MapDataset:
        """Keep elements where ``predicate`` is true; the others read as ``None``.

        The length is unchanged (random access stays O(1)); iteration skips the ``None``
        elements.

        Args:
          predicate: a function of one element returning a bool, or an object with a
            ``.filter`` method (Grain's ``FilterTransform``).

        Raises:
          TypeError: if ``predicate`` is neither callable nor has a ``.filter`` method.

        >>> ds = MapDataset.range(5).filter(lambda x: x % 2 == 0)
        >>> len(ds), ds[1], list(ds)
        (5, None, [0, 2, 4])
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.filter import FilterMapDataset

        return FilterMapDataset(self, as_callable(predicate, "filter", "filter"))

    def batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        batch_fn: Callable[[Sequence[Any]], Any] | None = None,
    ) -> MapDataset:
        """Group consecutive elements into batches (stacked leaf by leaf by default).

        Filtered (``None``) elements are left out of their batch, so batches after a
        ``filter`` can be smaller; filter on an ``IterDataset`` for full batches.

        Args:
          batch_size: elements per batch, >= 1.
          drop_remainder: drop a last batch smaller than ``batch_size``.
          batch_fn: ``fn(list of elements) -> batch``; None stacks leaf by leaf with NumPy.

        >>> MapDataset.range(5).batch(2)[2].tolist()
        [4]
        """
        if (
            isinstance(batch_size, bool)
            or not isinstance(batch_size, int | np.integer)
            or batch_size < 1
        ):
            raise ValueError(f"batch(): batch_size must be a positive integer, got {batch_size!r}")
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.batch import BatchMapDataset

        return BatchMapDataset(self, int(batch_size), bool(drop_remainder), batch_fn)

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

        Args:
          global_batch_size: :math:`G`, the rows of one global batch (all processes together).
          shard_index: this process's index, in ``[0, shard_count)``.
          shard_count: the number of processes; must divide ``global_batch_size``.
          batch_fn: ``fn(list of elements) -> batch``; None stacks leaf by leaf.

        >>> ds = MapDataset.range(8)
        >>> [b.tolist() for b in ds.shard_global_batches(4, 1, 2)]
        [[2, 3], [6, 7]]

        Raises:
          ValueError: sizes out of range, or ``global_batch_size`` not divisible by ``shard_count``.
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
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.slice import BlockSliceMapDataset

        return BlockSliceMapDataset(self, g, i * per, per).batch(
            per, drop_remainder=True, batch_fn=batch_fn
        )

    def repeat(self, num_epochs: int | None = None, reseed_each_epoch: bool = True) -> MapDataset:
        """Repeat ``num_epochs`` times (forever if ``None``), reshuffling every epoch.

        Args:
          num_epochs: how many repetitions, >= 0; None repeats forever.
          reseed_each_epoch: give each repetition its own epoch number, so ``shuffle`` and
            ``random_map`` differ per epoch; False repeats the same order.

        >>> list(MapDataset.range(3).repeat(2))
        [0, 1, 2, 0, 1, 2]

        Raises:
          ValueError: a negative ``num_epochs``.
        """
        if num_epochs is not None:
            num_epochs = operator.index(num_epochs)
            if num_epochs < 0:
                raise ValueError(f"repeat(): num_epochs must be >= 0 or None, got {num_epochs}")
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.repeat import RepeatMapDataset

        return RepeatMapDataset(self, num_epochs, reseed_each_epoch)

    def to_iter_dataset(
        self, read_options: ReadOptions | None = None, *, allow_nones: bool = False, debug: bool = False
    ) -> IterDataset:
        """An iterable, checkpointable view of this dataset (``None`` elements skipped).

        Args:
          read_options: how the elements are read (threads, chunk size); default
            ``ReadOptions()``.
          allow_nones: also yield the ``None`` elements (filtered out ones) instead of
            skipping them.
          debug: check every element's structure against the first one and name the
            first mismatch (``StructureMismatchError``).

        Raises:
          TypeError: if ``read_options`` is not a ``ReadOptions``.

        >>> it = iter(MapDataset.range(4).to_iter_dataset())
        >>> next(it), it.get_state()
        (0, {'version': 1, 'next_index': 1})
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.to_iter import MapRootIterDataset

        return MapRootIterDataset(self, read_options or ReadOptions(), debug=debug, allow_nones=allow_nones)

    # --- rendering ---
    def _graph_head(self) -> str:
        return f"{self._stage_name()}  [len={_fmt_len(self)}]"


def _items_via_getitem(self: MapDataset, indices: np.ndarray, epoch: int) -> list:
    """The batched read of a subclass that defines only ``__getitem__`` (Grain's protocol:
    index ``epoch * len + i`` is element ``i`` of that epoch)."""
    if indices.size == 0:
        return []
    offset = epoch * len(self)
    return [self[i + offset] for i in indices.tolist()]


def _iter_via_dunder(self: IterDataset, root_factory: Callable | None) -> DatasetIterator:
    """The iterator of a Grain-style ``IterDataset`` subclass that defines ``__iter__``."""
    return self.__iter__()


def _fmt_len(ds: MapDataset) -> str:
    n = len(ds)
    return "inf" if n >= sys.maxsize else str(n)


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How a ``MapDataset`` is read when iterated.

    Args:
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
            if not int_at_least(v, lo):
                raise ValueError(f"ReadOptions.{name} must be an int >= {lo}, got {v!r}")


# --- iterators ---


class DatasetIterator(Generic[T]):
    """Base of every iterator: ``next``, ``get_state``/``set_state``, ``summary``, ``close``.

    A custom iterator subclasses it as in Grain: ``super().__init__(parent)`` and define
    ``__next__``, ``get_state`` and ``set_state``.
    """

    _checker: StructureChecker | None = None

    def __init__(
        self,
        parents: DatasetIterator | Sequence[DatasetIterator] = (),
        name: str | None = None,
        debug: bool = False,
    ) -> None:
        """An iterator over ``parents`` (one iterator or a sequence); ``name`` labels it
        in ``summary()`` (default: the class name).

        Args:
          parents: the input iterator, or a sequence of them (none for a source iterator).
          name: the label in ``summary()``; None uses the class name.
          debug: check that every element has the structure of the first one seen.
        """
        self._parents = (parents,) if isinstance(parents, DatasetIterator) else tuple(parents)
        if len(self._parents) == 1:
            self._parent = self._parents[0]
        name = type(self).__name__ if name is None else name
        self._stats = IteratorStats(name)
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
        """A small JSON-able dict; ``set_state`` of it resumes exactly here.

        Every state carries ``"version"``; the rest is the stage's own fields (the
        root's ``next_index``, a step's counters) and its inputs' states, nested.
        """
        raise NotImplementedError

    def set_state(self, state: dict) -> None:
        """Resume at ``state`` (from ``get_state``, possibly of another iterator of the
        same pipeline, with any number of workers).

        Args:
          state: a dict from ``get_state()``.

        Raises:
          ValueError: (``StateError``) for a state this iterator cannot take, naming the
            field's path in the nested state and what was expected; the iterator is
            left unchanged.
        """
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
        return format_summary(rows, self._summary_extra())

    def _summary_extra(self) -> list[str]:
        out = []
        for p in self._parents:
            out.extend(p._summary_extra())
        return out


class IterDataset(_Pipeline, Generic[T]):
    """A sequential dataset; ``iter(ds)`` gives a checkpointable :class:`DatasetIterator`.

    ``IterDataset[int]`` annotates the element type. A custom step subclasses it as in
    Grain: ``super().__init__(parents)`` and define ``__iter__`` returning a
    ``DatasetIterator``.
    """

    _parents: tuple[IterDataset, ...] = ()

    def __init__(self, parents: Any = ()) -> None:
        """A step over ``parents``: one ``IterDataset`` or ``MapDataset``, or a sequence.

        Args:
          parents: one ``IterDataset`` or ``MapDataset``, or a sequence of them (none for a source).

        Raises:
          TypeError: if a parent is neither.
        """
        self._parents = _as_parents(parents, (IterDataset, MapDataset))
        if len(self._parents) == 1:
            self._parent = self._parents[0]

    @property
    def parents(self) -> Sequence[Any]:
        """The input datasets of this step (empty for a source)."""
        return self._parents

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__iter__" in cls.__dict__ and "_make_iter" not in cls.__dict__:
            cls._make_iter = _iter_via_dunder  # type: ignore[method-assign]

    def __iter__(self) -> DatasetIterator:
        return self._make_iter(None)

    def _make_iter(self, root_factory: Callable | None) -> DatasetIterator:
        raise NotImplementedError

    @property
    def _debug(self) -> bool:
        return any(getattr(p, "_debug", False) for p in self._parents)

    def _default_seed(self) -> int | None:
        for p in self._parents:
            s = p._default_seed()
            if s is not None:
                return s
        return None

    def seed(self, seed: int) -> IterDataset:
        """Set the default seed of the ``random_map`` steps that follow (as ``MapDataset.seed``).

        Args:
          seed: an int (not a bool); any int is valid.

        Raises:
          TypeError: for a bool or a non-integer seed.

        >>> from cairn.data import MapDataset
        >>> ds = MapDataset.range(4).to_iter_dataset().seed(5)
        >>> noisy = lambda x, rng: int(rng.integers(1000))
        >>> list(ds.random_map(noisy)) == list(ds.random_map(noisy, seed=5))
        True
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.seed import SeedIterDataset

        return SeedIterDataset(self, check_seed(seed, "seed()"))

    def map_with_index(self, fn: Callable[[int, Any], Any]) -> IterDataset:
        """Element number ``k`` (counted from 0 in output order) becomes ``fn(k, element)``.

        The count is part of the iterator state, so a restored iterator goes on counting.

        Args:
          fn: ``fn(k, element) -> element``, or an object with a ``.map_with_index`` method.

        Raises:
          TypeError: if ``fn`` is neither callable nor has a ``.map_with_index`` method.

        >>> from cairn.data import MapDataset
        >>> ds = MapDataset.range(10).to_iter_dataset().filter(lambda x: x % 3 == 0)
        >>> list(ds.map_with_index(lambda k, x: (k, x)))
        [(0, 0), (1, 3), (2, 6), (3, 9)]
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.map import MapWithIndexIterDataset

        return MapWithIndexIterDataset(self, as_callable(fn, "map_with_index", "map_with_index"))

    # --- steps ---
    def map(self, fn: MapFn) -> IterDataset:
        """Apply ``fn`` to every element (a function, or an object with ``.map``).

        Directly on ``to_iter_dataset()`` it folds into the ``MapDataset`` (and runs in
        worker processes).

        Args:
          fn: ``fn(element) -> element``, or an object with a ``.map`` method.

        >>> list(MapDataset.range(3).to_iter_dataset().batch(2).map(lambda b: b.tolist()))
        [[0, 1], [2]]
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.map import MapIterDataset

        return MapIterDataset(self, as_callable(fn, "map"))

    def random_map(self, fn: RandomMapFn, seed: int | None = None) -> IterDataset:
        """Apply ``fn(element, rng)``; ``rng`` is a Philox generator keyed by
        ``(seed, element number)``, so a restored iterator draws the same numbers.
        Without ``seed``, the one set by ``.seed(...)`` upstream is used, else 0.

        Args:
          fn: ``fn(element, rng) -> element`` with ``rng`` a ``numpy.random.Generator``, or an
            object with a ``.random_map`` method.
          seed: the int seed; None uses the one set by ``.seed(...)`` upstream, else 0.

        Raises:
          TypeError: for a non-callable ``fn`` or a non-integer ``seed``.

        >>> ds = MapDataset.range(4).to_iter_dataset().batch(2)
        >>> noisy = ds.random_map(lambda b, rng: b + rng.integers(10), seed=3)
        >>> [b.tolist() for b in noisy] == [b.tolist() for b in noisy]
        True
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.map import RandomMapIterDataset

        if seed is None:
            seed = self._default_seed() or 0
        return RandomMapIterDataset(
            self, as_callable(fn, "random_map", "random_map"), check_seed(seed, "random_map()")
        )

    def filter(self, predicate: FilterFn) -> IterDataset:
        """Keep the elements where ``predicate`` is true (a function, or an object with
        ``.filter``); unlike ``MapDataset.filter``, a ``batch`` after it gets full batches.

        Args:
          predicate: ``predicate(element) -> bool``, or an object with a ``.filter`` method.

        >>> ds = MapDataset.range(10).to_iter_dataset().batch(3).filter(lambda b: b[0] % 2)
        >>> [b.tolist() for b in ds]
        [[3, 4, 5], [9]]
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.filter import FilterIterDataset

        return FilterIterDataset(self, as_callable(predicate, "filter", "filter"))

    def batch(
        self, batch_size: int, drop_remainder: bool = False, batch_fn: Callable | None = None
    ) -> IterDataset:
        """Group ``batch_size`` consecutive elements (stacked leaf by leaf by default).

        Args:
          batch_size: elements per batch, an int >= 1.
          drop_remainder: drop a last, shorter batch.
          batch_fn: builds a batch from a list of elements (default ``stack_records``).

        Raises:
          ValueError: for a ``batch_size`` that is not a positive integer.

        >>> it = MapDataset.range(5).to_iter_dataset().filter(lambda x: x != 1).batch(2)
        >>> [b.tolist() for b in it]
        [[0, 2], [3, 4]]
        """
        if (
            isinstance(batch_size, bool)
            or not isinstance(batch_size, int | np.integer)
            or batch_size < 1
        ):
            raise ValueError(f"batch(): batch_size must be a positive integer, got {batch_size!r}")
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.batch import BatchIterDataset

        return BatchIterDataset(
            self, int(batch_size), bool(drop_remainder), batch_fn or stack_records
        )

    def prefetch(self, buffer_size: int = 2) -> IterDataset:
        """Compute up to ``buffer_size`` elements ahead in a background thread.

        Errors reach the consumer at the element that raised; the state is that of the
        last element handed out.

        Args:
          buffer_size: how many elements may be computed ahead, >= 1.

        Raises:
          ValueError: for a ``buffer_size`` that is not a positive int.

        >>> list(MapDataset.range(3).to_iter_dataset().prefetch(2))
        [0, 1, 2]
        """
        if not int_at_least(buffer_size, 1):
            raise ValueError(f"prefetch(): buffer_size must be a positive int, got {buffer_size!r}")
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.prefetch import PrefetchIterDataset

        return PrefetchIterDataset(self, buffer_size)

    def mp_prefetch(
        self, options: Any = None, worker_init_fn: Callable[[int, int], None] | None = None
    ) -> IterDataset:
        """Compute the ``MapDataset`` part of the pipeline in worker processes.

        Workers compute deterministic chunks of the global element order; the main
        process puts them back in order, so the output and the iterator state are the
        same for every worker count, including 0.

        Args:
          options: a :class:`MultiprocessingOptions` or an int (``num_workers``);
            default 2 workers. 0 workers returns the pipeline unchanged.
          worker_init_fn: called as ``worker_init_fn(worker_index, num_workers)`` in
            each worker before it computes anything.

        Raises:
          TypeError: for ``options`` of another type.
          ValueError: for a pipeline that does not start with ``to_iter_dataset()`` or
            has a step with several inputs below this one, and for
            ``start_method="fork"`` with a source that is not fork-safe.
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._multiprocessing import (
            MPPrefetchIterDataset,
            MultiprocessingOptions,
        )

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
        """Round-robin over ``cycle_length`` datasets at a time (see InterleaveIterDataset).

        Args:
          datasets: the input datasets (``IterDataset`` or ``MapDataset``), opened in order.
          cycle_length: how many are open at a time; None opens all of them.
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.interleave import InterleaveIterDataset

        return InterleaveIterDataset(datasets, cycle_length)

    @staticmethod
    def mix(datasets: Sequence[IterDataset], weights: Sequence[float] | None = None) -> IterDataset:
        """Interleave iterators deterministically in proportion to ``weights``.

        The same pattern as :meth:`MapDataset.mix` (it repeats every 1000 elements and
        gives input ``k`` ``round(weights[k] / sum(weights) * 1000)`` of them, spread
        evenly), drawn from iterators, so inputs may filter, batch or pack. The mixture
        ends when the input whose turn it is runs out. The state is the position in the
        pattern plus every input's state.

        Args:
          datasets: the input datasets.
          weights: relative weights, one per dataset (non-negative, not all 0); None weighs them
            equally.

        >>> from cairn.data import IterDataset, MapDataset
        >>> a = MapDataset.range(0, 100).to_iter_dataset()
        >>> b = MapDataset.range(100, 200).filter(lambda x: x % 2 == 0).to_iter_dataset()
        >>> list(IterDataset.mix([a, b], [3, 1]))[:8]
        [0, 1, 100, 2, 3, 4, 102, 5]
        """
        # import cycle (labelled): base classes <-> transformations, by design
        from cairn.data._transforms.mix import MixIterDataset

        return MixIterDataset(datasets, weights)

    def __repr__(self) -> str:
        return self.graph()
