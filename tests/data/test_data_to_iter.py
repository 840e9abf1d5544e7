"""MapDataset.to_iter_dataset: reader threads give the same stream and restore mid-stream."""

import pytest

from cairn.data import MapDataset, ReadOptions


def test_threads_give_the_same_stream():
    ds = MapDataset.range(1000).shuffle(seed=5).map(lambda x: x * 2)
    ref = list(ds.to_iter_dataset())
    assert list(ds.to_iter_dataset(ReadOptions(num_threads=3, chunk_records=7))) == ref
    with pytest.raises(ValueError, match="num_threads must be an int >= 0"):
        ReadOptions(num_threads=-1)


def test_threaded_read_restores_mid_stream():
    # set_state on an iterator whose read threads already have chunks in flight.
    it = iter(MapDataset.range(500).to_iter_dataset(ReadOptions(num_threads=2, chunk_records=10)))
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.set_state({"next_index": 250})
    assert list(it) == list(range(250, 500))
    it.set_state({"next_index": 7})
    assert next(it) == 7
    it.close()
