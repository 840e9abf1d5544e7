"""FirstFitPackIterDataset against an independent first-fit reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.data import (
    FirstFitPackIterDataset,
    MapDataset,
)


def _pack_reference(seqs, length, bins):
    """Independent first-fit packing of token lists: rows of (tokens, seg, pos)."""
    rows, open_rows = [], []
    for s in seqs:
        s = list(s)[:length]
        if not s:
            continue
        placed = False
        for r in open_rows:
            if sum(map(len, r)) + len(s) <= length:
                r.append(s)
                placed = True
                break
        if not placed and len(open_rows) < bins:
            open_rows.append([s])
            placed = True
        if not placed:
            rows += open_rows
            open_rows = [[s]]
    rows += open_rows
    out = []
    for r in rows:
        tok = [t for s in r for t in s]
        seg = [k + 1 for k, s in enumerate(r) for _ in s]
        pos = [p for s in r for p in range(len(s))]
        pad = length - len(tok)
        out.append((tok + [0] * pad, seg + [0] * pad, pos + [0] * pad))
    return out


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(0, 12), max_size=40),
    length=st.integers(1, 10),
    bins=st.integers(1, 4),
)
def test_first_fit_pack_matches_reference(lens, length, bins):
    seqs = [np.arange(n, dtype=np.int32) + 100 * i for i, n in enumerate(lens)]
    ds = FirstFitPackIterDataset(
        MapDataset.source(seqs).to_iter_dataset(),
        length_struct=length,
        num_packing_bins=bins,
        shuffle_bins=False,
    )
    got = [(a.tolist(), b.tolist(), c.tolist()) for a, b, c in ds]
    assert got == _pack_reference(seqs, length, bins)
    for a, b, c in ds:
        assert a.shape == b.shape == c.shape == (length,) and b.dtype == np.int32


def _pack_dict_reference(elems, lengths, bins):
    """Independent first-fit packing of dict elements (every feature must fit)."""
    keys = list(lengths)
    rows, open_rows = [], []
    for e in elems:
        e = {k: np.asarray(e[k])[: lengths[k]] for k in keys}
        if all(len(e[k]) == 0 for k in keys):
            continue
        for r in open_rows:
            if all(sum(len(m[k]) for m in r) + len(e[k]) <= lengths[k] for k in keys):
                r.append(e)
                break
        else:
            if len(open_rows) < bins:
                open_rows.append([e])
            else:
                rows += open_rows
                open_rows = [[e]]
    rows += open_rows
    out = []
    for r in rows:
        row = {}
        for k in keys:
            vals = np.concatenate([m[k] for m in r])
            tok = np.zeros((lengths[k], *vals.shape[1:]), vals.dtype)
            tok[: len(vals)] = vals
            seg = np.zeros(lengths[k], np.int32)
            pos = np.zeros(lengths[k], np.int32)
            at = 0
            for s, m in enumerate(r):
                seg[at : at + len(m[k])] = s + 1
                pos[at : at + len(m[k])] = np.arange(len(m[k]))
                at += len(m[k])
            row[k], row[f"{k}_segment_ids"], row[f"{k}_positions"] = tok, seg, pos
        out.append(row)
    return out


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 6)), max_size=30),
    bins=st.integers(1, 4),
    mixed=st.booleans(),
)
def test_first_fit_pack_dict_matches_reference(lens, bins, mixed):
    """Two features of different row lengths, one of them 2-D; with ``mixed`` the token
    dtype differs between elements (each row then keeps its own concatenation dtype)."""
    rng = np.random.default_rng(len(lens))
    elems = []
    for i, (a, b) in enumerate(lens):
        dt = (np.int64 if i % 3 == 0 else np.int32) if mixed else np.int32
        elems.append(
            {
                "tok": rng.integers(1, 99, a).astype(dt),
                "emb": rng.standard_normal((b, 2)).astype(np.float32),
            }
        )
    lengths = {"tok": 8, "emb": 5}
    got = list(
        FirstFitPackIterDataset(
            MapDataset.source(elems).to_iter_dataset(),
            length_struct=lengths,
            num_packing_bins=bins,
            shuffle_bins=False,
        )
    )
    want = _pack_dict_reference(elems, lengths, bins)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        for k in w:
            assert g[k].dtype == w[k].dtype and g[k].shape == w[k].shape, k
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)


def test_pack_dict_features_and_errors():
    seqs = [{"tokens": np.arange(n), "mask": np.ones(n, bool)} for n in (3, 4, 2)]
    rows = list(
        FirstFitPackIterDataset(
            MapDataset.source(seqs).to_iter_dataset(),
            length_struct={"tokens": 5, "mask": 5},
            num_packing_bins=2,
            shuffle_bins=False,
        )
    )
    assert sorted(rows[0]) == [
        "mask",
        "mask_positions",
        "mask_segment_ids",
        "tokens",
        "tokens_positions",
        "tokens_segment_ids",
    ]
    assert rows[0]["tokens"].tolist() == [0, 1, 2, 0, 1] and rows[0][
        "tokens_segment_ids"
    ].tolist() == [1, 1, 1, 2, 2]
    assert rows[1]["tokens"].tolist() == [0, 1, 2, 3, 0] and rows[1]["mask"].tolist() == [
        True
    ] * 4 + [False]
    bad = FirstFitPackIterDataset(
        MapDataset.source([{"x": np.arange(2)}]).to_iter_dataset(),
        length_struct={"y": 3},
        num_packing_bins=1,
    )
    with pytest.raises(
        ValueError, match="element 0 has keys \\['x'\\], but length_struct has \\['y'\\]"
    ):
        list(bad)
    with pytest.raises(ValueError, match="num_packing_bins must be a positive int"):
        FirstFitPackIterDataset(
            MapDataset.range(2).to_iter_dataset(), length_struct=3, num_packing_bins=0
        )
