"""``WindowShuffleMapDataset`` / ``WindowShuffleIterDataset``: shuffles within consecutive
windows of ``window_size`` elements (local shuffling, cheap to compute and to resume)."""

from __future__ import annotations

from typing import Any

import numpy as np

from cairn.data._arguments import check_seed
from cairn.data._dataset import DatasetIterator, IterDataset, MapDataset
from cairn.data._permutation import mix_seed, permute
from cairn.data._state_validation import any_field, check_state, int_field, nested, with_version
from cairn.data._transforms.common import UnaryIterDataset, UnaryMapDataset

__all__ = ["WindowShuffleIterDataset", "WindowShuffleMapDataset"]


def _window_size(w: Any, who: str) -> int:
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"{who}: window_size must be an int >= 1, got {w!r}")
    return w


class WindowShuffleMapDataset(UnaryMapDataset):
    """Element ``i`` of window ``w = i // window_size`` is a parent element of the same
    window, through a permutation keyed by ``(seed, w, epoch)``: every window holds the
    same elements in another order, and every epoch another order.

    Args:
      parent: the input ``MapDataset``.
      window_size: elements per window, >= 1.
      seed: the int seed of the permutations.

    Raises:
      ValueError: for ``window_size`` that is not an int >= 1.
      TypeError: for a non-integer ``seed``.

    >>> from cairn.data import MapDataset
    >>> ds = WindowShuffleMapDataset(MapDataset.range(8), window_size=4, seed=0)
    >>> [sorted(list(ds)[k:k + 4]) for k in (0, 4)]
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    """

    def __init__(self, parent: MapDataset, *, window_size: int, seed: int) -> None:
        super().__init__(parent)
        self._window = _window_size(window_size, "WindowShuffleMapDataset")
        self._seed = check_seed(seed, "WindowShuffleMapDataset")

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        if indices.size == 0:
            return []
        n, w = len(self._parent), self._window
        windows, local = np.divmod(indices, w)
        source = np.empty_like(indices)
        for k in np.unique(windows).tolist():
            pos = np.flatnonzero(windows == k)
            size = min(w, n - k * w)
            source[pos] = k * w + permute(local[pos], size, mix_seed(self._seed, k), epoch)
        return self._parent._getitems(source, epoch)

    def _stage_name(self) -> str:
        return f"window_shuffle(window_size={self._window}, seed={self._seed})"


class WindowShuffleIterator(DatasetIterator):
    """Reads ``window_size`` input elements, hands them out in an order keyed by
    ``(seed, window number)``. State: ``{"parent": input state at the window start,
    "window": window number, "emitted": elements of the window handed out}``."""

    def __init__(self, parent: DatasetIterator, window: int, seed: int, name: str, debug: bool) -> None:
        super().__init__((parent,), name, debug)
        self._p, self._w, self._seed = parent, window, seed
        self._start, self._number, self._emitted = parent.get_state(), 0, 0
        self._buf: list = []

    def _fill(self) -> None:
        self._start = self._p.get_state()
        buf = []
        for x in self._p:
            buf.append(x)
            if len(buf) == self._w:
                break
        order = permute(np.arange(len(buf)), len(buf), mix_seed(self._seed, self._number))
        self._buf = [buf[i] for i in order.tolist()]
        self._emitted = 0

    def _next(self) -> Any:
        if self._emitted >= len(self._buf):
            if self._buf:
                self._number += 1
            self._fill()
            if not self._buf:
                raise StopIteration
        x = self._buf[self._emitted]
        self._emitted += 1
        return x

    def get_state(self) -> dict:
        if self._buf and self._emitted >= len(self._buf):  # between windows
            return with_version({"parent": self._p.get_state(), "window": self._number + 1, "emitted": 0})
        return with_version({"parent": self._start, "window": self._number, "emitted": self._emitted})

    def set_state(self, state: dict) -> None:
        fields = {"parent": any_field, "window": int_field(0), "emitted": int_field(0, self._w)}
        check_state(state, "WindowShuffleIterDataset iterator", fields)
        with nested("parent"):
            self._p.set_state(state["parent"])
        self._start, self._number, self._buf, self._emitted = state["parent"], state["window"], [], 0
        if state["emitted"]:
            self._fill()
            self._emitted = min(state["emitted"], len(self._buf))


class WindowShuffleIterDataset(UnaryIterDataset):
    """``parent``'s elements shuffled within consecutive windows of ``window_size`` (the
    last may be shorter), in an order keyed by ``(seed, window number)``.

    Args:
      parent: the input ``IterDataset``.
      window_size: elements per window, >= 1.
      seed: the int seed of the permutations.

    Raises:
      ValueError: for ``window_size`` that is not an int >= 1.
      TypeError: for a non-integer ``seed``.

    >>> from cairn.data import MapDataset
    >>> out = list(WindowShuffleIterDataset(MapDataset.range(6).to_iter_dataset(), window_size=3, seed=1))
    >>> sorted(out[:3]), sorted(out[3:])
    ([0, 1, 2], [3, 4, 5])
    """

    _iterator = WindowShuffleIterator

    def __init__(self, parent: IterDataset, *, window_size: int, seed: int) -> None:
        super().__init__(parent, _window_size(window_size, "WindowShuffleIterDataset"),
                         check_seed(seed, "WindowShuffleIterDataset"))

    def _stage_name(self) -> str:
        return f"window_shuffle(window_size={self._args[0]}, seed={self._args[1]})"
