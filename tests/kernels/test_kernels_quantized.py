"""quantized_dot_general: every implementation against float64 dequantized references;
the integer dot is checked in the jaxpr."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import kernels
from cairn.core_array import QArray, QuantLayout

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import _kernels_testbase as tb

DN = (((1,), (0,)), ((), ()))


def int_q(rng, shape, layout, scale_shape, qtype="int8"):
    lo, hi = (-127, 128) if qtype == "int8" else (-8, 8)
    v = rng.integers(lo, hi, size=shape).astype(np.int8)
    s = rng.uniform(0.01, 0.1, size=scale_shape).astype(np.float32)
    q = QArray(jnp.asarray(v).astype(qtype), jnp.asarray(s), qtype=qtype, layout=layout)
    return q, np.asarray(q.dequantize(), np.float64)


class QuantizedBase:
    IMPL = "xla"

    def run(self, lhs, rhs, dn=DN, **kw):
        return kernels.quantized_dot_general(lhs, rhs, dn, implementation=self.IMPL, **kw)

    def test_weight_only_int8_per_channel_and_grad(self):
        rng, seed = tb.fresh_rng()
        x, x64 = tb.randn(rng, (3, 5, 40), "float32")
        w, w64 = int_q(rng, (40, 24), QuantLayout.per_channel(1), (1, 24))
        out = self.run(x, w, (((2,), (0,)), ((), ())))
        tb.assert_close(out, x64 @ w64, "float32", "w8 dot", seed)
        ct, c64 = tb.randn(rng, (3, 5, 24), "float32")
        (dx,) = jax.vjp(lambda a: self.run(a, w, (((2,), (0,)), ((), ()))), x)[1](ct)
        tb.assert_close(dx, c64 @ w64.T, "float32", "d x", seed, tb.GRAD_TOL)
        tb.assert_bitwise_equal(out, self.run(x, w, (((2,), (0,)), ((), ()))), "w8 dot")

    def test_w8a8_per_token_per_channel(self):
        rng, seed = tb.fresh_rng()
        xq, x64 = int_q(rng, (21, 40), QuantLayout.per_channel(0), (21, 1))
        w, w64 = int_q(rng, (40, 24), QuantLayout.per_channel(1), (1, 24))
        out = self.run(xq, w)
        tb.assert_close(out, x64 @ w64, "float32", "w8a8 dot", seed)

    def test_int4_packed_weight(self):
        rng, seed = tb.fresh_rng()
        x, x64 = tb.randn(rng, (9, 32), "bfloat16")
        w, w64 = int_q(rng, (32, 20), QuantLayout.per_channel(1), (1, 20), qtype="int4")
        out = self.run(x, w.pack())
        assert out.dtype == jnp.float32  # the QArray's original dtype wins the promotion
        tb.assert_close(out, x64 @ w64, "float32", "int4 packed dot", seed, {"float32": 1e-4})

    def test_bad_inputs_name_the_argument(self):
        w = QArray(jnp.ones((4, 3), jnp.int8), jnp.ones((1, 3)), layout=QuantLayout.per_channel(1))
        with pytest.raises(ValueError, match="contracting sizes differ"):
            self.run(jnp.ones((2, 5)), w)
        with pytest.raises(ValueError, match="dimension_numbers"):
            self.run(jnp.ones((2, 4)), w, (((3,), (0,)), ((), ())))
        with pytest.raises(ValueError, match="dimension_numbers"):
            self.run(jnp.ones((2, 4)), w, "rows")
        with pytest.raises(ValueError, match="implementation"):
            kernels.quantized_dot_general(jnp.ones((2, 4)), w, DN, implementation="marlin")


class TestQuantizedXla(QuantizedBase):
    IMPL = "xla"

    def test_integer_dot_in_jaxpr(self):
        rng, _ = tb.fresh_rng()
        xq, _ = int_q(rng, (4, 8), QuantLayout.per_channel(0), (4, 1))
        w, _ = int_q(rng, (8, 6), QuantLayout.per_channel(1), (1, 6))
        jaxpr = str(jax.make_jaxpr(lambda a, b: self.run(a, b))(xq, w))
        assert "preferred_element_type=int32" in jaxpr and "i8[4,8]" in jaxpr and "i8[8,6]" in jaxpr

    @pytest.mark.parametrize("both", [False, True])
    def test_per_tile_contracting(self, both):
        rng, seed = tb.fresh_rng()
        w, w64 = int_q(rng, (32, 12), QuantLayout.per_tile(0, 8), (4, 12))
        if both:
            x, x64 = int_q(rng, (5, 32), QuantLayout.per_tile(1, 8), (5, 4))
            jaxpr = str(jax.make_jaxpr(lambda a: self.run(a, w))(x))
            assert "preferred_element_type=int32" in jaxpr
        else:
            x, x64 = tb.randn(rng, (5, 32), "float32")
        tb.assert_close(self.run(x, w), x64 @ w64, "float32", "per-tile dot", seed)

    def test_fp8_both(self):
        rng, seed = tb.fresh_rng()
        v = jnp.asarray(rng.normal(size=(6, 16)), jnp.float8_e4m3fn)
        u = jnp.asarray(rng.normal(size=(16, 10)), jnp.float8_e4m3fn)
        x = QArray(v, jnp.full((6, 1), 0.5), qtype="float8_e4m3fn", layout=QuantLayout.per_channel(0))
        w = QArray(u, jnp.full((1, 10), 0.25), qtype="float8_e4m3fn", layout=QuantLayout.per_channel(1))
        ref = np.asarray(x.dequantize(), np.float64) @ np.asarray(w.dequantize(), np.float64)
        tb.assert_close(self.run(x, w), ref, "float32", "fp8 dot", seed, {"float32": 1e-5})
        assert "f8_e4m3fn[6,16]" in str(jax.make_jaxpr(lambda a, b: self.run(a, b))(x, w))

    def test_batch_dims_and_zero_point_fallback(self):
        rng, seed = tb.fresh_rng()
        x, x64 = tb.randn(rng, (3, 4, 8), "float32")
        v = rng.integers(0, 255, size=(3, 8, 5)).astype(np.uint8)
        w = QArray(jnp.asarray(v), jnp.full((3, 1, 5), 0.01, jnp.float32), jnp.full((3, 1, 5), 128.0, jnp.float32),
                   qtype="uint8", layout=QuantLayout.per_channel(0, 2))
        dn = (((2,), (1,)), ((0,), (0,)))
        ref = np.einsum("bik,bkn->bin", x64, np.asarray(w.dequantize(), np.float64))
        tb.assert_close(self.run(x, w, dn), ref, "float32", "zero-point batched dot", seed)

    @settings(max_examples=4, deadline=None)
    @given(m=st.integers(1, 6), tiles=st.integers(1, 3), tile=st.sampled_from([1, 2, 4]), n=st.integers(1, 5))
    def test_property_per_tile_matches_dequantized(self, m, tiles, tile, n):
        rng = np.random.default_rng(m * 100 + tiles * 10 + n)
        k = tiles * tile
        w, w64 = int_q(rng, (k, n), QuantLayout.per_tile(0, tile), (tiles, n))
        x = rng.normal(size=(m, k))
        out = self.run(jnp.asarray(x, jnp.float32), w)
        np.testing.assert_allclose(np.asarray(out), x @ w64, atol=1e-4, rtol=1e-4)


class TestQuantizedTriton(QuantizedBase):
    IMPL = "pallas_triton"

    def test_per_tile_is_refused_with_reason(self):
        w = QArray(jnp.ones((8, 4), jnp.int8), jnp.ones((2, 4)), layout=QuantLayout.per_tile(0, 4))
        with pytest.raises(ValueError, match="scale layout"):
            self.run(jnp.ones((2, 8)), w)

    def test_config_that_does_not_fit_raises(self):
        w = QArray(jnp.ones((8, 4), jnp.int8), jnp.ones((1, 4)), layout=QuantLayout.per_channel(1))
        with pytest.raises(ValueError, match="block_n"):
            kernels.call("quantized_dot_general", jnp.ones((2, 8)), w, DN, implementation=self.IMPL,
                         config={"block_n": 48})


def test_triton_kernel_lowers_for_cuda():
    from jax import export

    fn = kernels.implementations("quantized_dot_general")["pallas_triton"].fn
    w = QArray(jnp.ones((512, 256), jnp.int8), jnp.ones((1, 256)), layout=QuantLayout.per_channel(1))
    x = jnp.ones((128, 512), jnp.bfloat16)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    f = jax.jit(lambda a, b: fn(a, b, DN, config={}, interpret=False))
    assert "cuda" in export.export(f, platforms=["cuda"], disabled_checks=checks)(x, w).platforms


def test_ml_dtypes_int4_round_trip_assumption():
    # int4 values widen to int8 exactly (the kernels rely on it)
    v = np.arange(-8, 8, dtype=np.int8)
    assert np.array_equal(v.astype(ml_dtypes.int4).astype(np.int8), v)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_autotune_and_recording_cover_the_k2_ops():
    """One traced step calling ragged_dot, rms_norm, gated_linear_unit, the cross-entropy
    and quantized_dot_general: the offline autotuner measures each (xla on the CPU) and the
    recorder lists them with their configs."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2, 8, 4)), jnp.float32)
    gs = jnp.array([5, 9], jnp.int32)
    wg = jnp.asarray(rng.normal(size=(8, 2, 4)), jnp.float32)
    wv = jnp.asarray(rng.normal(size=(8, 40)), jnp.float32)
    lab = jnp.zeros((16,), jnp.int32)
    q = QArray(jnp.ones((8, 4), jnp.int8), jnp.ones((1, 4)), layout=QuantLayout.per_channel(1))

    def step(x):
        h = kernels.rms_norm(kernels.ragged_dot(x, w, gs), None)
        g = kernels.gated_linear_unit(x, wg, activation=jax.nn.swish)
        loss = kernels.linear_softmax_cross_entropy_loss(x, lab, wv)
        return h.sum() + g.sum() + loss + kernels.quantized_dot_general(x, q, DN).sum()

    ops = {"ragged_dot", "layer_norm", "gated_linear_unit", "linear_softmax_cross_entropy_loss",
           "quantized_dot_general"}
    result = kernels.autotune(step, x, iterations=1, mode="fwd")
    assert ops <= {e.op for e in result.entries}
    with kernels.recording() as calls:
        jax.grad(step)(x)
    assert ops <= {c.op for c in calls}
