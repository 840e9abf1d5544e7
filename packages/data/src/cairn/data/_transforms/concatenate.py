"""``MapDataset.concatenate``: datasets one after another."""

from __future__ import annotations

import numpy as np

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import MapDataset

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import ManyParentsMapDataset

__all__ = ["ConcatenateMapDataset"]


class ConcatenateMapDataset(ManyParentsMapDataset):
    """The inputs one after another; element ``i`` is routed by the cumulative lengths."""

    def __init__(self, datasets: list[MapDataset]) -> None:
        super().__init__(datasets, "concatenate")
        self._offsets = np.cumsum([0] + [len(d) for d in datasets])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        which = np.searchsorted(self._offsets, indices, side="right") - 1
        return self._route(which, indices - self._offsets[which], epoch)

    def _stage_name(self) -> str:
        return f"concatenate({len(self._parents)} datasets)"
