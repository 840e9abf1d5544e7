"""Attention against an explicit float64 NumPy softmax; GQA, masks, KV-cache decoding.

Tolerances: float32 within rtol=atol=1e-4 of the float64 reference; bfloat16 (inputs and
parameters in bfloat16) within rtol=atol=5e-2 of the reference computed from the same
bfloat16-rounded values (each of four bf16 matmul stages rounds to 8 bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import nn
from nn._nn_helpers import DTYPES, f64, randn, tolerances

TOL = tolerances(1e-4, 5e-2)


def jit_call(fn, *args, **static):
    """Run ``fn(*args, **static)`` as one compiled program (faster than op-by-op)."""
    return jax.jit(lambda *a: fn(*a, **static))(*args)


def np_attention(q, k, v, mask=None, causal=False):
    """q (B, Lq, H, D), k/v (B, Lk, Hk, D); explicit per-head softmax loops."""
    q, k, v = f64(q), f64(k), f64(v)
    b, lq, h, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    g = h // hk
    out = np.zeros((b, lq, h, v.shape[-1]))
    for bi in range(b):
        for hi in range(h):
            kh = hi // g
            s = q[bi, :, hi] @ k[bi, :, kh].T / np.sqrt(d)  # (Lq, Lk)
            valid = np.ones_like(s, bool)
            if mask is not None:
                valid &= np.broadcast_to(np.asarray(mask, bool), (b, h, lq, lk))[bi, hi]
            if causal:
                valid &= np.tril(np.ones((lq, lk), bool))
            s = np.where(valid, s, -np.inf)
            m = s.max(-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0)
            e = np.where(valid, np.exp(s - m), 0)
            den = e.sum(-1, keepdims=True)
            w = np.where(den > 0, e / np.where(den > 0, den, 1), 0)
            out[bi, :, hi] = w @ v[bi, :, kh]
    return out


def np_mha(mha, xq, xkv=None, mask=None, causal=False):
    xkv = xq if xkv is None else xkv

    def proj(lin, x):
        y = np.einsum("...f,fhd->...hd", f64(x), f64(lin.kernel[...]))
        return y + f64(lin.bias[...]) if lin.bias is not None else y

    q, k, v = proj(mha.query, xq), proj(mha.key, xkv), proj(mha.value, xkv)
    o = np_attention(q, k, v, mask, causal)
    y = np.einsum("...hd,hdf->...f", o, f64(mha.out.kernel[...]))
    return y + f64(mha.out.bias[...]) if mha.out.bias is not None else y


@pytest.mark.parametrize(
    "kv_heads, dtype",
    [
        (2, jnp.float32),
        (1, jnp.bfloat16),
        pytest.param(4, jnp.float32, marks=pytest.mark.slow),
        pytest.param(1, jnp.float32, marks=pytest.mark.slow),
        pytest.param(4, jnp.bfloat16, marks=pytest.mark.slow),
    ],
)
def test_dot_product_attention_matches_numpy(kv_heads, dtype):
    q = randn((2, 5, 4, 8), dtype, 0)
    k = randn((2, 7, kv_heads, 8), dtype, 1)
    v = randn((2, 7, kv_heads, 6), dtype, 2)
    mask = np.random.default_rng(0).random((2, 1, 5, 7)) > 0.3
    got = jax.jit(nn.dot_product_attention)(q, k, v, mask=jnp.asarray(mask))
    assert got.shape == (2, 5, 4, 6) and got.dtype == dtype
    np.testing.assert_allclose(f64(got), np_attention(q, k, v, mask), **TOL[dtype])


def test_fully_masked_rows_give_zeros_not_nan():
    q, k = randn((1, 3, 2, 4)), randn((1, 3, 2, 4), seed=1)
    mask = jnp.zeros((1, 1, 3, 3), bool).at[..., 1:, :].set(True)
    out = f64(nn.dot_product_attention(q, k, k, mask=mask))
    assert np.all(np.isfinite(out)) and np.all(out[:, 0] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mha_self_attention_causal_matches_numpy(dtype):
    mha = nn.MultiHeadAttention(
        4, 16, num_kv_heads=2, param_dtype=dtype, bias_init=nn.initializers.normal(0.5),
        rngs=nn.Rngs(0),
    )
    x = randn((2, 6, 16), dtype)
    got = jit_call(mha, x, is_causal=True)
    assert got.dtype == dtype
    np.testing.assert_allclose(f64(got), np_mha(mha, x, causal=True), **TOL[dtype])


def test_mha_cross_attention_padding_mask_and_shapes():
    mha = nn.MultiHeadAttention(2, 8, qkv_features=12, out_features=5, in_kv_features=3,
                                rngs=nn.Rngs(1))
    assert mha.head_dim == 6 and mha.key.kernel.shape == (3, 2, 6)
    xq, xkv = randn((2, 4, 8)), randn((2, 7, 3), seed=1)
    q_ids = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    k_ids = jnp.array([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0]])
    mask = nn.make_attention_mask(q_ids > 0, k_ids > 0)
    assert mask.shape == (2, 1, 4, 7)
    got = jax.jit(lambda m, a, b, c: m(a, b, mask=c))(mha, xq, xkv, mask)
    assert got.shape == (2, 4, 5)
    np.testing.assert_allclose(f64(got), np_mha(mha, xq, xkv, mask=f64(mask)), rtol=1e-4, atol=1e-4)


def test_masks_helpers():
    causal = f64(nn.make_causal_mask(jnp.ones((2, 4))))
    assert causal.shape == (2, 1, 4, 4)
    np.testing.assert_array_equal(causal[0, 0], np.tril(np.ones((4, 4))))
    a = jnp.ones((1, 1, 2, 2))
    b = jnp.array([[[[1, 0], [1, 1]]]])
    np.testing.assert_array_equal(f64(nn.combine_masks(a, None, b)), f64(b))
    assert nn.combine_masks(None, None) is None
    with pytest.raises(ValueError, match="equal rank"):
        nn.combine_masks(jnp.ones((2, 2)), jnp.ones((1, 2, 2)))


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = nn.MultiHeadAttention(6, 12, num_kv_heads=2, rngs=nn.Rngs(0))
    mha = nn.MultiHeadAttention(6, 12, rngs=nn.Rngs(1))
    mha.query.kernel[...] = gqa.query.kernel[...]
    mha.query.bias[...] = gqa.query.bias[...]
    mha.out.kernel[...] = gqa.out.kernel[...]
    mha.out.bias[...] = gqa.out.bias[...]
    # query head h reads kv head h // 3: repeat each kv head 3 times
    for name in ("key", "value"):
        src, dst = getattr(gqa, name), getattr(mha, name)
        dst.kernel[...] = jnp.repeat(src.kernel[...], 3, axis=1)
        dst.bias[...] = jnp.repeat(src.bias[...], 3, axis=0)
    x = randn((2, 5, 12))
    np.testing.assert_allclose(f64(jit_call(gqa, x, is_causal=True)), f64(jit_call(mha, x, is_causal=True)),
                               rtol=1e-5, atol=1e-5)
    alias = nn.MultiHeadAttention(6, 12, num_key_value_heads=3, rngs=nn.Rngs(0))
    assert alias.num_kv_heads == 3


@pytest.mark.parametrize("use_rope", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_kv_cache_decode_equals_full_causal_forward(use_rope):
    mha = nn.MultiHeadAttention(4, 16, num_kv_heads=2, use_rope=use_rope, rngs=nn.Rngs(0))
    x = randn((2, 7, 16))
    full = f64(jit_call(mha, x, is_causal=True))
    mha.init_cache((2, 8, 16))
    # prefill 3 tokens in one call, then one token at a time (under jit)
    outs = [f64(mha(x[:, :3], decode=True))]
    step = jax.jit(lambda m, t: (m, m(t, decode=True)))
    for t in range(3, 7):
        mha, y = step(mha, x[:, t : t + 1])
        outs.append(f64(y))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-4, atol=1e-4)
    assert int(mha.cache_index[...]) == 7
    with pytest.raises(ValueError, match="cache overflow"):
        mha(x[:, :2], decode=True)
    # is_causal=True during decode is harmless (Flax NNX issue #5591: there it attends
    # only to key 0); the decode mask already encodes causality
    mha.init_cache((2, 8, 16))
    np.testing.assert_allclose(f64(mha(x[:, :3], decode=True, is_causal=True)), full[:, :3],
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(f64(mha(x[:, 3:4], decode=True, is_causal=True)), full[:, 3:4],
                               rtol=1e-4, atol=1e-4)


def test_decode_without_cache_and_bad_cache_shape():
    mha = nn.MultiHeadAttention(2, 8, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="init_cache"):
        mha(jnp.ones((1, 1, 8)), decode=True)
    mha.init_cache((2, 4, 8))
    with pytest.raises(ValueError, match="does not fit the cache"):
        mha(jnp.ones((3, 1, 8)), decode=True)


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_decode_path_equals_full_attention_with_gqa_qk_norm_and_padding_mask():
    """The cached path (chunks of 2, 1, 3, 1 tokens) against one non-cached causal call.

    GQA, q/k LayerNorm and RoPE are on, and a padding mask hides key 1 of batch row 0;
    the decode mask is ``(*batch, 1, L, max_length)``, so the padding mask given to each
    step covers the whole cache while the full call's covers the 7 keys.
    """
    mha = nn.MultiHeadAttention(
        4, 16, num_kv_heads=2, normalize_qk=True, use_rope=True, rngs=nn.Rngs(3)
    )
    x = randn((2, 7, 16))
    keep = np.ones((2, 1, 1, 8), bool)
    keep[0, ..., 1] = False
    full = f64(mha(x, mask=jnp.asarray(keep[..., :7]), is_causal=True))
    mha.init_cache((2, 8, 16))
    outs, t = [], 0
    for n in (2, 1, 3, 1):
        outs.append(f64(mha(x[:, t : t + n], decode=True, mask=jnp.asarray(keep))))
        t += n
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-5, atol=1e-5)
    assert int(mha.cache_index[...]) == 7
    # the cache holds the (rotated) keys of the 7 tokens and zeros after them
    assert not np.any(np.asarray(mha.cached_key[...])[:, 7:])
    assert np.all(np.any(np.asarray(mha.cached_key[...])[:, :7] != 0, axis=(-2, -1)))


def test_mha_variable_paths_are_the_checkpoint_layout():
    """Users' checkpoints are keyed by these paths: they must not move."""
    mha = nn.MultiHeadAttention(4, 16, num_kv_heads=2, normalize_qk=True, rngs=nn.Rngs(0))
    assert nn.state(mha).flat_paths() == [
        "query/kernel", "query/bias", "key/kernel", "key/bias", "value/kernel", "value/bias",
        "query_ln/scale", "key_ln/scale", "out/kernel", "out/bias",
    ]
    assert mha.key.kernel[...].shape == (16, 2, 4) and mha.out.kernel[...].shape == (4, 4, 16)
    mha.init_cache((2, 8, 16))
    assert nn.state(mha, nn.Cache).flat_paths() == ["cached_key", "cached_value", "cache_index"]
    plain = nn.MultiHeadAttention(2, 8, use_bias=False, rngs=nn.Rngs(0))
    assert nn.state(plain).flat_paths() == ["query/kernel", "key/kernel", "value/kernel", "out/kernel"]


def test_rope_in_mha_matches_numpy():
    mha = nn.MultiHeadAttention(2, 8, use_rope=True, rngs=nn.Rngs(2))
    x = randn((1, 5, 8))
    q = np.einsum("...f,fhd->...hd", f64(x), f64(mha.query.kernel[...])) + f64(mha.query.bias[...])
    k = np.einsum("...f,fhd->...hd", f64(x), f64(mha.key.kernel[...])) + f64(mha.key.bias[...])
    v = np.einsum("...f,fhd->...hd", f64(x), f64(mha.value.kernel[...])) + f64(mha.value.bias[...])

    def rot(t):
        d = t.shape[-1]
        out = t.copy()
        pos = np.arange(t.shape[1])[:, None]
        for i in range(d // 2):
            ang = pos * 10000.0 ** (-2 * i / d)
            out[..., i] = t[..., i] * np.cos(ang) - t[..., i + d // 2] * np.sin(ang)
            out[..., i + d // 2] = t[..., i + d // 2] * np.cos(ang) + t[..., i] * np.sin(ang)
        return out

    o = np_attention(rot(q), rot(k), v, causal=True)
    ref = np.einsum("...hd,hdf->...f", o, f64(mha.out.kernel[...])) + f64(mha.out.bias[...])
    np.testing.assert_allclose(f64(jit_call(mha, x, is_causal=True)), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_attention_fn_plugs_in_with_only_the_keywords_it_declares():
    calls = []

    def kernel_lib_attention(query, key, value, *, mask=None, is_causal=False):
        calls.append((query.shape, key.shape, is_causal))
        return nn.dot_product_attention(query, key, value, mask=mask, is_causal=is_causal)

    mha = nn.MultiHeadAttention(4, 8, num_kv_heads=1, attention_fn=kernel_lib_attention,
                                rngs=nn.Rngs(0))
    x = randn((1, 3, 8))
    got = mha(x, is_causal=True)
    assert calls == [((1, 3, 4, 2), (1, 3, 1, 2), True)]  # kv heads unexpanded
    np.testing.assert_allclose(f64(got), np_mha(mha, x, causal=True), rtol=1e-4, atol=1e-4)

    def no_mask(query, key, value):
        return nn.dot_product_attention(query, key, value)

    plain = nn.MultiHeadAttention(2, 8, attention_fn=no_mask, rngs=nn.Rngs(0))
    plain(x)  # nothing needed beyond q, k, v
    with pytest.raises(TypeError, match=r"does not accept \['mask'\]"):
        plain(x, mask=jnp.ones((1, 1, 3, 3)))


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_attention_dropout_and_normalize_qk_and_sow():
    mha = nn.MultiHeadAttention(2, 8, dropout_rate=0.5, deterministic=False, normalize_qk=True,
                                rngs=nn.Rngs(params=0, dropout=1))
    x = randn((1, 4, 8))
    a, b = f64(mha(x)), f64(mha(x))
    assert not np.allclose(a, b)  # a fresh dropout key per call
    mha.eval()
    c, d = f64(mha(x)), f64(mha(x))
    np.testing.assert_array_equal(c, d)
    mha(x, sow_weights=True)
    (w,) = mha.attention_weights[...]
    assert w.shape == (1, 2, 4, 4)
    np.testing.assert_allclose(f64(w).sum(-1), 1.0, rtol=1e-5)


@settings(max_examples=6, deadline=None)
@given(lq=st.sampled_from([1, 4]), lk=st.sampled_from([1, 5]), h=st.sampled_from([(2, 1), (4, 2)]))
def test_attention_shapes_and_rows_sum_property(lq, lk, h):
    heads, kvh = h
    q = randn((1, lq, heads, 4))
    k = randn((1, lk, kvh, 4), seed=1)
    w = jax.jit(nn.dot_product_attention_weights)(q, k)
    assert w.shape == (1, heads, lq, lk)
    np.testing.assert_allclose(f64(w).sum(-1), 1.0, rtol=1e-5)
    out = jax.jit(nn.dot_product_attention)(q, k, k)
    np.testing.assert_allclose(f64(out), np_attention(q, k, k), rtol=1e-4, atol=1e-4)


def test_attention_errors():
    with pytest.raises(ValueError, match="divisible by num_kv_heads"):
        nn.MultiHeadAttention(4, 8, num_kv_heads=3, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="divisible by num_heads"):
        nn.MultiHeadAttention(3, 8, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="disagree"):
        nn.MultiHeadAttention(4, 8, num_kv_heads=2, num_key_value_heads=4, rngs=nn.Rngs(0))
    mha = nn.MultiHeadAttention(2, 8, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match=r"MultiHeadAttention expected last axis 8, got 6 in query input of shape \(1, 3, 6\)"):
        mha(jnp.ones((1, 3, 6)))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        nn.dot_product_attention(jnp.ones((1, 2, 3, 4)), jnp.ones((1, 2, 2, 4)), jnp.ones((1, 2, 2, 4)))
    with pytest.raises(ValueError, match="depths must match"):
        nn.dot_product_attention(jnp.ones((1, 2, 2, 4)), jnp.ones((1, 2, 2, 3)), jnp.ones((1, 2, 2, 3)))
    drop = nn.MultiHeadAttention(2, 8, dropout_rate=0.1, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="deterministic is None"):
        drop(jnp.ones((1, 2, 8)))


def test_mha_qk_norm_scale_metadata_reaches_the_layer_norms():
    mha = nn.MultiHeadAttention(
        2, 8, normalize_qk=True, rngs=nn.Rngs(0),
        query_ln_scale_metadata={"sharding_names": ("q",)},
        key_ln_scale_metadata={"sharding_names": ("k",)},
    )
    assert mha.query_ln.scale.sharding_names == ("q",)
    assert mha.key_ln.scale.sharding_names == ("k",)
    np.testing.assert_array_equal(mha.query_ln.scale.value, np.ones(4))  # still ones
