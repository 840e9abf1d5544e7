"""Pipelines over real ArrayRecord and Parquet files, with 0 and 2 workers."""

import os

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


@pytest.fixture
def corrupt_files(tmp_path):
    """An ArrayRecord file with record 37 damaged and a Parquet file with row group 2
    (rows 20..29) damaged; both hold 60 random 256-byte records."""
    rng = np.random.default_rng(3)
    recs = [rng.bytes(256) for _ in range(60)]
    (ar,) = cd.write_array_record(recs, str(tmp_path / "ar"))
    data = bytearray(open(ar, "rb").read())
    data[data.find(recs[37][:64]) + 9] ^= 0xFF
    open(ar, "wb").write(bytes(data))
    (pq,) = cd.write_parquet(
        ({"blob": r} for r in recs), str(tmp_path / "pq"), row_group_size=10, compression=None
    )
    data = bytearray(open(pq, "rb").read())
    data[data.find(recs[24][:64]) + 5] ^= 0xFF
    open(pq, "wb").write(bytes(data))
    return recs, ar, pq


def _blob(r):
    return r["blob"] if isinstance(r, dict) else r


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["arrayrecord", "parquet"])
@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_records_in_pipelines_named_or_skipped_and_counted(corrupt_files, kind, workers):
    """Through a whole pipeline (in worker processes too): an error naming the file and
    the record after every element before it, or, with skip_bad_records, the stream
    without the bad records and the source in the caller's process counting them."""
    recs, ar, pq = corrupt_files
    bad = {37} if kind == "arrayrecord" else set(range(20, 30))

    def source(skip):
        if kind == "arrayrecord":
            return cd.ArrayRecordDataSource(ar, skip_bad_records=skip)
        return cd.ParquetDataSource(pq, skip_bad_records=skip)

    def pipeline(src):
        ds = cd.MapDataset.source(src).map(_blob).to_iter_dataset(cd.ReadOptions(chunk_records=8))
        return ds.mp_prefetch(workers)

    it = iter(pipeline(source(False)))
    got = []
    with pytest.raises(cd.CorruptRecordError) as ei:
        for x in it:
            got.append(x)
    it.close()
    first_bad = min(bad)
    assert got == recs[:first_bad]
    assert ei.value.path == (ar if kind == "arrayrecord" else pq)
    assert ei.value.index == first_bad and os.path.basename(ei.value.path) in str(ei.value)

    src = source(True)
    with iter(pipeline(src)) as it:
        assert list(it) == [r for i, r in enumerate(recs) if i not in bad]
    assert src.bad_records == len(bad)
    # Shuffled and batched, resumed with another worker count: the same, counted again.
    ds = cd.MapDataset.source(src).shuffle(seed=1).map(_blob).batch(7).to_iter_dataset()
    ref = [b.tolist() for b in ds]
    assert src.bad_records == 2 * len(bad)
    cd.assert_equal_output_after_checkpoint(
        ds.mp_prefetch(workers), restore_ds=ds.mp_prefetch(2 - workers), max_steps=3
    )
    with iter(ds.mp_prefetch(workers)) as it:
        assert [b.tolist() for b in it] == ref
