"""First-fit sequence packing into fixed-length rows with segment ids and positions."""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import numpy as np

from cairn.data._iter_dataset import DatasetIterator, IterDataset, _check_state
from cairn.data._map_dataset import _int_at_least

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
        if not _int_at_least(num_packing_bins, 1):
            raise ValueError(f"num_packing_bins must be a positive int, got {num_packing_bins!r}")
        if isinstance(length_struct, Mapping):
            if not length_struct or not all(_int_at_least(v, 1) for v in length_struct.values()):
                raise ValueError(
                    f"length_struct must map feature names to positive ints, got {dict(length_struct)!r}"
                )
        elif not _int_at_least(length_struct, 1):
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
        self._keys = list(self._lengths)
        self._caps = [self._lengths[k] for k in self._keys]
        self._num_bins = num_bins
        self._count = 0
        self._reset()

    def _reset(self) -> None:
        # Open rows: per row, its members (each a list of feature arrays in key order) and
        # its fill per feature.
        self._bins: list[list[list[np.ndarray]]] = []
        self._fill: list[list[int]] = []
        self._window_start = None
        self._pending: collections.deque = collections.deque()
        self._pending_start = None
        self._emitted = 0
        self._skip = 0
        self._exhausted = False

    def _as_features(self, x: Any) -> list[np.ndarray]:
        """The element's features in key order, each cut to its row length."""
        if self._dict:
            if not isinstance(x, Mapping):
                raise TypeError(
                    f"FirstFitPack: element {self._count} is a {type(x).__name__}, expected a dict"
                )
            if len(x) != len(self._keys) or any(k not in x for k in self._keys):
                raise ValueError(
                    f"FirstFitPack: element {self._count} has keys {sorted(x)}, but length_struct has "
                    f"{sorted(self._lengths)}"
                )
            values = [x[k] for k in self._keys]
        else:
            values = [x]
        out = []
        for k, v, cap in zip(self._keys, values, self._caps):
            a = v if isinstance(v, np.ndarray) else np.asarray(v)
            if a.ndim == 0:
                raise ValueError(
                    f"FirstFitPack: feature {k or '<root>'!r} of element {self._count} is a scalar; expected a sequence"
                )
            out.append(a if a.shape[0] <= cap else a[:cap])
        return out

    def _place(self, feats: list[np.ndarray]) -> bool:
        lens = [a.shape[0] for a in feats]
        caps = self._caps
        for b, fill in enumerate(self._fill):
            for f, n, c in zip(fill, lens, caps):
                if f + n > c:
                    break
            else:
                self._bins[b].append(feats)
                self._fill[b] = [f + n for f, n in zip(fill, lens)]
                return True
        if len(self._bins) < self._num_bins:
            self._bins.append([feats])
            self._fill.append(lens)
            return True
        return False

    def _flush(self) -> list:
        """Emit the open rows: one (num_rows, length) array per output, rows are views.

        Every member's tokens go to ``out[row, offset:offset + n]`` by one fancy-index
        assignment per feature; segment ids and positions come from ``np.repeat`` over
        the member lengths, so the cost does not grow with Python work per token.
        """
        bins = self._bins
        nb = len(bins)
        members = [m for members in bins for m in members]
        per_bin = np.fromiter((len(m) for m in bins), np.int64, nb)
        row_of = np.repeat(np.arange(nb), per_bin)
        first = np.cumsum(per_bin) - per_bin  # index of each row's first member
        seg_num = (np.arange(len(members)) - np.repeat(first, per_bin) + 1).astype(np.int32)
        outs: list[dict[str, np.ndarray]] = [{} for _ in range(nb)]
        for j, (k, length) in enumerate(zip(self._keys, self._caps)):
            parts = [m[j] for m in members]
            lens = np.fromiter((p.shape[0] for p in parts), np.int64, len(parts))
            tokens = self._tokens(parts, bins, j, nb, length)
            cum = np.cumsum(lens) - lens  # start of each member in the flat token list
            start_in_row = cum - np.repeat(cum[first], per_bin)
            total = int(lens.sum())
            rows = np.repeat(row_of, lens)
            pos = np.arange(total, dtype=np.int64) - np.repeat(cum, lens)
            cols = np.repeat(start_in_row, lens) + pos
            seg = np.zeros((nb, length), np.int32)
            seg[rows, cols] = np.repeat(seg_num, lens)
            positions = np.zeros((nb, length), np.int32)
            positions[rows, cols] = pos
            if tokens is None:  # one dtype and trailing shape: one array for all rows
                flat = np.concatenate(parts)
                vals = np.zeros((nb, length, *flat.shape[1:]), flat.dtype)
                vals[rows, cols] = flat
                tokens = list(vals)
            for b in range(nb):
                o = outs[b]
                o[k] = tokens[b]
                o[f"{k}_segment_ids"] = seg[b]
                o[f"{k}_positions"] = positions[b]
        self._bins, self._fill = [], []
        if self._dict:
            return outs
        return [(o[""], o["_segment_ids"], o["_positions"]) for o in outs]

    @staticmethod
    def _tokens(parts, bins, j, nb, length):
        """Rows of feature ``j`` when members differ in dtype or trailing shape (each row
        then has the dtype NumPy's concatenation of its own members gives); else None."""
        p0 = parts[0]
        dt, tail = p0.dtype, p0.shape[1:]
        if all(p.dtype == dt and p.shape[1:] == tail for p in parts):
            return None
        rows = []
        for members in bins:
            vals = np.concatenate([m[j] for m in members])
            row = np.zeros((length, *vals.shape[1:]), vals.dtype)
            row[: vals.shape[0]] = vals
            rows.append(row)
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
            self._fill_pending()

    def _fill_pending(self) -> None:
        """Read input elements into the open rows until one fits in none (or the input
        ends): then the open rows move to ``_pending``, which starts at ``_window_start``."""
        while not self._pending and not self._exhausted:
            before = self._p.get_state()
            try:
                x = next(self._p)
            except StopIteration:
                self._exhausted = True
                if self._bins:
                    self._pending.extend(self._flush())
                    self._pending_start, self._emitted = self._window_start, 0
                return
            feats = self._as_features(x)
            self._count += 1
            if not any(a.shape[0] for a in feats):
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
            self._fill_pending()
            self._pending_start = state["parent"]
            self._emitted = 0
