"""slice, shard and shard_global_batches against Python slicing."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.data import MapDataset


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


def test_shard_errors():
    with pytest.raises(ValueError, match="count must be >= 1"):
        MapDataset.range(3).shard(0, 0)
    with pytest.raises(ValueError, match="index must be in \\[0, 2\\)"):
        MapDataset.range(3).shard(2, 2)
    # More shards than records: the last shards are empty (documented, no error).
    assert [list(MapDataset.range(2).shard(i, 5)) for i in range(5)] == [[0], [1], [], [], []]


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
