"""ArraySpec (JSON, hashing, JAX conversion) and the dtype table."""

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.core_array import (
    DTYPE_TABLE,
    ArraySpec,
    as_numpy_dtype,
    bit_width,
    canonical_dtype,
    dtype_info,
    spec_of,
    specs_from_json,
    specs_to_json,
)

EXPECTED_BITS = {
    "float64": 64, "float32": 32, "float16": 16, "bfloat16": 16, "float8_e4m3fn": 8,
    "float8_e5m2": 8, "float4_e2m1fn": 4, "int64": 64, "int32": 32, "int8": 8, "int4": 4,
    "uint4": 4, "int2": 2, "uint8": 8, "bool": 8,
}


@pytest.mark.parametrize("name,bits", sorted(EXPECTED_BITS.items()))
def test_table_names_and_bits(name, bits):
    info = dtype_info(name)
    assert info.name == name and info.bits == bits
    assert canonical_dtype(info.dtype) == name
    assert bit_width(name) == bits


REQUIRED = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "int4", "uint4", "int2"]


def test_required_low_precision_types_are_in_the_table():
    names = REQUIRED + (["uint2"] if hasattr(ml_dtypes, "uint2") else [])
    missing = [n for n in names if n not in DTYPE_TABLE]
    assert not missing, missing
    for n in names:
        assert DTYPE_TABLE[n].dtype == np.dtype(getattr(ml_dtypes, n))


@pytest.mark.parametrize("name", sorted(DTYPE_TABLE))
def test_bits_agree_with_finfo_iinfo(name):
    """Independent reference: ml_dtypes' finfo / iinfo report the logical bit width."""
    info = DTYPE_TABLE[name]
    if info.kind == "float":
        assert info.bits == ml_dtypes.finfo(info.dtype).bits
    elif info.kind in ("int", "uint"):
        assert info.bits == ml_dtypes.iinfo(info.dtype).bits
        assert (info.kind == "int") == (ml_dtypes.iinfo(info.dtype).min < 0)
    elif info.kind == "complex":
        assert info.bits == 8 * info.dtype.itemsize and info.dtype.kind == "c"
    else:
        assert info.dtype == np.dtype(bool)


@pytest.mark.parametrize("text", ["INT4", " bfloat16 ", "BF16", "Float8_E4M3FN"])
def test_names_parse_case_and_space_insensitively(text):
    assert canonical_dtype(text) == canonical_dtype(text.strip().lower().replace("bf16", "bfloat16"))


def test_aliases_and_types():
    assert canonical_dtype("bf16") == "bfloat16"
    assert canonical_dtype(ml_dtypes.bfloat16) == "bfloat16"
    assert canonical_dtype(np.dtype("float32")) == "float32"
    assert canonical_dtype("fp8_e4m3") == "float8_e4m3fn"
    assert as_numpy_dtype("int4") == np.dtype(ml_dtypes.int4)
    assert canonical_dtype(np.zeros(2, np.int16)) == "int16"
    assert dtype_info("int4").is_sub_byte and not dtype_info("int8").is_sub_byte


def test_jax_dtypes_map_to_the_same_names():
    jnp = pytest.importorskip("jax.numpy")
    assert canonical_dtype(jnp.bfloat16) == "bfloat16"
    assert canonical_dtype(jnp.zeros(2, jnp.int4)) == "int4"
    assert canonical_dtype(jnp.float8_e4m3fn) == "float8_e4m3fn"


@pytest.mark.parametrize("bad", ["float7", "", "bfloat", object(), np.dtype("U3"), np.dtype([("a", "i4")])])
def test_unknown_dtypes_raise(bad):
    with pytest.raises(ValueError) as e:
        dtype_info(bad)
    assert "expected one of" in str(e.value) or "cannot interpret" in str(e.value)


def test_every_table_entry_is_consistent():
    for name, info in DTYPE_TABLE.items():
        assert dtype_info(info.dtype) is info, name
        if info.bits >= 8:
            assert info.bits == info.dtype.itemsize * 8 or info.kind == "bool"


def test_array_spec_basics():
    s = ArraySpec([2, 3], np.float32, ("batch", None), ("data", None))
    assert s.shape == (2, 3) and s.dtype == "float32" and s.nbytes == 24 and s.size == 6
    assert hash(s) == hash(ArraySpec((2, 3), "f32", ["batch", None], ["data", None]))
    assert s == ArraySpec.from_json(json.loads(json.dumps(s.to_json())))
    assert ArraySpec((4,), "int8", sharding=(("a", "b"),)).sharding == (("a", "b"),)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"shape": (2, -1), "dtype": "float32"}, "non-negative"),
        ({"shape": "ab", "dtype": "float32"}, "sequence of ints"),
        ({"shape": (2,), "dtype": "nope"}, "unknown dtype name 'nope'"),
        ({"shape": (2,), "dtype": "float32", "logical_axes": ("a", "b")}, "has 2 entries for a 1-d"),
        ({"shape": (2,), "dtype": "float32", "logical_axes": (3,)}, "logical axis 3"),
        ({"shape": (2,), "dtype": "float32", "sharding": ("a", "b")}, "more entries than"),
        ({"shape": (2,), "dtype": "float32", "sharding": (1,)}, "must be None"),
    ],
)
def test_array_spec_errors(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        ArraySpec(**kwargs)


def test_from_json_errors():
    with pytest.raises(ValueError, match="'shape' and 'dtype'"):
        ArraySpec.from_json({"shape": [1]})
    with pytest.raises(ValueError, match="unknown keys"):
        ArraySpec.from_json({"shape": [1], "dtype": "int8", "bogus": 1})
    with pytest.raises(ValueError, match="not valid JSON"):
        specs_from_json("{")
    with pytest.raises(ValueError, match="format"):
        specs_from_json('{"tree": {}}')


def test_spec_of_and_tree_json_round_trip():
    tree = {"a": np.zeros((2, 3), ml_dtypes.bfloat16), "b": [np.zeros((), np.int32), (np.ones(4, np.int8),)], "c": None}
    specs = spec_of(tree)
    assert specs["a"] == ArraySpec((2, 3), "bfloat16")
    text = specs_to_json(specs)
    back = specs_from_json(text)
    assert back == specs
    assert isinstance(back["b"][1], tuple)


def test_jax_conversion_and_sharding_capture():
    jax = pytest.importorskip("jax")
    mesh = jax.make_mesh((1,), ("data",))
    x = jax.device_put(np.ones((4, 2), np.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    s = ArraySpec.from_array(x)
    assert s.sharding == ("data",)
    sds = s.to_shape_dtype_struct(mesh)
    assert sds.shape == (4, 2) and sds.dtype == np.float32 and sds.sharding.spec == jax.sharding.PartitionSpec("data")
    assert ArraySpec.from_array(jax.ShapeDtypeStruct((3,), jax.numpy.bfloat16)).dtype == "bfloat16"


dtype_names = st.sampled_from(sorted(EXPECTED_BITS))
axis_names = st.one_of(st.none(), st.sampled_from(["batch", "embed", "mlp"]))


@st.composite
def specs(draw):
    shape = tuple(draw(st.lists(st.integers(0, 7), max_size=4)))
    logical = draw(st.one_of(st.none(), st.tuples(*[axis_names for _ in shape])))
    sharding = draw(st.one_of(st.none(), st.tuples(*[st.one_of(st.none(), st.just("data"), st.just(("a", "b"))) for _ in shape])))
    return ArraySpec(shape, draw(dtype_names), logical, sharding)


@settings(max_examples=50, deadline=None)
@given(st.recursive(specs(), lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.sampled_from("abc"), c, max_size=3)), max_leaves=8))
def test_spec_tree_json_round_trip_property(tree):
    assert specs_from_json(specs_to_json(tree)) == tree


@settings(max_examples=50, deadline=None)
@given(specs())
def test_spec_hash_consistent_with_eq(s):
    t = ArraySpec.from_json(s.to_json())
    assert s == t and hash(s) == hash(t)
