"""ParquetDataSource + ParquetWriter: round trips, LRU bound, errors, corruption, pickling."""

import os
import pickle
import tempfile
from collections import OrderedDict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.data import CorruptRecordError, ParquetDataSource, ParquetWriter, write_parquet


def _rows(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "id": i,
            "f": np.float32(rng.standard_normal()),
            "s": f"row-{i}-" + "x" * int(rng.integers(0, 5)),
            "b": rng.bytes(int(rng.integers(0, 8))),
            "v": rng.standard_normal(int(rng.integers(0, 5))).astype(np.float32),
            "t": rng.integers(-9, 9, (2, 3)).astype(np.int16),
        }
        for i in range(n)
    ]


def _assert_row_equal(got, want):
    assert set(got) == set(want)
    assert got["id"] == want["id"] and isinstance(got["id"], np.int64)
    assert got["f"] == want["f"] and isinstance(got["f"], np.float32)
    assert got["s"] == want["s"] and isinstance(got["s"], str)
    assert got["b"] == want["b"] and isinstance(got["b"], bytes)
    assert got["v"].dtype == np.float32 and got["v"].ndim == 1
    np.testing.assert_array_equal(got["v"], want["v"])
    assert got["t"].dtype == np.int16 and got["t"].shape == (2, 3)
    np.testing.assert_array_equal(got["t"], want["t"])


@settings(max_examples=15, deadline=None)
@given(n=st.integers(0, 50), shards=st.integers(1, 4), rg=st.integers(1, 7), data=st.data())
def test_round_trip_random_batched_and_columnar(n, shards, rg, data):
    rows = _rows(n, seed=n)
    with tempfile.TemporaryDirectory() as d:
        paths = write_parquet(rows, d, num_shards=shards, row_group_size=rg)
        assert len(paths) == shards
        src = ParquetDataSource(d, cache_row_groups=2)
        assert len(src) == n
        for i in range(n):
            _assert_row_equal(src[i], rows[i])
        if not n:
            return
        assert src.num_row_groups == sum(-(-s // rg) for s in src_sizes(n, shards))
        idx = data.draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=30))
        for got, i in zip(src.__getitems__(idx), idx):
            _assert_row_equal(got, rows[i])
        batch = src.read_batch(idx)
        np.testing.assert_array_equal(batch["id"], [rows[i]["id"] for i in idx])
        assert batch["id"].dtype == np.int64 and batch["f"].dtype == np.float32
        np.testing.assert_array_equal(batch["f"], np.array([rows[i]["f"] for i in idx]))
        assert list(batch["s"]) == [rows[i]["s"] for i in idx]
        assert list(batch["b"]) == [rows[i]["b"] for i in idx]
        np.testing.assert_array_equal(batch["t"], np.stack([rows[i]["t"] for i in idx]))
        for got, i in zip(batch["v"], idx):
            np.testing.assert_array_equal(got, rows[i]["v"])


def src_sizes(n, shards):
    return [n // shards + (1 if i < n % shards else 0) for i in range(shards)]


def test_list_column_batch_is_2d_when_lengths_agree(tmp_path):
    write_parquet([{"tok": np.arange(i, i + 4, dtype=np.int32)} for i in range(10)], tmp_path)
    b = ParquetDataSource(tmp_path).read_batch([3, 1])
    assert b["tok"].shape == (2, 4) and b["tok"].dtype == np.int32
    np.testing.assert_array_equal(b["tok"], [[3, 4, 5, 6], [1, 2, 3, 4]])


def _reference_lru(accesses, size):
    cache, decodes = OrderedDict(), 0
    for batch in accesses:
        seen = {}
        for g in batch:
            if g in seen:
                continue
            if g in cache:
                cache.move_to_end(g)
            else:
                decodes += 1
                cache[g] = True
                while len(cache) > size:
                    cache.popitem(last=False)
            seen[g] = True
    return decodes


# The LRU cases: 50 rows {"x": i} in ten row groups of 5, read in batches of row indices.
_ROW_BATCHES = st.lists(st.lists(st.integers(0, 49), min_size=1, max_size=12), max_size=15)


def _write_ten_groups(d):
    write_parquet([{"x": i} for i in range(50)], d, row_group_size=5)


def _expected_decodes(batches, groups_cached):
    """Every batch decodes each of its row groups at most once, then the LRU decides."""
    return _reference_lru([sorted({i // 5 for i in b}) for b in batches], groups_cached)


@settings(max_examples=10, deadline=None)
@given(size=st.integers(0, 4), accesses=_ROW_BATCHES)
def test_lru_bound_and_decode_counts(size, accesses):
    with tempfile.TemporaryDirectory() as d:
        _write_ten_groups(d)
        src = ParquetDataSource(d, cache_row_groups=size)
        for batch in accesses:
            got = src.__getitems__(batch)
            assert [r["x"] for r in got] == batch
            assert src.cache_info()["size"] <= size
        assert src.row_groups_decoded == _expected_decodes(accesses, size)


def test_batch_decodes_each_row_group_once_even_with_small_cache(tmp_path):
    write_parquet([{"x": i} for i in range(40)], tmp_path, row_group_size=4)
    src = ParquetDataSource(tmp_path, cache_row_groups=1)
    idx = [0, 39, 1, 38, 20, 21, 2, 37]  # row groups 0, 9, 5
    assert [r["x"] for r in src.__getitems__(idx)] == idx
    assert src.row_groups_decoded == 3
    info = src.cache_info()
    assert (info["size"], info["max_size"], info["decoded"], info["hits"]) == (1, 1, 3, 0)


@settings(max_examples=10, deadline=None)
@given(groups_fit=st.integers(0, 4), accesses=_ROW_BATCHES)
def test_byte_bound_acts_as_lru_of_that_many_groups(groups_fit, accesses):
    with tempfile.TemporaryDirectory() as d:
        _write_ten_groups(d)
        probe = ParquetDataSource(d)
        probe[0]
        per = probe.cache_info()["bytes"]  # Arrow size of one decoded group (5 int64 + bitmap)
        assert 40 <= per <= 48
        src = ParquetDataSource(d, cache_bytes=per * groups_fit + per - 1)
        for batch in accesses:
            assert [r["x"] for r in src.__getitems__(batch)] == batch
            info = src.cache_info()
            assert info["bytes"] <= info["max_bytes"] and info["bytes"] == per * info["size"]
        assert src.row_groups_decoded == _expected_decodes(accesses, groups_fit)


def test_columns_selection_and_errors(tmp_path):
    write_parquet(_rows(12), tmp_path, num_shards=2, row_group_size=5)
    src = ParquetDataSource(tmp_path, columns=["s", "id"])
    assert src.columns == ["s", "id"]
    assert src[7] == {"s": _rows(12)[7]["s"], "id": 7}
    assert list(src.read_batch([1])) == ["s", "id"]
    with pytest.raises(
        ValueError,
        match=r"column 'nope' not found in Parquet file .*data-00000.*available columns: id, f, s",
    ):
        ParquetDataSource(tmp_path, columns=["id", "nope"])
    with pytest.raises(TypeError, match="list of names"):
        ParquetDataSource(tmp_path, columns="id")
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        ParquetDataSource(str(tmp_path / "missing.parquet"))
    with pytest.raises(FileNotFoundError, match="matched no files"):
        ParquetDataSource(str(tmp_path / "zz*.parquet"))
    with pytest.raises(IndexError, match=r"index 12 .*length 12"):
        src[12]
    with pytest.raises(IndexError, match=r"index -13 .*length 12"):
        src.read_batch([-13])
    with pytest.raises(ValueError, match="cache_row_groups"):
        ParquetDataSource(tmp_path, cache_row_groups=-1)
    with pytest.raises(ValueError, match="cache_bytes"):
        ParquetDataSource(tmp_path, cache_bytes=-1)


def test_schema_mismatch_between_files(tmp_path):
    write_parquet([{"a": 1}], tmp_path / "x.parquet")
    write_parquet([{"a": "text"}], tmp_path / "y.parquet")
    with pytest.raises(ValueError, match=r"y.parquet.*schema"):
        ParquetDataSource([tmp_path / "x.parquet", tmp_path / "y.parquet"])


def test_writer_errors_name_record_and_column(tmp_path):
    with pytest.raises(ValueError, match=r"record 2 has different columns.*missing \['b'\]"):
        write_parquet([{"a": 1, "b": 2}, {"a": 1, "b": 2}, {"a": 3}], tmp_path / "k")
    with pytest.raises(ValueError, match=r"column 'a' \(records 2\.\.3\)"):
        write_parquet(
            [{"a": 1}, {"a": 2}, {"a": "x"}, {"a": "y"}], tmp_path / "t", row_group_size=2
        )
    with pytest.raises(TypeError, match="record 0 is list"):
        write_parquet([[1, 2]], tmp_path / "l")
    with pytest.raises(ValueError, match="share one shape"):
        write_parquet([{"t": np.zeros((2, 2))}, {"t": np.zeros((3, 2))}], tmp_path / "s")
    for sub in ("k", "t", "l", "s"):
        assert os.listdir(tmp_path / sub) == []  # atomic: nothing left behind


def test_nulls_and_explicit_schema(tmp_path):
    schema = pa.schema([("a", pa.int32()), ("v", pa.list_(pa.float64())), ("s", pa.string())])
    rows = [{"a": 1, "v": np.array([1.0]), "s": "p"}, {"a": None, "v": None, "s": None}]
    write_parquet(rows, tmp_path, schema=schema)
    src = ParquetDataSource(tmp_path)
    assert src.schema == schema
    assert src[0]["a"] == 1 and isinstance(src[0]["a"], np.int32)
    assert src[1] == {"a": None, "v": None, "s": None}
    b = src.read_batch([1, 0])
    assert list(b["a"]) == [None, 1] and list(b["s"]) == [None, "p"]
    assert src.read_batch([0])["a"].dtype == np.int32


def test_empty_writes_give_empty_sources(tmp_path):
    paths = write_parquet([], tmp_path, num_shards=2)
    assert len(paths) == 2
    src = ParquetDataSource(tmp_path)
    assert len(src) == 0 and src.__getitems__([]) == []
    with pytest.raises(IndexError, match="empty"):
        src[0]


def _corrupt_one_row_group(tmp_path):
    rng = np.random.default_rng(0)
    rows = [{"id": i, "blob": rng.bytes(300)} for i in range(30)]
    (path,) = write_parquet(rows, tmp_path, row_group_size=10, compression=None)
    data = bytearray(open(path, "rb").read())
    pos = data.find(rows[14]["blob"][:32])
    assert pos > 0
    data[pos + 5] ^= 0xFF
    open(path, "wb").write(bytes(data))
    return rows, path


def test_flipped_bytes_raise_naming_file_and_row_group(tmp_path):
    rows, path = _corrupt_one_row_group(tmp_path)
    src = ParquetDataSource(path)
    assert src[3]["blob"] == rows[3]["blob"] and src[25]["blob"] == rows[25]["blob"]
    with pytest.raises(
        CorruptRecordError,
        match=r"data-00000-of-00001.parquet', row group 1 \(source rows 10\.\.19\)",
    ) as ei:
        src.__getitems__([0, 14])
    assert ei.value.path == path and ei.value.index == 10

    skip = ParquetDataSource(path, skip_bad_records=True)
    got = skip.__getitems__(list(range(30)))
    assert [g is None for g in got] == [10 <= i < 20 for i in range(30)]
    assert [g["blob"] for g in got if g is not None] == [r["blob"] for r in rows[:10] + rows[20:]]
    assert skip.bad_records == 10
    b = skip.read_batch([0, 15, 29])
    assert list(b["id"]) == [0, 29] and skip.bad_records == 11


def test_truncated_file_named_or_skipped(tmp_path):
    write_parquet([{"x": i} for i in range(20)], tmp_path, num_shards=2)
    p1 = str(tmp_path / "data-00001-of-00002.parquet")
    data = open(p1, "rb").read()
    open(p1, "wb").write(data[: len(data) // 2])
    with pytest.raises(CorruptRecordError, match=r"data-00001-of-00002.parquet.*truncated"):
        ParquetDataSource(tmp_path)
    with pytest.warns(RuntimeWarning, match="skipping unreadable file"):
        src = ParquetDataSource(tmp_path, skip_bad_records=True)
    assert src.bad_files == [p1] and [r["x"] for r in src] == list(range(10))


def test_pickle_drops_cache_and_reopens(tmp_path):
    rows = _rows(40)
    write_parquet(rows, tmp_path, num_shards=3, row_group_size=4)
    src = ParquetDataSource(tmp_path, cache_row_groups=8)
    src.__getitems__(list(range(40)))
    blob = pickle.dumps(src)
    assert len(blob) < 4000
    back = pickle.loads(blob)
    assert back.cache_info()["size"] == 0
    for got, i in zip(back.__getitems__([39, 0, 17]), [39, 0, 17]):
        _assert_row_equal(got, rows[i])


def test_parquet_writer_class_and_foreign_files(tmp_path):
    with ParquetWriter(tmp_path / "w", records_per_shard=7, row_group_size=3) as w:
        for i in range(15):
            w.write({"x": i})
    assert len(w.paths) == 3
    assert pq.ParquetFile(w.paths[0]).metadata.num_row_groups == 3
    # a file written by plain pyarrow (no checksums, one big row group)
    pq.write_table(pa.table({"y": list(range(9)), "z": [[1, 2]] * 9}), tmp_path / "plain.parquet")
    src = ParquetDataSource(tmp_path / "plain.parquet")
    assert src[8]["y"] == 8
    np.testing.assert_array_equal(src[8]["z"], [1, 2])


def test_string_and_binary_columns_with_nulls_match_pyarrow(tmp_path):
    """Text and bytes columns (plain and large offsets, nulls, non-ASCII) against
    pyarrow's own to_pylist, row-wise and column-wise."""
    rng = np.random.default_rng(3)
    n = 57
    words = [None if i % 7 == 3 else "é" * (i % 4) + f"w{i}" + "€" * (i % 3) for i in range(n)]
    blobs = [None if i % 5 == 1 else rng.bytes(int(rng.integers(0, 20))) for i in range(n)]
    table = pa.table(
        {
            "s": pa.array(words, pa.string()),
            "ls": pa.array(words, pa.large_string()),
            "b": pa.array(blobs, pa.binary()),
            "lb": pa.array(blobs, pa.large_binary()),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=10)
    want = table.to_pylist()
    src = ParquetDataSource(tmp_path)
    idx = rng.permutation(n).tolist()
    for got, i in zip(src.__getitems__(idx), idx):
        assert got == want[i], i
        assert all(type(got[k]) is (str if "s" in k else bytes) or got[k] is None for k in got)
    batch = src.read_batch(idx)
    for k in ("s", "ls", "b", "lb"):
        assert batch[k].dtype == object
        assert batch[k].tolist() == [want[i][k] for i in idx]


def _child_reads(src, q):
    rows = src.__getitems__(list(range(len(src))))
    q.put((src.cache_info()["decoded"], [r["id"] for r in rows], rows[5]["s"], rows[5]["b"]))


@pytest.mark.multiprocess
def test_forked_process_keeps_the_parents_cached_row_groups(tmp_path):
    import multiprocessing as mp

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("needs fork")
    rows = _rows(30)
    write_parquet(rows, tmp_path, row_group_size=4)
    src = ParquetDataSource(tmp_path)
    src.__getitems__(list(range(30)))  # decode and cache all 8 row groups
    assert src.cache_info()["decoded"] == 8
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_reads, args=(src, q))
    p.start()
    decoded, ids, s5, b5 = q.get(timeout=60)
    p.join(30)
    assert decoded == 0  # every row came from the inherited cache
    assert ids == list(range(30)) and s5 == rows[5]["s"] and b5 == rows[5]["b"]
    # A fresh (unpickled, spawn-style) copy starts empty and decodes what it reads.
    back = pickle.loads(pickle.dumps(src))
    back.__getitems__([0, 29])
    assert back.cache_info()["decoded"] == 2
