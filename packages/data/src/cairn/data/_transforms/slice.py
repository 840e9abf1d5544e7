"""``MapDataset.slice`` (and ``shard``), and the row blocks of ``shard_global_batches``."""

from __future__ import annotations

import numpy as np

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import MapDataset

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import UnaryMapDataset

__all__ = ["BlockSliceMapDataset", "SliceMapDataset"]


class SliceMapDataset(UnaryMapDataset):
    """The parent's elements ``range(*slice.indices(len(parent)))``."""

    def __init__(self, parent: MapDataset, sl: slice) -> None:
        super().__init__(parent)
        self._range = range(*sl.indices(len(parent)))

    def __len__(self) -> int:
        return len(self._range)

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        r = self._range
        return self._parent._getitems(indices * r.step + r.start, epoch)

    def _stage_name(self) -> str:
        r = self._range
        return f"slice({r.start}:{r.stop}:{r.step})"


class BlockSliceMapDataset(UnaryMapDataset):
    """Records ``[start, start + size)`` of every block of ``block`` parent records."""

    def __init__(self, parent: MapDataset, block: int, start: int, size: int) -> None:
        super().__init__(parent)
        self._block, self._start, self._size = block, start, size

    def __len__(self) -> int:
        return len(self._parent) // self._block * self._size

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        q, r = np.divmod(indices, self._size)
        return self._parent._getitems(q * self._block + self._start + r, epoch)

    def _stage_name(self) -> str:
        return f"block_slice(block={self._block}, rows={self._start}:{self._start + self._size})"
