"""Former home of ``IterDataset`` and its iterators, kept so that imports of this path
keep working.

The base classes now live in ``cairn.data._dataset`` and each transformation in its own
module of ``cairn.data._transforms``; import from there.
"""

from cairn.data._dataset import DatasetIterator, IterDataset, ReadOptions
from cairn.data._transforms.map import MapIterDataset as _MapIterDataset
from cairn.data._transforms.prefetch import PrefetchIterDataset as _PrefetchIterDataset

__all__ = [
    "DatasetIterator",
    "IterDataset",
    "ReadOptions",
    "_MapIterDataset",
    "_PrefetchIterDataset",
]
