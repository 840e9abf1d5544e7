"""repeat: lengths, per-epoch reshuffling, batches across epochs."""

import sys

import numpy as np
import pytest

from cairn.data import MapDataset
from cairn.data._permutation import permute


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
