"""KV-cache decoding equals the full forward pass: ragged right-padded prefill, then per-row decode.

The reference is the model's own full causal forward over the true tokens (which
test_llm_models.py checks against transformers), so each test isolates the cache: slot
writes at each row's own position, the position mask, sliding windows over the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llm_testlib import VARIANTS, extend, forward, load, reference

from cairn import llm, nn

# dynamic NTK rescales theta from the longest position in each call (as the reference
# does), so a cached decode and one full pass rotate differently by design
CACHED = [v for v in VARIANTS if v != "llama_dynamic"]


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("variant", CACHED)
def test_ragged_prefill_then_per_row_decode_equals_full_forward(variant):
    model = load(variant)
    ids, _ = reference(variant)  # [2, 12]
    full = np.asarray(forward(model, ids))
    lengths = np.array([9, 5], np.int32)
    prompt = ids[:, :9].copy()
    prompt[1, 5:] = 3  # right padding: any token, never attended to
    cache = model.init_cache(2, 16)
    logits, cache = extend(model, prompt, cache, lengths)
    assert cache.lengths.tolist() == [9, 5]
    for b, n in enumerate(lengths):
        _close(np.asarray(logits[b, :n]), full[b, :n])
    for step in range(3):  # row 0 decodes positions 9..11, row 1 positions 5..7, in the same calls
        token = ids[np.arange(2), lengths + step][:, None]
        logits, cache = extend(model, token, cache, np.ones(2, np.int32))
        assert cache.lengths.tolist() == (lengths + step + 1).tolist()
        for b in range(2):
            _close(np.asarray(logits[b, 0]), full[b, lengths[b] + step])


def _small(window):
    cfg = llm.LlmConfig("mistral", vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=4, sliding_window=window,
                        layer_types=("sliding_attention", "full_attention"))
    return llm.CausalLM(cfg, rngs=nn.Rngs(0))


_MODELS = {w: _small(w) for w in (2, 6)}


@settings(max_examples=12, deadline=None)
@given(window=st.sampled_from([2, 6]), lengths=st.lists(st.integers(1, 8), min_size=3, max_size=3),
       advance=st.lists(st.integers(0, 1), min_size=3, max_size=3), seed=st.integers(0, 2**31 - 1))
@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_cached_decode_matches_full_forward_for_any_ragged_batch(window, lengths, advance, seed):
    """Prefill rows of any lengths (junk after each), one decode step where some rows do
    not advance (their token is junk), one where all do: every real position's logits
    equal the full forward's."""
    model = _MODELS[window]
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50, size=(3, 10)).astype(np.int32)
    full = np.asarray(forward(model, tokens))
    lengths, advance = np.array(lengths, np.int32), np.array(advance, np.int32)
    prompt = np.where(np.arange(8) < lengths[:, None], tokens[:, :8], rng.integers(0, 50, size=(3, 8))).astype(np.int32)
    logits, cache = extend(model, prompt, model.init_cache(3, 12), lengths)
    for b in range(3):
        _close(np.asarray(logits[b, : lengths[b]]), full[b, : lengths[b]])
    pos = lengths.copy()
    for step_advance in (advance, np.ones(3, np.int32)):
        token = np.where(step_advance == 1, tokens[np.arange(3), pos], rng.integers(0, 50, size=3)).astype(np.int32)
        logits, cache = extend(model, token[:, None], cache, step_advance)
        for b in np.flatnonzero(step_advance):
            _close(np.asarray(logits[b, 0]), full[b, pos[b]])
        pos = pos + step_advance
        assert cache.lengths.tolist() == pos.tolist()


def test_cache_is_a_pytree_of_per_layer_arrays():
    model = _MODELS[2]
    cache = model.init_cache(2, 7, dtype=jnp.bfloat16)
    leaves = jax.tree_util.tree_leaves(cache)
    assert len(leaves) == 2 * 2 + 1
    assert cache.keys[0].shape == (2, 7, 2, 4) and cache.keys[0].dtype == jnp.bfloat16
    assert cache.max_length == 7 and cache.lengths.dtype == jnp.int32


def test_positions_and_lengths_are_refused_where_they_mean_nothing():
    model = _MODELS[2]
    ids = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="lengths is only meaningful with a cache"):
        model(ids, lengths=jnp.array([2]))
    with pytest.raises(ValueError, match="do not pass positions"):
        model(ids, positions=jnp.arange(3)[None], cache=model.init_cache(1, 4))


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_a_full_cache_is_refused_eagerly():
    model = _MODELS[2]
    cache = model.init_cache(2, 4)
    _, cache = model(jnp.zeros((2, 3), jnp.int32), cache=cache, lengths=jnp.array([3, 1]))
    with pytest.raises(ValueError, match=r"max_length 4 has no room: rows \[0\] would hold \[5\] tokens"):
        model(jnp.zeros((2, 2), jnp.int32), cache=cache)
    _, cache = model(jnp.zeros((2, 2), jnp.int32), cache=cache, lengths=jnp.array([0, 2]))  # padding may spill
    assert cache.lengths.tolist() == [3, 3]


def test_explicit_positions_are_used_and_only_their_differences_matter():
    """``positions=arange(T)`` is the default; a uniform shift of every position leaves the
    logits unchanged up to float error (rotary attention sees position differences only)."""
    model = _MODELS[6]
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 50, size=(2, 5)), jnp.int32)
    at = nn.jit(lambda m, x, p: m(x, positions=p))
    base = np.asarray(forward(model, ids))
    same = np.asarray(at(model, ids, jnp.broadcast_to(jnp.arange(5), (2, 5))))
    np.testing.assert_allclose(base, same, rtol=1e-6, atol=1e-6)
    shifted = np.asarray(at(model, ids, jnp.broadcast_to(jnp.arange(5) + 7, (2, 5))))
    np.testing.assert_allclose(shifted, base, rtol=1e-4, atol=1e-4)


def test_a_jitted_decode_step_updates_the_cache_in_place_and_copies_no_weight():
    """The compiled one-token step of a donated cache: every cache buffer is aliased to its
    output, and no parameter is copied (the ``[heads, head_dim, hidden]`` output projection
    used to be transposed into a fresh buffer on every step, a full weight copy per layer)."""
    cfg = llm.LlmConfig("qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, qkv_bias=True)
    model = llm.CausalLM(cfg, rngs=nn.Rngs(0))
    graph, state = nn.split(model)

    def step(state, tok, cache):
        logits, cache = nn.merge(graph, state)(tok[:, None], cache=cache)
        return logits, cache

    cache = model.init_cache(1, 16)
    hlo = jax.jit(step, donate_argnums=2).lower(state, jnp.zeros((1,), jnp.int32), cache).compile().as_text()
    n_params = len(jax.tree.leaves(state))
    header = hlo.splitlines()[0]
    # outputs 1.. (the cache's keys, values, lengths) alias the donated inputs after the params and the token
    for i in range(len(jax.tree.leaves(cache))):
        assert f"({n_params + 1 + i}, {{}}, may-alias)" in header, (i, header)
    entry = hlo[hlo.index("\nENTRY"):]
    weight_copies = [line for line in entry.splitlines()
                     if "copy" in line.split("=")[0] and "['kernel']" in line.replace("\\", "")]
    assert weight_copies == []
