"""layer_norm / rms_norm: every implementation against a float64 NumPy reference."""

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

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import _kernels_testbase as tb

pytest_generate_tests = tb.generate_cases  # noqa: V107 (pytest calls it)


def ref_norm(x, scale, offset, eps, subtract_mean, axis=-1):
    """``(y, vjp)`` in float64; the vjp by the closed form of the norm's derivative."""
    xm = np.moveaxis(x, axis, -1)
    mean = xm.mean(-1, keepdims=True) if subtract_mean else 0.0
    xc = xm - mean
    rstd = 1.0 / np.sqrt((xc * xc).mean(-1, keepdims=True) + eps)
    xhat = xc * rstd
    s = scale if scale is not None else 1.0
    y = xhat * s + (offset if offset is not None else 0.0)

    def vjp(ct):
        ctm = np.moveaxis(ct, axis, -1)
        g = ctm * s
        inner = g - xhat * (g * xhat).mean(-1, keepdims=True)
        if subtract_mean:
            inner = inner - g.mean(-1, keepdims=True)
        dx = np.moveaxis(inner * rstd, -1, axis)
        flat = (-1, xm.shape[-1])
        return dx, (ctm * xhat).reshape(flat).sum(0), ctm.reshape(flat).sum(0)

    return np.moveaxis(y, -1, axis), vjp


class NormBase:
    IMPL = "xla"
    CONFIG: dict | None = None
    FAST_DTYPES = ("float32", "bfloat16")

    def run(self, fn, *args, **kwargs):
        with kernels.override(self.IMPL, self.CONFIG, op="layer_norm"):
            return fn(*args, **kwargs)

    DTYPES = ("float32", "bfloat16", "float16")
    CASES = tuple((d, sm) for d in ("float32", "bfloat16", "float16") for sm in (True, False))

    @classmethod
    def is_fast(cls, case) -> bool:
        return case[0] in cls.FAST_DTYPES

    def test_values_grads_determinism(self, case):
        dtype, subtract_mean = case
        rng, seed = tb.fresh_rng()
        x, x64 = tb.randn(rng, (3, 7, 37), dtype, scale=2.0)  # 21 rows of 37 features
        s, s64 = tb.randn(rng, (37,), dtype)
        o, o64 = tb.randn(rng, (37,), dtype)
        ct, c64 = tb.randn(rng, x.shape, dtype)
        if subtract_mean:
            step = tb.jit_value_and_vjp(lambda a, b, c: self.run(kernels.layer_norm, a, b, c, epsilon=1e-5))
            args = (x, s, o)
            ref, rvjp = ref_norm(x64, s64, o64, 1e-5, True)
        else:
            step = tb.jit_value_and_vjp(lambda a, b: self.run(kernels.rms_norm, a, b, epsilon=1e-5))
            args = (x, s)
            ref, rvjp = ref_norm(x64, s64, None, 1e-5, False)
        y, grads = step(args, ct)
        assert y.dtype == x.dtype
        tb.assert_close(y, ref, dtype, "norm", seed)
        rgrads = rvjp(c64)
        for name, g, r in zip(("d x", "d scale", "d offset"), grads, rgrads):
            tb.assert_close(g, r, dtype, name, seed, {dtype: tb.GRAD_TOL[dtype] * 2})
        y2, grads2 = step(args, ct)
        tb.assert_bitwise_equal(y, y2, "norm")
        tb.assert_bitwise_equal(grads[0], grads2[0], "d x")

    def test_axis_and_no_params(self):
        rng, seed = tb.fresh_rng()
        x, x64 = tb.randn(rng, (5, 6, 4), "float32")
        y = self.run(kernels.layer_norm, x, None, None, axis=1)
        tb.assert_close(y, ref_norm(x64, None, None, 1e-6, True, axis=1)[0], "float32", "layer_norm axis=1", seed)

    def test_bad_inputs_name_the_argument(self):
        x = jnp.ones((4, 6))
        with pytest.raises(ValueError, match="scale"):
            kernels.layer_norm(x, jnp.ones((5,)), None, implementation=self.IMPL)
        with pytest.raises(ValueError, match="offset"):
            kernels.layer_norm(x, None, jnp.ones((4,)), implementation=self.IMPL)
        with pytest.raises(ValueError, match="axis"):
            kernels.rms_norm(x, None, axis=2, implementation=self.IMPL)
        with pytest.raises(ValueError, match="implementation"):
            kernels.rms_norm(x, None, implementation="apex")


class TestNormXla(NormBase):
    IMPL = "xla"

    @settings(max_examples=4, deadline=None)
    @given(rows=st.integers(1, 6), d=st.integers(1, 9), sm=st.booleans(), offset=st.floats(-1, 1))
    def test_property_shapes(self, rows, d, sm, offset):
        rng = np.random.default_rng(rows * 10 + d)
        x = rng.normal(size=(rows, d))
        s = rng.normal(size=(d,))
        y = kernels.layer_norm(jnp.asarray(x, jnp.float32), jnp.asarray(s, jnp.float32), None, subtract_mean=sm,
                               scale_offset=offset, implementation="xla")
        ref = ref_norm(x, s + offset, None, 1e-6, sm)[0]
        np.testing.assert_allclose(np.asarray(y), ref, atol=2e-4 * max(1, np.abs(ref).max()))


class TestNormTriton(NormBase):
    IMPL = "pallas_triton"
    CONFIG = {"block_rows": 4}
    FAST_DTYPES = ("float32",)

    def test_config_that_does_not_fit_raises(self):
        with pytest.raises(ValueError, match="block_rows"):
            kernels.call("layer_norm", jnp.ones((4, 4)), None, None, implementation=self.IMPL,
                         config={"block_rows": 3}, epsilon=1e-6, subtract_mean=True)


def test_triton_kernels_lower_for_cuda():
    from jax import export

    fn = kernels.implementations("layer_norm")["pallas_triton"].fn
    x = jnp.ones((64, 1000), jnp.bfloat16)
    s = jnp.ones((1000,), jnp.bfloat16)
    g = jax.grad(lambda a, b: fn(a, b, b, config={}, interpret=False).astype(jnp.float32).sum(), (0, 1))
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    assert "cuda" in export.export(jax.jit(g), platforms=["cuda"], disabled_checks=checks)(x, s).platforms
