"""``FlatMapMapDataset``: each element split into up to ``max_fan_out`` elements."""

from __future__ import annotations

from typing import Any

import numpy as np

from cairn.data._arguments import fn_name
from cairn.data._dataset import MapDataset
from cairn.data._transforms.common import UnaryMapDataset

__all__ = ["FlatMapMapDataset"]


class FlatMapMapDataset(UnaryMapDataset):
    """Element ``i`` is output ``i % k`` of ``transform.flat_map(parent[i // k])``, where
    ``k = transform.max_fan_out``; positions past an element's outputs read as ``None``
    (iteration skips them, as for ``filter``). Length ``len(parent) * k``.

    Raises:
      TypeError: if ``transform`` has no ``flat_map`` method.
      ValueError: if ``max_fan_out`` is not a positive int, or (when read) an element
        gives more than ``max_fan_out`` outputs.

    >>> class Twice:
    ...     max_fan_out = 2
    ...     def flat_map(self, x):
    ...         return [x, x] if x % 2 else [x]
    >>> list(FlatMapMapDataset(MapDataset.range(4), Twice()))
    [0, 1, 1, 2, 3, 3]
    """

    def __init__(self, parent: MapDataset, transform: Any) -> None:
        super().__init__(parent)
        if not callable(getattr(transform, "flat_map", None)):
            raise TypeError(f"FlatMapMapDataset: transform must have a flat_map method, got {type(transform).__name__}")
        k = getattr(transform, "max_fan_out", None)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"FlatMapMapDataset: transform.max_fan_out must be a positive int, got {k!r}")
        self._transform = transform
        self._fan_out = k
        self._may_filter = True

    def __len__(self) -> int:
        return len(self._parent) * self._fan_out

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        k = self._fan_out
        src, slot = np.divmod(indices, k)
        uniq, inverse = np.unique(src, return_inverse=True)
        values = self._parent._getitems(uniq, epoch)
        outputs = []
        for i, v in zip(uniq.tolist(), values):
            got = [] if v is None else list(self._transform.flat_map(v))
            if len(got) > k:
                raise ValueError(
                    f"FlatMapMapDataset: element {i} gave {len(got)} outputs, more than max_fan_out={k}"
                )
            outputs.append(got)
        return [
            outputs[u][s] if s < len(outputs[u]) else None
            for u, s in zip(inverse.tolist(), slot.tolist())
        ]

    def _stage_name(self) -> str:
        return f"flat_map({fn_name(self._transform.flat_map)}, max_fan_out={self._fan_out})"
