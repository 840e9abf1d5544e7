"""The generation test model itself (a cairn.llm CausalLM): cached prefill + decode equal its
full forward pass (float32 tolerance 2e-4 on logits of magnitude ~10), with QArray weights too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gen_testlib import (
    MAX_LENGTH,
    VOCAB_SIZE,
    cache_specs,
    decode,
    init_params,
    prefill,
    quantized_params,
    reference_logits,
)

TOL = 2e-4  # cached vs full float32 passes, relative to the logits' scale


def _check(got, want):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=TOL * scale, rtol=0)


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_prefill_then_decode_equal_full_forward(quant):
    params = init_params(3)
    if quant:
        params = quantized_params(params, quant)
    rng = np.random.default_rng(0)
    lengths = np.array([5, 1, 9], np.int32)
    p = 12
    tokens = rng.integers(0, VOCAB_SIZE, (3, p)).astype(np.int32)
    logits, cache = jax.jit(prefill)(params, jnp.asarray(tokens), jnp.asarray(lengths))
    assert set(cache) == set(cache_specs()) and all(c.shape == (3, MAX_LENGTH, 2, 8) for c in cache.values())
    seqs = [list(tokens[i, : lengths[i]]) for i in range(3)]
    for i in range(3):
        _check(logits[i], reference_logits(params, seqs[i])[-1])
    step = jax.jit(decode)
    for _ in range(6):
        nxt = rng.integers(0, VOCAB_SIZE, 3).astype(np.int32)
        pos = np.array([len(s) for s in seqs], np.int32)
        logits, cache = step(params, jnp.asarray(nxt), jnp.asarray(pos), cache)
        for i in range(3):
            seqs[i].append(int(nxt[i]))
            _check(logits[i], reference_logits(params, seqs[i])[-1])


def test_decode_rows_are_independent():
    params = init_params(1)
    tokens = jnp.asarray(np.arange(8, dtype=np.int32).reshape(2, 4) + 3)
    _, cache = jax.jit(prefill)(params, tokens, jnp.asarray([4, 4], jnp.int32))
    a, _ = jax.jit(decode)(params, jnp.asarray([5, 6], jnp.int32), jnp.asarray([4, 4], jnp.int32), cache)
    other = {k: v.at[1].set(0.0) for k, v in cache.items()}
    b, _ = jax.jit(decode)(params, jnp.asarray([5, 9], jnp.int32), jnp.asarray([4, 2], jnp.int32), other)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
