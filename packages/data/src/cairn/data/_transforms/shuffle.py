"""``MapDataset.shuffle``: a global, O(1)-memory permutation keyed by (seed, epoch)."""

from __future__ import annotations

import numpy as np

from cairn.data._permutation import permute

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import SeededMapDataset

__all__ = ["ShuffleMapDataset"]


class ShuffleMapDataset(SeededMapDataset):
    """Element ``i`` is ``parent[permute(i, len, seed, epoch)]``."""

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        return self._parent._getitems(permute(indices, len(self._parent), self._seed, epoch), epoch)

    def _stage_name(self) -> str:
        return f"shuffle(seed={self._seed})"
