"""``mix``: inputs drawn in a fixed, evenly spread weighted pattern (``MapDataset`` and
``IterDataset`` share :func:`mix_pattern`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import DatasetIterator, IterDataset, MapDataset
from cairn.data._state_validation import check_state, int_field, nested, with_version

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import ManyParentsMapDataset, as_iter_datasets, state_path

__all__ = ["MixIterDataset", "MixIterator", "MixMapDataset", "mix_pattern"]


class MixMapDataset(ManyParentsMapDataset):
    """Element ``i`` comes from input ``pattern[i % PERIOD]``, which takes its elements in
    order; the length stops just before the first input would run out."""

    PERIOD = 1000

    def __init__(self, datasets: list[MapDataset], weights: Sequence[float] | None) -> None:
        super().__init__(datasets, "mix")
        self._weights, counts, self._pattern_k, self._pattern_j = mix_pattern(
            weights, len(datasets), self.PERIOD
        )
        self._counts = counts
        length = sys.maxsize
        for k, d in enumerate(datasets):
            c = int(counts[k])
            if c == 0:
                continue
            p, r = divmod(len(d), c)
            pos = int(np.flatnonzero((self._pattern_k == k) & (self._pattern_j == r))[0])
            end = p * self.PERIOD + pos
            length = min(length, end)
        self._len = length

    def __len__(self) -> int:
        return self._len

    def _getitems(self, indices: np.ndarray, epoch: int) -> list:
        period, off = np.divmod(indices, self.PERIOD)
        which = self._pattern_k[off]
        local = period * self._counts[which] + self._pattern_j[off]
        return self._route(which, local, epoch)

    def _stage_name(self) -> str:
        return "mix(weights=[" + ", ".join(f"{x:.3g}" for x in self._weights) + "])"


def mix_pattern(
    weights: Sequence[float] | None, n: int, period: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The repeating selection pattern of ``mix`` (shared by MapDataset and IterDataset).

    Returns ``(normalised weights, counts per input, input of each slot, the element
    number within its input of each slot)``; input ``k`` takes ``counts[k]`` of the
    ``period`` slots, its ``j``-th at time ``(j + 0.5) / counts[k]``, merged by time.
    """
    if weights is None:
        weights = [1.0] * n
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,):
        raise ValueError(f"mix(): got {n} datasets but {w.size} weights")
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"mix(): weights must be finite, >= 0 and not all 0, got {list(weights)}")
    w = w / w.sum()
    counts = _largest_remainder(w, period)
    times, ks, js = [], [], []
    for k, c in enumerate(counts.tolist()):
        if c:
            j = np.arange(c)
            times.append((j + 0.5) / c)
            ks.append(np.full(c, k))
            js.append(j)
    t = np.concatenate(times)
    k_all = np.concatenate(ks)
    order = np.lexsort((k_all, t))
    return w, counts, k_all[order], np.concatenate(js)[order]


def _largest_remainder(w: np.ndarray, total: int) -> np.ndarray:
    raw = w * total
    base = np.floor(raw).astype(np.int64)
    rest = total - int(base.sum())
    if rest > 0:
        order = np.argsort(-(raw - base), kind="stable")
        base[order[:rest]] += 1
    # A dataset with a positive weight always appears at least once per period.
    for k in np.flatnonzero((base == 0) & (w > 0)):
        base[k] = 1
        base[int(np.argmax(base))] -= 1
    return base


class MixIterDataset(IterDataset):
    """``IterDataset.mix``: inputs drawn in a fixed, evenly spread weighted pattern.

    Args:
      datasets: the input datasets (at least one).
      weights: relative weights, one per dataset; None weighs them equally.
    """

    PERIOD = 1000

    def __init__(
        self, datasets: Sequence[IterDataset], weights: Sequence[float] | None = None
    ) -> None:
        self._datasets = as_iter_datasets(datasets, "mix")
        if not self._datasets:
            raise ValueError("mix(): needs at least one dataset")
        self._parents = tuple(self._datasets)
        self._weights, _, self._pattern, _ = mix_pattern(weights, len(self._datasets), self.PERIOD)

    def _stage_name(self):
        return "mix(weights=[" + ", ".join(f"{x:.3g}" for x in self._weights) + "])"

    def _make_iter(self, rf):
        its = [iter(d) for d in self._datasets]
        return MixIterator(its, self._pattern.tolist(), self._stage_name(), self._debug)


class MixIterator(DatasetIterator):
    """Draws from input ``pattern[index % len(pattern)]``.

    State: ``{"index": elements drawn, "inputs": [each input's state]}``."""

    def __init__(
        self, its: list[DatasetIterator], pattern: list[int], name: str, debug: bool
    ) -> None:
        super().__init__(its, name, debug)
        self._its = its
        self._pattern = pattern
        self._index = 0

    def _next(self):
        x = next(self._its[self._pattern[self._index % len(self._pattern)]])
        self._index += 1
        return x

    def get_state(self) -> dict:
        return with_version({"index": self._index, "inputs": [it.get_state() for it in self._its]})

    def set_state(self, state: dict) -> None:
        n = len(self._its)
        check_state(
            state,
            "mix iterator",
            {
                "index": int_field(0),
                "inputs": lambda v: (
                    None
                    if isinstance(v, list) and len(v) == n
                    else f"a list of the states of the {n} inputs"
                ),
            },
        )
        before = [it.get_state() for it in self._its]
        try:
            for k, (it, st) in enumerate(zip(self._its, state["inputs"])):
                with nested(state_path("inputs", k)):
                    it.set_state(st)
        except BaseException:  # leave the iterator where it was
            for it, st in zip(self._its, before):
                it.set_state(st)
            raise
        self._index = state["index"]
