"""FirstFitPackIterDataset's Grain options: seed, shuffle_bins, shuffle_bins_group_by_feature,
meta_features, pack_alignment_struct, padding_struct, max_sequences_per_bin.

Each option is checked against a plain-Python first-fit packer written here (per token,
no NumPy tricks), with hypothesis, against Grain itself where it is installed, and for
exact restores from states taken after every k rows.
"""

import collections
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.data import FirstFitPackIterDataset, MapDataset

LENGTHS = {"a": 8, "b": 6}


def _reference(elems, lengths, bins, *, align=None, pad=None, max_seqs=None, meta=()):
    """Windows (lists of rows) of a first-fit packer; rows are dicts of Python lists.

    A sequence goes into the first open row where, for every feature, its start (the
    row's fill rounded up to the alignment when it has tokens) plus its length fits and
    the row has fewer than ``max_seqs`` sequences; if none, the open rows form a window.
    """
    align, pad = align or {}, pad or {}
    keys = list(lengths)
    extra = [m for m in meta if m not in lengths]
    windows, open_rows = [], []

    def start_of(row, e):
        if max_seqs is not None and len(row["members"]) >= max_seqs:
            return None
        offs = {}
        for k in keys:
            n, f, a = len(e[k]), row["fill"][k], align.get(k, 1)
            o = f if n == 0 else (f + a - 1) // a * a
            if o + n > lengths[k]:
                return None
            offs[k] = o
        return offs

    def add(row, e, offs):
        row["members"].append((e, offs))
        for k in keys:
            row["fill"][k] = offs[k] + len(e[k])

    for elem in elems:
        e = {k: [x.tolist() for x in np.asarray(elem[k])[: lengths[k]]] for k in keys}
        e.update({m: elem[m] for m in extra})
        if not any(e[k] for k in keys):
            continue
        for row in open_rows:
            offs = start_of(row, e)
            if offs is not None:
                add(row, e, offs)
                break
        else:
            new = {"members": [], "fill": dict.fromkeys(keys, 0)}
            add(new, e, dict.fromkeys(keys, 0))
            if len(open_rows) < bins:
                open_rows.append(new)
            else:
                windows.append(open_rows)
                open_rows = [new]
    if open_rows:
        windows.append(open_rows)
    out = []
    for rows in windows:
        built = []
        for row in rows:
            r = {}
            for k in keys:
                tok = [pad.get(k, 0)] * lengths[k]
                seg, pos = [0] * lengths[k], [0] * lengths[k]
                for i, (e, offs) in enumerate(row["members"]):
                    for t, v in enumerate(e[k]):
                        tok[offs[k] + t] = v
                        seg[offs[k] + t] = i + 1
                        pos[offs[k] + t] = t
                r[k] = tok
                if k not in meta:
                    r[f"{k}_segment_ids"], r[f"{k}_positions"] = seg, pos
            for m in extra:
                r[m] = [e[m] for e, _ in row["members"]]
            built.append(r)
        out.append(built)
    return out


def _plain(row):
    return {
        k: (v.tolist() if isinstance(v, np.ndarray) else [x for x in v]) for k, v in row.items()
    }


def _key(row):
    return json.dumps(row, sort_keys=True)


def _elems(lens, mixed=False):
    rng = np.random.default_rng(len(lens))
    out = []
    for i, (na, nb) in enumerate(lens):
        dt = np.int64 if mixed and i % 3 == 0 else np.int32
        out.append(
            {
                "a": rng.integers(1, 99, na).astype(dt),
                "b": rng.integers(0, 3, nb).astype(np.int32),  # zeros too: group keys
                "id": i,
            }
        )
    return out


def _pack(elems, bins, **kw):
    return FirstFitPackIterDataset(
        MapDataset.source(elems).to_iter_dataset(),
        length_struct=LENGTHS,
        num_packing_bins=bins,
        **kw,
    )


OPTIONS = dict(
    align=st.sampled_from([None, {"a": 2}, {"a": 4, "b": 3}, {"b": 2}]),
    pad=st.sampled_from([None, {"a": -1}, {"a": 7, "b": -3}]),
    max_seqs=st.sampled_from([None, 1, 2, 3]),
    meta=st.sampled_from([(), ("id",), ("b",), ("b", "id")]),
)
LENS = st.lists(st.tuples(st.integers(0, 10), st.integers(0, 7)), max_size=30)


def _kwargs(align, pad, max_seqs, meta):
    return dict(
        pack_alignment_struct=align,
        padding_struct=pad,
        max_sequences_per_bin=max_seqs,
        meta_features=list(meta),
    )


def _strip_id(elems, meta):
    # Without "id" as a meta feature the elements must not carry it.
    return elems if "id" in meta else [{"a": e["a"], "b": e["b"]} for e in elems]


@settings(max_examples=25, deadline=None)
@given(lens=LENS, bins=st.integers(1, 4), mixed=st.booleans(), **OPTIONS)
def test_options_match_reference_unshuffled(lens, bins, mixed, align, pad, max_seqs, meta):
    elems = _strip_id(_elems(lens, mixed), meta)
    ds = _pack(elems, bins, shuffle_bins=False, **_kwargs(align, pad, max_seqs, meta))
    got = [_plain(r) for r in ds]
    want = [
        r
        for w in _reference(
            elems, LENGTHS, bins, align=align, pad=pad, max_seqs=max_seqs, meta=meta
        )
        for r in w
    ]
    assert got == want
    for r in ds:
        assert r["a"].shape == (8,) and r["b"].shape == (6,)
        if "b" not in meta:
            assert r["b_segment_ids"].dtype == np.int32 and r["b_positions"].dtype == np.int32
        if max_seqs is not None:
            assert r["a_segment_ids"].max() <= max_seqs


def _group_key(row, feature, pad):
    """Mean of the feature's nonzero values over the row's real tokens (0 if none)."""
    vals = row[feature]
    if f"{feature}_segment_ids" in row:
        vals = [v for v, s in zip(vals, row[f"{feature}_segment_ids"]) if s]
    elif feature in LENGTHS:  # a packed meta feature: its padding value never occurs here
        vals = [v for v in vals if v != pad]
    nz = [v for v in vals if v != 0]
    return sum(nz) / len(nz) if nz else 0.0


@settings(max_examples=25, deadline=None)
@given(
    lens=LENS,
    bins=st.integers(1, 5),
    seed=st.integers(-(2**70), 2**70),
    group=st.sampled_from([None, "a", "b", "id"]),
    **OPTIONS,
)
def test_shuffle_permutes_each_window(lens, bins, seed, group, align, pad, max_seqs, meta):
    meta = tuple(meta) + (("id",) if group == "id" and "id" not in meta else ())
    elems = _strip_id(_elems(lens), meta)
    kw = _kwargs(align, pad, max_seqs, meta)
    ds = _pack(elems, bins, seed=seed, shuffle_bins_group_by_feature=group, **kw)
    got = [_plain(r) for r in ds]
    assert got == [_plain(r) for r in ds]  # deterministic
    windows = _reference(elems, LENGTHS, bins, align=align, pad=pad, max_seqs=max_seqs, meta=meta)
    at = 0
    for w in windows:
        mine = got[at : at + len(w)]
        at += len(w)
        assert sorted(map(_key, mine)) == sorted(map(_key, w))
        if group is not None:
            keys = [_group_key(r, group, (pad or {}).get(group, 0)) for r in mine]
            assert keys == sorted(keys)
    assert at == len(got)


def test_shuffle_order_depends_on_seed_and_window():
    # Every sequence fills a row, so each window holds 16 rows in input order.
    elems = [{"a": np.full(8, i + 1), "b": np.full(1, i % 3)} for i in range(64)]

    def order(seed, shuffle=True):
        ds = _pack(elems, 16, seed=seed, shuffle_bins=shuffle)
        return [int(r["a"][0]) - 1 for r in ds]

    assert order(0, shuffle=False) == list(range(64))
    o0, o1 = order(0), order(1)
    assert o0 == order(0) and o0 != o1
    for o in (o0, o1):
        windows = [[x - 16 * w for x in o[16 * w : 16 * w + 16]] for w in range(4)]
        assert all(sorted(w) == list(range(16)) for w in windows)
        assert len({tuple(w) for w in windows}) == 4  # a new order for every window
    assert order(2**64 + 5) == order(5)  # the seed counts modulo 2**64
    grouped = _pack(elems, 16, shuffle_bins_group_by_feature="b")
    keys = [int(r["b"][0]) for r in grouped]
    assert all(keys[16 * w : 16 * w + 16] == sorted(keys[16 * w : 16 * w + 16]) for w in range(4))
    ignored = _pack(elems, 16, shuffle_bins=False, shuffle_bins_group_by_feature="b")
    assert [int(r["a"][0]) - 1 for r in ignored] == list(range(64))


@settings(max_examples=15, deadline=None)
@given(
    lens=st.lists(st.integers(0, 12), max_size=30),
    bins=st.integers(1, 3),
    align=st.sampled_from([1, 2, 5, 10]),
    pad=st.integers(-5, 5),
    max_seqs=st.sampled_from([None, 1, 2]),
)
def test_bare_arrays_with_options(lens, bins, align, pad, max_seqs):
    seqs = [np.arange(1, n + 1) + 100 * i for i, n in enumerate(lens)]
    ds = FirstFitPackIterDataset(
        MapDataset.source(seqs).to_iter_dataset(),
        length_struct=10,
        num_packing_bins=bins,
        shuffle_bins=False,
        pack_alignment_struct=align,
        padding_struct=pad,
        max_sequences_per_bin=max_seqs,
    )
    got = [(t.tolist(), s.tolist(), p.tolist()) for t, s, p in ds]
    ref = _reference(
        [{"x": s} for s in seqs],
        {"x": 10},
        bins,
        align={"x": align},
        pad={"x": pad},
        max_seqs=max_seqs,
    )
    assert got == [(r["x"], r["x_segment_ids"], r["x_positions"]) for w in ref for r in w]


def test_meta_features_output():
    elems = [{"t": np.arange(1, n + 1), "src": f"doc{n}"} for n in (3, 2, 4, 1)]
    rows = list(
        FirstFitPackIterDataset(
            MapDataset.source(elems).to_iter_dataset(),
            length_struct={"t": 6},
            num_packing_bins=2,
            shuffle_bins=False,
            meta_features=["src"],
        )
    )
    assert [r["src"] for r in rows] == [["doc3", "doc2", "doc1"], ["doc4"]]
    assert sorted(rows[0]) == ["src", "t", "t_positions", "t_segment_ids"]
    seq_meta = list(
        FirstFitPackIterDataset(
            MapDataset.source([{"t": np.arange(3), "w": np.ones(3)}]).to_iter_dataset(),
            length_struct={"t": 4, "w": 4},
            num_packing_bins=1,
            meta_features=["w"],
        )
    )
    assert sorted(seq_meta[0]) == ["t", "t_positions", "t_segment_ids", "w"]
    assert seq_meta[0]["w"].tolist() == [1, 1, 1, 0]


# --- exact restores ---

RESTORE_CASES = {
    "shuffle": dict(seed=3),
    "shuffle_grouped": dict(seed=4, shuffle_bins_group_by_feature="b"),
    "max_sequences_per_bin": dict(shuffle_bins=False, max_sequences_per_bin=2),
    "max_seqs_shuffled": dict(max_sequences_per_bin=1, seed=9),
    "meta_features": dict(meta_features=["id", "b"], seed=1),
    "aligned_padded": dict(pack_alignment_struct={"a": 4}, padding_struct={"a": -1}, seed=2),
}


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("case", sorted(RESTORE_CASES))
def test_restore_after_every_k_rows(case, k):
    kw = RESTORE_CASES[case]
    rng = np.random.default_rng(7)
    elems = _elems([tuple(x) for x in rng.integers(0, 8, (40, 2))])
    if "id" not in kw.get("meta_features", ()):
        elems = _strip_id(elems, ())
    ds = _pack(elems, 3, **kw)
    full = [_plain(r) for r in ds]
    assert len(full) > 6
    it = iter(ds)
    states = [(0, it.get_state())]
    for i, row in enumerate(it, 1):
        assert _plain(row) == full[i - 1]
        if i % k == 0:
            states.append((i, json.loads(json.dumps(it.get_state()))))
    states.append((len(full), it.get_state()))
    reused = iter(ds)
    next(reused)
    for i, state in states:
        fresh = iter(ds)
        fresh.set_state(state)
        assert [_plain(r) for r in fresh] == full[i:], (case, i)
        reused.set_state(state)
        assert [_plain(r) for r in reused] == full[i:], (case, i)


def test_old_state_without_window_still_restores():
    elems = _strip_id(_elems([(3, 2)] * 12), ())
    ds = _pack(elems, 2, shuffle_bins=False)
    full = [_plain(r) for r in ds]
    it = iter(ds)
    next(it)
    state = it.get_state()
    state.pop("window")
    it2 = iter(ds)
    it2.set_state(state)
    assert [_plain(r) for r in it2] == full[1:]


# --- against Grain ---


def _grain_rows(elems, bins, **kw):
    grain = pytest.importorskip("grain")
    ds = grain.experimental.FirstFitPackIterDataset(
        grain.MapDataset.source(elems).to_iter_dataset(),
        length_struct=LENGTHS,
        num_packing_bins=bins,
        **kw,
    )
    return [_plain(r) for r in ds]


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(pack_alignment_struct={"a": 4, "b": 2}),
        dict(padding_struct={"a": -1, "b": -2}),
        dict(max_sequences_per_bin=2),
        dict(meta_features=["id"]),
        dict(meta_features=["b"]),
        dict(pack_alignment_struct={"a": 2, "b": 3}, max_sequences_per_bin=3, meta_features=["id"]),
    ],
    ids=str,
)
def test_same_rows_as_grain(kw):
    rng = np.random.default_rng(11)
    elems = _elems([tuple(x) for x in rng.integers(1, 7, (30, 2))])
    if "id" not in kw.get("meta_features", ()):
        elems = _strip_id(elems, ())
    if "padding_struct" in kw:  # Grain wants a value for every packed feature
        ours_kw = dict(kw, padding_struct={"a": -1, "b": -2})
    else:
        ours_kw = kw
    want = _grain_rows(elems, 3, shuffle_bins=False, **kw)
    assert [_plain(r) for r in _pack(elems, 3, shuffle_bins=False, **ours_kw)] == want
    # Shuffled (Grain's default): a different order of the same rows.
    shuffled_grain = _grain_rows(elems, 3, **kw)
    shuffled = [_plain(r) for r in _pack(elems, 3, **ours_kw)]
    assert collections.Counter(map(_key, shuffled)) == collections.Counter(
        map(_key, shuffled_grain)
    )


# --- errors ---


def _src():
    return MapDataset.source([{"a": np.arange(3), "b": np.arange(2)}]).to_iter_dataset()


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(pack_alignment_struct={"a": 3}),
            r"pack_alignment_struct\['a'\]=3 does not divide length_struct\['a'\]=8; expected a divisor of 8",
        ),
        (
            dict(pack_alignment_struct={"a": 0}),
            r"pack_alignment_struct\['a'\] must be a positive int, got 0",
        ),
        (dict(pack_alignment_struct=5), r"pack_alignment_struct\['a'\]=5 does not divide"),
        (
            dict(pack_alignment_struct={"z": 2}),
            r"pack_alignment_struct has keys \['z'\] that are not in length_struct; expected keys among \['a', 'b'\]",
        ),
        (
            dict(padding_struct={"a": [1, 2]}),
            r"padding_struct\['a'\] must be a scalar padding value, got \[1, 2\]",
        ),
        (
            dict(padding_struct={"q": 1}),
            r"padding_struct has keys \['q'\] that are not in length_struct",
        ),
        (
            dict(shuffle_bins_group_by_feature="zz"),
            r"shuffle_bins_group_by_feature must be None or one of the packed or meta features \['a', 'b'\], got 'zz'",
        ),
        (dict(shuffle_bins_group_by_feature="id"), r"features \['a', 'b'\], got 'id'"),
        (
            dict(meta_features="id"),
            r"meta_features must be a sequence of feature names \(e.g. a list\), got 'id'",
        ),
        (dict(meta_features=["id", "id"]), r"meta_features must be distinct feature names"),
        (
            dict(meta_features=[3]),
            r"meta_features must be distinct feature names \(str\), got \[3\]",
        ),
        (
            dict(max_sequences_per_bin=0),
            r"max_sequences_per_bin must be None or a positive int, got 0",
        ),
        (
            dict(max_sequences_per_bin=1.5),
            r"max_sequences_per_bin must be None or a positive int, got 1.5",
        ),
        (dict(seed=1.0), r"seed must be an int, got 1.0"),
        (dict(shuffle_bins="yes"), r"shuffle_bins must be True or False, got 'yes'"),
    ],
)
def test_bad_options_name_the_option(kw, match):
    with pytest.raises(ValueError, match=match):
        FirstFitPackIterDataset(_src(), length_struct=LENGTHS, num_packing_bins=2, **kw)


def test_bad_options_for_bare_arrays_and_elements():
    src = MapDataset.range(3).map(lambda i: np.arange(i + 1)).to_iter_dataset()
    with pytest.raises(
        ValueError,
        match=r"meta_features needs dict elements \(a dict length_struct\); length_struct is 4",
    ):
        FirstFitPackIterDataset(src, length_struct=4, num_packing_bins=1, meta_features=["m"])
    with pytest.raises(
        ValueError,
        match=r"shuffle_bins_group_by_feature must be None or one of the packed or meta features \[\], got 'x'",
    ):
        FirstFitPackIterDataset(
            src, length_struct=4, num_packing_bins=1, shuffle_bins_group_by_feature="x"
        )
    with pytest.raises(
        ValueError,
        match=r"pack_alignment_struct must be a single value when length_struct is an int",
    ):
        FirstFitPackIterDataset(
            src, length_struct=4, num_packing_bins=1, pack_alignment_struct={"x": 2}
        )
    with pytest.raises(
        ValueError,
        match=r"pack_alignment_struct=3 does not divide length_struct=4; expected a divisor of 4",
    ):
        FirstFitPackIterDataset(src, length_struct=4, num_packing_bins=1, pack_alignment_struct=3)
    missing = FirstFitPackIterDataset(
        _src(), length_struct=LENGTHS, num_packing_bins=1, meta_features=["id"]
    )
    with pytest.raises(
        ValueError,
        match=r"element 0 has no meta feature 'id' \(meta_features not in length_struct: \['id'\]",
    ):
        list(missing)
    it = iter(FirstFitPackIterDataset(_src(), length_struct=LENGTHS, num_packing_bins=1))
    with pytest.raises(
        ValueError, match=r"FirstFitPack iterator state at 'window': expected an int >= 0, got -1"
    ):
        it.set_state({"parent": {"next_index": 0}, "emitted": 0, "window": -1})


def test_bad_values_found_while_packing():
    text_meta = FirstFitPackIterDataset(
        MapDataset.source([{"t": np.arange(1, 3), "src": "x"}] * 3).to_iter_dataset(),
        length_struct={"t": 2},
        num_packing_bins=2,
        meta_features=["src"],
        shuffle_bins_group_by_feature="src",
    )
    with pytest.raises(
        ValueError, match=r"shuffle_bins_group_by_feature='src' needs numeric values"
    ):
        list(text_meta)
    small = FirstFitPackIterDataset(
        MapDataset.source([np.arange(3, dtype=np.uint8)]).to_iter_dataset(),
        length_struct=4,
        num_packing_bins=1,
        padding_struct=-1,
    )
    with pytest.raises(ValueError, match=r"padding_struct=-1 is not a valid uint8 value"):
        list(small)
    mixed = FirstFitPackIterDataset(
        MapDataset.source(
            [{"t": np.arange(2, dtype=np.uint8)}, {"t": np.arange(2, dtype=np.uint16)}]
        ).to_iter_dataset(),
        length_struct={"t": 8},
        num_packing_bins=1,
        padding_struct={"t": 70000},
    )
    with pytest.raises(
        ValueError, match=r"padding_struct\['t'\]=70000 is not a valid uint16 value"
    ):
        list(mixed)
