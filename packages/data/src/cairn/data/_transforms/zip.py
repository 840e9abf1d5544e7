"""``ZipMapDataset`` / ``ZipIterDataset``: tuples of the inputs' elements, position by position."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cairn.data._dataset import DatasetIterator, IterDataset, MapDataset
from cairn.data._state_validation import check_state, nested, with_version
from cairn.data._transforms.common import ManyParentsMapDataset, as_iter_datasets, state_path

__all__ = ["ZipIterDataset", "ZipIterator", "ZipMapDataset"]


class ZipMapDataset(ManyParentsMapDataset):
    """Element ``i`` is ``(parents[0][i], parents[1][i], ...)``; an element that any input
    filtered out reads as ``None``.

    Args:
      parents: the ``MapDataset`` s to zip, all of one length.

    Raises:
      ValueError: for no inputs, or inputs of different lengths (all are named).

    >>> from cairn.data import MapDataset
    >>> list(ZipMapDataset([MapDataset.range(3), MapDataset.source("abc")]))
    [(0, 'a'), (1, 'b'), (2, 'c')]
    """

    def __init__(self, parents: Sequence[MapDataset]) -> None:
        super().__init__(list(parents), "ZipMapDataset")
        lengths = [len(p) for p in self._parents]
        if len(set(lengths)) != 1:
            raise ValueError(f"ZipMapDataset: all inputs must have the same length, got lengths {lengths}")
        self._len = lengths[0]

    def __len__(self) -> int:
        return self._len

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        columns = [p._getitems(indices, epoch) for p in self._parents]
        return [None if any(v is None for v in row) else tuple(row) for row in zip(*columns)]

    def _stage_name(self) -> str:
        return f"zip({len(self._parents)} inputs)"


class ZipIterator(DatasetIterator):
    """One element of every input per step. State: ``{"inputs": [each input's state]}``."""

    def __init__(self, parents: list[DatasetIterator], strict: bool, name: str, debug: bool) -> None:
        super().__init__(parents, name, debug)
        self._its, self._strict = parents, strict

    def _next(self) -> Any:
        row = []
        for k, it in enumerate(self._its):
            try:
                row.append(next(it))
            except StopIteration:
                if self._strict:
                    self._check_all_ended(k)
                raise
        return tuple(row)

    def _check_all_ended(self, k: int) -> None:
        """Input ``k`` ended: with ``strict``, every other input must end at the same step."""
        if k > 0:
            raise ValueError(f"ZipIterDataset(strict=True): input {k} is shorter than input 0")
        for j, it in enumerate(self._its[1:], start=1):
            if next(it, _END) is not _END:
                raise ValueError(f"ZipIterDataset(strict=True): input {j} is longer than input 0")

    def get_state(self) -> dict:
        return with_version({"inputs": [it.get_state() for it in self._its]})

    def set_state(self, state: dict) -> None:
        n = len(self._its)

        def inputs(v: Any) -> str | None:
            ok = isinstance(v, list) and len(v) == n
            return None if ok else f"a list of {n} input states"

        check_state(state, "ZipIterDataset iterator", {"inputs": inputs})
        for k, (it, s) in enumerate(zip(self._its, state["inputs"])):
            with nested(state_path("inputs", k)):
                it.set_state(s)


_END = object()


class ZipIterDataset(IterDataset):
    """Tuples of the inputs' elements, one from each per step (``MapDataset`` inputs are
    iterated with ``to_iter_dataset()``).

    Args:
      parents: the inputs.
      strict: raise ``ValueError`` (naming the input) when the inputs do not all end at
        the same step; with ``False`` the zip ends with the shortest input.

    >>> from cairn.data import MapDataset
    >>> a, b = MapDataset.range(3).to_iter_dataset(), MapDataset.range(10, 12).to_iter_dataset()
    >>> list(ZipIterDataset([a, b], strict=False))
    [(0, 10), (1, 11)]
    """

    def __init__(self, parents: Sequence[Any], *, strict: bool = True) -> None:
        inputs = as_iter_datasets(parents, "ZipIterDataset")
        if not inputs:
            raise ValueError("ZipIterDataset needs at least one input")
        super().__init__(inputs)
        self._strict = bool(strict)

    def _make_iter(self, root_factory: Any) -> DatasetIterator:
        its = [p._make_iter(root_factory) for p in self._parents]
        return ZipIterator(its, self._strict, self._stage_name(), self._debug)

    def _stage_name(self) -> str:
        return f"zip({len(self._parents)} inputs, strict={self._strict})"
