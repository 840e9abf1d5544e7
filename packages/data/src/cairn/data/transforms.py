"""Transform classes to subclass (Grain's ``grain.transforms``).

Every dataset step and ``DataLoader(operations=...)`` accepts these objects as well as
plain functions: ``ds.map(MyMap())`` calls ``MyMap().map``.

>>> import cairn.data as grain
>>> class Double(grain.transforms.Map):
...     def map(self, element):
...         return element * 2
>>> list(grain.MapDataset.range(3).map(Double()))
[0, 2, 4]
"""

from __future__ import annotations

import abc
from typing import Any

from cairn.data._data_loader import Batch, FilterTransform, MapTransform, RandomMapTransform
from cairn.data._transforms.select import DatasetSelectionMap

__all__ = [
    "Batch",
    "DatasetSelectionMap",
    "Filter",
    "FlatMap",
    "Map",
    "MapWithIndex",
    "RandomMap",
    "TfRandomMap",
]

Map = MapTransform
RandomMap = RandomMapTransform
Filter = FilterTransform


class MapWithIndex(abc.ABC):
    """Subclass and define ``map_with_index(self, index, element)``; ``index`` is the
    element's position in the dataset (for ``MapDataset.map_with_index``)."""

    @abc.abstractmethod
    def map_with_index(self, index: int, element: Any) -> Any:
        """The transformed element.

        Args:
          index: the element's position in the dataset.
          element: one element of the pipeline.
        """


class FlatMap(abc.ABC):
    """Subclass and define ``flat_map(self, element)`` returning at most ``max_fan_out``
    elements (for ``cairn.data.experimental.FlatMapMapDataset`` / ``FlatMapIterDataset``)."""

    max_fan_out: int

    @abc.abstractmethod
    def flat_map(self, element: Any) -> Any:
        """The elements ``element`` becomes (at most ``max_fan_out`` of them).

        Args:
          element: one element of the pipeline.
        """


class TfRandomMap(abc.ABC):
    """Grain's base class for random maps run by TensorFlow pipelines (``np_random_map``).

    It exists so that code defining such transforms imports; like Grain's own Python
    datasets, cairn.data's steps refuse these objects (``TypeError``): subclass
    :class:`RandomMap` for a random map in a pipeline.
    """

    @abc.abstractmethod
    def np_random_map(self, element: Any, rng: Any) -> Any:
        """The transformed element (TensorFlow pipelines only; cairn.data refuses these objects).

        Args:
          element: one element.
          rng: a NumPy random generator.
        """
