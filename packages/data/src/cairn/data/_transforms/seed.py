"""``MapDataset.seed``: the default seed of the ``shuffle`` / ``random_map`` steps after it."""

from __future__ import annotations

import numpy as np

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import SeededMapDataset

__all__ = ["SeedMapDataset"]


class SeedMapDataset(SeededMapDataset):
    """Passes elements through; sets the default seed of the seeded steps above it."""

    def _default_seed(self) -> int | None:
        return self._seed

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        return self._parent._getitems(indices, epoch)

    def _stage_name(self) -> str:
        return f"seed({self._seed})"
