"""cairn.kernels.dot_product_attention as the attention_fn of a real cairn.nn model.

Values and gradients match nn's default attention (causal, grouped-query heads, padding
mask, decode with a KV cache), under nn.jit, with the override context manager picking
the implementation and config for a block of code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cairn.kernels as ck
from cairn import nn


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, rngs: nn.Rngs, attention_fn=None) -> None:
        extra = {} if attention_fn is None else {"attention_fn": attention_fn}
        self.attn = nn.MultiHeadAttention(heads, d, num_kv_heads=kv_heads, rngs=rngs, **extra)
        self.out = nn.Linear(d, d, rngs=rngs)

    def __call__(self, x, mask=None):
        return self.out(x + self.attn(x, mask=mask, is_causal=mask is None))


def _pair(**kw):
    ours = _Block(32, 4, 2, nn.Rngs(0), attention_fn=ck.dot_product_attention, **kw)
    theirs = _Block(32, 4, 2, nn.Rngs(0), **kw)
    return ours, theirs


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("chunk_size", [None, 8])
def test_values_and_grads_match_nn_default(chunk_size):
    ours, theirs = _pair()
    x = jax.random.normal(jax.random.key(1), (2, 19, 32))

    def loss(m):
        return jnp.sum(m(x) ** 2)

    value_and_grads = nn.jit(lambda m: (loss(m), nn.grad(loss)(m)))
    with ck.override(config={"chunk_size": chunk_size}, op="dot_product_attention"):
        got_value, got_grads = value_and_grads(ours)
    want_value, want_grads = value_and_grads(theirs)
    np.testing.assert_allclose(got_value, want_value, rtol=1e-5)
    for a, b in zip(_leaves(got_grads), _leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4)


def test_padding_mask_and_jit():
    ours, theirs = _pair()
    x = jax.random.normal(jax.random.key(2), (2, 11, 32))
    valid = jnp.arange(11)[None, :] < jnp.array([[11], [6]])
    mask = valid[:, None, None, :]  # [B, 1, 1, S]
    got = nn.jit(lambda m, x: m(x, mask))(ours, x)
    np.testing.assert_allclose(got, theirs(x, mask), atol=1e-5)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_pallas_triton_in_the_model_via_override():
    ours, theirs = _pair()
    x = jax.random.normal(jax.random.key(3), (1, 20, 32))
    with ck.override("pallas_triton", {"block_q": 16, "block_k": 16}):
        with ck.recording() as calls:
            got = ours(x)
    assert [c.implementation for c in calls] == ["pallas_triton"]
    np.testing.assert_allclose(got, theirs(x), atol=2e-5)


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_decode_with_kv_cache_matches_full_forward():
    ours, _ = _pair()
    x = jax.random.normal(jax.random.key(4), (1, 6, 32))
    full = ours.attn(x, is_causal=True)
    ours.attn.init_cache((1, 8, 32))
    steps = [ours.attn(x[:, :4], decode=True)] + [ours.attn(x[:, t : t + 1], decode=True) for t in (4, 5)]
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5)


def test_sow_weights_is_refused_clearly():
    ours, _ = _pair()
    with pytest.raises(NotImplementedError, match="sow_weights"):
        ours.attn(jnp.ones((1, 3, 32)), sow_weights=True)
