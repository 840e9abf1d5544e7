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

__all__ = [
    "Batch",
    "Filter",
    "FlatMap",
    "Map",
    "MapWithIndex",
    "RandomMap",
]

Map = MapTransform
RandomMap = RandomMapTransform
Filter = FilterTransform


class MapWithIndex(abc.ABC):
    """Subclass and define ``map_with_index(self, index, element)``; ``index`` is the
    element's position in the dataset (for ``MapDataset.map_with_index``)."""

    @abc.abstractmethod
    def map_with_index(self, index: int, element: Any) -> Any: ...


class FlatMap(abc.ABC):
    """Subclass and define ``flat_map(self, element)`` returning at most ``max_fan_out``
    elements (for ``cairn.data.experimental.FlatMapMapDataset`` / ``FlatMapIterDataset``)."""

    max_fan_out: int

    @abc.abstractmethod
    def flat_map(self, element: Any) -> Any: ...
