"""gated_linear_unit: every implementation against a float64 NumPy reference."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import kernels
from cairn.core_array import QArray, QuantLayout

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import _kernels_testbase as tb

pytest_generate_tests = tb.generate_cases  # noqa: V107 (pytest calls it)

ACTS = {
    "swish": (jax.nn.swish, lambda a: a / (1 + np.exp(-a)), lambda a: (1 + np.exp(-a) + a * np.exp(-a)) / (1 + np.exp(-a)) ** 2),
    "none": (None, lambda a: a, lambda a: np.ones_like(a)),
}


def ref_glu(x, w, act, dact, ct):
    a, b = x @ w[:, 0], x @ w[:, 1]
    out = act(a) * b
    da, db = ct * b * dact(a), ct * act(a)
    dx = da @ w[:, 0].T + db @ w[:, 1].T
    dw = np.stack([x.T @ da, x.T @ db], axis=1)
    return out, dx, dw


class GluBase:
    IMPL = "xla"
    CONFIG: dict | None = None
    FAST_DTYPES = ("float32", "bfloat16")

    def run(self, *args, **kwargs):
        with kernels.override(self.IMPL, self.CONFIG, op="gated_linear_unit"):
            return kernels.gated_linear_unit(*args, **kwargs)

    DTYPES = ("float32", "bfloat16", "float16")
    CASES = tuple((d, a) for d in ("float32", "bfloat16", "float16") for a in ("swish", "none"))

    @classmethod
    def is_fast(cls, case) -> bool:
        return case[0] in cls.FAST_DTYPES and (case[1] == "swish" or case[0] == "float32")

    def test_values_grads_determinism(self, case):
        dtype, act = case
        fn, ref_act, ref_dact = ACTS[act]
        rng, seed = tb.fresh_rng()
        x, x64 = tb.randn(rng, (37, 20), dtype)
        w, w64 = tb.randn(rng, (20, 2, 24), dtype, scale=0.3)
        ct, c64 = tb.randn(rng, (37, 24), dtype)
        step = tb.jit_value_and_vjp(lambda a, b: self.run(a, b, activation=fn))
        out, (dx, dw) = step((x, w), ct)
        ref, rdx, rdw = ref_glu(x64, w64, ref_act, ref_dact, c64)
        assert out.dtype == x.dtype
        tb.assert_close(out, ref, dtype, "glu", seed)
        tb.assert_close(dx, rdx, dtype, "d x", seed, tb.GRAD_TOL)
        tb.assert_close(dw, rdw, dtype, "d weights", seed, tb.GRAD_TOL)
        out2, (dx2, _) = step((x, w), ct)
        tb.assert_bitwise_equal(out, out2, "glu")
        tb.assert_bitwise_equal(dx, dx2, "d x")

    def test_batch_axes(self):
        rng, seed = tb.fresh_rng()
        x, x64 = tb.randn(rng, (2, 3, 8), "float32")
        w, w64 = tb.randn(rng, (8, 2, 5), "float32")
        out = self.run(x, w, activation=jax.nn.sigmoid)
        ref = (1 / (1 + np.exp(-(x64 @ w64[:, 0])))) * (x64 @ w64[:, 1])
        tb.assert_close(out, ref, "float32", "glu [2, 3, 8]", seed)

    def test_bad_inputs_name_the_argument(self):
        x = jnp.ones((4, 6))
        with pytest.raises(ValueError, match="weights"):
            kernels.gated_linear_unit(x, jnp.ones((6, 3, 5)), implementation=self.IMPL)
        with pytest.raises(ValueError, match="weights"):
            kernels.gated_linear_unit(x, jnp.ones((5, 2, 5)), implementation=self.IMPL)
        with pytest.raises(ValueError, match="dtype"):
            kernels.gated_linear_unit(x, jnp.ones((6, 2, 5), jnp.bfloat16), implementation=self.IMPL)
        with pytest.raises(ValueError, match="implementation"):
            kernels.gated_linear_unit(x, jnp.ones((6, 2, 5)), implementation="cutlass")


class TestGluXla(GluBase):
    IMPL = "xla"

    @settings(max_examples=4, deadline=None)
    @given(m=st.integers(1, 7), k=st.integers(1, 7), n=st.integers(1, 7))
    def test_property_shapes(self, m, k, n):
        rng = np.random.default_rng(m * 100 + k * 10 + n)
        x, w = rng.normal(size=(m, k)), rng.normal(size=(k, 2, n))
        out = kernels.gated_linear_unit(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), implementation="xla")
        np.testing.assert_allclose(np.asarray(out), (x @ w[:, 0]) * (x @ w[:, 1]), atol=1e-4, rtol=1e-4)

    def test_quantized_weights_int8_per_channel(self):
        rng, seed = tb.fresh_rng()
        x, x64 = tb.randn(rng, (6, 16), "float32")
        q = rng.integers(-127, 128, size=(16, 2, 8)).astype(np.int8)
        s = rng.uniform(0.005, 0.02, size=(1, 2, 8)).astype(np.float32)
        w = QArray(jnp.asarray(q), jnp.asarray(s), layout=QuantLayout.per_channel(1, 2))
        out = kernels.gated_linear_unit(x, w, activation=jax.nn.swish)
        wf = q * s.astype(np.float64)
        ref = ref_glu(x64, wf, ACTS["swish"][1], ACTS["swish"][2], np.zeros((6, 8)))[0]
        tb.assert_close(out, ref, "float32", "int8 glu", seed)
        jaxpr = str(jax.make_jaxpr(lambda a: kernels.gated_linear_unit(a, w))(x))
        assert "i8[16,2,8]" in jaxpr  # the int8 values reach the computation, not a dequantized copy


class TestGluTriton(GluBase):
    IMPL = "pallas_triton"
    CONFIG = {"block_m": 16, "block_n": 16, "block_k": 16}
    FAST_DTYPES = ("float32",)

    def test_config_that_does_not_fit_raises(self):
        with pytest.raises(ValueError, match="block_k"):
            kernels.call("gated_linear_unit", jnp.ones((4, 4)), jnp.ones((4, 2, 4)), implementation=self.IMPL,
                         config={"block_k": 8})


class TestGluMosaic(GluBase):
    IMPL = "pallas_mosaic_gpu"
    CONFIG = {"block_n": 32, "block_k": 32}
    DTYPES = ("bfloat16", "float16")  # wgmma takes 16-bit operands
    FAST_DTYPES = ("bfloat16",)

    def test_batch_axes(self):
        pytest.skip("float32: wgmma takes 16-bit operands (covered by the xla and Triton classes)")

    def test_float32_is_refused_with_reason(self):
        with pytest.raises(ValueError, match="wgmma"):
            kernels.gated_linear_unit(jnp.ones((4, 8)), jnp.ones((8, 2, 4)), implementation=self.IMPL)


@pytest.mark.parametrize("impl", tb.PALLAS)
def test_gpu_kernels_lower_for_cuda(impl):
    from jax import export

    fn = kernels.implementations("gated_linear_unit")[impl].fn
    x = jnp.ones((256, 512), jnp.bfloat16)
    w = jnp.ones((512, 2, 1024), jnp.bfloat16)
    g = jax.grad(lambda a, b: fn(a, b, config={}, interpret=False, activation=jax.nn.swish).astype(jnp.float32).sum(), (0, 1))
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    assert "cuda" in export.export(jax.jit(g), platforms=["cuda"], disabled_checks=checks)(x, w).platforms
