"""``DataLoader`` + ``IndexSampler`` + transform classes, for users of Grain's older API."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

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
]


class MapTransform(abc.ABC):
    """Subclass and define ``map(self, element)``."""

    @abc.abstractmethod
    def map(self, element: Any) -> Any: ...


class RandomMapTransform(abc.ABC):
    """Subclass and define ``random_map(self, element, rng: np.random.Generator)``."""

    @abc.abstractmethod
    def random_map(self, element: Any, rng: np.random.Generator) -> Any: ...


class FilterTransform(abc.ABC):
    """Subclass and define ``filter(self, element) -> bool``."""

    @abc.abstractmethod
    def filter(self, element: Any) -> bool: ...


@dataclasses.dataclass(frozen=True)
class Batch:
    """Stack ``batch_size`` consecutive elements (leaf by leaf, or with ``batch_fn``)."""

    batch_size: int
    drop_remainder: bool = False
    batch_fn: Any = None


@dataclasses.dataclass(frozen=True)
class IndexSampler:
    """Which record indices to read, in which order, for how many epochs.

    The records of this process's shard (``shard_options``) are read ``num_epochs`` times
    (forever if ``None``), shuffled with a new permutation every epoch when ``shuffle``.
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


class DataLoader:
    """Read ``data_source`` in the order of ``sampler``, apply ``operations``, iterate.

    Built on the dataset API: per-record operations run at the ``MapDataset`` level (in
    worker processes when ``worker_count > 0``), so the output and the iterator state are
    the same for every ``worker_count``.

    >>> from cairn.data import DataLoader, IndexSampler, Batch
    >>> loader = DataLoader(data_source=list(range(10)), sampler=IndexSampler(10, shuffle=True, seed=1),
    ...                     operations=[Batch(4, drop_remainder=True)])
    >>> [b.shape for b in loader]
    [(4,), (4,)]
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
        if len(data_source) != sampler.num_records:
            raise ValueError(
                f"DataLoader: the sampler expects {sampler.num_records} records but the source has {len(data_source)}"
            )
        shard = shard_options if shard_options is not None else sampler.shard_options
        ds = MapDataset.source(data_source).shard(
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
