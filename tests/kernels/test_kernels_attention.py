"""dot_product_attention: ONE shared test base that every implementation subclasses.

Values and gradients are checked against a float64 NumPy reference
(``_kernels_attention_reference``) on fresh random inputs, with per-dtype tolerances (the
table in docs/kernels.md), ragged lengths (not multiples of the blocks), grouped-query
heads, causal + window + soft-cap combinations, fully masked rows (zeros, never NaN), a
bitwise-determinism rerun, outputs poisoned before each run (Pallas kernels write into
NaN-filled buffers), and bad input naming the argument. Pallas kernels run with
``interpret=True`` on the CPU; sizes stay tiny so the file runs in well under a minute.
"""

from __future__ import annotations

import contextlib
import itertools

import _kernels_attention_reference as ref
import jax
import jax.experimental.pallas
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cairn.kernels as ck
from cairn.kernels._attention import pallas_triton as _attention_triton

# (forward atol/rtol, gradient atol/rtol) per dtype; the same table is in docs/kernels.md
TOLERANCES = {
    "float32": (2e-5, 1e-4),
    "bfloat16": (3e-2, 8e-2),
    "float16": (4e-3, 1e-2),
}
_SEEDS = itertools.count(1)


def fresh_inputs(b, t, s, n, kh, h, dtype, hv=None):
    """New random q, k, v and output cotangent each call (a new seed every time)."""
    keys = jax.random.split(jax.random.key(next(_SEEDS)), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, s, kh, h), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, s, kh, hv or h), jnp.float32).astype(dtype)
    do = jax.random.normal(keys[3], (b, t, n, hv or h), jnp.float32).astype(dtype)
    return q, k, v, do


class AttentionTestBase:
    """Subclasses set ``implementation``, ``config``, the dtypes they take and their limits."""

    implementation: str = "xla"
    config: dict | None = None
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    combo_dtype: str = "float32"  # the dtype of the many-feature cases
    head_dim: int = 16
    takes_segments: bool = True
    takes_bias_mask: bool = False

    def run(self, q, k, v, **kw):
        return ck.dot_product_attention(q, k, v, implementation=self.implementation, config=self.config, **kw)

    def poisoned(self):
        return contextlib.nullcontext()

    def jitted(self, **kw):
        """One jitted forward + vjp (arrays among ``kw`` stay arguments, the rest static)."""
        arrays = {name: x for name, x in kw.items() if isinstance(x, jax.Array)}
        statics = {name: x for name, x in kw.items() if name not in arrays}

        @jax.jit
        def fn(q, k, v, do, arrays):
            out, vjp = jax.vjp(lambda q_, k_, v_: self.run(q_, k_, v_, **statics, **arrays), q, k, v)
            return (out, *vjp(do))

        def run(q, k, v, do):
            with self.poisoned():
                return fn(q, k, v, do, arrays)

        return run

    def value_and_grads(self, q, k, v, do, **kw):
        return self.jitted(**kw)(q, k, v, do)

    def check(self, dtype, *, shape=(2, 21, 27, 4, 2), ref_kw=None, **kw):
        b, t, s, n, kh = shape
        q, k, v, do = fresh_inputs(b, t, s, n, kh, self.head_dim, dtype)
        got = self.value_and_grads(q, k, v, do, **kw)
        want = ref.attention(*(np.asarray(x, np.float64) for x in (q, k, v, do)), **(ref_kw or {}))
        ftol, gtol = TOLERANCES[dtype]
        for name, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want, (ftol, gtol, gtol, gtol)):
            g = np.asarray(g.astype(jnp.float32), np.float64)
            assert not np.isnan(g).any(), f"{name} has NaN"
            np.testing.assert_allclose(g, w, atol=tol, rtol=tol, err_msg=f"{self.implementation} {name} {dtype}")
        return got

    # --- values and gradients ---

    @pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
    def test_values_and_grads_per_dtype(self):
        for dtype in self.dtypes:
            self.check(dtype)

    def test_causal_window_softcap_gqa(self):
        self.check(self.combo_dtype, shape=(1, 19, 23, 6, 2), is_causal=True, local_window_size=(5, 0),
                   logits_soft_cap=2.0, ref_kw={"is_causal": True, "window": (5, 0), "soft_cap": 2.0})

    @pytest.mark.slow
    @pytest.mark.parametrize(
        "kw, ref_kw",
        [
            ({"is_causal": True}, {"is_causal": True}),
            ({"local_window_size": (4, 2)}, {"window": (4, 2)}),
            ({"local_window_size": 3, "logits_soft_cap": 3.0}, {"window": 3, "soft_cap": 3.0}),
            ({"logits_soft_cap": 1.5, "scale": 0.3}, {"soft_cap": 1.5, "scale": 0.3}),
        ],
        ids=["causal", "window", "window+softcap", "softcap+scale"],
    )
    def test_mask_combinations(self, kw, ref_kw):
        self.check(self.combo_dtype, ref_kw=ref_kw, **kw)

    @pytest.mark.slow
    def test_multi_query(self):
        self.check(self.combo_dtype, shape=(1, 19, 19, 4, 1))

    @pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
    def test_lengths_and_fully_masked_rows(self):
        if not self.takes_segments:
            pytest.skip(f"{self.implementation} takes no lengths (its supports() says why; tested below)")
        q_lens, kv_lens = jnp.array([21, 9]), jnp.array([0, 27])  # batch 0 sees no key at all
        got = self.check(self.combo_dtype, query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens, is_causal=True,
                         ref_kw={"q_lens": q_lens, "kv_lens": kv_lens, "is_causal": True})
        assert np.all(np.asarray(got[0])[0] == 0.0)  # fully masked rows are zeros
        assert np.all(np.asarray(got[0])[1, 9:] == 0.0)  # padded queries are zeros

    @pytest.mark.slow
    def test_segment_ids(self):
        if not self.takes_segments:
            pytest.skip(f"{self.implementation} takes no segment ids")
        seg = jnp.array([[0] * 8 + [1] * 13, [0] * 21])
        self.check(self.combo_dtype, shape=(2, 21, 21, 2, 2), segment_ids=seg,
                   ref_kw={"q_seg": seg, "kv_seg": seg})

    @pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
    def test_bitwise_deterministic(self):
        q, k, v, do = fresh_inputs(1, 21, 27, 2, 1, self.head_dim, self.combo_dtype)
        fn = self.jitted(is_causal=True)
        first, second = fn(q, k, v, do), fn(q, k, v, do)
        for a, b in zip(first, second):
            assert np.array_equal(np.asarray(a), np.asarray(b))

    # --- bad input ---

    def test_bad_input_names_the_argument(self):
        q, k, v, _ = fresh_inputs(1, 8, 8, 4, 2, self.head_dim, self.combo_dtype)
        k3 = jnp.zeros((1, 8, 3, self.head_dim), q.dtype)
        with pytest.raises(ValueError, match="heads"):
            self.run(q, k3, k3)
        with pytest.raises(ValueError, match="head_dim"):
            self.run(q, k[..., :8], v[..., :8])
        with pytest.raises(ValueError, match="local_window_size"):
            self.run(q, k, v, local_window_size=-1)
        with pytest.raises(ValueError, match="logits_soft_cap"):
            self.run(q, k, v, logits_soft_cap=0.0)
        with pytest.raises(ValueError, match="unknown implementation 'nope'.*dot_product_attention"):
            ck.dot_product_attention(q, k, v, implementation="nope")
        with pytest.raises(ValueError, match="config key"):
            ck.dot_product_attention(q, k, v, implementation=self.implementation, config={"bogus": 1})
        if not self.takes_bias_mask:
            with pytest.raises(ValueError, match=f"{self.implementation}.*bias"):
                self.run(q, k, v, bias=jnp.zeros((1, 4, 8, 8)))


class TestXlaPlain(AttentionTestBase):
    implementation = "xla"
    config = {"chunk_size": None}
    takes_bias_mask = True

    @pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
    def test_bias_and_dense_mask(self):
        b, t, s, n, kh = 2, 13, 17, 4, 2
        q, k, v, do = fresh_inputs(b, t, s, n, kh, 16, "float32")
        bias = jax.random.normal(jax.random.key(7), (b, n, t, s))
        mask = jax.random.bernoulli(jax.random.key(8), 0.7, (b, 1, t, s)).at[0, 0, 3].set(False)
        got = self.value_and_grads(q, k, v, do, bias=bias, mask=mask)
        want = ref.attention(q, k, v, do, bias=bias, mask=mask)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float64), w, atol=1e-4, rtol=1e-4)
        assert np.all(np.asarray(got[0])[0, 3] == 0.0)  # the fully masked row

    def test_dropout(self):
        q, k, v, _ = fresh_inputs(1, 16, 16, 2, 2, 16, "float32")
        rng = jax.random.key(3)
        a = self.run(q, k, v, dropout_rate=0.5, dropout_rng=rng)
        b = self.run(q, k, v, dropout_rate=0.5, dropout_rng=rng)
        c = self.run(q, k, v, dropout_rate=0.5, dropout_rng=rng, deterministic=True)
        np.testing.assert_array_equal(a, b)
        assert not np.allclose(a, c)
        np.testing.assert_allclose(c, self.run(q, k, v), atol=1e-6)
        with pytest.raises(ValueError, match="dropout_rng"):
            self.run(q, k, v, dropout_rate=0.5)
        with pytest.raises(ValueError, match="dropout_rate"):
            self.run(q, k, v, dropout_rate=1.0)

    def test_segment_ids_packed(self):
        seg = jnp.array([[0] * 8 + [1] * 13])
        self.check("float32", shape=(1, 21, 21, 2, 2), segment_ids=seg, ref_kw={"q_seg": seg, "kv_seg": seg})

    @settings(max_examples=4, deadline=None)
    @given(
        t=st.integers(1, 24), s=st.integers(1, 24), kh=st.sampled_from([1, 2]), g=st.sampled_from([1, 3]),
        causal=st.booleans(), window=st.none() | st.tuples(st.integers(0, 6), st.integers(0, 6)),
    )
    @pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
    def test_property_random_shapes(self, t, s, kh, g, causal, window):
        self.check("float32", shape=(1, t, s, kh * g, kh), is_causal=causal, local_window_size=window,
                   ref_kw={"is_causal": causal, "window": window})


class TestXlaChunked(AttentionTestBase):
    implementation = "xla"
    config = {"chunk_size": 8}
    takes_bias_mask = True

    def test_dense_mask_in_chunks(self):
        q, k, v, do = fresh_inputs(1, 13, 21, 2, 1, 16, "float32")
        mask = jax.random.bernoulli(jax.random.key(9), 0.6, (1, 2, 13, 21))
        got = self.value_and_grads(q, k, v, do, mask=mask)
        want = ref.attention(q, k, v, do, mask=mask)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float64), w, atol=1e-4, rtol=1e-4)

    def test_bad_chunk_size(self):
        q, k, v, _ = fresh_inputs(1, 8, 8, 2, 2, 16, "float32")
        with pytest.raises(ValueError, match="chunk_size"):
            ck.dot_product_attention(q, k, v, config={"chunk_size": 0})


class TestPallasTriton(AttentionTestBase):
    implementation = "pallas_triton"
    config = {"block_q": 16, "block_k": 16, "num_warps": 4, "num_stages": 2}

    def poisoned(self):
        return _attention_triton.poisoned_outputs()

    def test_config_that_does_not_fit(self):
        q, k, v, _ = fresh_inputs(1, 8, 8, 2, 2, 16, "float32")
        with pytest.raises(ValueError, match="block_q must be a power of two"):
            ck.dot_product_attention(q, k, v, implementation=self.implementation, config={"block_q": 24})

    def test_unwritten_output_would_be_caught(self):
        # the poison hook works: a kernel that writes nothing leaves NaN behind
        def lazy(x_ref, o_ref):
            del x_ref, o_ref

        spec = jax.ShapeDtypeStruct((8,), jnp.float32)
        with _attention_triton.poisoned_outputs():
            block = jax.experimental.pallas.BlockSpec((8,), lambda: (0,))
            out = _attention_triton._pallas(lazy, 1, [spec], in_specs=[block], out_specs=[block], interpret=True)(
                jnp.ones(8)
            )
        assert np.isnan(np.asarray(out[0])).all()


class TestPallasMosaicGpu(AttentionTestBase):
    implementation = "pallas_mosaic_gpu"
    config = {"block_q": 64, "block_k": 64}
    dtypes = ("bfloat16", "float16")
    combo_dtype = "bfloat16"
    head_dim = 64
    takes_segments = False

    def poisoned(self):
        return _attention_triton.poisoned_outputs()  # interpreter fills uninitialised memory with NaN

    def test_values_and_grads_per_dtype(self):
        self.check("bfloat16", shape=(1, 70, 75, 2, 1))

    @pytest.mark.slow
    def test_values_and_grads_float16(self):
        self.check("float16", shape=(1, 70, 75, 2, 1))

    @pytest.mark.slow
    def test_causal_window_softcap_gqa(self):
        super().test_causal_window_softcap_gqa()

    @pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
    def test_causal_softcap(self):
        self.check("bfloat16", shape=(1, 70, 75, 2, 1), is_causal=True, logits_soft_cap=2.0,
                   ref_kw={"is_causal": True, "soft_cap": 2.0})

    @pytest.mark.slow  # 5 s interpreted; the default (2 buffers) runs in every test above
    def test_one_or_two_kv_buffers_give_the_same_bits(self):
        """Double-buffered key/value copies (the default) change the schedule, not the result."""
        q, k, v, _ = fresh_inputs(1, 64, 170, 1, 1, 64, "bfloat16")  # 3 key blocks, the last part padding
        outs = [ck.dot_product_attention(q, k, v, implementation=self.implementation,
                                         config={"block_q": 64, "block_k": 64, "kv_buffers": n}) for n in (1, 2)]
        np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))
        with pytest.raises(ValueError, match="kv_buffers"):
            ck.dot_product_attention(q, k, v, implementation=self.implementation, config={"kv_buffers": 3})

    def test_rejects_what_it_cannot_take(self):
        q, k, v, _ = fresh_inputs(1, 8, 8, 2, 2, 64, "float32")
        with pytest.raises(ValueError, match="pallas_mosaic_gpu: dtype float32"):
            self.run(q, k, v)
        qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
        with pytest.raises(ValueError, match="segment_ids"):
            self.run(qb, kb, vb, key_value_seq_lengths=jnp.array([4]))
        # a sequence falls back to the first implementation that takes the arguments
        out = ck.dot_product_attention(q, k, v, implementation=("pallas_mosaic_gpu", "xla"))
        np.testing.assert_allclose(out, ck.dot_product_attention(q, k, v, implementation="xla"), atol=1e-6)


# --- lowering for CUDA without a GPU ---

_TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


@pytest.mark.parametrize("implementation, marker", [("pallas_triton", "__gpu$xla.gpu.triton"),
                                                    ("pallas_mosaic_gpu", "mosaic_gpu")])
def test_gpu_kernels_lower_for_cuda(implementation, marker):
    q = jax.ShapeDtypeStruct((1, 128, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        out = ck.dot_product_attention(q, k, v, implementation=implementation, is_causal=True)
        return out.astype(jnp.float32).sum()

    with ck.cross_compile("gpu"):
        exported = jax.export.export(jax.jit(jax.grad(loss, (0, 1, 2))), platforms=["cuda"],
                                     disabled_checks=[_TRITON])(q, kv, kv)
    text = exported.mlir_module()
    assert marker in text
    assert "__gpu$xla.gpu.triton" in text  # the backward kernels (Triton for both)


# --- the untuned default (no autotune cache): a heuristic on shapes, dtype and backend ---


def _untuned(q_shape, kv_len, dtype=jnp.float32, is_causal=False, platform="cpu", **kw):
    """The KernelCall default dispatch makes for these shapes, as on ``platform``."""
    b, _, n, h = q_shape
    q = jax.ShapeDtypeStruct(q_shape, dtype)
    kv = jax.ShapeDtypeStruct((b, kv_len, n, h), dtype)
    with ck.cross_compile(platform):
        (call,) = ck.ops_in(lambda q, k, v: ck.dot_product_attention(q, k, v, is_causal=is_causal, **kw), q, kv, kv)
    return call


@pytest.mark.parametrize("q_shape, is_causal, dtype", [
    ((1, 1024, 8, 64), True, jnp.float32),   # issue 25: plain was 2-3.5x slower than the tuned chunks of 128
    ((4, 512, 8, 64), False, jnp.float32),
    ((4, 512, 8, 64), True, jnp.float32),
    ((1, 1024, 8, 64), True, jnp.bfloat16),
])
def test_untuned_cpu_default_is_the_chunked_path_the_autotuner_picks(q_shape, is_causal, dtype):
    call = _untuned(q_shape, q_shape[1], dtype, is_causal)
    assert (call.implementation, dict(call.config), call.source) == ("xla", {"chunk_size": 128}, "default")


@pytest.mark.parametrize("q_shape, kv_len", [
    ((1, 64, 8, 64), 128),    # one chunk of keys: nothing to chunk
    ((16, 129, 8, 64), 129),  # a chunk and one key: plain measured 2.4x faster (a DPO batch of 129-token rows)
    ((16, 320, 8, 64), 320),  # two chunks and a partial one: plain measured 1.4x faster
    ((4, 1, 8, 64), 2048),    # decoding: one query row per step
    ((4, 16, 8, 64), 2048),   # too few queries for a chunk's matmul to pay for the scan
])
def test_untuned_cpu_default_stays_plain_where_plain_measured_faster(q_shape, kv_len):
    assert dict(_untuned(q_shape, kv_len).config) == {"chunk_size": None}


def test_untuned_xla_default_off_cpu_keeps_the_fused_plain_path_up_to_the_limit():
    # on a GPU (or TPU) xla is the fallback behind the Pallas kernels; plain up to 1024 x 1024
    kw = {"implementation": "xla"}
    assert dict(_untuned((1, 1024, 8, 64), 1024, platform="gpu", **kw).config) == {"chunk_size": None}
    assert dict(_untuned((1, 2048, 8, 64), 2048, platform="gpu", **kw).config) == {"chunk_size": 512}


# --- cuDNN's fused attention (GPU only) ---


def test_cudnn_refuses_off_an_nvidia_gpu_and_what_it_does_not_take():
    """``supports`` names each feature cuDNN's fused attention does not take, and off an
    NVIDIA GPU (a CPU, or cross-compiling for a GPU) the device; dispatch then moves on."""
    from cairn.kernels._attention.common import AttentionSpec

    q, k, v, _ = fresh_inputs(1, 8, 8, 4, 2, 64, "bfloat16")
    impl = ck.implementations("dot_product_attention")["cudnn"]
    plain = AttentionSpec(scale=0.125)
    assert "soft-capping" in impl.supports(q, k, v, spec=AttentionSpec(scale=0.125, soft_cap=5.0))
    assert "local windows" in impl.supports(q, k, v, spec=AttentionSpec(scale=0.125, window=(4, 0)))
    assert "segment ids" in impl.supports(q, k, v, spec=AttentionSpec(scale=0.125, use_segments=True))
    assert "float16/bfloat16" in impl.supports(q.astype(jnp.float32), k, v, spec=plain)
    assert "bias" in impl.supports(q, k, v, spec=plain, bias=jnp.zeros((1, 4, 8, 8)))
    assert "head dims" in impl.supports(q, k, v[..., :32], spec=plain)
    if jax.default_backend() == "gpu":
        assert impl.supports(q, k, v, spec=plain) is None
        return
    assert "NVIDIA GPU" in impl.supports(q, k, v, spec=plain)
    with pytest.raises(ValueError, match="cudnn: cuDNN runs on an NVIDIA GPU"):
        ck.dot_product_attention(q, k, v, implementation="cudnn")
    (call,) = ck.ops_in(lambda q, k, v: ck.dot_product_attention(q, k, v, is_causal=True), q, k, v)
    assert call.implementation == "xla"
    with ck.cross_compile("gpu"):  # lowering for CUDA from this host: cuDNN cannot be asked its version
        (call,) = ck.ops_in(lambda q, k, v: ck.dot_product_attention(q, k, v, is_causal=True), q, k, v)
    assert call.implementation == "pallas_mosaic_gpu"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs an NVIDIA GPU")
@pytest.mark.parametrize("is_causal", [False, True])
def test_cudnn_matches_float64_reference_with_grouped_heads(is_causal):
    """On a GPU, the cuDNN implementation (the default there for plain bf16 attention) against
    float64 NumPy, forward and gradients, at bf16 tolerances."""
    q, k, v, do = fresh_inputs(2, 128, 128, 8, 2, 64, "bfloat16")

    def fn(q, k, v):
        return ck.dot_product_attention(q, k, v, is_causal=is_causal, implementation="cudnn")

    out, vjp = jax.vjp(fn, q, k, v)
    want = ref.attention(q, k, v, do, is_causal=is_causal)
    ftol, gtol = TOLERANCES["bfloat16"]
    for got, w, tol in zip((out, *vjp(do)), want, (ftol, gtol, gtol, gtol), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), w, atol=tol, rtol=tol)
    (call,) = ck.ops_in(lambda q, k, v: ck.dot_product_attention(q, k, v, is_causal=is_causal), q, k, v)
    assert call.implementation == "cudnn"


# --- one query row (a decode step): the xla plain path's multiply-reduce products ---

_ONE_QUERY_CASES = {
    "gqa": ((3, 1, 27, 4, 2), {}, {}),
    "multi-query": ((2, 1, 19, 4, 1), {}, {}),
    "groups-of-3+softcap+scale": ((2, 1, 23, 6, 2), {"logits_soft_cap": 1.5, "scale": 0.3},
                                  {"soft_cap": 1.5, "scale": 0.3}),
    "causal+window": ((2, 1, 9, 4, 2), {"is_causal": True, "local_window_size": (3, 2)},
                      {"is_causal": True, "window": (3, 2)}),
    "lengths, one row sees nothing": ((2, 1, 17, 4, 2),
                                      {"key_value_seq_lengths": jnp.array([0, 11])}, {"kv_lens": [0, 11]}),
}


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("case", list(_ONE_QUERY_CASES))
def test_one_query_row_matches_the_float64_reference(case, dtype):
    shape, kw, ref_kw = _ONE_QUERY_CASES[case]
    base = AttentionTestBase()
    base.config = {"chunk_size": None}
    got = base.check(dtype, shape=shape, ref_kw=ref_kw, **kw)
    if "key_value_seq_lengths" in kw:
        assert np.all(np.asarray(got[0])[0] == 0.0)  # the row that sees no key is zeros, not NaN


def test_one_query_row_with_bias_mask_and_segments_matches_the_reference():
    b, s, n, kh = 2, 21, 6, 2
    q, k, v, do = fresh_inputs(b, 1, s, n, kh, 16, "float32")
    bias = jax.random.normal(jax.random.key(11), (b, n, 1, s))
    mask = jax.random.bernoulli(jax.random.key(12), 0.6, (b, 1, 1, s)).at[1].set(False)
    got = ck.dot_product_attention(q, k, v, bias=bias, mask=mask, implementation="xla", config={"chunk_size": None})
    want = ref.attention(q, k, v, do, bias=bias, mask=mask)[0]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(got)[1] == 0.0)  # fully masked
    qseg, kvseg = jnp.array([[1], [2]]), jnp.array([[1] * 10 + [2] * 11, [2] * 5 + [1] * 16])
    got = ck.dot_product_attention(q, k, v, segment_ids=(qseg, kvseg), implementation="xla",
                                   config={"chunk_size": None})
    want = ref.attention(q, k, v, do, q_seg=qseg, kv_seg=kvseg)[0]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-5, rtol=1e-5)


def test_one_query_row_dropout_is_deterministic_and_off_when_deterministic():
    q, k, v, _ = fresh_inputs(2, 1, 33, 4, 2, 16, "float32")
    rng, kw = jax.random.key(5), {"implementation": "xla", "config": {"chunk_size": None}}
    a = ck.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=rng, **kw)
    np.testing.assert_array_equal(a, ck.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=rng, **kw))
    off = ck.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=rng, deterministic=True, **kw)
    assert not np.allclose(a, off)
    np.testing.assert_allclose(off, ck.dot_product_attention(q, k, v, **kw), atol=1e-6)


def test_one_query_row_reads_the_cache_without_a_transposed_copy():
    # the decode step's products as dots made XLA's CPU backend copy the whole cache into a
    # transposed layout each call; the multiply-reduce form must not bring that back
    q = jnp.ones((8, 1, 4, 16), jnp.float32)
    k = v = jnp.ones((8, 64, 2, 16), jnp.float32)
    fn = jax.jit(lambda q, k, v: ck.dot_product_attention(q, k, v, implementation="xla", config={"chunk_size": None}))
    hlo = fn.lower(q, k, v).compile().as_text()
    assert not [ln for ln in hlo.splitlines() if "transpose" in ln and "f32[8,2,16,64]" in ln], "a transposed cache copy"
