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
    with pytest.raises(ValueError, match="sampler expects 41 records but the source has 40"):
        DataLoader(data_source=src, sampler=IndexSampler(41))
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
