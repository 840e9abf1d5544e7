"""``FlatMapMapDataset``: each element split into up to ``max_fan_out`` elements;
``FlatMapIterDataset``: into any number of elements, on an iterator."""

from __future__ import annotations

from typing import Any

import numpy as np

from cairn.data._arguments import fn_name

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import DatasetIterator, IterDataset, MapDataset
from cairn.data._state_validation import any_field, check_state, int_field, nested, with_version

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import UnaryIterDataset, UnaryMapDataset

__all__ = ["FlatMapIterDataset", "FlatMapIterator", "FlatMapMapDataset"]


class FlatMapMapDataset(UnaryMapDataset):
    """Element ``i`` is output ``i % k`` of ``transform.flat_map(parent[i // k])``, where
    ``k = transform.max_fan_out``; positions past an element's outputs read as ``None``
    (iteration skips them, as for ``filter``). Length ``len(parent) * k``.

    Args:
      parent: the input ``MapDataset``.
      transform: an object with ``flat_map(element) -> sequence`` and an int ``max_fan_out``.

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


class FlatMapIterator(DatasetIterator):
    """Hands out ``transform.flat_map(x)`` element by element for each input ``x``.

    State: ``{"parent": the input's state before the current element, "emitted": outputs
    of that element already handed out}``; a restore reads that element again and skips
    ``emitted`` outputs, so the element's outputs are recomputed, never stored."""

    def __init__(self, parent: DatasetIterator, transform: Any, name: str, debug: bool) -> None:
        super().__init__((parent,), name, debug)
        self._p, self._fn = parent, transform.flat_map
        self._before = parent.get_state()
        self._outs: list = []
        self._emitted = 0

    def _next(self) -> Any:
        while self._emitted >= len(self._outs):
            before = self._p.get_state()
            x = next(self._p)
            self._before, self._outs, self._emitted = before, list(self._fn(x)), 0
        out = self._outs[self._emitted]
        self._emitted += 1
        return out

    def get_state(self) -> dict:
        if self._emitted >= len(self._outs):  # between elements: the input's current state
            return with_version({"parent": self._p.get_state(), "emitted": 0})
        return with_version({"parent": self._before, "emitted": self._emitted})

    def set_state(self, state: dict) -> None:
        check_state(state, "FlatMapIterDataset iterator", {"parent": any_field, "emitted": int_field(0)})
        with nested("parent"):
            self._p.set_state(state["parent"])
        self._before, self._outs, self._emitted = state["parent"], [], 0
        k = state["emitted"]
        if k:
            self._outs = list(self._fn(next(self._p)))
            if k > len(self._outs):
                raise ValueError(
                    f"invalid FlatMapIterDataset iterator state at 'emitted': the element has "
                    f"{len(self._outs)} outputs, got {k}"
                )
            self._emitted = k


class FlatMapIterDataset(UnaryIterDataset):
    """Each input element becomes the elements of ``transform.flat_map(element)`` (any
    number, no ``max_fan_out`` needed), in order.

    Args:
      parent: the input ``IterDataset``.
      transform: an object with ``flat_map(element) -> iterable``.

    Raises:
      TypeError: if ``transform`` has no ``flat_map`` method.

    >>> class Split:
    ...     def flat_map(self, s):
    ...         return s.split()
    >>> list(FlatMapIterDataset(MapDataset.source(["a b", "", "c"]).to_iter_dataset(), Split()))
    ['a', 'b', 'c']
    """

    _iterator = FlatMapIterator

    def __init__(self, parent: IterDataset, transform: Any) -> None:
        if not callable(getattr(transform, "flat_map", None)):
            raise TypeError(f"FlatMapIterDataset: transform must have a flat_map method, got {type(transform).__name__}")
        super().__init__(parent, transform)

    def _stage_name(self) -> str:
        return f"flat_map({fn_name(self._args[0].flat_map)})"
