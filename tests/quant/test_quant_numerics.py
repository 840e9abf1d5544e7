"""Quantize/dequantize against float64 NumPy references, per qtype and calibration method."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.quant import QTYPES, bounds, parse_method, qtype_info, quantize_array

INT_QTYPES = ["int8", "int4", "int2"]
FLOAT_QTYPES = ["float8_e4m3fn", "float8_e5m2"]


def _ref_bounds(x: np.ndarray, method: str, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Independent float64 statement of the calibration grammar."""
    name, *args = method.split(",")
    a = [float(v) for v in args]
    x = x.astype(np.float64)
    if name == "absmax":
        hi = (a[0] if a else 1.0) * np.max(np.abs(x), axis=axes, keepdims=True)
        return -hi, hi
    if name == "minmax":
        s = a[0] if a else 1.0
        return s * np.min(x, axis=axes, keepdims=True), s * np.max(x, axis=axes, keepdims=True)
    if name == "rms":
        hi = a[0] * np.sqrt(np.mean(x**2, axis=axes, keepdims=True))
        return -hi, hi
    if name == "percentile":
        hi = np.percentile(np.abs(x), a[0], axis=axes, keepdims=True)
        return -hi, hi
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    return np.full(shape, a[0]), np.full(shape, a[1])


@pytest.mark.parametrize("method", ["absmax", "absmax,0.9", "minmax", "minmax,0.8", "rms,3", "percentile,99", "fixed,-2,3"])
def test_bounds_match_float64_reference(method):
    x = np.random.default_rng(0).normal(size=(6, 40)).astype(np.float32)
    lo, hi = bounds(x, method, (1,))
    rlo, rhi = _ref_bounds(x, method, (1,))
    np.testing.assert_allclose(np.asarray(lo), rlo, rtol=2e-6, atol=1e-6)  # float32 arithmetic
    np.testing.assert_allclose(np.asarray(hi), rhi, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("bad", ["absmin", "rms", "rms,0", "percentile,101", "fixed,3,1", "absmax,x", "minmax,1,2", 3])
def test_bad_methods_are_named(bad):
    with pytest.raises(ValueError, match="calibration method"):
        parse_method(bad)


def _ref_symmetric_int(x: np.ndarray, bits: int, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    qmax = 2 ** (bits - 1) - 1
    hi = np.max(np.abs(x.astype(np.float64)), axis=axes, keepdims=True)
    scale = np.where(hi > 0, hi / (qmax + 0.5), 1.0)  # the top bucket [qmax - 0.5, qmax + 0.5) used fully
    q = np.clip(np.round(x / scale), -qmax, qmax)
    return q, scale


@pytest.mark.parametrize("qtype", INT_QTYPES)
def test_symmetric_int_matches_reference(qtype):
    x = np.random.default_rng(1).normal(size=(8, 16)).astype(np.float32)
    q = quantize_array(x, qtype, reduce_axes=(0,))
    rq, rs = _ref_symmetric_int(x, qtype_info(qtype).bits, (0,))
    np.testing.assert_allclose(np.asarray(q.scale), rs, rtol=1e-6)
    # float32 division can land a value exactly on a rounding boundary differently: at most 1 step, rarely
    diff = np.abs(np.asarray(q.qvalue).astype(np.int64) - rq)
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01
    assert q.layout.kind == "per_channel" and q.layout.axes == (1,)


@pytest.mark.parametrize("qtype", INT_QTYPES + ["uint4", "uint8"] + FLOAT_QTYPES)
@pytest.mark.parametrize("method", ["absmax", "minmax"])
def test_round_trip_within_half_a_step(qtype, method):
    x = np.random.default_rng(2).normal(size=(4, 64)).astype(np.float32)
    q = quantize_array(x, qtype, reduce_axes=(1,), method=method)
    err = np.abs(np.asarray(q.dequantize(), np.float64) - x)
    scale = np.asarray(q.scale, np.float64)
    info = qtype_info(qtype)
    if info.is_float:
        # relative precision of the fp8 format: 2**-(mantissa bits + 1) of the value, plus subnormals
        mant = {"float8_e4m3fn": 3, "float8_e5m2": 2}[qtype]
        tiny = float(ml_dtypes.finfo(getattr(ml_dtypes, qtype)).smallest_subnormal)
        assert np.all(err <= np.abs(x) * 2.0 ** -(mant + 1) * 1.001 + scale * tiny)
    else:
        assert np.all(err <= scale * 0.5 * (1 + 1e-5) + 1e-7)


@given(
    rows=st.integers(1, 5),
    tiles=st.integers(1, 4),
    tile=st.sampled_from([1, 2, 4, 8]),
    qtype=st.sampled_from(INT_QTYPES + FLOAT_QTYPES),
)
@settings(deadline=None, max_examples=25)
@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_per_tile_layout_and_round_trip(rows, tiles, tile, qtype):
    x = np.random.default_rng(rows * 100 + tiles).normal(size=(tiles * tile, rows)).astype(np.float32)
    q = quantize_array(x, qtype, reduce_axes=(0,), tile=(0, tile))
    assert q.layout.kind == "per_tile" and q.layout.axes == (0,) and q.layout.tile_size == tile
    assert q.scale.shape == (tiles, rows)
    # each tile's scale is that tile's absmax / qmax
    xt = x.reshape(tiles, tile, rows).astype(np.float64)
    info = qtype_info(qtype)
    expect = np.max(np.abs(xt), axis=1) / (info.qmax + 0.5 if not info.is_float else info.qmax)
    np.testing.assert_allclose(np.asarray(q.scale), np.where(expect > 0, expect, 1.0), rtol=1e-6)
    assert np.asarray(q.dequantize()).shape == x.shape


def test_tile_that_does_not_divide_names_the_weight():
    with pytest.raises(ValueError, match=r"layers/0/kernel.*tile_size 3.*size 8"):
        quantize_array(np.ones((8, 4), np.float32), "int8", reduce_axes=(0,), tile=(0, 3), where="layers/0/kernel")


def test_unknown_qtype():
    with pytest.raises(ValueError, match="unknown qtype 'int9'"):
        quantize_array(np.ones(3, np.float32), "int9")
    assert set(QTYPES) >= {"int8", "int4", "float8_e4m3fn"}


def test_zero_tensor_has_unit_scale():
    q = quantize_array(np.zeros((2, 3), np.float32), "int8", reduce_axes=(1,))
    assert np.all(np.asarray(q.scale) == 1.0) and np.all(np.asarray(q.dequantize()) == 0)


def test_nf4_picks_the_nearest_normal_float_level():
    from cairn.core_array import NF4_LEVELS

    x = np.random.default_rng(3).normal(size=(6, 40)).astype(np.float32)
    q = quantize_array(x, "nf4", reduce_axes=(1,))
    assert q.qtype == "nf4" and q.qvalue.dtype == ml_dtypes.uint4
    levels = np.asarray(NF4_LEVELS, np.float64)
    absmax = np.abs(x.astype(np.float64)).max(axis=1, keepdims=True)
    want = np.abs(x[..., None] / absmax[..., None] - levels).argmin(axis=-1)
    got = np.asarray(q.qvalue).astype(np.int64)
    assert (got != want).mean() < 0.005  # ties at midpoints may go either way in float32
    np.testing.assert_allclose(np.asarray(q.dequantize()), levels[got] * absmax, rtol=1e-6)


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("qtype,block", [("mxfp8", 32), ("mxfp4", 32), ("nvfp4", 16)])
def test_block_formats(qtype, block):
    x = np.random.default_rng(4).normal(size=(4, 64)).astype(np.float32) * 10
    q = quantize_array(x, qtype, reduce_axes=(1,), tile=(1, block))
    info = qtype_info(qtype)
    assert q.qtype == qtype and q.layout.tile_size == block and q.scale.shape == (4, 64 // block)
    scale = np.asarray(q.scale.astype(np.float32), np.float64)
    if info.kind == "mx":
        assert q.scale.dtype == ml_dtypes.float8_e8m0fnu
        np.testing.assert_array_equal(np.log2(scale), np.round(np.log2(scale)))  # powers of two
    else:
        assert q.scale.dtype == ml_dtypes.float8_e4m3fn
    values = np.asarray(q.qvalue.astype(np.float32))
    assert np.abs(values).max() <= info.qmax
    rel = np.linalg.norm(np.asarray(q.dequantize()) - x) / np.linalg.norm(x)
    assert rel < {"mxfp8": 0.05, "mxfp4": 0.2, "nvfp4": 0.15}[qtype]
    with pytest.raises(ValueError, match=f"blocks of {block}"):
        quantize_array(x, qtype, reduce_axes=(1,), tile=(1, 8))
    with pytest.raises(ValueError, match="needs a tile axis"):
        quantize_array(x, qtype, reduce_axes=(1,))


def test_two_axis_tiles_give_one_scale_per_block():
    # 2-d blocks (as in block-scaled fp8 weights): each (4, 3) block of x has its own scale
    x = np.random.default_rng(7).normal(size=(8, 6)).astype(np.float32)
    q = quantize_array(x, "int8", reduce_axes=(0,), tile=((0, 4), (1, 3)))
    assert q.layout.axes == (0, 1) and q.layout.tile_sizes == (4, 3) and q.scale.shape == (2, 2)
    blocks = np.abs(x.astype(np.float64)).reshape(2, 4, 2, 3).max(axis=(1, 3))
    np.testing.assert_allclose(np.asarray(q.scale), blocks / 127.5, rtol=1e-6)
    s = np.repeat(np.repeat(blocks / 127.5, 4, 0), 3, 1)
    np.testing.assert_array_equal(np.asarray(q.qvalue, np.int64), np.clip(np.round(x / s), -127, 127))


@pytest.mark.parametrize("qtype,layout_args,method", [
    ("int8", ((1,), None), "absmax"),
    ("int4", ((0,), ((0, 4),)), "absmax"),
    ("uint4", ((1,), None), "minmax"),
    ("float8_e4m3fn", ((0,), None), "absmax"),
    ("int8", ((0,), ((0, 4), (1, 3))), "absmax"),
])
def test_core_array_quantize_agrees_with_quantize_array(qtype, layout_args, method):
    # the one basic quantize in core_array (kernels call it) and quant's share one grid
    from cairn.core_array import QuantLayout, quantize

    x = np.random.default_rng(8).normal(size=(8, 6)).astype(np.float32)
    reduce_axes, tile = layout_args
    ours = quantize_array(x, qtype, reduce_axes=reduce_axes, tile=tile, method=method)
    if tile:
        layout = QuantLayout.per_tile(tuple(a for a, _ in tile), tuple(t for _, t in tile))
    else:
        layout = QuantLayout.per_channel(*[a for a in range(2) if a not in reduce_axes])
    base = quantize(x, qtype, layout, method=method)
    np.testing.assert_allclose(np.asarray(base.scale, np.float64).ravel(), np.asarray(ours.scale, np.float64).ravel(), rtol=3e-7)
    np.testing.assert_allclose(np.asarray(base.dequantize()), np.asarray(ours.dequantize()), rtol=1e-6, atol=float(np.max(ours.scale)) * 1.01)


def test_minmax_widens_a_range_that_excludes_zero():
    # all-positive data with a zero point: the grid must still hold 0, or the top is clipped
    x = np.random.default_rng(9).uniform(0.2, 3.0, size=(5, 7)).astype(np.float32)
    q = quantize_array(x, "uint8", reduce_axes=(0,), method="minmax")
    step = np.asarray(q.scale, np.float64)
    assert np.all(np.abs(np.asarray(q.dequantize(), np.float64) - x) <= step + 1e-6)
