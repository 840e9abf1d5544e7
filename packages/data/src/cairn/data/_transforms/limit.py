"""``LimitIterDataset``: the first ``count`` elements of an iterator pipeline."""

from __future__ import annotations

from typing import Any

from cairn.data._dataset import DatasetIterator, IterDataset
from cairn.data._state_validation import any_field, check_state, int_field, nested, with_version
from cairn.data._transforms.common import UnaryIterDataset

__all__ = ["LimitIterDataset", "LimitIterator"]


class LimitIterator(DatasetIterator):
    """Stops after ``count`` elements. State: ``{"parent": input state, "count": elements given}``."""

    def __init__(self, parent: DatasetIterator, limit: int, name: str, debug: bool) -> None:
        super().__init__((parent,), name, debug)
        self._p, self._limit, self._count = parent, limit, 0

    def _next(self) -> Any:
        if self._count >= self._limit:
            raise StopIteration
        x = next(self._p)
        self._count += 1
        return x

    def get_state(self) -> dict:
        return with_version({"parent": self._p.get_state(), "count": self._count})

    def set_state(self, state: dict) -> None:
        check_state(state, "LimitIterDataset iterator", {"parent": any_field, "count": int_field(0, self._limit)})
        with nested("parent"):
            self._p.set_state(state["parent"])
        self._count = state["count"]


class LimitIterDataset(UnaryIterDataset):
    """At most the first ``count`` elements of ``parent`` (an ``IterDataset``).

    Args:
      parent: the input ``IterDataset``.
      count: the most elements to yield, >= 1.

    Raises:
      ValueError: for ``count`` that is not an int >= 1.

    >>> from cairn.data import MapDataset
    >>> list(LimitIterDataset(MapDataset.range(10).to_iter_dataset(), count=3))
    [0, 1, 2]
    """

    _iterator = LimitIterator

    def __init__(self, parent: IterDataset, count: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"LimitIterDataset: count must be an int >= 1, got {count!r}")
        super().__init__(parent, count)

    def _stage_name(self) -> str:
        return f"limit({self._args[0]})"
