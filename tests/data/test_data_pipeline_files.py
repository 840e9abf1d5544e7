"""Pipelines over real ArrayRecord and Parquet files, with 0 and 2 workers."""

import numpy as np
import pytest

import cairn.data as cd

pytest.importorskip("pyarrow")
pytest.importorskip("array_record")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    records = [np.full(16, i, np.int32).tobytes() for i in range(300)]
    ar = cd.write_array_record(records, str(d / "ar"), num_shards=3)
    cd.write_parquet(
        ({"id": i, "v": np.full(4, i, np.float32)} for i in range(300)),
        str(d / "pq"),
        row_group_size=32,
    )
    return records, ar, str(d / "pq")


def _decode(b):
    return np.frombuffer(b, np.int32)


def _row(r):
    return r["v"] * 2 + r["id"]


@pytest.mark.multiprocess
def test_arrayrecord_pipeline_matches_memory_and_resumes(files):
    records, ar, _ = files

    def make(src):
        return cd.MapDataset.source(src).shuffle(seed=5).map(_decode).batch(16).to_iter_dataset()

    ref = [b for b in make(records)]
    src = cd.ArrayRecordDataSource(ar)
    for w in (0, 2):
        it = iter(make(src).mp_prefetch(w))
        got = list(it)
        it.close()
        assert len(got) == len(ref) and all(np.array_equal(a, b) for a, b in zip(got, ref))
    cd.assert_equal_output_after_checkpoint(make(src).mp_prefetch(2), restore_ds=make(src))


@pytest.mark.multiprocess
def test_parquet_pipeline_matches_reference_and_resumes(files):
    _, _, pq = files
    src = cd.ParquetDataSource(pq, columns=["id", "v"])
    ds = (
        cd.MapDataset.source(src)
        .shuffle(seed=1)
        .map(_row)
        .batch(10, drop_remainder=True)
        .to_iter_dataset()
    )
    perm = [cd.MapDataset.range(300).shuffle(seed=1)[i] for i in range(300)]
    ref = [
        np.stack([np.full(4, 3 * i, np.float32) for i in perm[k : k + 10]])
        for k in range(0, 300, 10)
    ]
    with iter(ds.mp_prefetch(2)) as it:
        got = list(it)
    assert len(got) == 30 and all(np.array_equal(a, b) for a, b in zip(got, ref))
    cd.assert_equal_output_after_checkpoint(ds, restore_ds=ds.mp_prefetch(2), max_steps=6)
