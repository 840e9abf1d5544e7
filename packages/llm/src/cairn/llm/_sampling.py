"""Choosing the next token from logits: greedy, temperature, top-k and top-p, one row at a time.

Every function works on a batch of rows ``[B, V]`` with per-row settings ``[B]``, and a
row's result depends only on that row (its logits, settings and key), so a batch gives
each row exactly what it would get alone.

The processing order is that of transformers' logits warpers: divide by the temperature,
keep the ``top_k`` largest logits, then keep the smallest set of the largest remaining
tokens whose probability (renormalized after top-k) reaches ``top_p``. Kept logits are
unchanged, removed ones become ``-inf``. Thresholds are values, so tokens tied with the
last kept one are kept too.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["SamplingParams", "choose", "filter_logits"]


class SamplingParams(NamedTuple):
    """Per-row settings, each ``[B]``: ``temperature`` float32 (0: greedy), ``top_k`` int32
    (0: off), ``top_p`` float32 (1: off)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``logits [B, V]`` with every token outside row ``b``'s top-k / top-p set at ``-inf``.

    ``top_k [B]`` int (0 or >= V: keep all), ``top_p [B]`` float in ``(0, 1]`` (1: keep all).
    Top-p keeps token ``i`` (in descending order) when the probability of the tokens before
    it is below ``top_p``, so the token that crosses ``top_p`` is kept and at least one
    token always is.

    >>> import jax.numpy as jnp, numpy as np
    >>> x = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    >>> np.isfinite(filter_logits(x, jnp.array([0]), jnp.array([0.7]))).tolist()
    [[True, True, False, False]]
    >>> np.isfinite(filter_logits(x, jnp.array([1]), jnp.array([1.0]))).tolist()
    [[True, False, False, False]]
    """
    v = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v).astype(jnp.int32)
    in_k = jnp.arange(v)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    top_p = top_p[:, None]
    keep = in_k & ((before < top_p) | (top_p >= 1.0))
    n = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(desc, (n - 1)[:, None], axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def processed_logits(logits: jax.Array, params: SamplingParams, filtering: bool) -> jax.Array:
    """The logits a sampled row draws from: ``logits / temperature``, then top-k / top-p
    (``filtering=False`` skips the sort when no row filters)."""
    t = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    scaled = logits / t
    return filter_logits(scaled, params.top_k, params.top_p) if filtering else scaled


def choose(logits: jax.Array, keys: jax.Array, params: SamplingParams, *, sampling: bool,
           filtering: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The next token of each row and its log-probabilities.

    Args:
      logits: ``[B, V]`` float32, the model's raw next-token logits.
      keys: ``[B]`` PRNG keys, one per row (used by rows with ``temperature > 0``).
      params: per-row :class:`SamplingParams`.
      sampling: False when every row is greedy (no random draw is traced).
      filtering: False when no row uses top-k or top-p.

    Returns:
      ``tokens [B]`` int32; ``logprobs [B]``: ``log_softmax(logits)`` at the token (the
      model's distribution); ``processed [B]``: the log-probability of the token under the
      distribution it was drawn from (0 for a greedy row: the argmax has probability 1).
    """
    raw = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if sampling:
        proc = processed_logits(logits, params, filtering)
        drawn = jax.vmap(jax.random.categorical)(keys, proc).astype(jnp.int32)
        is_sampled = params.temperature > 0
        tokens = jnp.where(is_sampled, drawn, greedy)
        proc_lp = jnp.take_along_axis(jax.nn.log_softmax(proc, axis=-1), tokens[:, None], axis=-1)[:, 0]
        processed = jnp.where(is_sampled, proc_lp, 0.0)
    else:
        tokens = greedy
        processed = jnp.zeros(tokens.shape, jnp.float32)
    logprobs = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs, processed
