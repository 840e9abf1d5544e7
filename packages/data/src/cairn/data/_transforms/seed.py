"""``MapDataset.seed`` / ``IterDataset.seed``: the default seed of the ``shuffle`` /
``random_map`` steps after it."""

from __future__ import annotations

import numpy as np

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import (
    SameStateIterator,
    SeededMapDataset,
    UnaryIterDataset,
)

__all__ = ["SeedIterDataset", "SeedMapDataset"]


class SeedMapDataset(SeededMapDataset):
    """Passes elements through; sets the default seed of the seeded steps above it."""

    def _default_seed(self) -> int | None:
        return self._seed

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        return self._parent._getitems(indices, epoch)

    def _stage_name(self) -> str:
        return f"seed({self._seed})"


class _PassIterator(SameStateIterator):
    def __init__(self, parent, seed, name, debug):
        super().__init__(parent, name, debug)

    def _next(self):
        return next(self._p)


class SeedIterDataset(UnaryIterDataset):
    """Passes elements through (the state is the input's); sets the default seed of the
    ``random_map`` steps above it. Args ``(seed,)``."""

    _iterator = _PassIterator

    def _default_seed(self) -> int | None:
        return self._args[0]

    def _stage_name(self) -> str:
        return f"seed({self._args[0]})"
