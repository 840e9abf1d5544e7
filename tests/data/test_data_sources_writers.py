"""Writer atomicity and naming (the codec's tests are in test_data_codec.py)."""

import os

import pytest

from cairn.data import (
    ArrayRecordDataSource,
    ParquetDataSource,
    write_array_record,
    write_parquet,
)


def _failing(n_ok, kind):
    for i in range(n_ok):
        yield b"r%d" % i if kind == "ar" else {"x": i}
    raise RuntimeError("source broke")


@pytest.mark.parametrize("kind", ["ar", "pq"])
def test_error_mid_stream_leaves_nothing(tmp_path, kind):
    write = write_array_record if kind == "ar" else write_parquet
    with pytest.raises(RuntimeError, match="source broke"):
        write(_failing(25, kind), tmp_path, records_per_shard=10)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["ar", "pq"])
def test_naming_modes(tmp_path, kind):
    ext = ".array_record" if kind == "ar" else ".parquet"
    write = write_array_record if kind == "ar" else write_parquet
    recs = [b"%d" % i for i in range(5)] if kind == "ar" else [{"x": i} for i in range(5)]
    p = write(recs, tmp_path / "d", num_shards=2, prefix="train")
    assert [os.path.basename(x) for x in p] == [f"train-0000{i}-of-00002{ext}" for i in range(2)]
    p = write(recs, str(tmp_path / f"one{ext}"), num_shards=3)
    assert [os.path.basename(x) for x in p] == [f"one-0000{i}-of-00003{ext}" for i in range(3)]
    p = write(recs, str(tmp_path / ("t/s{shard}of{num_shards}" + ext)), records_per_shard=4)
    assert [os.path.basename(x) for x in p] == [f"s0of2{ext}", f"s1of2{ext}"]
    Source = ArrayRecordDataSource if kind == "ar" else ParquetDataSource
    assert len(Source(tmp_path / "d")) == 5
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write(recs, str(tmp_path / f"one{ext}"), num_shards=3)
    with pytest.raises(ValueError, match="num_shards must be a positive int"):
        write(recs, tmp_path / "z", num_shards=0)
    with pytest.raises(ValueError, match="records_per_shard must be a positive int"):
        write(recs, tmp_path / "z", records_per_shard=0)
