"""DataLoader against the equivalent dataset pipeline; sharding options."""

import importlib.util

import pytest

from cairn.data import (
    Batch,
    DataLoader,
    FilterTransform,
    IndexSampler,
    MapDataset,
    MapTransform,
    NoSharding,
    RandomMapTransform,
    ShardByJaxProcess,
    ShardOptions,
)


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
    with pytest.raises(ValueError, match="wants 2 records from an empty source"):
        DataLoader(data_source=[], sampler=IndexSampler(2))
    with pytest.raises(TypeError, match="operation 0 is a int"):
        DataLoader(data_source=src, sampler=IndexSampler(40), operations=[3])
    with pytest.raises(ValueError, match="needs a seed"):
        IndexSampler(3, shuffle=True)


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


def test_sampler_num_records_may_differ_from_the_source():
    # As in Grain: fewer records read a prefix, more wrap around the source.
    src = list(range(5))
    assert list(DataLoader(data_source=src, sampler=IndexSampler(3))) == [0, 1, 2]
    assert list(DataLoader(data_source=src, sampler=IndexSampler(7))) == [0, 1, 2, 3, 4, 0, 1]


def test_index_sampler_is_a_sequence_of_record_metadata():
    s = IndexSampler(4, shuffle=True, seed=1, num_epochs=2)
    keys = [m.record_key for m in s]
    assert len(s) == 8 and [m.index for m in s] == list(range(8))
    assert sorted(keys[:4]) == sorted(keys[4:]) == [0, 1, 2, 3]
    src = list(range(10, 14))
    assert [x - 10 for x in DataLoader(data_source=src, sampler=s)] == keys
    a, b = s[3].rng, s[3].rng
    assert a is not None and a.integers(1 << 30) == b.integers(1 << 30)
    assert IndexSampler(4, num_epochs=None)[9].record_key == 1 and IndexSampler(4).__getitem__(0).rng is None
    with pytest.raises(IndexError, match=r"index 8 is out of range \[0, 8\)"):
        s[8]
    with pytest.raises(TypeError, match="integers"):
        s["0"]
