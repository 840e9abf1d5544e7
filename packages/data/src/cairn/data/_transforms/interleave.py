"""``IterDataset.interleave``: round-robin over ``cycle_length`` inputs at a time."""

from __future__ import annotations

from collections.abc import Sequence

from cairn.data._arguments import int_at_least

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import DatasetIterator, IterDataset
from cairn.data._state_validation import StateError, check_state, int_field, nested, with_version

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import as_iter_datasets, state_path

__all__ = ["InterleaveIterDataset", "InterleaveIterator"]


class InterleaveIterDataset(IterDataset):
    """Round-robin over ``cycle_length`` input datasets at a time.

    Slot ``s`` of the cycle yields one element in turn; when its dataset is exhausted the
    next unopened dataset takes the slot. The order is deterministic, and the state is
    the index of the next dataset to open plus the open datasets' states.

    Args:
      datasets: the input datasets (``IterDataset`` or ``MapDataset``), opened in order.
      cycle_length: how many are open at a time; None opens all of them.

    >>> from cairn.data import InterleaveIterDataset, MapDataset
    >>> a = MapDataset.range(0, 3).to_iter_dataset()
    >>> b = MapDataset.range(10, 12).to_iter_dataset()
    >>> list(InterleaveIterDataset([a, b], cycle_length=2))
    [0, 10, 1, 11, 2]
    """

    def __init__(self, datasets: Sequence[IterDataset], cycle_length: int | None = None) -> None:
        datasets = as_iter_datasets(datasets, "interleave")
        if cycle_length is None:
            cycle_length = max(1, len(datasets))
        if not int_at_least(cycle_length, 1):
            raise ValueError(
                f"interleave(): cycle_length must be a positive int, got {cycle_length!r}"
            )
        self._datasets = datasets
        self._parents = tuple(datasets)
        self._cycle = cycle_length

    def _stage_name(self):
        return f"interleave(cycle_length={self._cycle})"

    def _make_iter(self, rf):
        return InterleaveIterator(self._datasets, self._cycle, self._stage_name(), self._debug)


class InterleaveIterator(DatasetIterator):
    """Cycles over ``cycle`` open input iterators; opens the next input when one ends.

    State: ``{"next_to_open", "slot", "open": [null or [input index, input state]]}``."""

    def __init__(self, datasets: list[IterDataset], cycle: int, name: str, debug: bool) -> None:
        super().__init__((), name, debug)
        self._datasets = datasets
        self._cycle = cycle
        self._reset({"next_to_open": 0, "slot": 0, "open": []})

    def _reset(self, state):
        opened: list = []
        try:
            for j, entry in enumerate(state["open"]):
                if entry is None:
                    opened.append(None)
                    continue
                k, st = entry
                it = iter(self._datasets[k])
                opened.append([k, it])
                with nested(state_path("open", j, 1)):
                    it.set_state(st)
        except BaseException:
            for e in opened:
                if e is not None:
                    e[1].close()
            raise
        for e in getattr(self, "_open_iters", []):
            if e is not None:
                e[1].close()
        self._next_to_open = state["next_to_open"]
        self._slot = state["slot"]
        self._open_iters = opened
        while len(self._open_iters) < self._cycle:
            self._open_iters.append(self._open_next())

    def _open_next(self):
        if self._next_to_open >= len(self._datasets):
            return None
        k = self._next_to_open
        self._next_to_open += 1
        return [k, iter(self._datasets[k])]

    def _next(self):
        while any(e is not None for e in self._open_iters):
            s = self._slot
            entry = self._open_iters[s]
            if entry is None:
                self._slot = (s + 1) % self._cycle
                continue
            try:
                x = next(entry[1])
            except StopIteration:
                entry[1].close()
                self._open_iters[s] = self._open_next()
                if self._open_iters[s] is None:
                    self._slot = (s + 1) % self._cycle
                continue
            self._slot = (s + 1) % self._cycle
            return x
        raise StopIteration

    def get_state(self) -> dict:
        return with_version(
            {
                "next_to_open": self._next_to_open,
                "slot": self._slot,
                "open": [None if e is None else [e[0], e[1].get_state()] for e in self._open_iters],
            }
        )

    def set_state(self, state: dict) -> None:
        kind, n = "interleave iterator", len(self._datasets)
        check_state(
            state,
            kind,
            {
                "next_to_open": int_field(0, n),
                "slot": int_field(0, self._cycle - 1),
                "open": lambda v: (
                    None
                    if isinstance(v, list) and len(v) == self._cycle
                    else f"a list of {self._cycle} entries (one per cycle slot)"
                ),
            },
        )
        seen: set = set()
        for j, entry in enumerate(state["open"]):
            if entry is None:
                continue
            if not isinstance(entry, list | tuple) or len(entry) != 2:
                raise StateError(
                    kind, state_path("open", j), "null or [input index, input state]", entry
                )
            k = entry[0]
            if int_field(0, state["next_to_open"] - 1)(k) is not None or k in seen:
                raise StateError(
                    kind,
                    state_path("open", j, 0),
                    f"the index of an input opened before next_to_open={state['next_to_open']} "
                    "and not open in another slot",
                    k,
                )
            seen.add(k)
        self._reset(state)

    def close(self) -> None:
        for e in self._open_iters:
            if e is not None:
                e[1].close()
