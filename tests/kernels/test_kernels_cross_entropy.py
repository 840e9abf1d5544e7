"""linear_softmax_cross_entropy_loss: every implementation against a float64 NumPy reference,
and its memory against the naive composition."""

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

OP = "linear_softmax_cross_entropy_loss"


def ref_loss_and_grads(x, labels, w, reduction):
    logits = x @ w
    m = logits.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]
    per = lse - logits[np.arange(len(labels)), labels]
    coef = 1.0 / len(labels) if reduction == "mean" else 1.0
    p = np.exp(logits - lse[:, None])
    p[np.arange(len(labels)), labels] -= 1.0
    p *= coef
    return per.sum() * coef, p @ w.T, x.T @ p


def naive(x, labels, w):
    logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
    return (jax.nn.logsumexp(logits, axis=1) - jnp.take_along_axis(logits, labels[:, None], 1)[:, 0]).sum()


class CrossEntropyBase:
    IMPL = "xla"
    CONFIG: dict = {"block_v": 64}
    FAST_DTYPES = ("float32", "bfloat16")
    SIZES = (37, 40, 300)  # tokens, hidden, vocab: none a multiple of a block

    def run(self, *args, **kwargs):
        with kernels.override(self.IMPL, self.CONFIG, op=OP):
            return kernels.linear_softmax_cross_entropy_loss(*args, **kwargs)

    DTYPES = ("float32", "bfloat16", "float16")
    CASES = tuple((d, r) for d in ("float32", "bfloat16", "float16") for r in ("sum", "mean"))

    @classmethod
    def is_fast(cls, case) -> bool:
        return case[0] in cls.FAST_DTYPES and (case[1] == "sum" or cls.IMPL == "xla")

    def test_values_grads_determinism(self, case):
        dtype, reduction = case
        b, h, v = self.SIZES
        rng, seed = tb.fresh_rng()
        x, x64 = tb.randn(rng, (b, h), dtype)
        w, w64 = tb.randn(rng, (h, v), dtype, scale=0.3)
        labels = rng.integers(0, v, size=b)
        lab = jnp.asarray(labels, jnp.int32)
        step = jax.jit(jax.value_and_grad(lambda a, c: self.run(a, lab, c, reduction=reduction), (0, 1)))
        loss, (dx, dw) = step(x, w)
        rl, rdx, rdw = ref_loss_and_grads(x64, labels, w64, reduction)
        assert loss.dtype == jnp.float32 and loss.shape == ()
        # the loss sums b per-token terms: its rounding scales with them, not with max|ref|
        tol = {dtype: tb.TOL[dtype] * (4 if dtype == "float32" else 1)}
        tb.assert_close(loss, rl, dtype, "loss", seed, tol)
        tb.assert_close(dx, rdx, dtype, "d x", seed, tb.GRAD_TOL)
        tb.assert_close(dw, rdw, dtype, "d weights", seed, tb.GRAD_TOL)
        assert dx.dtype == x.dtype and dw.dtype == w.dtype
        again = step(x, w)
        tb.assert_bitwise_equal(loss, again[0], "loss")
        tb.assert_bitwise_equal(dw, again[1][1], "d weights")

    def test_bad_inputs_name_the_argument(self):
        x, w, lab = jnp.ones((4, 3)), jnp.ones((3, 5)), jnp.zeros((4,), jnp.int32)
        f = kernels.linear_softmax_cross_entropy_loss
        with pytest.raises(ValueError, match="weights"):
            f(x, lab, jnp.ones((2, 5)), implementation=self.IMPL)
        with pytest.raises(ValueError, match="labels"):
            f(x, jnp.zeros((3,), jnp.int32), w, implementation=self.IMPL)
        with pytest.raises(TypeError, match="labels"):
            f(x, jnp.zeros((4,)), w, implementation=self.IMPL)
        with pytest.raises(ValueError, match="reduction"):
            f(x, lab, w, reduction="max", implementation=self.IMPL)
        with pytest.raises(ValueError, match="x must be 2-d"):
            f(jnp.ones((4,)), lab, w, implementation=self.IMPL)
        with pytest.raises(ValueError, match="implementation"):
            f(x, lab, w, implementation="fused_magic")


class TestCrossEntropyXla(CrossEntropyBase):
    IMPL = "xla"

    @settings(max_examples=4, deadline=None)
    @given(b=st.integers(1, 9), h=st.integers(1, 6), v=st.integers(2, 40), block_v=st.sampled_from([1, 4, 16, 64]))
    def test_property_any_chunking(self, b, h, v, block_v):
        rng = np.random.default_rng(b * 1000 + h * 100 + v)
        x, w = rng.normal(size=(b, h)), rng.normal(size=(h, v))
        labels = rng.integers(0, v, size=b)
        out = kernels.call(OP, jnp.asarray(x, jnp.float32), jnp.asarray(labels, jnp.int32), jnp.asarray(w, jnp.float32),
                           implementation="xla", config={"block_v": block_v}, reduction="sum")
        np.testing.assert_allclose(float(out), ref_loss_and_grads(x, labels, w, "sum")[0], rtol=1e-4, atol=1e-4)

    def test_extreme_logits_stay_finite(self):
        x = jnp.array([[100.0, -100.0], [0.0, 1.0]])
        w = jnp.array([[50.0, -50.0, 0.0], [1.0, 2.0, 3.0]])
        loss = self.run(x, jnp.array([1, 0]), w)
        assert np.isfinite(float(loss))

    def test_memory_below_naive(self):
        """Compiled temp memory of value-and-grad: chunked vs the whole-logits composition."""
        b, h, v = 512, 64, 16384
        args = (jax.ShapeDtypeStruct((b, h), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32),
                jax.ShapeDtypeStruct((h, v), jnp.float32))

        def temp(f):
            g = jax.jit(jax.value_and_grad(f, (0, 2)))
            return g.lower(*args).compile().memory_analysis().temp_size_in_bytes

        with kernels.override("xla", {"block_v": 512, "block_b": 32}, op=OP):
            ours = temp(kernels.linear_softmax_cross_entropy_loss)
        theirs = temp(naive)
        logits_bytes = b * v * 4
        assert theirs >= logits_bytes  # the naive form holds at least the logits
        # the chunked form holds two [b, block_v] chunks and the [h, v] gradient buffer
        assert ours < theirs / 4, f"chunked temp {ours} B vs naive {theirs} B"

    def test_bad_config(self):
        with pytest.raises(ValueError, match="block_v"):
            kernels.call(OP, jnp.ones((2, 2)), jnp.zeros((2,), jnp.int32), jnp.ones((2, 3)),
                         implementation="xla", config={"block_v": 0})


class TestCrossEntropyTriton(CrossEntropyBase):
    IMPL = "pallas_triton"
    CONFIG = {"block_b": 16, "block_v": 64, "block_h": 16, "block_v_bwd": 128}
    FAST_DTYPES = ("float32",)

    def test_config_that_does_not_fit_raises(self):
        with pytest.raises(ValueError, match="block_v"):
            kernels.call(OP, jnp.ones((2, 2)), jnp.zeros((2,), jnp.int32), jnp.ones((2, 3)),
                         implementation=self.IMPL, config={"block_v": 100})


class TestCrossEntropyMosaic(CrossEntropyBase):
    IMPL = "pallas_mosaic_gpu"
    CONFIG = {"block_v": 64, "block_h": 64, "block_v_bwd": 128}
    FAST_DTYPES = ("bfloat16",)
    DTYPES = ("bfloat16", "float16")  # wgmma takes 16-bit operands
    SIZES = (70, 40, 192)  # tokens and hidden not multiples of the blocks; block_v divides vocab

    def test_refusals_name_the_reason(self):
        with pytest.raises(ValueError, match="wgmma"):
            kernels.linear_softmax_cross_entropy_loss(jnp.ones((4, 8)), jnp.zeros((4,), jnp.int32), jnp.ones((8, 64)),
                                                      implementation=self.IMPL)
        with pytest.raises(ValueError, match="multiple of 32"):
            kernels.linear_softmax_cross_entropy_loss(
                jnp.ones((4, 8), jnp.bfloat16), jnp.zeros((4,), jnp.int32), jnp.ones((8, 50), jnp.bfloat16),
                implementation=self.IMPL,
            )


class TestCrossEntropyMosaic128(TestCrossEntropyMosaic):
    """128 token rows per program (a [128, block_v] accumulator): two programs, the second padded."""

    CONFIG = {"block_b": 128, "block_v": 64, "block_h": 64, "block_v_bwd": 128}
    SIZES = (150, 40, 192)

    def test_block_rows_outside_a_warpgroup_raise(self):
        with pytest.raises(ValueError, match="block_b=96"):
            kernels.call(OP, jnp.ones((4, 8), jnp.bfloat16), jnp.zeros((4,), jnp.int32), jnp.ones((8, 64), jnp.bfloat16),
                         implementation=self.IMPL, config={"block_b": 96})


@pytest.mark.parametrize("impl", tb.PALLAS)
def test_gpu_forward_lowers_for_cuda(impl):
    """The GPU kernels lower for CUDA without a GPU (realistic sizes, vocab 32000)."""
    from jax import export

    fn = kernels.implementations(OP)[impl].fn
    x = jnp.ones((256, 512), jnp.bfloat16)
    w = jnp.ones((512, 32000), jnp.bfloat16)
    lab = jnp.zeros((256,), jnp.int32)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    cfg = {"block_v": 128} if impl == "pallas_mosaic_gpu" else {}
    g = jax.grad(lambda a, c: fn(a, lab, c, config=cfg, interpret=False), (0, 1))
    exp = export.export(jax.jit(g), platforms=["cuda"], disabled_checks=checks)(x, w)
    assert "cuda" in exp.platforms


def test_quantized_weights_int8_per_column():
    from cairn.core_array import QArray, QuantLayout

    rng, seed = tb.fresh_rng()
    x, x64 = tb.randn(rng, (19, 16), "float32")
    q = rng.integers(-127, 128, size=(16, 50)).astype(np.int8)
    s = rng.uniform(0.001, 0.01, size=(1, 50)).astype(np.float32)
    w = QArray(jnp.asarray(q), jnp.asarray(s), layout=QuantLayout.per_channel(1))
    labels = rng.integers(0, 50, size=19)
    lab = jnp.asarray(labels, jnp.int32)
    with kernels.override("xla", {"block_b": 8}, op=OP):
        loss, dx = jax.value_and_grad(lambda a: kernels.linear_softmax_cross_entropy_loss(a, lab, w))(x)
        jaxpr = str(jax.make_jaxpr(lambda a: kernels.linear_softmax_cross_entropy_loss(a, lab, w))(x))
    rl, rdx, _ = ref_loss_and_grads(x64, labels, q * s.astype(np.float64), "sum")
    tb.assert_close(loss, rl, "float32", "int8 loss", seed, {"float32": 1e-4})
    tb.assert_close(dx, rdx, "float32", "int8 d x", seed, tb.GRAD_TOL)
    assert "i8[16,50]" in jaxpr
