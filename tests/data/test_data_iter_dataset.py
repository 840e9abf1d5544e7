"""IterDataset steps, packing, interleave, prefetch, summaries, DataLoader, device_put."""

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.data import (
    Batch,
    DataLoader,
    FilterTransform,
    FirstFitPackIterDataset,
    IndexSampler,
    InterleaveIterDataset,
    IterDataset,
    MapDataset,
    MapTransform,
    MixIterDataset,
    NoSharding,
    RandomMapTransform,
    ReadOptions,
    ShardByJaxProcess,
    ShardOptions,
    assert_equal_output_after_checkpoint,
    device_put,
)


def test_iter_steps_match_reference():
    ds = MapDataset.range(30).to_iter_dataset()
    out = list(
        ds.map(lambda x: x + 1)
        .filter(lambda x: x % 4 != 0)
        .batch(4, drop_remainder=True)
        .map(lambda b: b.tolist())
    )
    ref = [x + 1 for x in range(30) if (x + 1) % 4 != 0]
    assert out == [ref[i : i + 4] for i in range(0, len(ref) - 3, 4)]
    assert [b.tolist() for b in ds.batch(8)][-1] == list(range(24, 30))
    r = ds.batch(2).random_map(lambda b, rng: b + rng.integers(100), seed=1)
    assert [x.tolist() for x in r] == [x.tolist() for x in r]
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        ds.batch(0)


def test_threads_give_the_same_stream():
    ds = MapDataset.range(1000).shuffle(seed=5).map(lambda x: x * 2)
    ref = list(ds.to_iter_dataset())
    assert list(ds.to_iter_dataset(ReadOptions(num_threads=3, chunk_records=7))) == ref
    with pytest.raises(ValueError, match="num_threads must be an int >= 0"):
        ReadOptions(num_threads=-1)


def test_threaded_read_restores_mid_stream():
    # set_state on an iterator whose read threads already have chunks in flight.
    it = iter(MapDataset.range(500).to_iter_dataset(ReadOptions(num_threads=2, chunk_records=10)))
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.set_state({"next_index": 250})
    assert list(it) == list(range(250, 500))
    it.set_state({"next_index": 7})
    assert next(it) == 7
    it.close()


def test_prefetch_propagates_errors_and_restores():
    def bad(x):
        if x == 5:
            raise ZeroDivisionError("bad record 5")
        return x

    it = iter(
        MapDataset.range(10).to_iter_dataset().batch(1).map(lambda b: bad(int(b[0]))).prefetch(2)
    )
    assert [next(it) for _ in range(5)] == list(range(5))
    with pytest.raises(ZeroDivisionError, match="bad record 5"):
        next(it)
    it.close()
    it = iter(MapDataset.range(10).to_iter_dataset().prefetch(3))
    assert [next(it) for _ in range(4)] == [0, 1, 2, 3]
    st_ = it.get_state()
    assert list(it) == list(range(4, 10))
    it.set_state(st_)
    assert list(it) == list(range(4, 10))
    it.close()


def test_interleave_order_and_errors():
    dss = [MapDataset.range(k * 10, k * 10 + n).to_iter_dataset() for k, n in enumerate([3, 1, 2])]
    assert list(IterDataset.interleave(dss, cycle_length=2)) == [0, 10, 1, 20, 2, 21]
    assert list(IterDataset.interleave(dss)) == [0, 10, 20, 1, 21, 2]
    with pytest.raises(ValueError, match="cycle_length must be a positive int"):
        InterleaveIterDataset(dss, cycle_length=0)
    with pytest.raises(TypeError, match="input 0 is a list"):
        InterleaveIterDataset([[1]])


def _mix_reference(streams, weights, period=1000):
    """Independent weighted mix: input k owns the slots where its share of the first n
    slots, rounded to the period's largest-remainder counts, first exceeds its count."""
    w = np.asarray(weights, np.float64) / np.sum(weights)
    raw = w * period
    counts = np.floor(raw).astype(int)
    for k in np.argsort(-(raw - counts), kind="stable")[: period - counts.sum()]:
        counts[k] += 1
    events = sorted(((j + 0.5) / c, k) for k, c in enumerate(counts) for j in range(c))
    pattern = [k for _, k in events]
    its = [iter(s) for s in streams]
    out = []
    for n in range(10**9):
        try:
            out.append(next(its[pattern[n % period]]))
        except StopIteration:
            return out


@settings(max_examples=25, deadline=None)
@given(
    weights=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    sizes=st.lists(st.integers(0, 400), min_size=4, max_size=4),
)
def test_iter_mix_matches_reference_and_map_mix(weights, sizes):
    streams = [list(range(k * 1000, k * 1000 + n)) for k, n in enumerate(sizes[: len(weights)])]
    ds = IterDataset.mix([MapDataset.source(s).to_iter_dataset() for s in streams], weights)
    got = list(ds)
    assert got == _mix_reference(streams, weights)
    # the same pattern as MapDataset.mix over the same inputs
    assert got == list(MapDataset.mix([MapDataset.source(s) for s in streams], weights))


def test_iter_mix_filtered_inputs_resume_exactly():
    a = MapDataset.range(0, 500).filter(lambda x: x % 3 != 0).to_iter_dataset()
    b = MapDataset.range(1000, 1300).shuffle(seed=4).to_iter_dataset().batch(2)
    ds = IterDataset.mix([a, b], [2.0, 1.0])
    full = list(ds)
    kinds = {type(x).__name__ for x in full}
    assert len(full) > 300 and "int" in kinds and len(kinds) == 2  # elements and batches
    for k in (0, 1, 7, len(full) // 2, len(full)):
        it = iter(ds)
        head = [next(it) for _ in range(k)]
        state = it.get_state()
        it2 = iter(ds)
        it2.set_state(state)
        rest = list(it2)
        assert _same(head + rest, full), k
    assert ds.graph().count("mix(weights=[0.667, 0.333])") == 1


def _same(xs, ys):
    return len(xs) == len(ys) and all(np.array_equal(x, y) for x, y in zip(xs, ys))


def test_iter_mix_errors():
    a = MapDataset.range(4).to_iter_dataset()
    with pytest.raises(ValueError, match="weights must be finite"):
        IterDataset.mix([a, a], [1, float("nan")])
    with pytest.raises(ValueError, match="2 datasets but 1 weights"):
        IterDataset.mix([a, a], [1])
    with pytest.raises(ValueError, match="needs at least one dataset"):
        MixIterDataset([])
    with pytest.raises(TypeError, match="input 1 is a int"):
        IterDataset.mix([a, 3])
    it = iter(IterDataset.mix([a, a]))
    with pytest.raises(ValueError, match="mix iterator state at 'inputs': expected a value"):
        it.set_state({"index": 0})
    with pytest.raises(ValueError, match="the states of the 2 inputs"):
        it.set_state({"index": 0, "inputs": [{"next_index": 0}]})


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


def test_summary_and_graph():
    ds = MapDataset.range(100).shuffle(seed=0).map(_triple).to_iter_dataset().batch(10).prefetch(2)
    it = iter(ds)
    list(it)
    text = it.summary()
    lines = text.splitlines()
    assert lines[0].split()[:6] == [
        "stage",
        "out",
        "total_s",
        "self_s",
        "wait_share",
        "buffer_fill",
    ]
    assert lines[2].split()[0] == "prefetch(2)" and lines[2].split()[1] == "10"
    rows = _stage_rows(it)
    # every stage has its own row, the MapDataset ones below to_iter_dataset
    assert list(rows) == [
        "prefetch(2)",
        "batch(10)",
        "to_iter_dataset",
        "map(_triple)",
        "shuffle(seed=0)",
        "range(0, 100, 1)",
    ]
    assert rows["to_iter_dataset"][0] == 100 and rows["shuffle(seed=0)"][0] == 100
    for _count, total, own in rows.values():  # own time never exceeds total time
        assert own <= total + 1e-9
    g = ds.graph().splitlines()
    assert g[:3] == [
        "prefetch(2)",
        "batch(10)",
        "to_iter_dataset(ReadOptions(num_threads=0, prefetch_buffer_size=2, chunk_records=1024))",
    ]
    it.close()


class Double(MapTransform):
    def map(self, x):
        return x * 2


class Odd(FilterTransform):
    def filter(self, x):
        return x % 4 == 2


class Noise(RandomMapTransform):
    def random_map(self, x, rng):
        return x + rng.integers(1, 2)  # always 1: deterministic check of the rng plumbing


def test_data_loader_matches_dataset_pipeline():
    src = list(range(40))
    loader = DataLoader(
        data_source=src,
        sampler=IndexSampler(
            40, shard_options=ShardOptions(1, 2), shuffle=True, seed=3, num_epochs=2
        ),
        operations=[Double(), Odd(), Noise(), Batch(3)],
    )
    ref = (
        MapDataset.source(src)[20:40]
        .shuffle(seed=3)
        .repeat(2)
        .map(lambda x: x * 2)
        .filter(lambda x: x % 4 == 2)
    )
    flat = [x + 1 for x in ref.to_iter_dataset()]
    got = [b.tolist() for b in loader]
    assert got == [flat[i : i + 3] for i in range(0, len(flat), 3)]
    with pytest.raises(ValueError, match="sampler expects 41 records but the source has 40"):
        DataLoader(data_source=src, sampler=IndexSampler(41))
    with pytest.raises(TypeError, match="operation 0 is a int"):
        DataLoader(data_source=src, sampler=IndexSampler(40), operations=[3])
    with pytest.raises(ValueError, match="needs a seed"):
        IndexSampler(3, shuffle=True)


def _triple(x):
    return x * 3


def _even(x):
    return x % 2 == 0


def _stage_rows(it):
    out = {}
    for ln in it.summary().splitlines()[2:]:
        parts = ln.split()
        if parts and not parts[0].startswith(("main", "worker")):
            # the last five columns are numbers; the stage name may contain spaces
            out[" ".join(parts[:-5])] = (int(parts[-5]), float(parts[-4]), float(parts[-3]))
    return out


@pytest.mark.parametrize("how", ["inline", "threads", "workers"])
def test_summary_counts_each_map_stage(how):
    ds = MapDataset.range(600).map(_triple).filter(_even).batch(8)
    if how == "threads":
        root = ds.to_iter_dataset(ReadOptions(num_threads=2))
    else:
        root = ds.to_iter_dataset()
    if how == "workers":
        root = root.mp_prefetch(2)
    it = iter(root)
    out = list(it)
    rows = _stage_rows(it)
    it.close()
    assert sum(len(b) for b in out) == 300
    # a full pass reads every element exactly once, in whichever process or thread
    assert rows["map(_triple)"][0] == 600 and rows["range(0, 600, 1)"][0] == 600
    assert rows["filter(_even)"][0] == 300  # elements that passed
    assert rows["batch(8)"][0] == 75 == len(out)  # batches of 8 indices, Nones dropped
    assert rows["batch(8)"][1] >= rows["filter(_even)"][1] >= rows["map(_triple)"][1]


def test_sharding_options():
    assert NoSharding() == ShardOptions(0, 1)
    with pytest.raises(ValueError, match="shard_index must be in \\[0, 2\\)"):
        ShardOptions(2, 2)


def test_shard_by_jax_process():
    if importlib.util.find_spec("jax") is None:  # cairn-data alone: a clear error, not a crash
        with pytest.raises(ImportError, match="ShardByJaxProcess needs JAX"):
            ShardByJaxProcess(drop_remainder=True)
        return
    so = ShardByJaxProcess(drop_remainder=True)
    assert (so.shard_index, so.shard_count, so.drop_remainder) == (0, 1, True)


def test_device_put_with_jax():
    jax = pytest.importorskip("jax")
    ds = device_put(MapDataset.range(8).batch(4).to_iter_dataset(), jax.devices()[0])
    it = iter(ds)
    out = list(it)
    assert all(isinstance(b, jax.Array) for b in out)
    assert [np.asarray(b).tolist() for b in out] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    it.set_state({"next_index": 1})
    assert np.asarray(next(it)).tolist() == [4, 5, 6, 7]
    it.close()


@pytest.mark.multiprocess
def test_device_put_restores_after_every_step_with_and_without_workers():
    jax = pytest.importorskip("jax")
    dev = jax.devices()[0]
    base = MapDataset.range(60).shuffle(seed=2).map(_triple).batch(4).to_iter_dataset()
    assert_equal_output_after_checkpoint(device_put(base, dev))
    # Workers forked by a process that already runs JAX (they never call it), restored
    # into 0 workers and back.
    two = device_put(base.mp_prefetch(2), dev, buffer_size=3)
    assert_equal_output_after_checkpoint(two, restore_ds=device_put(base, dev), max_steps=None)
    assert_equal_output_after_checkpoint(device_put(base, dev), restore_ds=two, max_steps=3)
    with iter(two) as it:
        out = list(it)
    assert all(isinstance(b, jax.Array) for b in out)
    assert [np.asarray(b).tolist() for b in out] == [b.tolist() for b in base]


def test_imports_and_runs_without_jax():
    code = (
        "import sys; sys.modules['jax'] = None\n"
        "import cairn.data as cd\n"
        "ds = cd.MapDataset.range(20).shuffle(seed=1).map(lambda x: x * 2).batch(5).to_iter_dataset()\n"
        "it = iter(ds); next(it); st = it.get_state(); assert len(list(it)) == 3\n"
        "assert 'jax' not in [m for m in sys.modules if sys.modules[m] is not None and m.split('.')[0] == 'jax']\n"
        "try:\n    cd.ShardByJaxProcess()\nexcept ImportError as e:\n    assert 'needs JAX' in str(e)\nelse:\n    raise SystemExit('no error')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
