"""``batch`` on ``MapDataset`` (one batched read per batch) and ``IterDataset``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cairn.data._arguments import fn_name

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import DatasetIterator, MapDataset

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import SameStateIterator, UnaryIterDataset, UnaryMapDataset
from cairn.data._tree import stack_records

__all__ = ["BatchIterDataset", "BatchIterator", "BatchMapDataset"]


class BatchMapDataset(UnaryMapDataset):
    """Element ``i`` is ``batch_fn`` of parent elements ``[i * batch_size, (i + 1) * batch_size)``,
    read in one call; ``None`` (filtered) elements are left out of their batch."""

    def __init__(
        self,
        parent: MapDataset,
        batch_size: int,
        drop_remainder: bool,
        batch_fn: Callable[[list], Any] | None,
    ) -> None:
        super().__init__(parent)
        self._bs = batch_size
        self._drop = drop_remainder
        self._batch_fn = batch_fn if batch_fn is not None else stack_records
        self._may_filter = parent._may_filter

    def __len__(self) -> int:
        n = len(self._parent)
        return n // self._bs if self._drop else -(-n // self._bs)

    def _records_per_element(self) -> int:
        return self._bs * self._parent._records_per_element()

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        if indices.size == 0:
            return []
        bs, n = self._bs, len(self._parent)
        starts = indices * bs
        stops = np.minimum(starts + bs, n)
        sizes = stops - starts
        if (sizes == bs).all():
            rec = (starts[:, None] + np.arange(bs)).reshape(-1)
        else:
            rec = np.concatenate([np.arange(a, b) for a, b in zip(starts.tolist(), stops.tolist())])
        values = self._parent._getitems(rec, epoch)
        fn = self._batch_fn
        out: list = []
        pos = 0
        for size in sizes.tolist():
            group = values[pos : pos + size]
            pos += size
            if self._may_filter:
                group = [v for v in group if v is not None]
                if not group:
                    out.append(None)
                    continue
            out.append(fn(group))
        return out

    def _stage_name(self) -> str:
        extra = ", drop_remainder=True" if self._drop else ""
        if self._batch_fn is not stack_records:
            extra += f", batch_fn={fn_name(self._batch_fn)}"
        return f"batch({self._bs}{extra})"


class BatchIterator(SameStateIterator):
    """Calls ``fn`` on each run of ``bs`` input elements (a shorter last run unless ``drop``)."""

    def __init__(
        self,
        parent: DatasetIterator,
        bs: int,
        drop: bool,
        fn: Callable[[list], Any],
        name: str,
        debug: bool,
    ) -> None:
        super().__init__(parent, name, debug)
        self._bs, self._drop, self._fn = bs, drop, fn

    def _next(self):
        items = []
        p = self._p
        try:
            for _ in range(self._bs):
                items.append(next(p))
        except StopIteration:
            if not items or self._drop:
                raise
        return self._fn(items)


class BatchIterDataset(UnaryIterDataset):
    """``IterDataset.batch``: args ``(batch_size, drop_remainder, batch_fn)``."""

    _iterator = BatchIterator

    def _stage_name(self):
        bs, drop, _ = self._args
        return f"batch({bs}{', drop_remainder=True' if drop else ''})"
