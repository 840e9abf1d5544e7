"""First-fit sequence packing into fixed-length rows with segment ids and positions."""

from __future__ import annotations

import collections
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cairn.data._arguments import int_at_least as _int_at_least
from cairn.data._dataset import DatasetIterator, IterDataset
from cairn.data._state_validation import (
    StateError,
    any_field,
    check_state,
    int_field,
    nested,
    with_version,
)

__all__ = ["FirstFitPackIterDataset"]

_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64 finaliser on a Python int (mod 2**64)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)


def _window_order(seed: int, window: int, n: int) -> np.ndarray:
    """A permutation of ``range(n)`` that is a pure function of (seed, window).

    Each position gets a SplitMix64 hash of (seed, window, position); the order sorts the
    hashes. A few vectorised NumPy operations, so a restore re-derives the same order.
    """
    base = _mix64((seed & _MASK64) ^ _mix64((window + 0x9E3779B97F4A7C15) & _MASK64))
    z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(base)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return np.argsort(z, kind="stable")


def _padded(shape: tuple, pad: Any, dtype: np.dtype, key: str) -> np.ndarray:
    try:
        return np.full(shape, pad, dtype)
    except (OverflowError, TypeError, ValueError) as e:
        where = f"padding_struct[{key!r}]" if key else "padding_struct"
        raise ValueError(
            f"FirstFitPack: {where}={pad!r} is not a valid {dtype} value for that feature ({e})"
        ) from e


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (numbers.Number, np.generic)) or (
        isinstance(v, np.ndarray) and v.ndim == 0
    )


class FirstFitPackIterDataset(IterDataset):
    """Pack variable-length sequences into rows of fixed length (first fit).

    Elements are dicts of arrays whose first axis is the sequence (or bare arrays).
    ``length_struct`` gives each packed feature's row length (a dict with the same keys,
    or an int for bare arrays). Up to ``num_packing_bins`` rows are open at a time; an
    element goes into the first row where every feature still fits. When an element fits
    in no open row, all open rows are emitted (a *window*) and a new set starts with it.
    Sequences longer than the row are truncated; empty sequences are dropped.

    For a dict element, each packed key ``k`` gives ``k`` (the tokens, padded),
    ``k_segment_ids`` (1, 2, ... per packed sequence, 0 for padding) and ``k_positions``
    (0, 1, ... inside each sequence) as int32. A bare array gives the tuple
    ``(tokens, segment_ids, positions)``.

    The keyword options have Grain's names, defaults and meaning.

    Elements must have exactly the packed keys plus the meta features not in
    ``length_struct``.

    The state is the input's state where the current window began, the window number and
    the number of its rows already emitted, so a restore re-packs (and re-shuffles) the
    same rows.

    Args:
      parent: the input ``IterDataset`` of sequences.
      length_struct: each packed feature's row length: a dict with the packed keys, or an
        int for bare arrays.
      num_packing_bins: how many rows are open at a time (>= 1).
      seed: the seed of the row shuffle.
      shuffle_bins: emit the rows of each window in a shuffled order, a pure function of
        ``(seed, window number)`` (the order differs from Grain's, the set of rows is the same).
      shuffle_bins_group_by_feature: with ``shuffle_bins``, a window's rows come out sorted
        by the mean of this feature's nonzero values in the row (0 when there are none;
        padding is not counted), shuffled among equal keys. It must be a packed key or a
        meta feature. Ignored without ``shuffle_bins`` (as in Grain).
      meta_features: features with no segment ids or positions. One in ``length_struct`` is
        packed and padded like the others; one not in it is returned as the list of the
        row's sequences' values (in the row's order).
      pack_alignment_struct: an int, or a dict with a subset of the packed keys: every
        sequence after the first in a row starts at a multiple of the feature's alignment
        (the gap is padding). Each alignment must divide the row length. None: no alignment.
      padding_struct: a scalar, or a dict with a subset of the packed keys: the value padding
        tokens get (None: 0); segment ids and positions pad with 0.
      max_sequences_per_bin: at most this many sequences in one row; None: no limit.

    >>> import numpy as np
    >>> from cairn.data import MapDataset
    >>> seqs = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6, 7, 8, 9])]
    >>> ds = FirstFitPackIterDataset(
    ...     MapDataset.source(seqs).to_iter_dataset(), length_struct=5, num_packing_bins=2, shuffle_bins=False
    ... )
    >>> [r[0].tolist() for r in ds]
    [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    >>> [r[1].tolist() for r in ds]
    [[1, 1, 1, 2, 2], [1, 1, 1, 1, 0]]
    >>> aligned = FirstFitPackIterDataset(
    ...     MapDataset.source(seqs).to_iter_dataset(), length_struct=8, num_packing_bins=1,
    ...     shuffle_bins=False, pack_alignment_struct=4, padding_struct=-1,
    ... )
    >>> [r[0].tolist() for r in aligned]
    [[1, 2, 3, -1, 4, 5, -1, -1], [6, 7, 8, 9, -1, -1, -1, -1]]
    """

    def __init__(
        self,
        parent: IterDataset,
        *,
        length_struct: Any,
        num_packing_bins: int,
        seed: int = 0,
        shuffle_bins: bool = True,
        shuffle_bins_group_by_feature: str | None = None,
        meta_features: Sequence[str] = (),
        pack_alignment_struct: Any = None,
        padding_struct: Any = None,
        max_sequences_per_bin: int | None = None,
    ) -> None:
        if not isinstance(parent, IterDataset):
            raise TypeError(
                f"FirstFitPackIterDataset needs an IterDataset input, got {type(parent).__name__}"
            )
        if not _int_at_least(num_packing_bins, 1):
            raise ValueError(f"num_packing_bins must be a positive int, got {num_packing_bins!r}")
        is_dict = isinstance(length_struct, Mapping)
        if is_dict:
            if not length_struct or not all(_int_at_least(v, 1) for v in length_struct.values()):
                raise ValueError(
                    f"length_struct must map feature names to positive ints, got {dict(length_struct)!r}"
                )
        elif not _int_at_least(length_struct, 1):
            raise ValueError(
                f"length_struct must be a positive int or a dict of them, got {length_struct!r}"
            )
        lengths = dict(length_struct) if is_dict else {"": length_struct}
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, (bool, np.bool_)):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if not isinstance(shuffle_bins, (bool, np.bool_)):
            raise ValueError(f"shuffle_bins must be True or False, got {shuffle_bins!r}")
        if max_sequences_per_bin is not None and not _int_at_least(max_sequences_per_bin, 1):
            raise ValueError(
                f"max_sequences_per_bin must be None or a positive int, got {max_sequences_per_bin!r}"
            )
        if isinstance(meta_features, (str, bytes)) or not isinstance(meta_features, Sequence):
            raise ValueError(
                f"meta_features must be a sequence of feature names (e.g. a list), got {meta_features!r}"
            )
        meta = list(meta_features)
        if not all(isinstance(m, str) for m in meta) or len(set(meta)) != len(meta):
            raise ValueError(
                f"meta_features must be distinct feature names (str), got {meta_features!r}"
            )
        if meta and not is_dict:
            raise ValueError(
                f"meta_features needs dict elements (a dict length_struct); length_struct is "
                f"{length_struct!r}, got meta_features={meta!r}"
            )
        group = shuffle_bins_group_by_feature
        if group is not None:
            allowed = sorted(set(lengths) | set(meta)) if is_dict else []
            if group not in allowed:
                raise ValueError(
                    "shuffle_bins_group_by_feature must be None or one of the packed or meta "
                    f"features {allowed}, got {group!r}"
                )
        self._parent = parent
        self._parents = (parent,)
        self._lengths = lengths if is_dict else length_struct
        self._bins = num_packing_bins
        self._opts = {
            "seed": int(seed),
            "shuffle": bool(shuffle_bins),
            "group": group,
            "meta": meta,
            "align": self._per_feature(
                pack_alignment_struct, lengths, "pack_alignment_struct", is_dict
            ),
            "pad": self._per_feature(padding_struct, lengths, "padding_struct", is_dict),
            "max_seqs": max_sequences_per_bin,
        }

    @staticmethod
    def _per_feature(struct: Any, lengths: dict, name: str, is_dict: bool) -> dict | None:
        """``pack_alignment_struct`` / ``padding_struct`` as a dict over the packed keys
        (None when not given); checks keys and values."""
        if struct is None:
            return None
        if isinstance(struct, Mapping):
            if not is_dict:
                raise ValueError(
                    f"{name} must be a single value when length_struct is an int, got {dict(struct)!r}"
                )
            extra = sorted(k for k in struct if k not in lengths)
            if extra:
                raise ValueError(
                    f"{name} has keys {extra} that are not in length_struct; expected keys among {sorted(lengths)}"
                )
            out = {k: struct[k] for k in lengths if k in struct and struct[k] is not None}
        else:
            out = dict.fromkeys(lengths, struct)
        for k, v in out.items():
            where = f"{name}[{k!r}]" if is_dict else name
            if name == "padding_struct":
                if not _is_scalar(v):
                    raise ValueError(f"{where} must be a scalar padding value, got {v!r}")
            else:
                if not _int_at_least(v, 1):
                    raise ValueError(f"{where} must be a positive int, got {v!r}")
                if lengths[k] % v:
                    where_len = f"length_struct[{k!r}]" if is_dict else "length_struct"
                    raise ValueError(
                        f"{where}={v} does not divide {where_len}={lengths[k]}; expected a divisor of {lengths[k]}"
                    )
        return out

    def _stage_name(self) -> str:
        o = self._opts
        extra = "".join(
            f", {name}={o[key]!r}"
            for name, key, default in (
                ("seed", "seed", 0),
                ("shuffle_bins", "shuffle", True),
                ("shuffle_bins_group_by_feature", "group", None),
                ("meta_features", "meta", []),
                ("pack_alignment_struct", "align", None),
                ("padding_struct", "pad", None),
                ("max_sequences_per_bin", "max_seqs", None),
            )
            if o[key] != default
        )
        return (
            f"first_fit_pack(length_struct={self._lengths}, num_packing_bins={self._bins}{extra})"
        )

    def _make_iter(self, rf):
        return _PackIterator(
            self._parent._make_iter(rf),
            self._lengths,
            self._bins,
            self._opts,
            self._stage_name(),
            self._debug,
        )


class _PackIterator(DatasetIterator):
    def __init__(self, parent, lengths, num_bins, opts, name, debug):
        super().__init__((parent,), name, debug)
        self._p = parent
        self._dict = isinstance(lengths, dict)
        self._lengths = lengths if self._dict else {"": lengths}
        self._keys = list(self._lengths)
        self._caps = [self._lengths[k] for k in self._keys]
        self._num_bins = num_bins
        meta = opts["meta"]
        self._extra = [m for m in meta if m not in self._lengths]  # one value per sequence
        self._no_seg = {m for m in meta if m in self._lengths}  # packed, no ids/positions
        self._elem_keys = set(self._keys) | set(self._extra)
        align = opts["align"] or {}
        self._align = [align.get(k, 1) for k in self._keys]
        self._aligned = any(a > 1 for a in self._align)
        pad = opts["pad"] or {}
        self._pad = [pad.get(k, 0) for k in self._keys]
        self._max_seqs = opts["max_seqs"]
        self._seed = opts["seed"]
        self._shuffle = opts["shuffle"]
        self._group = opts["group"] if opts["shuffle"] else None
        self._count = 0
        self._windows = 0  # windows flushed so far = number of the window being filled
        self._reset()

    def _reset(self) -> None:
        # Open rows: per row, its members (each a list of feature arrays in key order),
        # their start offsets per feature, their meta values, and the fill per feature.
        self._bins: list[list[list[np.ndarray]]] = []
        self._offs: list[list[list[int]]] = []
        self._metas: list[list[list[Any]]] = []
        self._fill: list[list[int]] = []
        self._window_start = None
        self._pending: collections.deque = collections.deque()
        self._pending_start = None
        self._pending_window = 0
        self._emitted = 0
        self._skip = 0
        self._exhausted = False

    def _as_features(self, x: Any) -> tuple[list[np.ndarray], list[Any]]:
        """The element's packed features in key order, each cut to its row length, and
        its non-sequence meta values."""
        if self._dict:
            if not isinstance(x, Mapping):
                raise TypeError(
                    f"FirstFitPack: element {self._count} is a {type(x).__name__}, expected a dict"
                )
            if len(x) != len(self._elem_keys) or any(k not in x for k in self._elem_keys):
                missing = [m for m in self._extra if m not in x]
                if missing:
                    raise ValueError(
                        f"FirstFitPack: element {self._count} has no meta feature {missing[0]!r} "
                        f"(meta_features not in length_struct: {self._extra}; element keys {sorted(x)})"
                    )
                more = f" and meta_features {self._extra}" if self._extra else ""
                raise ValueError(
                    f"FirstFitPack: element {self._count} has keys {sorted(x)}, but length_struct has "
                    f"{sorted(self._lengths)}{more}"
                )
            values = [x[k] for k in self._keys]
            extras = [x[k] for k in self._extra]
        else:
            values = [x]
            extras = []
        out = []
        for k, v, cap in zip(self._keys, values, self._caps):
            a = v if isinstance(v, np.ndarray) else np.asarray(v)
            if a.ndim == 0:
                raise ValueError(
                    f"FirstFitPack: feature {k or '<root>'!r} of element {self._count} is a scalar; expected a sequence"
                )
            out.append(a if a.shape[0] <= cap else a[:cap])
        return out, extras

    def _place(self, feats: list[np.ndarray], lens: list[int], extras: list[Any]) -> bool:
        caps = self._caps
        max_seqs = self._max_seqs
        bins = self._bins
        for b, fill in enumerate(self._fill):
            if max_seqs is not None and len(bins[b]) >= max_seqs:
                continue
            if self._aligned:
                # A feature with tokens starts at its fill rounded up to the alignment.
                offs = [-(-f // a) * a if n else f for f, n, a in zip(fill, lens, self._align)]
            else:
                offs = fill
            for o, n, c in zip(offs, lens, caps):
                if o + n > c:
                    break
            else:
                bins[b].append(feats)
                self._offs[b].append(offs)
                self._metas[b].append(extras)
                self._fill[b] = [o + n for o, n in zip(offs, lens)]
                return True
        if len(bins) < self._num_bins:
            bins.append([feats])
            self._offs.append([[0] * len(lens)])
            self._metas.append([extras])
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
        offsets = [o for offs in self._offs for o in offs]
        nm = len(members)
        per_bin = np.fromiter((len(m) for m in bins), np.int64, nb)
        row_of = np.repeat(np.arange(nb), per_bin)
        first = np.cumsum(per_bin) - per_bin  # index of each row's first member
        seg_num = (np.arange(nm) - np.repeat(first, per_bin) + 1).astype(np.int32)
        outs: list[dict[str, Any]] = [{} for _ in range(nb)]
        group_key = None
        for j, (k, length) in enumerate(zip(self._keys, self._caps)):
            parts = [m[j] for m in members]
            lens = np.fromiter((p.shape[0] for p in parts), np.int64, nm)
            starts = np.fromiter((o[j] for o in offsets), np.int64, nm)
            pad = self._pad[j]
            cum = np.cumsum(lens) - lens  # start of each member in the flat token list
            total = int(lens.sum())
            rows = np.repeat(row_of, lens)
            pos = np.arange(total, dtype=np.int64) - np.repeat(cum, lens)
            cols = np.repeat(starts, lens) + pos
            tokens = self._tokens(parts, bins, self._offs, j, length, pad, k)
            flat = None
            if tokens is None:  # one dtype and trailing shape: one array for all rows
                flat = np.concatenate(parts)
                if pad == 0:
                    vals = np.zeros((nb, length, *flat.shape[1:]), flat.dtype)
                else:
                    vals = _padded((nb, length, *flat.shape[1:]), pad, flat.dtype, k)
                vals[rows, cols] = flat
                tokens = list(vals)
            if k == self._group and nb > 1:
                group_key = self._row_keys(parts, flat, rows, row_of, nb, k)
            if k in self._no_seg:
                for b in range(nb):
                    outs[b][k] = tokens[b]
                continue
            seg = np.zeros((nb, length), np.int32)
            seg[rows, cols] = np.repeat(seg_num, lens)
            positions = np.zeros((nb, length), np.int32)
            positions[rows, cols] = pos
            for b in range(nb):
                o = outs[b]
                o[k] = tokens[b]
                o[f"{k}_segment_ids"] = seg[b]
                o[f"{k}_positions"] = positions[b]
        for j, k in enumerate(self._extra):
            for b in range(nb):
                outs[b][k] = [m[j] for m in self._metas[b]]
            if k == self._group and nb > 1:
                group_key = self._row_keys(
                    [np.asarray(m[j]) for ms in self._metas for m in ms], None, None, row_of, nb, k
                )
        self._bins, self._offs, self._metas, self._fill = [], [], [], []
        if self._shuffle and nb > 1:
            order = _window_order(self._seed, self._windows, nb)
            if group_key is not None:
                order = order[np.argsort(group_key[order], kind="stable")]
            outs = [outs[i] for i in order]
        self._windows += 1
        if self._dict:
            return outs
        return [(o[""], o["_segment_ids"], o["_positions"]) for o in outs]

    @staticmethod
    def _row_keys(parts, flat, rows, row_of, nb, name) -> np.ndarray:
        """Per row: the mean of the nonzero values of its members' (unpadded) values."""
        try:
            return _PackIterator._row_keys_unchecked(parts, flat, rows, row_of, nb)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"FirstFitPack: shuffle_bins_group_by_feature={name!r} needs numeric values "
                f"(the group key is the mean of the nonzero values in a row); {e}"
            ) from e

    @staticmethod
    def _row_keys_unchecked(parts, flat, rows, row_of, nb) -> np.ndarray:
        if flat is not None:  # one array of all tokens, ``rows`` gives each token's row
            v = flat.reshape(flat.shape[0], int(np.prod(flat.shape[1:])))
            sums = np.bincount(rows, weights=v.sum(axis=1, dtype=np.float64), minlength=nb)
            counts = np.bincount(rows, weights=np.count_nonzero(v, axis=1), minlength=nb)
        else:  # per member
            s = np.fromiter(
                (float(np.sum(p, dtype=np.float64)) for p in parts), np.float64, len(parts)
            )
            c = np.fromiter((np.count_nonzero(p) for p in parts), np.float64, len(parts))
            sums = np.bincount(row_of, weights=s, minlength=nb)
            counts = np.bincount(row_of, weights=c, minlength=nb)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)

    @staticmethod
    def _tokens(parts, bins, offs, j, length, pad, key):
        """Rows of feature ``j`` when members differ in dtype or trailing shape (each row
        then has the dtype NumPy's concatenation of its own members gives); else None."""
        p0 = parts[0]
        dt, tail = p0.dtype, p0.shape[1:]
        if all(p.dtype == dt and p.shape[1:] == tail for p in parts):
            return None
        rows = []
        for members, starts in zip(bins, offs):
            vals = np.concatenate([m[j] for m in members])
            row = _padded((length, *vals.shape[1:]), pad, vals.dtype, key)
            for m, o in zip(members, starts):
                n = m[j].shape[0]
                row[o[j] : o[j] + n] = m[j]
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

    def _flush_to_pending(self) -> None:
        self._pending_window = self._windows
        self._pending.extend(self._flush())
        self._pending_start, self._emitted = self._window_start, 0

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
                    self._flush_to_pending()
                return
            feats, extras = self._as_features(x)
            self._count += 1
            lens = [a.shape[0] for a in feats]
            if not any(lens):
                continue
            if not self._bins:
                self._window_start = before
            if not self._place(feats, lens, extras):
                self._flush_to_pending()
                self._window_start = before
                self._place(feats, lens, extras)

    def get_state(self) -> dict:
        if self._pending or self._skip:
            # Right after set_state the restored rows not yet dropped count as emitted.
            return with_version(
                {
                    "parent": self._pending_start,
                    "emitted": self._emitted + self._skip,
                    "window": self._pending_window,
                }
            )
        if self._bins:
            return with_version(
                {"parent": self._window_start, "emitted": 0, "window": self._windows}
            )
        return with_version({"parent": self._p.get_state(), "emitted": 0, "window": self._windows})

    def set_state(self, state: dict) -> None:
        kind = "FirstFitPack iterator"
        # A window emits at most num_packing_bins rows, and a state is taken before its
        # last row is out: so at most num_packing_bins - 1 rows of it are emitted.
        check_state(
            state,
            kind,
            {
                "parent": any_field,
                "emitted": int_field(0, self._num_bins - 1),
                "window": int_field(0),
            },
            optional=("window",),  # older states have no window number (read as 0)
        )
        before = self.get_state()
        try:
            self._restore(state)
        except BaseException:  # leave the iterator where it was
            self._restore(before)
            raise
        if self._skip and self._skip >= len(self._pending):
            rows = len(self._pending)
            self._restore(before)
            raise StateError(
                kind,
                "emitted",
                f"less than {rows} (the window at this parent state packs into {rows} rows)",
                state["emitted"],
            )

    def _restore(self, state: dict) -> None:
        with nested("parent"):
            self._p.set_state(state["parent"])
        parent = self._p.get_state()  # as given, in the current format (with its version)
        self._reset()
        self._windows = state.get("window", 0)
        self._skip = state["emitted"]
        if self._skip:
            # Re-pack the window the state points into, then drop the rows already emitted.
            self._pending_start = parent
            self._fill_pending()
            self._pending_start = parent
            self._emitted = 0
