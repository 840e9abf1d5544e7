"""Packed training rows: ``segment_ids`` keep attention inside each segment, so a packed row
gives each segment the logits it has alone (the reference: the model's full pass on that
segment, which test_llm_models.py checks against transformers); ``hidden_states`` times
``output_projection`` is the logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from llm_testlib import forward, load

from cairn import nn


@nn.jit
def _packed(model, ids, positions, segment_ids):
    return model(ids, positions=positions, segment_ids=segment_ids)


# llama: cairn.kernels' causal attention with segment ids; mistral: sliding window 5, the mask path
@pytest.mark.parametrize("family", ["llama", pytest.param("mistral", marks=pytest.mark.slow)])
def test_a_packed_row_gives_each_segment_its_own_logits(family):
    model = load(family)
    rng = np.random.default_rng(0)
    parts = [rng.integers(3, 96, n) for n in (7, 4, 6)]  # three segments, then 3 padding tokens
    ids = np.concatenate([*parts, np.zeros(3, np.int64)]).astype(np.int32)
    seg = np.concatenate([np.full(len(p), i + 1) for i, p in enumerate(parts)] + [np.zeros(3)]).astype(np.int32)
    pos = np.concatenate([np.arange(len(p)) for p in parts] + [np.arange(3)]).astype(np.int32)
    got = np.asarray(_packed(model, jnp.asarray(ids[None]), jnp.asarray(pos[None]), jnp.asarray(seg[None])))[0]
    start = 0
    for p in parts:
        want = np.asarray(forward(model, jnp.asarray(p[None], jnp.int32)))[0]
        np.testing.assert_allclose(got[start : start + len(p)], want, atol=2e-5, rtol=0)
        start += len(p)
    assert np.isfinite(got).all()  # padding attends to nothing and stays finite


def test_hidden_states_times_the_output_projection_are_the_logits():
    for family in ("llama", "qwen2"):  # untied head, tied embedding
        model = load(family)
        ids = jnp.asarray([[5, 17, 33, 8, 61]], jnp.int32)
        h = model.hidden_states(ids)
        np.testing.assert_allclose(np.asarray(h @ model.output_projection()), np.asarray(forward(model, ids)),
                                   atol=2e-5, rtol=0)


def test_segment_ids_with_a_cache_are_refused():
    model = load("llama")
    with pytest.raises(ValueError, match="segment_ids .* are for a full pass"):
        model(jnp.ones((1, 2), jnp.int32), cache=model.init_cache(1, 8), segment_ids=jnp.ones((1, 2), jnp.int32))
