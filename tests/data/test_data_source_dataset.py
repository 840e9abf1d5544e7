"""MapDataset.source and MapDataset.range: source kinds, batched reads, empty and skipping sources."""

import numpy as np
import pytest

from cairn.data import MapDataset, ReadOptions


def test_source_kinds_and_batched_reads():
    class Counting:
        def __init__(self, n):
            self.n, self.calls, self.single = n, 0, 0

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            self.single += 1
            return i * 2

        def __getitems__(self, idx):
            self.calls += 1
            return [int(i) * 2 for i in idx]

    src = Counting(1000)
    ds = MapDataset.source(src).shuffle(seed=0).batch(64)
    batches = list(ds.to_iter_dataset(ReadOptions(chunk_records=256)))
    assert sorted(np.concatenate(batches).tolist()) == list(range(0, 2000, 2))
    # One batched read per chunk of 256 records (after a ramp of 1, 2 batches), never per record.
    assert src.single == 0 and src.calls <= 2 + 1000 // 256 + 2
    assert list(MapDataset.source(np.arange(5) * 3)) == [0, 3, 6, 9, 12]
    assert list(MapDataset.source((7, 8))) == [7, 8]
    with pytest.raises(TypeError, match="random-access source"):
        MapDataset.source(iter([1, 2]))


def test_empty_source():
    ds = MapDataset.source([]).shuffle(seed=1).map(lambda x: x).batch(4)
    assert len(ds) == 0 and list(ds) == []
    with pytest.raises(IndexError, match="length 0"):
        ds[0]


def test_sources_returning_none_for_bad_records_are_filtered():
    class Flaky:
        skip_bad_records = True

        def __len__(self):
            return 10

        def __getitem__(self, i):
            return None if i in (3, 7) else i

        def __getitems__(self, idx):
            return [self[int(i)] for i in idx]

    ds = MapDataset.source(Flaky()).map(lambda x: x * 10)
    assert list(ds) == [x * 10 for x in range(10) if x not in (3, 7)]
    assert [b.tolist() for b in ds.batch(4)] == [[0, 10, 20], [40, 50, 60], [80, 90]]
