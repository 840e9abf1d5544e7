"""First-fit sequence packing into fixed-length rows with segment ids and positions."""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import numpy as np

from cairn.data._iter_dataset import DatasetIterator, IterDataset, _check_state

__all__ = ["FirstFitPackIterDataset"]


class FirstFitPackIterDataset(IterDataset):
    """Pack variable-length sequences into rows of fixed length (first fit).

    Elements are dicts of arrays whose first axis is the sequence (or bare arrays).
    ``length_struct`` gives each packed feature's row length (a dict with the same keys,
    or an int for bare arrays). Up to ``num_packing_bins`` rows are open at a time; an
    element goes into the first row where every feature still fits. When an element fits
    in no open row, all open rows are emitted (in order) and a new set starts with it.
    Sequences longer than the row are truncated; empty sequences are dropped.

    For a dict element, each packed key ``k`` gives ``k`` (the tokens, zero padded),
    ``k_segment_ids`` (1, 2, ... per packed sequence, 0 for padding) and ``k_positions``
    (0, 1, ... inside each sequence) as int32; keys not in ``length_struct`` are not
    allowed. A bare array gives the tuple ``(tokens, segment_ids, positions)``.

    The state is the input's state where the current set of rows began plus the number
    of its rows already emitted, so a restore re-packs the same rows.

    >>> import numpy as np
    >>> from cairn.data import MapDataset
    >>> seqs = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6, 7, 8, 9])]
    >>> ds = FirstFitPackIterDataset(MapDataset.source(seqs).to_iter_dataset(), length_struct=5, num_packing_bins=2)
    >>> [r[0].tolist() for r in ds]
    [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    >>> [r[1].tolist() for r in ds]
    [[1, 1, 1, 2, 2], [1, 1, 1, 1, 0]]
    """

    def __init__(self, parent: IterDataset, *, length_struct: Any, num_packing_bins: int):
        if not isinstance(parent, IterDataset):
            raise TypeError(
                f"FirstFitPackIterDataset needs an IterDataset input, got {type(parent).__name__}"
            )
        if (
            isinstance(num_packing_bins, bool)
            or not isinstance(num_packing_bins, int)
            or num_packing_bins < 1
        ):
            raise ValueError(f"num_packing_bins must be a positive int, got {num_packing_bins!r}")
        if isinstance(length_struct, Mapping):
            bad = {
                k: v
                for k, v in length_struct.items()
                if not isinstance(v, int) or isinstance(v, bool) or v < 1
            }
            if bad or not length_struct:
                raise ValueError(
                    f"length_struct must map feature names to positive ints, got {dict(length_struct)!r}"
                )
        elif (
            isinstance(length_struct, bool)
            or not isinstance(length_struct, int)
            or length_struct < 1
        ):
            raise ValueError(
                f"length_struct must be a positive int or a dict of them, got {length_struct!r}"
            )
        self._parent = parent
        self._parents = (parent,)
        self._lengths = dict(length_struct) if isinstance(length_struct, Mapping) else length_struct
        self._bins = num_packing_bins

    def _stage_name(self) -> str:
        return f"first_fit_pack(length_struct={self._lengths}, num_packing_bins={self._bins})"

    def _make_iter(self, rf):
        return _PackIterator(
            self._parent._make_iter(rf), self._lengths, self._bins, self._stage_name(), self._debug
        )


class _PackIterator(DatasetIterator):
    def __init__(self, parent, lengths, num_bins, name, debug):
        super().__init__((parent,), name, debug)
        self._p = parent
        self._dict = isinstance(lengths, dict)
        self._lengths = lengths if self._dict else {"": lengths}
        self._num_bins = num_bins
        self._count = 0
        self._reset()

    def _reset(self) -> None:
        self._bins: list[list[dict]] = []  # each bin: list of {key: array}
        self._fill: list[dict[str, int]] = []
        self._window_start = None
        self._pending: collections.deque = collections.deque()
        self._pending_start = None
        self._emitted = 0
        self._skip = 0
        self._exhausted = False

    def _as_features(self, x: Any) -> dict:
        if self._dict:
            if not isinstance(x, Mapping):
                raise TypeError(
                    f"FirstFitPack: element {self._count} is a {type(x).__name__}, expected a dict"
                )
            if set(x) != set(self._lengths):
                raise ValueError(
                    f"FirstFitPack: element {self._count} has keys {sorted(x)}, but length_struct has "
                    f"{sorted(self._lengths)}"
                )
            items = x.items()
        else:
            items = (("", x),)
        out = {}
        for k, v in items:
            a = np.asarray(v)
            if a.ndim == 0:
                raise ValueError(
                    f"FirstFitPack: feature {k or '<root>'!r} of element {self._count} is a scalar; expected a sequence"
                )
            out[k] = a[: self._lengths[k]]
        return out

    def _place(self, feats: dict) -> bool:
        for b, fill in enumerate(self._fill):
            if all(fill[k] + len(v) <= self._lengths[k] for k, v in feats.items()):
                self._bins[b].append(feats)
                for k, v in feats.items():
                    fill[k] += len(v)
                return True
        if len(self._bins) < self._num_bins:
            self._bins.append([feats])
            self._fill.append({k: len(v) for k, v in feats.items()})
            return True
        return False

    def _flush(self) -> list:
        rows = []
        for members in self._bins:
            row: dict = {}
            for k, length in self._lengths.items():
                parts = [m[k] for m in members]
                vals = np.concatenate(parts)
                pad = [(0, length - len(vals))] + [(0, 0)] * (vals.ndim - 1)
                seg = np.concatenate(
                    [np.full(len(p), s + 1, np.int32) for s, p in enumerate(parts)]
                )
                pos = np.concatenate([np.arange(len(p), dtype=np.int32) for p in parts])
                tail = length - len(vals)
                row[k] = np.pad(vals, pad)
                row[f"{k}_segment_ids"] = np.pad(seg, (0, tail))
                row[f"{k}_positions"] = np.pad(pos, (0, tail))
            if self._dict:
                rows.append(row)
            else:
                rows.append((row[""], row["_segment_ids"], row["_positions"]))
        self._bins, self._fill = [], []
        return rows

    def _next(self):
        while True:
            if self._pending:
                row = self._pending.popleft()
                self._emitted += 1
                if self._skip:
                    self._skip -= 1
                    continue
                return row
            if self._exhausted:
                raise StopIteration
            before = self._p.get_state()
            try:
                x = next(self._p)
            except StopIteration:
                self._exhausted = True
                if self._bins:
                    self._pending.extend(self._flush())
                    self._pending_start, self._emitted = self._window_start, 0
                continue
            feats = self._as_features(x)
            self._count += 1
            if all(len(v) == 0 for v in feats.values()):
                continue
            if not self._bins:
                self._window_start = before
            if not self._place(feats):
                self._pending.extend(self._flush())
                self._pending_start, self._emitted = self._window_start, 0
                self._window_start = before
                self._place(feats)

    def get_state(self) -> dict:
        if self._pending or self._skip:
            return {"parent": self._pending_start, "emitted": self._emitted}
        if self._bins:
            return {"parent": self._window_start, "emitted": 0}
        return {"parent": self._p.get_state(), "emitted": 0}

    def set_state(self, state: dict) -> None:
        _check_state(state, ("parent", "emitted"), "FirstFitPack iterator")
        self._p.set_state(state["parent"])
        self._reset()
        self._skip = int(state["emitted"])
        if self._skip:
            # Re-pack the window the state points into, then drop the rows already emitted.
            self._pending_start = state["parent"]
            while not self._pending and not self._exhausted:
                before = self._p.get_state()
                try:
                    x = next(self._p)
                except StopIteration:
                    self._exhausted = True
                    if self._bins:
                        self._pending.extend(self._flush())
                    break
                feats = self._as_features(x)
                if all(len(v) == 0 for v in feats.values()):
                    continue
                if not self._bins:
                    self._window_start = before
                if not self._place(feats):
                    self._pending.extend(self._flush())
                    self._window_start = before
                    self._place(feats)
            self._pending_start = state["parent"]
            self._emitted = 0
