"""``map``, ``map_with_index`` and ``random_map``, on ``MapDataset`` and ``IterDataset``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cairn.data._arguments import fn_name

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import DatasetIterator, MapDataset
from cairn.data._permutation import mix_seed
from cairn.data._state_validation import any_field, check_state, int_field, nested, with_version

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import FnMapDataset, SameStateIterator, UnaryIterDataset

__all__ = [
    "MapWithIndexIterDataset",
    "MapWithIndexIterator",
    "MapIterDataset",
    "MapIterator",
    "MapMapDataset",
    "MapWithIndexMapDataset",
    "RandomMapIterDataset",
    "RandomMapIterator",
    "RandomMapMapDataset",
    "rng_for",
]


def rng_for(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The per-element generator of ``random_map``: Philox keyed by (seed, epoch, index)."""
    return np.random.Generator(np.random.Philox(key=mix_seed(seed, epoch, index)))


# --- MapDataset ---


class MapMapDataset(FnMapDataset):
    """Element ``i`` is ``fn(parent[i])`` (``None`` stays ``None``)."""

    _verb = "map"

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        values = self._parent._getitems(indices, epoch)
        fn = self._fn
        if self._may_filter:
            return [None if v is None else fn(v) for v in values]
        return list(map(fn, values))


class MapWithIndexMapDataset(FnMapDataset):
    """Element ``i`` is ``fn(i, parent[i])`` (``None`` stays ``None``)."""

    _verb = "map_with_index"

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        values = self._parent._getitems(indices, epoch)
        fn = self._fn
        return [None if v is None else fn(i, v) for i, v in zip(indices.tolist(), values)]


class RandomMapMapDataset(FnMapDataset):
    """Element ``i`` is ``fn(parent[i], rng)``, ``rng`` keyed by ``(seed, epoch, i)``."""

    def __init__(self, parent: MapDataset, fn: Callable, seed: int) -> None:
        super().__init__(parent, fn)
        self._seed = seed

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        values = self._parent._getitems(indices, epoch)
        fn, seed = self._fn, self._seed
        return [
            None if v is None else fn(v, rng_for(seed, epoch, i))
            for i, v in zip(indices.tolist(), values)
        ]

    def _stage_name(self) -> str:
        return f"random_map({fn_name(self._fn)}, seed={self._seed})"


# --- IterDataset ---


class MapIterator(SameStateIterator):
    """Calls ``fn`` on each input element; the state is the input's."""

    def __init__(
        self, parent: DatasetIterator, fn: Callable[[Any], Any], name: str, debug: bool
    ) -> None:
        super().__init__(parent, name, debug)
        self._fn = fn

    def _next(self):
        return self._fn(next(self._p))


class RandomMapIterator(DatasetIterator):
    """Calls ``fn(x, rng)`` with ``rng`` keyed by ``(seed, element count)``.

    State: ``{"parent": input state, "count": elements seen}``."""

    def __init__(
        self,
        parent: DatasetIterator,
        fn: Callable[[Any, np.random.Generator], Any],
        seed: int,
        name: str,
        debug: bool,
    ) -> None:
        super().__init__((parent,), name, debug)
        self._p, self._fn, self._seed = parent, fn, seed
        self._count = 0

    def _next(self):
        x = next(self._p)
        rng = rng_for(self._seed, 0, self._count)
        self._count += 1
        return self._fn(x, rng)

    def get_state(self) -> dict:
        return with_version({"parent": self._p.get_state(), "count": self._count})

    def set_state(self, state: dict) -> None:
        check_state(state, "random_map iterator", {"parent": any_field, "count": int_field(0)})
        with nested("parent"):
            self._p.set_state(state["parent"])
        self._count = state["count"]


class MapWithIndexIterator(DatasetIterator):
    """Calls ``fn(k, x)`` with ``k`` the number of elements before ``x``.

    State: ``{"parent": input state, "count": elements seen}``."""

    def __init__(
        self, parent: DatasetIterator, fn: Callable[[int, Any], Any], name: str, debug: bool
    ) -> None:
        super().__init__((parent,), name, debug)
        self._p, self._fn = parent, fn
        self._count = 0

    def _next(self):
        x = next(self._p)
        k = self._count
        self._count += 1
        return self._fn(k, x)

    def get_state(self) -> dict:
        return with_version({"parent": self._p.get_state(), "count": self._count})

    def set_state(self, state: dict) -> None:
        check_state(state, "map_with_index iterator", {"parent": any_field, "count": int_field(0)})
        with nested("parent"):
            self._p.set_state(state["parent"])
        self._count = state["count"]


class MapWithIndexIterDataset(UnaryIterDataset):
    """``IterDataset.map_with_index``: args ``(fn,)``."""

    _iterator = MapWithIndexIterator

    def _stage_name(self):
        (fn,) = self._args
        return f"map_with_index({fn_name(fn)})"


class MapIterDataset(UnaryIterDataset):
    """``IterDataset.map``: args ``(fn,)``."""

    _iterator = MapIterator

    def _stage_name(self):
        (fn,) = self._args
        return f"map({fn_name(fn)})"


class RandomMapIterDataset(UnaryIterDataset):
    """``IterDataset.random_map``: args ``(fn, seed)``."""

    _iterator = RandomMapIterator

    def _stage_name(self):
        fn, seed = self._args
        return f"random_map({fn_name(fn)}, seed={seed})"
