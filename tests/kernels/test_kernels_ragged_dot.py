"""ragged_dot / ragged_dot_general: every implementation against a float64 NumPy reference."""

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


def ref_m(lhs, rhs, gs):
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    s = 0
    for g, n in enumerate(gs):
        out[s : s + n] = lhs[s : s + n] @ rhs[g]
        s += n
    return out


def ref_k(lhs, rhs, gs):
    out = np.zeros((len(gs), lhs.shape[1], rhs.shape[1]))
    s = 0
    for g, n in enumerate(gs):
        out[g] = lhs[s : s + n].T @ rhs[s : s + n]
        s += n
    return out


def ref_m_grads(lhs, rhs, gs, ct):
    dl = np.zeros_like(lhs)
    dr = np.zeros_like(rhs)
    s = 0
    for g, n in enumerate(gs):
        dl[s : s + n] = ct[s : s + n] @ rhs[g].T
        dr[g] = lhs[s : s + n].T @ ct[s : s + n]
        s += n
    return dl, dr


# ragged sizes: an empty group, groups that cross block boundaries, sum < m
SIZES = (70, 48, 40, [9, 0, 33, 17])  # m, k, n, group sizes (sum 59)


class RaggedDotBase:
    IMPL = "xla"
    DTYPES = ("float32", "bfloat16", "float16")
    FAST_DTYPES = ("float32",)  # the other dtypes run in the slow suite
    CONFIG: dict = {}

    def run(self, *args, **kwargs):
        if self.CONFIG:
            with kernels.override(self.IMPL, self.CONFIG, op="ragged_dot"):
                return kernels.ragged_dot(*args, **kwargs)
        return kernels.ragged_dot(*args, implementation=self.IMPL, **kwargs)

    SIZES = SIZES

    def _inputs(self, dtype):
        m, k, n, gs = self.SIZES
        rng, seed = tb.fresh_rng()
        lhs, l64 = tb.randn(rng, (m, k), dtype)
        rhs, r64 = tb.randn(rng, (len(gs), k, n), dtype)
        ct, c64 = tb.randn(rng, (m, n), dtype)
        return (lhs, rhs, jnp.asarray(gs, jnp.int32), ct), (l64, r64, gs, c64), seed

    CASES = (("float32", "m"), ("bfloat16", "m"), ("float16", "m"))

    @classmethod
    def is_fast(cls, case) -> bool:
        return case[0] in cls.FAST_DTYPES

    def test_values_grads_determinism(self, case):
        dtype = case[0]
        (lhs, rhs, gs, ct), (l64, r64, gs64, c64), seed = self._inputs(dtype)
        step = tb.jit_value_and_vjp(lambda a, b: self.run(a, b, gs))
        out, (dl, dr) = step((lhs, rhs), ct)
        assert out.dtype == jnp.dtype(dtype)
        tb.assert_close(out, ref_m(l64, r64, gs64), dtype, "ragged_dot", seed)
        assert np.all(np.asarray(out[sum(gs64):]) == 0), "rows after the groups must be zero"
        rdl, rdr = ref_m_grads(l64, r64, gs64, c64)
        tb.assert_close(dl, rdl, dtype, "d lhs", seed, tb.GRAD_TOL)
        tb.assert_close(dr, rdr, dtype, "d rhs", seed, tb.GRAD_TOL)
        assert np.all(np.asarray(dr[1]) == 0), "an empty group's weight gradient is zero"
        out2, (_, dr2) = step((lhs, rhs), ct)
        tb.assert_bitwise_equal(out, out2, "ragged_dot")
        tb.assert_bitwise_equal(dr, dr2, "d rhs")

    def test_ragged_contracting_general(self):
        dtype = self.DTYPES[0]
        rng, seed = tb.fresh_rng()
        gs = [5, 0, 20, 11]
        lhs, l64 = tb.randn(rng, (40, 36), dtype)
        rhs, r64 = tb.randn(rng, (40, 24), dtype)
        dn = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])
        out = kernels.ragged_dot_general(lhs, rhs, jnp.asarray(gs, jnp.int32), dn, implementation=self.IMPL)
        tb.assert_close(out, ref_k(l64, r64, gs), dtype, "ragged_dot_general (ragged contracting)", seed)

    def test_general_transposed_rhs_matches_ragged_dot(self):
        dtype = self.DTYPES[0]
        (lhs, rhs, gs, _), (l64, r64, gs64, _), seed = self._inputs(dtype)
        # rhs as [n, groups, k]: the kernels transpose it to [groups, k, n]
        dn = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [1])
        out = kernels.ragged_dot_general(lhs, jnp.transpose(rhs, (2, 0, 1)), gs, dn, implementation=self.IMPL)
        tb.assert_close(out, ref_m(l64, r64, gs64), dtype, "ragged_dot_general (rhs [n, g, k])", seed)

    def test_bad_inputs_name_the_argument(self):
        lhs = jnp.ones((8, 4), jnp.bfloat16)
        rhs = jnp.ones((2, 4, 3), jnp.bfloat16)
        with pytest.raises(ValueError, match="rhs"):
            kernels.ragged_dot(lhs, jnp.ones((2, 5, 3), jnp.bfloat16), jnp.array([4, 4]), implementation=self.IMPL)
        with pytest.raises(ValueError, match="group_sizes"):
            kernels.ragged_dot(lhs, rhs, jnp.array([4, 2, 2]), implementation=self.IMPL)
        with pytest.raises(TypeError, match="group_sizes"):
            kernels.ragged_dot(lhs, rhs, jnp.array([4.0, 4.0]), implementation=self.IMPL)
        with pytest.raises(ValueError, match="lhs"):
            kernels.ragged_dot(jnp.ones((8,)), rhs, jnp.array([4, 4]), implementation=self.IMPL)
        with pytest.raises(ValueError, match="implementation"):
            kernels.ragged_dot(lhs, rhs, jnp.array([4, 4]), implementation="cuda_magic")


class TestRaggedDotXla(RaggedDotBase):
    IMPL = "xla"
    CONFIG = {"block_m": 16}

    def test_dense_method_matches(self):
        (lhs, rhs, gs, _), (l64, r64, gs64, _), seed = self._inputs("float32")
        out = kernels.call("ragged_dot", lhs, rhs, gs, implementation="xla", config={"method": "dense"})
        tb.assert_close(out, ref_m(l64, r64, gs64), "float32", "dense ragged_dot", seed)

    @settings(max_examples=3, deadline=None)
    @given(
        sizes=st.lists(st.integers(0, 19), min_size=1, max_size=5),
        extra=st.integers(-6, 9),  # negative: groups summing to more than m (the excess is ignored)
        k=st.integers(1, 9),
        n=st.integers(1, 7),
        block_m=st.sampled_from([8, 16, 32]),
        dtype=st.sampled_from(["float32", "bfloat16"]),
    )
    @pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
    def test_property_any_grouping(self, sizes, extra, k, n, block_m, dtype):
        m = max(1, sum(sizes) + extra)
        rng = np.random.default_rng(sum(sizes) * 31 + k * 7 + n)
        lhs, l64 = tb.randn(rng, (m, k), dtype)
        rhs, r64 = tb.randn(rng, (len(sizes), k, n), dtype)
        out = kernels.call(
            "ragged_dot", lhs, rhs, jnp.asarray(sizes, jnp.int32), implementation="xla",
            config={"block_m": block_m}, ragged="m",
        )
        assert out.dtype == jnp.dtype(dtype)
        clamped, start = [], 0
        for size in sizes:
            clamped.append(max(0, min(size, m - start)))
            start += clamped[-1]
        tb.assert_close(out, ref_m(l64, r64, clamped), dtype, "ragged_dot property", 0, {dtype: tb.TOL[dtype] * 5})

    def test_quantized_rhs_int8_per_channel(self):
        rng, seed = tb.fresh_rng()
        gs = [3, 0, 9, 4]
        lhs, l64 = tb.randn(rng, (18, 12), "float32")
        q = rng.integers(-127, 128, size=(4, 12, 5)).astype(np.int8)
        scale = rng.uniform(0.01, 0.1, size=(4, 1, 5)).astype(np.float32)
        w = QArray(jnp.asarray(q), jnp.asarray(scale), qtype="int8", layout=QuantLayout.per_channel(0, 2))
        out = kernels.ragged_dot(lhs, w, jnp.asarray(gs, jnp.int32), implementation=self.IMPL)
        tb.assert_close(out, ref_m(l64, q.astype(np.float64) * scale, gs), "float32", "int8 ragged_dot", seed)

    def test_quantized_rhs_int4_packed_per_tile_falls_back(self):
        rng, seed = tb.fresh_rng()
        gs = [6, 6]
        lhs, l64 = tb.randn(rng, (12, 8), "float32")
        q = rng.integers(-8, 8, size=(2, 8, 4)).astype(np.int8)
        scale = rng.uniform(0.05, 0.2, size=(2, 2, 4)).astype(np.float32)
        w = QArray(jnp.asarray(q).astype(jnp.int4), jnp.asarray(scale), qtype="int4",
                   layout=QuantLayout.per_tile(1, 4)).pack()
        out = kernels.ragged_dot(lhs, w, jnp.asarray(gs, jnp.int32), implementation=self.IMPL)
        ref = ref_m(l64, q.astype(np.float64) * np.repeat(scale, 4, axis=1), gs)
        tb.assert_close(out, ref, "float32", "int4 per-tile ragged_dot", seed)

    def test_bad_config_names_key(self):
        with pytest.raises(ValueError, match="blocks"):
            kernels.call("ragged_dot", jnp.ones((4, 4)), jnp.ones((1, 4, 4)), jnp.array([4]),
                         implementation="xla", config={"blocks": 3})


class TestRaggedDotTriton(RaggedDotBase):
    IMPL = "pallas_triton"
    CONFIG = {"block_m": 16, "block_k": 16, "block_n": 16}

    @pytest.mark.slow
    def test_ragged_contracting_general(self):
        super().test_ragged_contracting_general()

    @pytest.mark.slow
    def test_general_transposed_rhs_matches_ragged_dot(self):
        super().test_general_transposed_rhs_matches_ragged_dot()

    def test_config_that_does_not_fit_raises(self):
        with pytest.raises(ValueError, match="block_m"):
            kernels.call("ragged_dot", jnp.ones((4, 4)), jnp.ones((1, 4, 4)), jnp.array([4]),
                         implementation=self.IMPL, config={"block_m": 24})


class TestRaggedDotMosaic(RaggedDotBase):
    IMPL = "pallas_mosaic_gpu"
    DTYPES = ("bfloat16", "float16")
    FAST_DTYPES = ("bfloat16",)
    CONFIG = {"block_m": 64, "block_k": 32, "block_n": 32}
    SIZES = (40, 32, 32, [9, 0, 20, 7])  # few programs: interpret mode simulates each one

    @pytest.mark.slow
    def test_ragged_contracting_general(self):
        super().test_ragged_contracting_general()

    @pytest.mark.slow
    def test_general_transposed_rhs_matches_ragged_dot(self):
        super().test_general_transposed_rhs_matches_ragged_dot()


    def test_float32_is_refused_with_reason(self):
        with pytest.raises(ValueError, match="wgmma"):
            kernels.ragged_dot(jnp.ones((4, 4)), jnp.ones((1, 4, 4)), jnp.array([4]), implementation=self.IMPL)


def _export_cuda(fn, *args):
    from jax import export

    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)


@pytest.mark.parametrize("impl", tb.PALLAS)
def test_gpu_kernels_lower_for_cuda(impl):
    """The GPU kernels (forward and backward) lower for CUDA without a GPU."""
    lhs = jnp.ones((128, 64), jnp.bfloat16)
    rhs = jnp.ones((4, 64, 64), jnp.bfloat16)
    gs = jnp.array([30, 40, 0, 50], jnp.int32)

    fn = kernels.implementations("ragged_dot")[impl].fn

    def loss(a, b):
        # the implementation itself, compiled (the registry would interpret it on a CPU host)
        return fn(a, b, gs, config={}, interpret=False).astype(jnp.float32).sum()

    exp = _export_cuda(jax.grad(loss, (0, 1)), lhs, rhs)
    assert "cuda" in exp.platforms
