"""ArrayRecordDataSource + ArrayRecordWriter: round trips, errors, corruption, pickling."""

import os
import pickle
import tempfile
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.data import (
    ArrayRecordDataSource,
    ArrayRecordWriter,
    CorruptRecordError,
    decode_example,
    encode_example,
    write_array_record,
)


def _records(n, seed=0, size=None):
    rng = np.random.default_rng(seed)
    return [
        rng.bytes(int(size if size is not None else rng.integers(0, 300))) + b"#%d" % i
        for i in range(n)
    ]


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 60), shards=st.integers(1, 5), data=st.data())
def test_round_trip_random_and_batched(n, shards, data):
    recs = _records(n, seed=n)
    with tempfile.TemporaryDirectory() as d:
        paths = write_array_record(recs, d, num_shards=shards)
        assert len(paths) == shards
        assert all(os.path.isfile(p) for p in paths)
        src = ArrayRecordDataSource(d)
        assert len(src) == n
        assert src.num_records_per_file == [
            n // shards + (1 if i < n % shards else 0) for i in range(shards)
        ]
        assert [src[i] for i in range(n)] == recs
        assert list(src) == recs
        if n:
            idx = data.draw(st.lists(st.integers(-n, n - 1), max_size=40))
            assert src.__getitems__(idx) == [recs[i] for i in idx]
            perm = np.random.default_rng(n).permutation(n)
            assert src.__getitems__(perm) == [recs[i] for i in perm]
        assert src.__getitems__([]) == []


@settings(max_examples=15, deadline=None)
@given(n=st.integers(0, 40), per=st.integers(1, 12))
def test_records_per_shard_stream(n, per):
    recs = _records(n, seed=3)
    with tempfile.TemporaryDirectory() as d:
        paths = write_array_record(iter(recs), d, records_per_shard=per)
        assert len(paths) == max(1, -(-n // per))
        src = ArrayRecordDataSource(paths)
        assert src.__getitems__(list(range(n))) == recs


def test_paths_globs_instructions_and_templates(tmp_path):
    recs = _records(30, seed=1)
    paths = write_array_record(
        recs, str(tmp_path / "train-{shard:03d}-of-{num_shards:03d}.array_record"), num_shards=3
    )
    assert [os.path.basename(p) for p in paths] == [
        "train-000-of-003.array_record",
        "train-001-of-003.array_record",
        "train-002-of-003.array_record",
    ]
    assert (
        ArrayRecordDataSource(str(tmp_path / "train-*.array_record")).__getitems__(range(30))
        == recs
    )
    # "file[start:end]" slices and FileInstruction-like objects
    src = ArrayRecordDataSource(
        [f"{paths[0]}[2:5]", SimpleNamespace(filename=paths[2], skip=1, take=3)]
    )
    assert len(src) == 6
    assert src.__getitems__(range(6)) == recs[2:5] + recs[21:24]
    with pytest.raises(IndexError, match=r"\[0:99\].*has 10 records"):
        ArrayRecordDataSource(f"{paths[0]}[0:99]")
    # single file target
    single = write_array_record(recs[:4], str(tmp_path / "one.array_record"))
    assert single == [str(tmp_path / "one.array_record")]
    assert ArrayRecordDataSource(single[0])[3] == recs[3]


def test_dict_records_with_encode_example(tmp_path):
    exs = [
        {"image": np.full((2, 3), i, np.uint8), "label": i, "text": f"t{i}", "w": np.float32(i)}
        for i in range(7)
    ]
    write_array_record([encode_example(e) for e in exs], tmp_path, num_shards=2)
    src = ArrayRecordDataSource(tmp_path)
    for i, raw in enumerate(src.__getitems__([6, 0, 3])):
        e = decode_example(raw)
        j = [6, 0, 3][i]
        np.testing.assert_array_equal(e["image"], exs[j]["image"])
        assert e["label"] == j and e["text"] == f"t{j}" and e["w"] == np.float32(j)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.array_record"):
        ArrayRecordDataSource(str(tmp_path / "nope.array_record"))
    with pytest.raises(FileNotFoundError, match="matched no files"):
        ArrayRecordDataSource(str(tmp_path / "*.array_record"))
    with pytest.raises(FileNotFoundError, match="contains no files"):
        ArrayRecordDataSource(tmp_path)
    with pytest.raises(ValueError, match="at least one file"):
        ArrayRecordDataSource([])
    write_array_record(_records(5), tmp_path, num_shards=2)
    src = ArrayRecordDataSource(tmp_path)
    with pytest.raises(IndexError, match=r"index 5 .*length 5"):
        src[5]
    with pytest.raises(IndexError, match=r"index -6 .*length 5"):
        src.__getitems__([0, -6])
    with pytest.raises(TypeError, match=r"record 1 is dict.*encode_example"):
        write_array_record([b"ok", {"a": 1}], tmp_path / "other")
    assert not os.listdir(tmp_path / "other")  # nothing half-written left behind
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_array_record([b"x"], tmp_path)
    new = write_array_record([b"x"], tmp_path, overwrite=True)
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".array_record")) == [
        os.path.basename(new[0])
    ]  # stale shards removed
    with pytest.raises(ValueError, match="not both"):
        write_array_record([b"x"], tmp_path / "b", num_shards=2, records_per_shard=1)
    with pytest.raises(TypeError, match="records_per_shard instead"):
        write_array_record(iter([b"x"]), tmp_path / "c", num_shards=2)


def _find_record(data: bytes, rec: bytes) -> int:
    pos = data.find(rec[:64])
    assert pos >= 0, "random records are stored verbatim (incompressible)"
    return pos


def test_flipped_bytes_raise_naming_file_and_record(tmp_path):
    recs = _records(50, seed=7, size=512)
    (path,) = write_array_record(recs, tmp_path)
    data = bytearray(open(path, "rb").read())
    pos = _find_record(bytes(data), recs[17])
    data[pos + 10] ^= 0xFF
    open(path, "wb").write(bytes(data))

    src = ArrayRecordDataSource(path)
    assert src[16] == recs[16] and src[18] == recs[18]
    with pytest.raises(
        CorruptRecordError, match=r"corrupt record 17 in ArrayRecord file .*data-00000"
    ) as ei:
        src.__getitems__([3, 17, 40])
    assert ei.value.path == path and ei.value.index == 17
    with pytest.raises(CorruptRecordError, match="record 17"):
        src[17]

    skipping = ArrayRecordDataSource(path, skip_bad_records=True)
    got = skipping.__getitems__(list(range(50)))
    assert got[17] is None
    assert [g for i, g in enumerate(got) if i != 17] == [r for i, r in enumerate(recs) if i != 17]
    assert skipping.bad_records == 1
    assert skipping[17] is None and skipping.bad_records == 2


def test_truncated_file_named_or_skipped(tmp_path):
    recs = _records(40, seed=2, size=200)
    paths = write_array_record(recs, tmp_path, num_shards=2)
    data = open(paths[1], "rb").read()
    open(paths[1], "wb").write(data[: len(data) // 2])
    with pytest.raises(CorruptRecordError, match=r"data-00001-of-00002.*truncated"):
        ArrayRecordDataSource(tmp_path)
    with pytest.warns(RuntimeWarning, match="skipping unreadable file"):
        src = ArrayRecordDataSource(tmp_path, skip_bad_records=True)
    assert src.bad_files == [paths[1]]
    assert src.__getitems__(range(len(src))) == recs[:20]
    open(paths[1], "wb").write(b"")
    with pytest.raises(CorruptRecordError, match="size 0 bytes"):
        ArrayRecordDataSource(paths[1])


def test_pickle_is_cheap_and_reopens(tmp_path):
    recs = _records(100, seed=4)
    write_array_record(recs, tmp_path, num_shards=4)
    src = ArrayRecordDataSource(tmp_path)
    src.__getitems__([0, 50, 99])  # opens readers
    blob = pickle.dumps(src)
    assert len(blob) < 2000
    back = pickle.loads(blob)
    assert back.__getitems__([99, 0, 50]) == [recs[99], recs[0], recs[50]]


def test_concurrent_batched_reads_from_threads(tmp_path):
    recs = _records(400, seed=5)
    write_array_record(recs, tmp_path, num_shards=3)
    src = ArrayRecordDataSource(tmp_path)
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(20):
            idx = rng.integers(0, 400, 32)
            if src.__getitems__(idx) != [recs[i] for i in idx]:
                errors.append(seed)

    ts = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []


def test_writer_context_manager_aborts_on_error(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with ArrayRecordWriter(tmp_path, records_per_shard=2) as w:
            for i in range(5):
                w.write(b"r%d" % i)
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    with ArrayRecordWriter(tmp_path, records_per_shard=2) as w:
        for i in range(5):
            w.write(b"r%d" % i)
    assert w.num_records == 5 and len(w.paths) == 3
    assert ArrayRecordDataSource(w.paths).__getitems__([4, 0]) == [b"r4", b"r0"]


def test_group_size_warning(tmp_path):
    (p,) = write_array_record([b"a"] * 10, tmp_path, options="group_size:4")
    with pytest.warns(RuntimeWarning, match="group_size:4"):
        src = ArrayRecordDataSource(p)
    assert src[9] == b"a"


def test_read_threads_give_the_same_records(tmp_path):
    recs = _records(300, seed=8)
    write_array_record(recs, tmp_path, num_shards=4)
    src = ArrayRecordDataSource(tmp_path, read_threads=3)
    perm = np.random.default_rng(1).permutation(300)
    assert src.__getitems__(perm) == [recs[i] for i in perm]
    back = pickle.loads(pickle.dumps(src))  # the pool is not pickled
    assert back.__getitems__(perm[:50]) == [recs[i] for i in perm[:50]]
    src.close()
    assert src[5] == recs[5]  # reopens lazily
    with pytest.raises(ValueError, match="read_threads"):
        ArrayRecordDataSource(tmp_path, read_threads=-1)
