"""IterDataset.prefetch: errors reach the consumer, state restores."""

import pytest

from cairn.data import MapDataset


def test_prefetch_propagates_errors_and_restores():
    def bad(x):
        if x == 5:
            raise ZeroDivisionError("bad record 5")
        return x

    it = iter(
        MapDataset.range(10).to_iter_dataset().batch(1).map(lambda b: bad(int(b[0]))).prefetch(2)
    )
    assert [next(it) for _ in range(5)] == list(range(5))
    with pytest.raises(ZeroDivisionError, match="bad record 5"):
        next(it)
    it.close()
    it = iter(MapDataset.range(10).to_iter_dataset().prefetch(3))
    assert [next(it) for _ in range(4)] == [0, 1, 2, 3]
    st_ = it.get_state()
    assert list(it) == list(range(4, 10))
    it.set_state(st_)
    assert list(it) == list(range(4, 10))
    it.close()
