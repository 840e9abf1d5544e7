"""``MapDataset.select_from_datasets``: element ``i`` is picked by a ``DatasetSelectionMap``."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import MapDataset

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import ManyParentsMapDataset

__all__ = ["DatasetSelectionMap", "SelectMapDataset"]


class DatasetSelectionMap(abc.ABC):
    """Which input each element of ``MapDataset.select_from_datasets`` comes from.

    Subclass it and define ``__len__`` (the length of the selection) and
    ``__getitem__(index) -> (dataset_index, index_in_that_dataset)``.

    >>> import cairn.data as grain
    >>> class Alternate(grain.DatasetSelectionMap):
    ...     def __len__(self):
    ...         return 6
    ...     def __getitem__(self, index):
    ...         return index % 2, index // 2
    >>> ds = grain.MapDataset.select_from_datasets(
    ...     [grain.MapDataset.range(3), grain.MapDataset.range(10, 13)], Alternate())
    >>> list(ds)
    [0, 10, 1, 11, 2, 12]
    """

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __getitem__(self, index: int) -> tuple[int, int]: ...


class SelectMapDataset(ManyParentsMapDataset):
    """Element ``i`` is element ``selection_map[i][1]`` of input ``selection_map[i][0]``;
    the inputs are read once per chunk each. Epoch ``e`` reads epoch ``e`` of the inputs."""

    def __init__(self, datasets: Sequence[MapDataset], selection_map: DatasetSelectionMap) -> None:
        super().__init__(list(datasets), "select_from_datasets")
        if not (hasattr(selection_map, "__len__") and hasattr(selection_map, "__getitem__")):
            raise TypeError(
                "select_from_datasets(): selection_map needs __len__ and __getitem__, got "
                f"{type(selection_map).__name__}"
            )
        self._map = selection_map
        self._len = len(selection_map)

    def __len__(self) -> int:
        return self._len

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        if indices.size == 0:
            return []
        pairs = [self._map[i] for i in indices.tolist()]
        which = np.fromiter((p[0] for p in pairs), np.int64, len(pairs))
        local = np.fromiter((p[1] for p in pairs), np.int64, len(pairs))
        n = len(self._parents)
        if which.min() < 0 or which.max() >= n:
            bad = int(np.flatnonzero((which < 0) | (which >= n))[0])
            raise IndexError(
                f"select_from_datasets(): selection_map[{int(indices[bad])}] picks dataset "
                f"{int(which[bad])}, but there are {n} datasets"
            )
        return self._route(which, local, epoch)

    def _stage_name(self) -> str:
        return f"select_from_datasets({type(self._map).__name__})"
