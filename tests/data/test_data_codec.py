"""The example codec (encode_example / decode_example): golden bytes and round trips.

The golden hex below was produced by the codec as it stood before it moved out of
``_writers.py`` (commit "data: golden bytes for encode_example"); the byte format is a
storage format, so every later version must produce the same bytes and decode them to
the same values.
"""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cairn.data import decode_example, encode_example

# --- golden bytes ---


def _golden_examples():
    """One example per field kind (and the array/scalar variants), built deterministically."""
    return {
        "array_numeric": {
            "i16": np.arange(3, dtype=np.int16),
            "f32_2d": np.arange(6, dtype=np.float32).reshape(2, 3) / 4,
            "u8_empty": np.zeros((0, 3), np.uint8),
            "zero_d": np.array(7, np.int32),
            "c64": np.array([1 + 2j], np.complex64),
            "b": np.array([True, False, True]),
        },
        "array_special": {
            "bf16": np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16),
            "f8": np.array([0.5, -2.0], dtype=ml_dtypes.float8_e4m3fn),
            "big_endian": np.arange(3, dtype=">i4"),
            "strided": np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],
            "fortran": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
            "unicode": np.array(["ab", "c"]),
            "bytes_arr": np.array([b"xy", b"z"]),
        },
        "scalars": {
            "f16": np.float16(1.5),
            "i64": np.int64(-5),
            "bool_": np.bool_(True),
            "u32": np.uint32(4000000000),
        },
        "python": {
            "int": 42,
            "neg": -(2**63),
            "max": 2**63 - 1,
            "float": -0.25,
            "inf": float("inf"),
            "true": True,
            "false": False,
            "none": None,
        },
        "text": {
            "str": "hi",
            "unicode": "h\u00e9\u4e16\U0001f600",
            "empty_str": "",
            "bytes": b"\x00\xffab",
            "bytearray": bytearray(b"ba"),
            "memoryview": memoryview(b"mv"),
            "empty_bytes": b"",
        },
        "nested": {
            "empty": {},
            "a": {"b": {"c": np.arange(2, dtype=np.uint16), "d": "x"}, "e": {}},
        },
        "empty_root": {},
        "typical": {
            "ids": np.arange(8, dtype=np.int32),
            "mask": np.ones(8, np.float32),
            "pos": np.arange(8, dtype=np.int64) % 7,
            "label": 3,
            "text": "the quick brown fox",
        },
    }


_GOLDEN_HEX = {
    "array_numeric": (
        "434458310600000003006931366105696e743136010300000000000000060000000000000000000000000000"
        "0000000000000100020006006633325f32646107666c6f617433320202000000000000000300000000000000"
        "1800000000000000000000000000803e0000003f0000403f0000803f0000a03f080075385f656d7074796105"
        "75696e7438020000000000000000030000000000000000000000000000000000000000000000000000000000"
        "06007a65726f5f646105696e7433320004000000000000000000000000000000070000000300633634610963"
        "6f6d706c65783634010100000000000000080000000000000000000000000000000000000000803f00000040"
        "0100626104626f6f6c01030000000000000003000000000000000000000000000000000000000000010001"
    ),
    "array_special": (
        "4344583107000000040062663136610862666c6f617431360104000000000000000800000000000000000000"
        "000000000000803f0040404002006638610d666c6f6174385f65346d33666e01020000000000000002000000"
        "000000000000000030c00a006269675f656e6469616e6105696e7433320103000000000000000c0000000000"
        "0000000000000000000000000000000001000000020000000700737472696465646105696e74363402030000"
        "0000000000020000000000000030000000000000000000000000000000000000000000000000000002000000"
        "000000000400000000000000060000000000000008000000000000000a000000000000000700666f72747261"
        "6e6107666c6f6174363402020000000000000003000000000000003000000000000000000000000000000000"
        "00000000000000000000f03f0000000000000040000000000000084000000000000010400000000000001440"
        "0700756e69636f646561033c5532010200000000000000100000000000000000610000006200000063000000"
        "00000000090062797465735f61727261037c5332010200000000000000040000000000000000000000000000"
        "000000000000000078797a00"
    ),
    "scalars": (
        "434458310400000003006631366707666c6f6174313600020000000000000000003e03006936346705696e74"
        "3634000800000000000000000000000000000000fbffffffffffffff0500626f6f6c5f6704626f6f6c000100"
        "0000000000000000010300753332670675696e74333200040000000000000000000000000000000000286bee"
    ),
    "python": (
        "43445831080000000300696e74692a0000000000000003006e656769000000000000008003006d617869ffff"
        "ffffffffff7f0500666c6f617466000000000000d0bf0300696e6666000000000000f07f0400747275653f01"
        "050066616c73653f0004006e6f6e656e"
    ),
    "text": (
        "4344583107000000030073747273020000000000000068690700756e69636f6465730a0000000000000068c3"
        "a9e4b896f09f98800900656d7074795f73747273000000000000000005006279746573620400000000000000"
        "00ff6162090062797465617272617962020000000000000062610a006d656d6f727976696577620200000000"
        "0000006d760b00656d7074795f6279746573620000000000000000"
    ),
    "nested": (
        "43445831040000000500656d707479640500612f622f63610675696e74313601020000000000000004000000"
        "00000000000001000500612f622f64730100000000000000780300612f6564"
    ),
    "empty_root": ("4344583100000000"),
    "typical": (
        "434458310500000003006964736105696e743332010800000000000000200000000000000000000000000000"
        "00000000000000000100000002000000030000000400000005000000060000000700000004006d61736b6107"
        "666c6f6174333201080000000000000020000000000000000000803f0000803f0000803f0000803f0000803f"
        "0000803f0000803f0000803f0300706f736105696e7436340108000000000000004000000000000000000000"
        "0000000000000000010000000000000002000000000000000300000000000000040000000000000005000000"
        "000000000600000000000000000000000000000005006c6162656c6903000000000000000400746578747313"
        "0000000000000074686520717569636b2062726f776e20666f78"
    ),
}


@pytest.mark.parametrize("name", sorted(_GOLDEN_HEX))
def test_encoding_matches_the_golden_bytes(name):
    assert encode_example(_golden_examples()[name]).hex() == _GOLDEN_HEX[name]


def _expected(value):
    """What decoding gives back for ``value``: buffers become bytes, arrays little-endian."""
    if isinstance(value, dict):
        return {k: _expected(v) for k, v in value.items()}
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, np.ndarray):
        return value.astype(value.dtype.newbyteorder("<"))
    if isinstance(value, float):
        return float(value)  # a NumPy float64 scalar is a float, stored as one
    return value


def _same(got, want, where=""):
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            _same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), where
    elif isinstance(want, np.generic):  # bit for bit, so NaN scalars compare too
        assert type(got) is type(want) and got.dtype == want.dtype, where
        assert got.tobytes() == want.tobytes(), where
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), where
    else:
        assert type(got) is type(want) and got == want, where


@pytest.mark.parametrize("name", sorted(_GOLDEN_HEX))
@pytest.mark.parametrize("copy", [False, True])
def test_golden_bytes_decode_to_the_example(name, copy):
    got = decode_example(bytes.fromhex(_GOLDEN_HEX[name]), copy=copy)
    _same(got, _expected(_golden_examples()[name]))


# --- round trips over every kind ---

_ARRAY_DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
]
_ML_DTYPES = [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]

_arrays = st.sampled_from(_ARRAY_DTYPES).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
)
_ml_arrays = st.sampled_from(_ML_DTYPES).flatmap(
    lambda dt: hnp.arrays(
        np.float32,
        hnp.array_shapes(max_dims=2, max_side=4),
        elements=st.sampled_from([0.0, 0.5, -2.0, 1.0]),
    ).map(lambda a: a.astype(dt))
)
_text_arrays = st.one_of(
    hnp.arrays(hnp.unicode_string_dtypes(max_len=4), hnp.array_shapes(max_dims=2, max_side=3)),
    hnp.arrays(hnp.byte_string_dtypes(max_len=4), hnp.array_shapes(max_dims=2, max_side=3)),
)
_big_endian = st.sampled_from([">i4", ">f8", ">u2"]).flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(max_dims=2, max_side=4))
)
_np_scalars = _arrays.filter(lambda a: a.size > 0).map(lambda a: a.reshape(-1)[0])
_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.text(max_size=10),
    st.binary(max_size=10),
    st.binary(max_size=10).map(bytearray),
    _arrays,
    _ml_arrays,
    _text_arrays,
    _big_endian,
    _np_scalars,
    st.just({}),
)
_key = st.text(
    st.characters(blacklist_characters="/", blacklist_categories=("Cs",)), min_size=1, max_size=6
)
_example = st.recursive(
    st.dictionaries(_key, _leaf, max_size=4),
    lambda inner: st.dictionaries(_key, inner | _leaf, min_size=1, max_size=3),
    max_leaves=10,
)


@settings(max_examples=60, deadline=None)
@given(ex=_example)
def test_round_trip_over_every_kind(ex):
    raw = encode_example(ex)
    want = _expected(ex)
    _same(decode_example(raw), want)
    _same(decode_example(bytearray(raw), copy=True), want)
    _same(decode_example(memoryview(raw)), want)
    assert encode_example(decode_example(raw)) == raw  # decoding loses nothing the bytes hold


@settings(max_examples=30, deadline=None)
@given(arr=_arrays.filter(lambda a: a.ndim >= 2))
def test_non_contiguous_arrays_are_stored_in_c_order(arr):
    view = arr[:, ::-1]
    _same(decode_example(encode_example({"v": view}))["v"], np.ascontiguousarray(view))


def test_decoded_arrays_are_aligned_read_only_views_unless_copied():
    raw = encode_example(
        {"k": "odd-length key pushes the data", "x": np.arange(5, dtype=np.float64)}
    )
    x = decode_example(raw)["x"]
    assert not x.flags.writeable and x.ctypes.data % 8 == 0
    assert decode_example(raw, copy=True)["x"].flags.writeable


# --- errors ---


@pytest.mark.parametrize(
    "example, error, match",
    [
        ({"a": {"b": [1, 2]}}, TypeError, r"field 'a/b' has unsupported type list"),
        ({"x/y": 1}, ValueError, r"key 'x/y' must .* no '/'"),
        ({"": 1}, ValueError, r"key '' must be non-empty"),
        ({1: 1}, TypeError, r"keys must be str, got 1 in /"),
        ({"a": {2: 1}}, TypeError, r"keys must be str, got 2 in a/"),
        ({"o": np.array([object()])}, TypeError, r"field 'o'.*cannot be encoded"),
        ({"big": 2**70}, OverflowError, "'big'"),
        ([1], TypeError, "expects a dict"),
        ({"k" * 70000: 1}, ValueError, "longer than 65535 bytes"),
    ],
)
def test_encode_errors(example, error, match):
    with pytest.raises(error, match=match):
        encode_example(example)


def test_decode_errors_name_the_problem():
    good = encode_example({"x": np.arange(10, dtype=np.int32), "s": "hello"})
    with pytest.raises(ValueError, match="not an encode_example record"):
        decode_example(b"XXXX" + good[4:])
    with pytest.raises(ValueError, match="truncated data: header"):
        decode_example(good[:5])
    for cut in range(8, len(good)):
        with pytest.raises(ValueError, match="truncated"):
            decode_example(good[:cut])
    with pytest.raises(ValueError, match="trailing bytes"):
        decode_example(good + b"\x00")
    bad_kind = bytearray(encode_example({"x": 1}))
    bad_kind[11] = ord("z")
    with pytest.raises(ValueError, match=r"unknown field kind b'z' for 'x' at offset 11"):
        decode_example(bytes(bad_kind))
    bad_size = bytearray(encode_example({"x": np.zeros(2, np.int32)}))
    bad_size[4 + 4 + 2 + 1 + 1 + 1 + 5 + 1 + 8] = 3  # nbytes 8 -> 3
    with pytest.raises(ValueError, match="do not match shape"):
        decode_example(bytes(bad_size))


# --- round trips and errors (moved from test_data_sources_writers.py) ---

_W_DTYPES = [np.float32, np.float64, np.int8, np.uint16, np.int64, np.bool_, np.complex64]

_w_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=10),
    st.binary(max_size=10),
    st.sampled_from(_W_DTYPES).flatmap(
        lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, max_side=4))
    ),
)
_w_key = st.text(
    st.characters(blacklist_characters="/", blacklist_categories=("Cs",)), min_size=1, max_size=6
)
_w_example = st.recursive(
    st.dictionaries(_w_key, _w_leaf, max_size=4),
    lambda inner: st.dictionaries(_w_key, inner | _w_leaf, min_size=1, max_size=3),
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
@given(ex=_w_example)
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
