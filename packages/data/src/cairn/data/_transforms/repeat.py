"""``MapDataset.repeat``: the parent ``num_epochs`` times (or forever), reseeded per epoch."""

from __future__ import annotations

import sys

import numpy as np

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import MapDataset

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import UnaryMapDataset, gather

__all__ = ["RepeatMapDataset"]


class RepeatMapDataset(UnaryMapDataset):
    """The parent ``num_epochs`` times (``None``: endless, ``sys.maxsize`` long unless the
    parent is empty); each repetition gets its own epoch number unless ``reseed`` is false."""

    def __init__(self, parent: MapDataset, num_epochs: int | None, reseed: bool) -> None:
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
        return gather(parts, len(indices))

    def _stage_name(self) -> str:
        return f"repeat({self._epochs if self._epochs is not None else 'None'})"
