"""``DataLoader`` + ``IndexSampler`` + transform classes, for users of Grain's older API."""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from cairn.data._dataset import DatasetIterator, IterDataset, MapDataset, ReadOptions
from cairn.data._multiprocessing import MultiprocessingOptions
from cairn.data._sharding import NoSharding, ShardOptions

__all__ = [
    "DataLoader",
    "IndexSampler",
    "MapTransform",
    "RandomMapTransform",
    "FilterTransform",
    "Batch",
    "RecordMetadata",
    "Sampler",
    "SequentialSampler",
]


@runtime_checkable
class Sampler(Protocol):
    """What ``DataLoader`` reads a record order from (Grain's protocol): indexing by global
    step gives that step's ``RecordMetadata``. ``IndexSampler`` and ``SequentialSampler`` are
    samplers; ``isinstance(x, Sampler)`` checks for ``__getitem__``."""

    def __getitem__(self, index: int) -> RecordMetadata: ...


class MapTransform(abc.ABC):
    """Subclass and define ``map(self, element)``."""

    @abc.abstractmethod
    def map(self, element: Any) -> Any:
        """The transformed element.

        Args:
          element: one element of the pipeline.
        """


class RandomMapTransform(abc.ABC):
    """Subclass and define ``random_map(self, element, rng: np.random.Generator)``."""

    @abc.abstractmethod
    def random_map(self, element: Any, rng: np.random.Generator) -> Any:
        """The transformed element, drawing any randomness from ``rng``.

        Args:
          element: one element of the pipeline.
          rng: a ``numpy.random.Generator`` keyed by the seed and the element's position.
        """


class FilterTransform(abc.ABC):
    """Subclass and define ``filter(self, element) -> bool``."""

    @abc.abstractmethod
    def filter(self, element: Any) -> bool:
        """Whether to keep ``element``.

        Args:
          element: one element of the pipeline.
        """


@dataclasses.dataclass(frozen=True)
class Batch:
    """Stack ``batch_size`` consecutive elements (leaf by leaf, or with ``batch_fn``).

    Args:
      batch_size: elements per batch, >= 1.
      drop_remainder: drop a last batch smaller than ``batch_size``.
      batch_fn: ``fn(list of elements) -> batch``; None stacks leaf by leaf with NumPy.
    """

    batch_size: int
    drop_remainder: bool = False
    batch_fn: Any = None


@dataclasses.dataclass(frozen=True)
class RecordMetadata:
    """One step of a sampler: position ``index`` reads record ``record_key``; ``rng`` is a
    generator keyed by ``seed + index`` when the sampler has a seed (else ``None``).

    Args:
      index: the position in the sampler's order (0, 1, 2...).
      record_key: the index of the record read at that position.
      rng: a ``numpy.random.Generator`` keyed by ``seed + index``, or None without a seed.
    """

    index: int
    record_key: int | None = None
    rng: np.random.Generator | None = None


def _record_metadata(index: int, record_key: int, seed: int | None) -> RecordMetadata:
    rng = None if seed is None else np.random.Generator(np.random.Philox(key=seed + index))
    return RecordMetadata(index=index, record_key=record_key, rng=rng)


def _check_position(index: Any, n: int, who: str) -> int:
    if isinstance(index, bool) or not isinstance(index, int | np.integer):
        raise TypeError(f"{who} indices must be integers, got {type(index).__name__}")
    if not 0 <= int(index) < n:
        raise IndexError(f"{who}: index {int(index)} is out of range [0, {n})")
    return int(index)


@dataclasses.dataclass(frozen=True)
class IndexSampler:
    """Which record indices to read, in which order, for how many epochs.

    The records of this process's shard (``shard_options``) are read ``num_epochs`` times
    (forever if ``None``), shuffled with a new permutation every epoch when ``shuffle``.

    Args:
      num_records: how many records the source has (the first ``num_records`` are read), >= 0.
      shard_options: which shard this process reads (default: no sharding).
      shuffle: shuffle with a new permutation every epoch.
      num_epochs: how many times to read the records; None reads forever.
      seed: the shuffle seed (and the base seed of random operations); None means 0.
    """

    num_records: int
    shard_options: ShardOptions = dataclasses.field(default_factory=NoSharding)
    shuffle: bool = False
    num_epochs: int | None = 1
    seed: int | None = None

    def __post_init__(self):
        if (
            isinstance(self.num_records, bool)
            or not isinstance(self.num_records, int)
            or self.num_records < 0
        ):
            raise ValueError(
                f"IndexSampler.num_records must be an int >= 0, got {self.num_records!r}"
            )
        if self.shuffle and self.seed is None:
            raise ValueError("IndexSampler(shuffle=True) needs a seed")
        if self.num_epochs is not None and (
            not isinstance(self.num_epochs, int) or self.num_epochs < 0
        ):
            raise ValueError(
                f"IndexSampler.num_epochs must be an int >= 0 or None, got {self.num_epochs!r}"
            )

    @functools.cached_property
    def _order(self) -> MapDataset:
        """Record keys in reading order: the same steps ``DataLoader`` applies to the source."""
        s = self.shard_options
        ds = MapDataset.range(self.num_records).shard(s.shard_index, s.shard_count, s.drop_remainder)
        if self.shuffle:
            ds = ds.shuffle(seed=self.seed)
        return ds.repeat(self.num_epochs) if self.num_epochs != 1 else ds

    def __len__(self) -> int:
        """Steps in all epochs of this shard (``sys.maxsize`` when endless)."""
        return len(self._order)

    def __getitem__(self, index: int) -> RecordMetadata:
        """The record to read at step ``index``.

        Raises:
          IndexError: for ``index`` outside ``[0, len(self))``.
        """
        i = _check_position(index, len(self), "IndexSampler")
        return _record_metadata(i, int(self._order[i]), self.seed)

    def __iter__(self) -> Iterator[RecordMetadata]:
        """Every step in order (endless when ``num_epochs`` is ``None``).

        >>> [m.record_key for m in IndexSampler(3, num_epochs=2)]
        [0, 1, 2, 0, 1, 2]
        """
        for i in range(len(self)):
            yield self[i]


@dataclasses.dataclass(frozen=True)
class SequentialSampler:
    """Records ``0 .. num_records-1`` of this shard, once, in order (Grain's name).

    Args:
      num_records: how many records the source has.
      shard_options: which shard this process reads (default: no sharding).
      seed: the seed of the ``rng`` in each :class:`RecordMetadata`; None gives no ``rng``.
    """

    num_records: int
    shard_options: ShardOptions = dataclasses.field(default_factory=NoSharding)
    seed: int | None = None

    @functools.cached_property
    def _order(self) -> MapDataset:
        s = self.shard_options
        return MapDataset.range(self.num_records).shard(s.shard_index, s.shard_count, s.drop_remainder)

    def __len__(self) -> int:
        """Records in this shard."""
        return len(self._order)

    def __getitem__(self, index: int) -> RecordMetadata:
        """The record to read at step ``index``.

        Raises:
          IndexError: for ``index`` outside ``[0, len(self))``.
        """
        i = _check_position(index, len(self), "SequentialSampler")
        return _record_metadata(i, int(self._order[i]), self.seed)

    def __iter__(self) -> Iterator[RecordMetadata]:
        """Every step in order."""
        for i in range(len(self)):
            yield self[i]


def _first_records(ds: MapDataset, num_records: int) -> MapDataset:
    """The first ``num_records`` records of ``ds``, wrapping around past its end (as
    Grain reads ``source[key % len(source)]`` when the sampler has more records)."""
    n = len(ds)
    if num_records == n:
        return ds
    if n == 0:
        raise ValueError(f"DataLoader: the sampler wants {num_records} records from an empty source")
    if num_records > n:
        ds = ds.repeat(-(-num_records // n), reseed_each_epoch=False)
    return ds.slice(slice(0, num_records))


class DataLoader:
    """Read ``data_source`` in the order of ``sampler``, apply ``operations``, iterate.

    Built on the dataset API: per-record operations run at the ``MapDataset`` level (in
    worker processes when ``worker_count > 0``), so the output and the iterator state are
    the same for every ``worker_count``.

    Args:
      data_source: a random-access source (``__len__`` and ``__getitem__``: a list, an
        :class:`InMemoryDataSource`, ``ArrayRecordDataSource``...).
      sampler: an :class:`IndexSampler`: how many records, the shard, shuffling, epochs and seed.
      operations: applied in order: :class:`MapTransform`, :class:`RandomMapTransform` (seeded from
        ``sampler.seed`` plus its position), :class:`FilterTransform`, :class:`Batch`, or plain
        callables (mapped).
      worker_count: worker processes computing the per-record operations (0: in this process).
      shard_options: overrides ``sampler.shard_options``; None keeps the sampler's.
      read_options: how the source is read (threads, prefetch); None for the defaults.
      worker_buffer_size: chunks each worker may compute ahead.
      debug: check that every element has the structure of the first (slower; errors name the
        stage).

    >>> from cairn.data import DataLoader, IndexSampler, Batch
    >>> loader = DataLoader(data_source=list(range(10)), sampler=IndexSampler(10, shuffle=True, seed=1),
    ...                     operations=[Batch(4, drop_remainder=True)])
    >>> [b.shape for b in loader]
    [(4,), (4,)]

    Raises:
      TypeError: ``data_source`` or ``sampler`` missing, or an operation of an unknown kind.
    """

    def __init__(
        self,
        data_source: Any = None,
        sampler: IndexSampler | None = None,
        operations: Sequence[Any] = (),
        worker_count: int = 0,
        shard_options: ShardOptions | None = None,
        read_options: ReadOptions | None = None,
        worker_buffer_size: int = 2,
        *,
        debug: bool = False,
    ) -> None:
        if data_source is None or sampler is None:
            raise TypeError("DataLoader needs data_source= and sampler=")
        if not isinstance(sampler, IndexSampler):
            raise TypeError(
                f"DataLoader: sampler must be an IndexSampler, got {type(sampler).__name__}"
            )
        shard = shard_options if shard_options is not None else sampler.shard_options
        ds = _first_records(MapDataset.source(data_source), sampler.num_records).shard(
            shard.shard_index, shard.shard_count, shard.drop_remainder
        )
        if sampler.shuffle:
            ds = ds.shuffle(seed=sampler.seed)
        if sampler.num_epochs != 1:
            ds = ds.repeat(sampler.num_epochs)
        seed = sampler.seed if sampler.seed is not None else 0
        read_options = read_options or ReadOptions()
        pipeline: MapDataset | IterDataset = ds
        filtered = False
        for k, op in enumerate(operations):
            if isinstance(op, Batch):
                if isinstance(pipeline, MapDataset) and filtered:
                    pipeline = pipeline.to_iter_dataset(read_options, debug=debug)
                pipeline = pipeline.batch(op.batch_size, op.drop_remainder, op.batch_fn)
            elif isinstance(op, RandomMapTransform):
                pipeline = pipeline.random_map(op, seed=seed + k)
            elif isinstance(op, FilterTransform):
                pipeline = pipeline.filter(op)
                filtered = True
            elif isinstance(op, MapTransform) or callable(op):
                pipeline = pipeline.map(op)
            else:
                raise TypeError(
                    f"DataLoader: operation {k} is a {type(op).__name__}; expected MapTransform, "
                    "RandomMapTransform, FilterTransform, Batch or a callable"
                )
        if isinstance(pipeline, MapDataset):
            pipeline = pipeline.to_iter_dataset(read_options, debug=debug)
        if worker_count:
            pipeline = pipeline.mp_prefetch(
                MultiprocessingOptions(worker_count, worker_buffer_size)
            )
        self._dataset = pipeline

    @property
    def dataset(self) -> IterDataset:
        """The equivalent dataset pipeline."""
        return self._dataset

    def __iter__(self) -> DatasetIterator:
        return iter(self._dataset)
