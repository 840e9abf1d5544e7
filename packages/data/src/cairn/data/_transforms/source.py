"""The leaves: ``MapDataset.source`` (any random-access source) and ``MapDataset.range``."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import MapDataset

__all__ = ["RangeMapDataset", "SourceMapDataset"]


class SourceMapDataset(MapDataset):
    """A random-access source, read with the fastest call it offers (array fancy
    indexing, ``__getitems__``, ``itemgetter`` on a list, or one ``[i]`` per index)."""

    def __init__(self, source: Any) -> None:
        self._source = source
        self._n = len(source)
        # Sources that skip corrupt records return None for them (read as filtered out).
        self._may_filter = bool(getattr(source, "skip_bad_records", False))
        if isinstance(source, np.ndarray):
            self._read = self._read_array
        elif hasattr(source, "__getitems__"):
            self._read = self._read_batched
        elif isinstance(source, list | tuple):
            self._read = self._read_list
        else:
            self._read = self._read_generic

    def __len__(self) -> int:
        return self._n

    def _read_array(self, idx: np.ndarray) -> list:
        return list(self._source[idx])

    def _read_batched(self, idx: np.ndarray) -> list:
        out = self._source.__getitems__(idx)
        if not isinstance(out, list):
            out = list(out)
        if len(out) != len(idx):
            raise ValueError(
                f"{type(self._source).__name__}.__getitems__ returned {len(out)} records for "
                f"{len(idx)} indices"
            )
        return out

    def _read_list(self, idx: np.ndarray) -> list:
        if len(idx) == 1:
            return [self._source[int(idx[0])]]
        return list(operator.itemgetter(*idx.tolist())(self._source))

    def _read_generic(self, idx: np.ndarray) -> list:
        src = self._source
        return [src[i] for i in idx.tolist()]

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        if indices.size == 0:
            return []
        return self._read(indices)

    def _stage_name(self) -> str:
        return f"source({type(self._source).__name__})"


class RangeMapDataset(MapDataset):
    """The integers of a ``range``, computed for a whole index array at once."""

    def __init__(self, r: range) -> None:
        self._range = r

    def __len__(self) -> int:
        return len(self._range)

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        r = self._range
        return (indices * r.step + r.start).tolist()

    def _stage_name(self) -> str:
        r = self._range
        return f"range({r.start}, {r.stop}, {r.step})"
