"""encode_example/decode_example and writer atomicity and naming."""

import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cairn.data import (
    ArrayRecordDataSource,
    ParquetDataSource,
    decode_example,
    encode_example,
    write_array_record,
    write_parquet,
)

_DTYPES = [np.float32, np.float64, np.int8, np.uint16, np.int64, np.bool_, np.complex64]

_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=10),
    st.binary(max_size=10),
    st.sampled_from(_DTYPES).flatmap(
        lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, max_side=4))
    ),
)
_key = st.text(
    st.characters(blacklist_characters="/", blacklist_categories=("Cs",)), min_size=1, max_size=6
)
_example = st.recursive(
    st.dictionaries(_key, _leaf, max_size=4),
    lambda inner: st.dictionaries(_key, inner | _leaf, min_size=1, max_size=3),
    max_leaves=8,
)


def _equal(a, b):
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_array_equal(a, b)
    else:
        assert type(a) is type(b) and a == b


@settings(max_examples=25, deadline=None)
@given(ex=_example)
def test_encode_decode_round_trip(ex):
    _equal(decode_example(encode_example(ex)), ex)
    _equal(decode_example(bytearray(encode_example(ex)), copy=True), ex)


def test_low_precision_scalars_views_and_byte_order():
    ex = {
        "bf": np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3),
        "f8": np.array([0.5, -2.0], dtype=ml_dtypes.float8_e4m3fn),
        "be": np.arange(3, dtype=">i4"),
        "s": np.float16(1.5),
        "u": np.array(["ab", "c"]),
    }
    out = decode_example(encode_example(ex))
    assert out["bf"].dtype == ml_dtypes.bfloat16 and out["bf"].shape == (2, 3)
    np.testing.assert_array_equal(out["bf"].astype(np.float32), ex["bf"].astype(np.float32))
    assert out["f8"].dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(out["be"], [0, 1, 2])
    assert out["be"].dtype == np.dtype("<i4")
    assert isinstance(out["s"], np.float16) and out["s"] == 1.5
    assert list(out["u"]) == ["ab", "c"]
    assert not out["bf"].flags.writeable  # zero-copy views are read-only
    assert decode_example(encode_example(ex), copy=True)["bf"].flags.writeable


def test_encode_errors_name_the_field():
    with pytest.raises(TypeError, match=r"field 'a/b' has unsupported type list"):
        encode_example({"a": {"b": [1, 2]}})
    with pytest.raises(ValueError, match=r"key 'x/y' must .* no '/'"):
        encode_example({"x/y": 1})
    with pytest.raises(TypeError, match=r"field 'o'.*cannot be encoded"):
        encode_example({"o": np.array([object()])})
    with pytest.raises(OverflowError, match="'big'"):
        encode_example({"big": 2**70})
    with pytest.raises(TypeError, match="expects a dict"):
        encode_example([1])


def test_decode_rejects_damaged_bytes():
    good = encode_example({"x": np.arange(10, dtype=np.int32), "s": "hello"})
    with pytest.raises(ValueError, match="not an encode_example record"):
        decode_example(b"XXXX" + good[4:])
    with pytest.raises(ValueError, match="truncated"):
        decode_example(good[:-5])
    with pytest.raises(ValueError, match="trailing bytes"):
        decode_example(good + b"\x00")


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
