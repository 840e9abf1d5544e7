"""nf4 and the block formats as QArray qtypes; packed nbytes."""

from __future__ import annotations

from statistics import NormalDist

import ml_dtypes
import numpy as np
import pytest

from cairn.core_array import LOGICAL_QTYPES, NF4_LEVELS, QArray, QuantLayout, storage_dtype


def test_nf4_levels_are_normal_quantiles():
    # QLoRA's construction: quantiles at evenly spaced probabilities between 1 - d and 1/2
    # (8 positive, 7 negative), d = (1/(2*15) + 1/(2*16)) / 2, plus 0, scaled to [-1, 1]
    d = 0.5 * (1 / 32 + 1 / 30)
    n = NormalDist()
    pos = [n.inv_cdf(1 - d - i * (0.5 - d) / 8) for i in range(8)]
    neg = [-n.inv_cdf(1 - d - i * (0.5 - d) / 7) for i in range(7)]
    levels = sorted([v / pos[0] for v in pos] + [v / pos[0] for v in neg] + [0.0])
    np.testing.assert_allclose(NF4_LEVELS, levels, atol=1e-6)


def test_nf4_qarray_dequantizes_through_the_table():
    idx = np.array([[0, 7, 15]], ml_dtypes.uint4)
    q = QArray(idx, np.array([[2.0]], np.float32), qtype="nf4", layout=QuantLayout.per_channel(0))
    assert q.qtype == "nf4"
    np.testing.assert_allclose(q.dequantize(), [[-2.0, 0.0, 2.0]])
    assert QArray.from_json(q.to_json()).qtype == "nf4"
    with pytest.raises(ValueError, match=r"qtype is 'nf4' \(stored as uint4\)"):
        QArray(np.zeros((1, 3), np.int8), np.ones((1, 1), np.float32), qtype="nf4", layout=QuantLayout.per_channel(0))


@pytest.mark.parametrize("qtype", sorted(LOGICAL_QTYPES))
def test_storage_dtypes(qtype):
    assert storage_dtype(qtype) == LOGICAL_QTYPES[qtype]
    assert storage_dtype("int4") == "int4"


def test_nbytes_is_the_packed_size():
    q = QArray(np.zeros((64, 32), ml_dtypes.int4), np.ones((1, 32), np.float32), qtype="int4", layout=QuantLayout.per_channel(1))
    assert q.nbytes == 64 * 32 // 2 + 32 * 4


def test_specs_json_keeps_qarray_qtype_and_layout():
    from cairn.core_array import ArraySpec, spec_of, specs_from_json, specs_to_json

    q = QArray(np.zeros((64, 8), ml_dtypes.int4), np.ones((4, 8), np.float32), qtype="int4", layout=QuantLayout.per_tile(0, 16))
    tree = {"layers": [{"kernel": q, "bias": np.zeros(8, np.float32)}]}
    specs = spec_of(tree)
    back = specs_from_json(specs_to_json(specs))
    k = back["layers"][0]["kernel"]
    assert isinstance(k, QArray) and k.qtype == "int4" and k.layout == QuantLayout.per_tile(0, 16)
    assert k.qvalue == ArraySpec((64, 8), "int4") and k.scale == ArraySpec((4, 8), "float32") and k.zero_point is None
    assert back["layers"][0]["bias"] == ArraySpec((8,), "float32")
    nf4 = QArray(np.zeros((2, 3), ml_dtypes.uint4), np.ones((2, 1), np.float32), qtype="nf4", layout=QuantLayout.per_channel(0))
    assert specs_from_json(specs_to_json(spec_of({"w": nf4})))["w"].qtype == "nf4"


@pytest.mark.parametrize("name,lo,hi", [("int4", -8, 8), ("uint4", 0, 16), ("int2", -2, 2), ("uint2", 0, 4)])
@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 2, 8)])
def test_jax_packing_is_bit_for_bit_numpys(name, lo, hi, shape):
    jax = pytest.importorskip("jax")
    from cairn.core_array import pack_bits, unpack_bits

    dt = getattr(ml_dtypes, name)
    x = np.random.default_rng(sum(shape)).integers(lo, hi, size=shape).astype(dt)
    packed = jax.jit(pack_bits)(jax.numpy.asarray(x))
    assert isinstance(packed, jax.Array)
    np.testing.assert_array_equal(np.asarray(packed), pack_bits(x))
    back = unpack_bits(jax.numpy.asarray(pack_bits(x)), name, shape[-1])
    np.testing.assert_array_equal(np.asarray(back).astype(np.int64), x.astype(np.int64))


def test_jax_packing_of_float4_keeps_the_bit_patterns():
    jax = pytest.importorskip("jax")
    from cairn.core_array import pack_bits, unpack_bits

    f4 = np.array([[0, 0.5, -1.5, 6, -6, 3, 2, -0.5, 4, -0.0]], ml_dtypes.float4_e2m1fn)
    np.testing.assert_array_equal(np.asarray(pack_bits(jax.numpy.asarray(f4))), pack_bits(f4))
    back = unpack_bits(jax.numpy.asarray(pack_bits(f4)), "float4_e2m1fn", 10)
    np.testing.assert_array_equal(np.asarray(back).astype(np.float32), f4.astype(np.float32))


@pytest.mark.parametrize("name,qtype", [("int4", "int4"), ("uint4", "nf4"), ("int2", "int2"), ("float4_e2m1fn", "mxfp4")])
def test_packed_qarray_round_trips(name, qtype):
    dt = getattr(ml_dtypes, name)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 4, size=(3, 10)) if name != "float4_e2m1fn" else rng.choice([0.5, -1.0, 3.0, 6.0], size=(3, 10))
    layout = QuantLayout.per_tile(1, 2) if qtype == "mxfp4" else QuantLayout.per_channel(0)
    scale = np.full((3, 5) if qtype == "mxfp4" else (3, 1), 0.25, np.float32)
    q = QArray(raw.astype(dt), scale, qtype=qtype, layout=layout)
    p = q.pack()
    assert p.qvalue.dtype == np.uint8 and p.packed_length == 10 and p.shape == q.shape == (3, 10)
    assert p.qvalue.shape[-1] == (10 * dtype_bits(name) + 7) // 8
    np.testing.assert_array_equal(p.dequantize(), q.dequantize())
    np.testing.assert_array_equal(np.asarray(p.unpack().qvalue).astype(np.float32), np.asarray(q.qvalue).astype(np.float32))
    assert p.nbytes == q.nbytes
    assert QArray.from_json(p.to_json()).packed_length == 10
    too_long = 10 + 2 * (8 // dtype_bits(name))  # two bytes more than qvalue holds
    with pytest.raises(ValueError, match=f"packed_length {too_long}"):
        QArray(p.qvalue, scale, qtype=qtype, layout=QuantLayout.per_channel(0), packed_length=too_long)


def dtype_bits(name: str) -> int:
    from cairn.core_array import bit_width

    return bit_width(name)


def test_only_sub_byte_qtypes_pack():
    q = QArray(np.zeros((2, 4), np.int8), np.ones((2, 1), np.float32), qtype="int8", layout=QuantLayout.per_channel(0))
    assert q.pack() is q
    with pytest.raises(ValueError, match="only sub-byte qtypes"):
        QArray(np.zeros((2, 4), np.uint8), np.ones((2, 1), np.float32), qtype="int8", layout=QuantLayout.per_channel(0), packed_length=4)
