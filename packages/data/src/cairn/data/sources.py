"""Random-access data sources (Grain's ``grain.sources``).

A source is anything with ``__len__`` and ``__getitem__`` (a list works);
``RandomAccessDataSource`` is the base class to subclass for documentation's sake.

>>> import cairn.data as grain
>>> class Squares(grain.sources.RandomAccessDataSource):
...     def __len__(self):
...         return 4
...     def __getitem__(self, index):
...         return index * index
>>> list(grain.MapDataset.source(Squares()))
[0, 1, 4, 9]
"""

from __future__ import annotations

import abc
from typing import Any

from cairn.data._dataset import ReadOptions
from cairn.data._source_arrayrecord import ArrayRecordDataSource
from cairn.data._source_memory import InMemoryDataSource, RangeDataSource
from cairn.data._source_parquet import ParquetDataSource

__all__ = [
    "ArrayRecordDataSource",
    "InMemoryDataSource",
    "ParquetDataSource",
    "RandomAccessDataSource",
    "RangeDataSource",
    "ReadOptions",
]


class RandomAccessDataSource(abc.ABC):
    """Base class of a source: ``len(source)`` records, ``source[i]`` for ``0 <= i < len``.

    Subclassing is optional; ``MapDataset.source`` takes any object with both methods.
    """

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __getitem__(self, index: int) -> Any: ...
