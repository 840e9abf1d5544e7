"""core_array.quantize / dequantize and tiles on two axes, against float64 NumPy formulas."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.core_array import NF4_LEVELS, QArray, QuantLayout, dequantize, quantize

INT_QMAX = {"int8": 127, "int4": 7, "int2": 1}


def _ref_symmetric(x: np.ndarray, groups: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 reference: per element, the absmax of its group, then the grid."""
    s = np.where(groups > 0, groups / (qmax + 0.5), 1.0)
    return np.clip(np.round(x / s), -qmax, qmax), s


def _block_absmax(x: np.ndarray, t0: int, t1: int) -> np.ndarray:
    """Each element's absmax over its (t0, t1) block, computed with explicit loops."""
    out = np.zeros_like(x, np.float64)
    for i in range(0, x.shape[0], t0):
        for j in range(0, x.shape[1], t1):
            out[i : i + t0, j : j + t1] = np.abs(x[i : i + t0, j : j + t1]).max()
    return out


@pytest.mark.parametrize("qtype", ["int8", "int4", "int2"])
def test_two_axis_tiles_match_a_loop_reference(qtype):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 12)).astype(np.float32)
    layout = QuantLayout.per_tile((0, 1), (4, 3))
    q = quantize(x, qtype, layout)
    assert q.scale.shape == (2, 4) and q.layout.tile_sizes == (4, 3)
    want_q, want_s = _ref_symmetric(x.astype(np.float64), _block_absmax(x, 4, 3), INT_QMAX[qtype])
    np.testing.assert_array_equal(np.asarray(q.qvalue, np.int64), want_q)
    np.testing.assert_allclose(np.repeat(np.repeat(q.scale, 4, 0), 3, 1), want_s, rtol=1e-6)
    # dequantize broadcasts the block scales: (q * s) within half a step of x
    np.testing.assert_allclose(q.dequantize(), want_q * want_s, rtol=1e-6, atol=1e-7)
    assert np.all(np.abs(q.dequantize() - x) <= want_s / 2 + 1e-6)


def test_two_axis_tiles_on_jax_arrays_agree_with_numpy():
    jnp = pytest.importorskip("jax.numpy")
    x = np.random.default_rng(1).normal(size=(4, 6, 8)).astype(np.float32)
    layout = QuantLayout.per_tile((0, 2), 2)
    qn, qj = quantize(x, "int8", layout), quantize(jnp.asarray(x), "int8", layout)
    assert qn.scale.shape == (2, 6, 4)
    # XLA may divide by the constant as a multiply by its reciprocal: scales agree to an ulp
    np.testing.assert_allclose(np.asarray(qj.scale), qn.scale, rtol=3e-7)
    assert np.mean(np.asarray(qj.qvalue) == qn.qvalue) > 0.99
    np.testing.assert_allclose(np.asarray(qj.dequantize()), qn.dequantize(), atol=float(qn.scale.max()) * 1.01)


def test_layout_json_and_validation_for_two_axes():
    lay = QuantLayout.per_tile((0, 1), (128, 64))
    assert QuantLayout.from_json(json.loads(json.dumps(lay.to_json()))) == lay
    assert QuantLayout.per_tile((0, 1), (32, 32)).tile_size == 32  # one length for both
    assert QuantLayout.per_tile(1, 16).tile_sizes == (16,)
    with pytest.raises(ValueError, match="positive tile_size"):
        QuantLayout.per_tile((0, 1), (4, 0))
    with pytest.raises(ValueError, match="positive tile_size"):
        QuantLayout.per_tile((0, 1), (4, 4, 4))
    with pytest.raises(ValueError, match="not a multiple of tile_size 5"):
        lay_bad = QuantLayout.per_tile((0, 1), (2, 5))
        lay_bad.expected_scale_shape((4, 8))
    with pytest.raises(ValueError, match="scale shape"):
        QArray(np.zeros((4, 8), np.int8), np.ones((2, 8), np.float32), layout=QuantLayout.per_tile((0, 1), 2))


@pytest.mark.parametrize("layout,scale_shape", [
    (None, (1, 1)),
    (QuantLayout.per_channel(1), (1, 6)),
    (QuantLayout.per_channel(0), (4, 1)),
    (QuantLayout.per_tile(0, 2), (2, 6)),
])
def test_int8_absmax_per_layout_matches_reference(layout, scale_shape):
    x = np.random.default_rng(2).normal(size=(4, 6)).astype(np.float32)
    q = quantize(x, "int8", layout)
    assert q.scale.shape == scale_shape and q.zero_point is None
    lay = layout or QuantLayout.per_tensor()
    if lay.kind == "per_tile":
        groups = np.repeat(np.abs(x).reshape(2, 2, 6).max(1), 2, 0)
    else:
        red = tuple(i for i in range(2) if scale_shape[i] == 1)
        groups = np.broadcast_to(np.abs(x).max(axis=red, keepdims=True), x.shape)
    want_q, _ = _ref_symmetric(x.astype(np.float64), groups.astype(np.float64), 127)
    np.testing.assert_array_equal(q.qvalue.astype(np.int64), want_q)


@pytest.mark.parametrize("qtype,qmin,qmax", [("uint4", 0, 15), ("uint8", 0, 255), ("int8", -128, 127)])
def test_minmax_and_unsigned_use_a_zero_point(qtype, qmin, qmax):
    x = np.random.default_rng(3).uniform(-1.0, 3.0, size=(5, 7)).astype(np.float32)
    x[:, 0] = np.abs(x[:, 0]) + 0.5  # a channel that excludes 0: the range is widened to hold it
    q = quantize(x, qtype, QuantLayout.per_channel(1), method="minmax")
    lo = np.minimum(x.min(0, keepdims=True).astype(np.float64), 0.0)
    hi = np.maximum(x.max(0, keepdims=True).astype(np.float64), 0.0)
    s = (hi - lo) / (qmax - qmin)
    z = np.clip(np.round(qmin - lo / s), qmin, qmax)
    np.testing.assert_allclose(q.scale, s, rtol=1e-6)
    np.testing.assert_array_equal(q.zero_point, z)
    np.testing.assert_array_equal(q.qvalue.astype(np.int64), np.clip(np.round(x / q.scale.astype(np.float64)) + z, qmin, qmax))
    # the zero point is rounded, so the range's ends may sit up to one step off the grid
    assert np.all(np.abs(q.dequantize() - x) <= s + 1e-5)


@pytest.mark.parametrize("qtype", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"])
def test_float_qtypes_round_by_the_cast(qtype):
    x = np.random.default_rng(4).normal(size=(3, 16)).astype(np.float32)
    q = quantize(x, qtype, QuantLayout.per_channel(0))
    fmax = float(ml_dtypes.finfo(getattr(ml_dtypes, qtype)).max)
    s = np.abs(x).max(1, keepdims=True) / fmax
    np.testing.assert_allclose(q.scale, s, rtol=1e-6)
    want = (x / q.scale).astype(getattr(ml_dtypes, qtype)).astype(np.float64) * q.scale
    np.testing.assert_allclose(q.dequantize(), want, rtol=1e-6)


def test_nf4_is_the_nearest_level():
    x = np.random.default_rng(5).normal(size=(4, 32)).astype(np.float32)
    q = quantize(x, "nf4", QuantLayout.per_tile(1, 16))
    levels = np.asarray(NF4_LEVELS)
    scaled = x.reshape(4, 2, 16) / np.abs(x.reshape(4, 2, 16)).max(-1, keepdims=True)
    want = np.abs(scaled[..., None] - levels).argmin(-1).reshape(4, 32)
    np.testing.assert_array_equal(q.qvalue.astype(np.int64), want)
    assert q.qtype == "nf4" and q.pack().nbytes < x.nbytes / 4  # 4 bits + one f32 scale per 16


@pytest.mark.parametrize("qtype,block", [("mxfp8", 32), ("mxfp4", 32), ("nvfp4", 16)])
def test_block_formats(qtype, block):
    x = np.random.default_rng(6).normal(size=(2, 64)).astype(np.float32)
    q = quantize(x, qtype, QuantLayout.per_tile(1, block))
    assert q.scale.shape == (2, 64 // block)
    err = np.abs(q.dequantize() - x).max() / np.abs(x).max()
    assert err < (0.07 if qtype == "mxfp8" else 0.35)
    if qtype.startswith("mx"):
        np.testing.assert_array_equal(np.log2(q.scale), np.round(np.log2(q.scale)))  # powers of two
    with pytest.raises(ValueError, match=f"block of {block}"):
        quantize(x, qtype, QuantLayout.per_channel(0))


def test_bad_input_names_what_was_wrong():
    x = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match="method 'rms' unknown"):
        quantize(x, "int8", method="rms")
    with pytest.raises(ValueError, match="minmax.*integer"):
        quantize(x, "float8_e4m3fn", method="minmax")
    with pytest.raises(ValueError, match="not a quantized type"):
        quantize(x, "bool")
    with pytest.raises(ValueError, match="not a multiple of tile_size 3"):
        quantize(x, "int8", QuantLayout.per_tile(0, 3))


def test_all_zero_groups_get_scale_one_and_dequantize_is_identity_on_plain_arrays():
    q = quantize(np.zeros((2, 3), np.float32), "int8", QuantLayout.per_channel(1))
    assert np.all(q.scale == 1.0) and np.all(q.dequantize() == 0.0)
    a = np.ones(3)
    assert dequantize(a) is a and np.array_equal(dequantize(q), q.dequantize())


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4), cols=st.integers(1, 4), t0=st.sampled_from([1, 2, 4]), t1=st.sampled_from([1, 2, 3]),
    qtype=st.sampled_from(["int8", "int4", "uint4", "float8_e4m3fn"]), seed=st.integers(0, 2**16),
)
def test_round_trip_error_is_bounded_by_half_a_step(rows, cols, t0, t1, qtype, seed):
    x = np.random.default_rng(seed).normal(size=(rows * t0, cols * t1)).astype(np.float32)
    q = quantize(x, qtype, QuantLayout.per_tile((0, 1), (t0, t1)))
    r = QArray.from_json(json.loads(json.dumps(q.to_json())))  # JSON keeps the 2-axis layout
    np.testing.assert_array_equal(r.dequantize(), q.dequantize())
    step = np.repeat(np.repeat(np.asarray(q.scale, np.float64), t0, 0), t1, 1)
    err = np.abs(q.dequantize().astype(np.float64) - x)
    if qtype.startswith("float8"):
        assert np.all(err <= np.abs(x) * 2.0**-3 + step * 2.0**-6)  # e4m3: 3 mantissa bits
    elif qtype == "uint4":  # asymmetric: the rounded zero point costs up to one step at the ends
        assert np.all(err <= step + 1e-6 * np.abs(x).max())
    else:
        assert np.all(err <= step / 2 + 1e-6 * np.abs(x).max())
