"""``MapDataset.repeat``: the parent ``num_epochs`` times (or forever), reseeded per epoch;
``RepeatIterDataset``: an iterator pipeline restarted from its first state ``num_epochs`` times."""

from __future__ import annotations

import copy
import sys
from typing import Any

import numpy as np

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import DatasetIterator, IterDataset, MapDataset
from cairn.data._state_validation import any_field, check_state, int_field, nested, with_version

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import UnaryIterDataset, UnaryMapDataset, gather

__all__ = ["RepeatIterDataset", "RepeatIterator", "RepeatMapDataset"]


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


class RepeatIterator(DatasetIterator):
    """Restarts its input from the input's first state at the end of each epoch.

    State: ``{"parent": input state, "epoch": finished epochs}``. An input that yields
    nothing in an epoch ends the repetition (no endless loop on an empty input)."""

    def __init__(self, parent: DatasetIterator, num_epochs: int | None, name: str, debug: bool) -> None:
        super().__init__((parent,), name, debug)
        self._p, self._epochs = parent, num_epochs
        self._start = copy.deepcopy(parent.get_state())
        self._epoch = 0
        self._fresh = True  # nothing produced yet in this epoch

    def _next(self) -> Any:
        while True:
            try:
                x = next(self._p)
            except StopIteration:
                self._epoch += 1
                if self._fresh or (self._epochs is not None and self._epoch >= self._epochs):
                    raise
                self._p.set_state(copy.deepcopy(self._start))
                self._fresh = True
                continue
            self._fresh = False
            return x

    def get_state(self) -> dict:
        return with_version({"parent": self._p.get_state(), "epoch": self._epoch})

    def set_state(self, state: dict) -> None:
        hi = self._epochs if self._epochs is not None else None
        check_state(state, "RepeatIterDataset iterator", {"parent": any_field, "epoch": int_field(0, hi)})
        with nested("parent"):
            self._p.set_state(state["parent"])
        self._epoch = state["epoch"]
        self._fresh = False


class RepeatIterDataset(UnaryIterDataset):
    """``parent`` iterated ``num_epochs`` times (``None``: forever), each time from the start:
    the same elements every epoch (no reshuffle; repeat the ``MapDataset`` for that).

    Args:
      parent: the input ``IterDataset``.
      num_epochs: how many passes, >= 1; None repeats forever.

    Raises:
      ValueError: for ``num_epochs`` that is not None or an int >= 1.

    >>> from cairn.data import MapDataset
    >>> from cairn.data.experimental import RepeatIterDataset
    >>> list(RepeatIterDataset(MapDataset.range(3).to_iter_dataset().batch(2), 2))[2].tolist()
    [0, 1]
    """

    _iterator = RepeatIterator

    def __init__(self, parent: IterDataset, num_epochs: int | None = None) -> None:
        if num_epochs is not None and (isinstance(num_epochs, bool) or not isinstance(num_epochs, int)
                                       or num_epochs < 1):
            raise ValueError(f"RepeatIterDataset: num_epochs must be None or an int >= 1, got {num_epochs!r}")
        super().__init__(parent, num_epochs)

    def _stage_name(self) -> str:
        return f"repeat_iter({self._args[0]})"
