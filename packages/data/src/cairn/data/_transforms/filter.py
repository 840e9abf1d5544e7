"""``filter`` on ``MapDataset`` (dropped elements read as ``None``) and ``IterDataset``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cairn.data._arguments import fn_name

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import DatasetIterator, MapDataset
from cairn.data._options import FilterRatioCheck, current_options

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import FnMapDataset, SameStateIterator, UnaryIterDataset

__all__ = ["FilterIterDataset", "FilterIterator", "FilterMapDataset"]


class FilterMapDataset(FnMapDataset):
    """Elements where ``predicate`` is false read as ``None`` (iteration skips them)."""

    _verb = "filter"

    def __init__(self, parent: MapDataset, predicate: Callable) -> None:
        super().__init__(parent, predicate)
        self._may_filter = True

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        values = self._parent._getitems(indices, epoch)
        pred = self._fn
        return [v if v is not None and pred(v) else None for v in values]


class FilterIterator(SameStateIterator):
    """Skips input elements until ``pred`` holds; the state is the input's."""

    def __init__(
        self, parent: DatasetIterator, pred: Callable[[Any], bool], name: str, debug: bool
    ) -> None:
        super().__init__(parent, name, debug)
        self._pred = pred
        check = FilterRatioCheck(name, current_options())
        self._check = check if check.active else None

    def _next(self):
        check = self._check
        while True:
            x = next(self._p)
            if self._pred(x):
                if check is not None:
                    check.add(1, 0)
                return x
            if check is not None:
                check.add(0, 1)


class FilterIterDataset(UnaryIterDataset):
    """``IterDataset.filter``: args ``(predicate,)``."""

    _iterator = FilterIterator

    def _stage_name(self):
        (pred,) = self._args
        return f"filter({fn_name(pred)})"
