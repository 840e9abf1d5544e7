"""filter on MapDataset: filtered-out elements read as None, iteration skips them."""

from cairn.data import MapDataset


def test_filter_reads_none_and_iteration_skips():
    ds = MapDataset.range(20)
    f = ds.filter(lambda x: x % 3 == 0)
    assert f[1] is None and f[3] == 3
    assert list(f.map(lambda x: x + 1)) == [x + 1 for x in range(20) if x % 3 == 0]
