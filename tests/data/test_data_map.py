"""map, map_with_index, random_map against references."""

from cairn.data import MapDataset


def test_map_map_with_index_random_map():
    ds = MapDataset.range(20)
    assert list(ds.map(lambda x: x * x)) == [x * x for x in range(20)]
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
