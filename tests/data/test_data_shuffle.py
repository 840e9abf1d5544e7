"""The global shuffle: a permutation per (seed, epoch), O(1) memory, vectorised."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.data import MapDataset
from cairn.data._permutation import permute

sizes = st.one_of(
    st.integers(0, 300), st.integers(300, 70_000), st.sampled_from([2**16, 2**16 + 1, 2**20 - 1])
)


@settings(max_examples=25, deadline=None)
@given(n=sizes, seed=st.integers(-(2**70), 2**70), epoch=st.integers(0, 10**6))
def test_permute_is_a_permutation(n, seed, epoch):
    p = permute(np.arange(n), n, seed, epoch)
    assert p.dtype == np.int64 and p.shape == (n,)
    assert np.array_equal(np.sort(p), np.arange(n))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 50_000), seed=st.integers(0, 2**64 - 1), data=st.data())
def test_permute_is_pointwise(n, seed, data):
    """Any subset of indices maps exactly as in the full permutation (pure function of index)."""
    full = permute(np.arange(n), n, seed, 3)
    idx = np.asarray(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=50)))
    assert np.array_equal(permute(idx, n, seed, 3), full[idx])


@settings(max_examples=20, deadline=None)
@given(n=st.integers(20, 100_000), seed=st.integers(-(2**63), 2**63))
def test_differs_across_seeds_and_epochs(n, seed):
    a = permute(np.arange(n), n, seed, 0)
    assert not np.array_equal(a, permute(np.arange(n), n, seed + 1, 0))
    assert not np.array_equal(a, permute(np.arange(n), n, seed, 1))
    # Not the identity, and roughly uniform: displacement close to n/3 on average.
    assert not np.array_equal(a, np.arange(n))
    if n >= 1000:
        assert abs(np.abs(a - np.arange(n)).mean() / n - 1 / 3) < 0.05


def test_position_distribution_is_uniform():
    """Where element 0 lands, over many seeds: chi-square against uniform over 16 places."""
    n, trials = 16, 4000
    counts = np.zeros(n)
    for s in range(trials):
        counts[np.argmin(permute(np.arange(n), n, s, 0))] += 1  # which index maps to 0
    expected = trials / n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 45.0  # 15 dof: p ~ 1e-4


def test_shuffle_dataset_epochs_and_negative_seed():
    ds = MapDataset.range(100).shuffle(seed=-5).repeat(3)
    xs = list(ds)
    epochs = [xs[i * 100 : (i + 1) * 100] for i in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(100))
    assert epochs[0] != epochs[1] != epochs[2]
    # Negative seeds are documented as seed mod 2**64.
    assert list(MapDataset.range(100).shuffle(seed=-5)) == list(
        MapDataset.range(100).shuffle(seed=2**64 - 5)
    )
    assert list(MapDataset.range(100).shuffle(seed=-5)) != list(
        MapDataset.range(100).shuffle(seed=5)
    )


def test_shuffle_random_access_matches_iteration():
    ds = MapDataset.range(1000).shuffle(seed=1)
    xs = list(ds)
    assert [ds[i] for i in (0, 17, 999, -1)] == [xs[0], xs[17], xs[999], xs[-1]]
    assert ds.__getitems__([5, 3]) == [xs[5], xs[3]]


def test_shuffle_empty_and_single():
    assert list(MapDataset.range(0).shuffle(seed=0)) == []
    assert list(MapDataset.range(1).shuffle(seed=0)) == [0]


def test_seed_errors():
    with pytest.raises(ValueError, match="needs a seed"):
        MapDataset.range(3).shuffle()
    with pytest.raises(TypeError, match="seed must be an int"):
        MapDataset.range(3).shuffle(seed=1.5)
    assert list(MapDataset.range(10).seed(3).shuffle()) == list(
        MapDataset.range(10).shuffle(seed=3)
    )
