"""MapDataset transformations against plain-Python references."""

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.data import MapDataset, ReadOptions, StructureMismatchError, stack_records
from cairn.data._permutation import permute


def test_source_kinds_and_batched_reads():
    class Counting:
        def __init__(self, n):
            self.n, self.calls, self.single = n, 0, 0

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            self.single += 1
            return i * 2

        def __getitems__(self, idx):
            self.calls += 1
            return [int(i) * 2 for i in idx]

    src = Counting(1000)
    ds = MapDataset.source(src).shuffle(seed=0).batch(64)
    batches = list(ds.to_iter_dataset(ReadOptions(chunk_records=256)))
    assert sorted(np.concatenate(batches).tolist()) == list(range(0, 2000, 2))
    # One batched read per chunk of 256 records (after a ramp of 1, 2 batches), never per record.
    assert src.single == 0 and src.calls <= 2 + 1000 // 256 + 2
    assert list(MapDataset.source(np.arange(5) * 3)) == [0, 3, 6, 9, 12]
    assert list(MapDataset.source((7, 8))) == [7, 8]
    with pytest.raises(TypeError, match="random-access source"):
        MapDataset.source(iter([1, 2]))


def test_indexing():
    ds = MapDataset.range(10).map(lambda x: x + 1)
    assert ds[0] == 1 and ds[-1] == 10
    assert list(ds[2:8:3]) == [3, 6]
    with pytest.raises(IndexError, match="out of range .* length 10"):
        ds[10]
    with pytest.raises(TypeError, match="integers or slices"):
        ds["a"]
    with pytest.raises(IndexError, match="index 12 is out of range"):
        ds.__getitems__([1, 12])


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 200), bs=st.integers(1, 70), drop=st.booleans())
def test_batch_matches_reference(n, bs, drop):
    ds = MapDataset.range(n).map(lambda x: np.array([x, -x])).batch(bs, drop_remainder=drop)
    ref = [np.array([[x, -x] for x in range(s, min(s + bs, n))]) for s in range(0, n, bs)]
    if drop:
        ref = [b for b in ref if len(b) == bs]
    got = list(ds)
    assert len(ds) == len(ref) == len(got)
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g, r.reshape(-1, 2))


def test_batch_size_errors_and_batch_fn():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            MapDataset.range(3).batch(bad)
    ds = MapDataset.range(5).batch(2, batch_fn=lambda xs: sum(xs))
    assert list(ds) == [1, 5, 4]


def test_batch_structures():
    recs = [{"a": np.full(3, i), "b": (i, float(i)), "s": f"x{i}"} for i in range(5)]
    b = list(MapDataset.source(recs).batch(5))[0]
    np.testing.assert_array_equal(b["a"], np.repeat(np.arange(5)[:, None], 3, 1))
    assert b["b"][0].tolist() == list(range(5)) and b["b"][1].dtype == np.float64
    assert b["s"].dtype == object and b["s"].tolist() == [f"x{i}" for i in range(5)]
    with pytest.raises(
        ValueError, match="record 1 has shape \\(4,\\) but record 0 has shape \\(3,\\)"
    ):
        stack_records([{"a": np.zeros(3)}, {"a": np.zeros(4)}])
    with pytest.raises(ValueError, match="record 1 differs from record 0"):
        stack_records([{"a": 1}, {"b": 1}])


def test_map_filter_map_with_index_random_map():
    ds = MapDataset.range(20)
    assert list(ds.map(lambda x: x * x)) == [x * x for x in range(20)]
    f = ds.filter(lambda x: x % 3 == 0)
    assert f[1] is None and f[3] == 3
    assert list(f.map(lambda x: x + 1)) == [x + 1 for x in range(20) if x % 3 == 0]
    assert list(ds.map_with_index(lambda i, x: (i, x * 2))) == [(i, i * 2) for i in range(20)]
    r = ds.random_map(lambda x, rng: int(rng.integers(1 << 30)), seed=5)
    a, b = list(r), list(r)
    assert a == b and len(set(a)) == 20
    # Pure function of (seed, index): random access agrees with iteration.
    assert r[7] == a[7]
    assert list(ds.random_map(lambda x, rng: int(rng.integers(1 << 30)), seed=6)) != a
    # A new draw every epoch.
    rep = list(ds.random_map(lambda x, rng: int(rng.integers(1 << 30)), seed=5).repeat(2))
    assert rep[:20] != rep[20:]


def test_batch_after_filter_drops_none_inside_batches():
    ds = MapDataset.range(10).filter(lambda x: x % 2 == 0).batch(4)
    assert [b.tolist() for b in ds] == [[0, 2], [4, 6], [8]]
    assert MapDataset.range(4).filter(lambda x: False).batch(2)[0] is None


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 60),
    start=st.integers(-70, 70),
    stop=st.integers(-70, 70),
    step=st.integers(-5, 5).filter(bool),
)
def test_slice_matches_python(n, start, stop, step):
    assert list(MapDataset.range(n)[start:stop:step]) == list(range(n))[start:stop:step]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 50), count=st.integers(1, 60), drop=st.booleans())
def test_shard_partitions(n, count, drop):
    shards = [list(MapDataset.range(n).shard(i, count, drop_remainder=drop)) for i in range(count)]
    flat = [x for s in shards for x in s]
    if drop:
        assert all(len(s) == n // count for s in shards)
        assert flat == list(range(n // count * count))
    else:
        assert flat == list(range(n))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
    # More shards than records: the extra shards are empty (documented).


def test_shard_errors():
    with pytest.raises(ValueError, match="count must be >= 1"):
        MapDataset.range(3).shard(0, 0)
    with pytest.raises(ValueError, match="index must be in \\[0, 2\\)"):
        MapDataset.range(3).shard(2, 2)
    # More shards than records: the last shards are empty (documented, no error).
    assert [list(MapDataset.range(2).shard(i, 5)) for i in range(5)] == [[0], [1], [], [], []]


def test_repeat_and_lengths():
    assert len(MapDataset.range(3).repeat()) == sys.maxsize
    assert len(MapDataset.range(0).repeat()) == 0
    assert list(MapDataset.range(3).repeat(0)) == []
    ds = MapDataset.range(5).shuffle(seed=2).repeat(3)
    xs = list(ds)
    for e in range(3):
        ref = permute(np.arange(5), 5, 2, e).tolist()
        assert xs[e * 5 : (e + 1) * 5] == ref
    # reseed_each_epoch=False repeats the same order.
    same = list(MapDataset.range(5).shuffle(seed=2).repeat(2, reseed_each_epoch=False))
    assert same[:5] == same[5:]
    # A batch spanning two epochs.
    b = MapDataset.range(5).repeat(2).batch(3)
    assert [x.tolist() for x in b] == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4]]
    with pytest.raises(ValueError, match="num_epochs must be >= 0"):
        MapDataset.range(3).repeat(-1)
    inf = MapDataset.range(4).shuffle(seed=0).repeat()
    assert sorted(inf.__getitems__(list(range(10**12, 10**12 + 4)))) == [0, 1, 2, 3]


def test_concatenate_and_mix():
    a, b = MapDataset.range(0, 5), MapDataset.range(100, 103)
    assert list(MapDataset.concatenate([a, b])) == [0, 1, 2, 3, 4, 100, 101, 102]
    m = MapDataset.mix(
        [MapDataset.range(0, 10_000), MapDataset.range(10**6, 10**6 + 10_000)], [0.7, 0.3]
    )
    xs = np.array(list(m))
    first = xs < 10**6
    # Each input in order, in the proportions asked for, ending before an input runs out.
    assert np.array_equal(xs[first], np.arange(first.sum()))
    assert np.array_equal(xs[~first] - 10**6, np.arange((~first).sum()))
    assert abs(first[:1000].mean() - 0.7) < 0.002
    assert first.sum() <= 10_000 and (~first).sum() <= 10_000
    assert len(m) == len(xs) and first.sum() in (9_999, 10_000)
    with pytest.raises(ValueError, match="weights must be finite"):
        MapDataset.mix([a, b], [-1, 2])
    with pytest.raises(ValueError, match="2 datasets but 3 weights"):
        MapDataset.mix([a, b], [1, 2, 3])
    with pytest.raises(TypeError, match="input 1 is a list"):
        MapDataset.concatenate([a, [1]])


def test_empty_source():
    ds = MapDataset.source([]).shuffle(seed=1).map(lambda x: x).batch(4)
    assert len(ds) == 0 and list(ds) == []
    with pytest.raises(IndexError, match="length 0"):
        ds[0]


def test_graph_rendering():
    g = (
        MapDataset.concatenate([MapDataset.range(3), MapDataset.range(2).shuffle(seed=1)])
        .batch(2)
        .graph()
    )
    lines = g.splitlines()
    assert lines[0].startswith("batch(2)")
    assert "concatenate(2 datasets)" in lines[1] and "<input 1>" in g and "shuffle(seed=1)" in g


def test_debug_mode_names_first_mismatch():
    recs = [{"x": np.zeros(3)}] * 5 + [{"x": np.zeros(3, np.int32)}]
    it = iter(MapDataset.source(recs).to_iter_dataset(debug=True))
    for _ in range(5):
        next(it)
    with pytest.raises(
        StructureMismatchError, match="element 5 .* path 'x'.*dtype float64.*got .*int32"
    ):
        next(it)
    it = iter(MapDataset.source([{"a": 1}, {"a": 1, "b": 2}]).to_iter_dataset(debug=True).batch(1))
    next(it)
    with pytest.raises(StructureMismatchError, match="differs from the first element"):
        next(it)


def test_sources_returning_none_for_bad_records_are_filtered():
    class Flaky:
        skip_bad_records = True

        def __len__(self):
            return 10

        def __getitem__(self, i):
            return None if i in (3, 7) else i

        def __getitems__(self, idx):
            return [self[int(i)] for i in idx]

    ds = MapDataset.source(Flaky()).map(lambda x: x * 10)
    assert list(ds) == [x * 10 for x in range(10) if x not in (3, 7)]
    assert [b.tolist() for b in ds.batch(4)] == [[0, 10, 20], [40, 50, 60], [80, 90]]


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 300), g=st.sampled_from([4, 6, 12]), data=st.data())
def test_shard_global_batches_agree_across_host_counts(n, g, data):
    base = MapDataset.range(n).shuffle(seed=3)
    ref = [b.tolist() for b in base.batch(g, drop_remainder=True)]
    for hosts in [h for h in (1, 2, 3, 4, 6) if g % h == 0]:
        per_host = [
            [b.tolist() for b in base.shard_global_batches(g, h, hosts)] for h in range(hosts)
        ]
        assert all(len(p) == len(ref) for p in per_host)
        for step, global_batch in enumerate(ref):
            assert sum((p[step] for p in per_host), []) == global_batch
    # A state saved on 2 hosts resumes on 3 hosts at the same global batch.
    if len(ref) > 1 and g % 3 == 0 and g % 2 == 0:
        it2 = iter(base.shard_global_batches(g, 0, 2).to_iter_dataset())
        next(it2)
        it3 = iter(base.shard_global_batches(g, 1, 3).to_iter_dataset())
        it3.set_state(it2.get_state())
        assert next(it3).tolist() == ref[1][g // 3 : 2 * g // 3]
    with pytest.raises(ValueError, match="not divisible by shard_count"):
        base.shard_global_batches(g, 0, 5)
