"""What the transformation modules share: one-input and many-input bases."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cairn.data._arguments import fn_name

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import DatasetIterator, IterDataset, MapDataset

__all__ = [
    "FnMapDataset",
    "ManyParentsMapDataset",
    "SameStateIterator",
    "SeededMapDataset",
    "UnaryIterDataset",
    "UnaryMapDataset",
    "as_iter_datasets",
    "gather",
    "state_path",
]


# --- MapDataset steps ---


class UnaryMapDataset(MapDataset):
    """A ``MapDataset`` step with one input, of the input's length unless it says otherwise."""

    def __init__(self, parent: MapDataset) -> None:
        if not isinstance(parent, MapDataset):
            raise TypeError(f"expected a MapDataset, got {type(parent).__name__}")
        self._parent = parent
        self._parents = (parent,)
        self._may_filter = parent._may_filter

    def __len__(self) -> int:
        return len(self._parent)


class SeededMapDataset(UnaryMapDataset):
    """A one-input step that carries a resolved ``seed``."""

    def __init__(self, parent: MapDataset, seed: int) -> None:
        super().__init__(parent)
        self._seed = seed


class FnMapDataset(UnaryMapDataset):
    """A step that calls a user function; its stage is named ``<_verb>(<function name>)``."""

    _verb = ""

    def __init__(self, parent: MapDataset, fn: Callable) -> None:
        super().__init__(parent)
        self._fn = fn

    def _stage_name(self) -> str:
        return f"{self._verb}({fn_name(self._fn)})"


def gather(parts: list[tuple[np.ndarray, list]], total: int) -> list:
    """Scatter ``(positions, values)`` parts back into one list of ``total`` values."""
    out: list = [None] * total
    for pos, vals in parts:
        for p, v in zip(pos.tolist(), vals):
            out[p] = v
    return out


class ManyParentsMapDataset(MapDataset):
    """A step over several ``MapDataset`` inputs; ``what`` names it in error messages."""

    def __init__(self, datasets: list[MapDataset], what: str) -> None:
        if not datasets:
            raise ValueError(f"{what}() needs at least one dataset")
        for k, d in enumerate(datasets):
            if not isinstance(d, MapDataset):
                raise TypeError(
                    f"{what}(): input {k} is a {type(d).__name__}, expected a MapDataset"
                )
        self._parents = tuple(datasets)
        self._may_filter = any(d._may_filter for d in datasets)

    def _route(self, which: np.ndarray, local: np.ndarray, epoch: int) -> list:
        """Element ``j`` is element ``local[j]`` of input ``which[j]``: one read per input."""
        parts = []
        for k in np.unique(which).tolist():
            pos = np.flatnonzero(which == k)
            parts.append((pos, self._parents[k]._getitems(local[pos], epoch)))
        if len(parts) == 1:
            return parts[0][1]
        return gather(parts, len(which))


# --- IterDataset steps ---


class SameStateIterator(DatasetIterator):
    """One input, whose state is this iterator's state."""

    def __init__(self, parent: DatasetIterator, name: str, debug: bool) -> None:
        super().__init__((parent,), name, debug)
        self._p = parent

    def get_state(self) -> dict:
        return self._p.get_state()

    def set_state(self, state: dict) -> None:
        self._p.set_state(state)


class UnaryIterDataset(IterDataset):
    """One input; ``iter`` gives ``_iterator(input iterator, *args, stage name, debug)``."""

    _iterator: Callable[..., DatasetIterator]

    def __init__(self, parent: IterDataset, *args: Any) -> None:
        if not isinstance(parent, IterDataset):
            raise TypeError(f"expected an IterDataset, got {type(parent).__name__}")
        self._parent = parent
        self._parents = (parent,)
        self._args = args

    def _make_iter(self, rf):
        return self._iterator(
            self._parent._make_iter(rf), *self._args, self._stage_name(), self._debug
        )


def as_iter_datasets(datasets: Sequence[Any], who: str) -> list[IterDataset]:
    out = list(datasets)
    for k, d in enumerate(out):
        if isinstance(d, MapDataset):
            out[k] = d.to_iter_dataset()
        elif not isinstance(d, IterDataset):
            raise TypeError(f"{who}(): input {k} is a {type(d).__name__}, expected an IterDataset")
    return out


def state_path(*keys: str | int) -> str:
    """The ``/``-joined path of a field inside a nested iterator state, as
    ``cairn.core_array.path_of`` writes it: ``state_path("inputs", 1) == "inputs/1"``.

    core_array is imported on first use (a ``set_state``), so ``import cairn.data`` does
    not load it.
    """
    from cairn.core_array import path_of

    return path_of(keys)
