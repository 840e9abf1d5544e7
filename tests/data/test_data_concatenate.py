"""MapDataset.concatenate: datasets one after another."""

import pytest

from cairn.data import MapDataset


def test_concatenate_order_and_errors():
    a, b = MapDataset.range(0, 5), MapDataset.range(100, 103)
    assert list(MapDataset.concatenate([a, b])) == [0, 1, 2, 3, 4, 100, 101, 102]
    with pytest.raises(TypeError, match="input 1 is a list"):
        MapDataset.concatenate([a, [1]])
