"""IterDataset.interleave: order and argument errors."""

import pytest

from cairn.data import (
    InterleaveIterDataset,
    IterDataset,
    MapDataset,
)


def test_interleave_order_and_errors():
    dss = [MapDataset.range(k * 10, k * 10 + n).to_iter_dataset() for k, n in enumerate([3, 1, 2])]
    assert list(IterDataset.interleave(dss, cycle_length=2)) == [0, 10, 1, 20, 2, 21]
    assert list(IterDataset.interleave(dss)) == [0, 10, 20, 1, 21, 2]
    with pytest.raises(ValueError, match="cycle_length must be a positive int"):
        InterleaveIterDataset(dss, cycle_length=0)
    with pytest.raises(TypeError, match="input 0 is a list"):
        InterleaveIterDataset([[1]])
