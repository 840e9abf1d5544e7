"""Linear softmax cross-entropy, the XLA implementation: never materialises ``[tokens, vocab]``.

Forward: a loop over vocabulary chunks of ``block_v`` columns computes ``x @ w[:, chunk]``
and folds it into a running max, sum of exponentials and label logit per token (online
logsumexp), so the peak extra memory is one ``[tokens, block_v]`` chunk. Backward
(``custom_vjp``): the same loop recomputes each chunk's logits from ``x``, ``w`` and the
saved logsumexp, forms ``softmax - onehot`` for the chunk and adds its share of ``dx`` and
writes its columns of ``dw``. The Pallas implementations reuse this backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def _chunk(w: jax.Array, i: Any, block_v: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(w, i * block_v, block_v, axis=1)


def _pad_cols(w: jax.Array, block_v: int) -> jax.Array:
    pad = -w.shape[1] % block_v
    return jnp.pad(w, ((0, 0), (0, pad))) if pad else w


def stats_xla(x: Any, labels: Any, w: Any, *, block_v: int, precision: Any = None) -> tuple[jax.Array, jax.Array]:
    """``(logsumexp, label_logit)`` per token, float32, chunked over the vocabulary."""
    b = x.shape[0]
    v = w.shape[1]
    wp = _pad_cols(w, block_v)
    cols0 = jnp.arange(block_v, dtype=jnp.int32)
    lab = labels.astype(jnp.int32)[:, None]

    def body(i, carry):
        m, s, ll = carry
        logits = jnp.dot(x, _chunk(wp, i, block_v), precision=precision, preferred_element_type=jnp.float32)
        cols = i * block_v + cols0
        logits = jnp.where(cols[None, :] < v, logits, -jnp.inf)
        new_m = jnp.maximum(m, logits.max(axis=1))
        s = s * jnp.exp(m - new_m) + jnp.exp(logits - new_m[:, None]).sum(axis=1)
        ll = ll + jnp.where(cols[None, :] == lab, logits, 0.0).sum(axis=1)
        return new_m, s, ll

    init = (jnp.full((b,), -jnp.inf, jnp.float32), jnp.zeros((b,), jnp.float32), jnp.zeros((b,), jnp.float32))
    m, s, ll = lax.fori_loop(0, wp.shape[1] // block_v, body, init)
    return m + jnp.log(s), ll


def grads_xla(x: Any, labels: Any, w: Any, lse: Any, coef: Any, *, block_v: int, precision: Any = None) -> tuple[jax.Array, jax.Array]:
    """``(dx, dw)`` of ``coef * sum(lse - label_logit)``, chunked over the vocabulary."""
    v = w.shape[1]
    wp = _pad_cols(w, block_v)
    cols0 = jnp.arange(block_v, dtype=jnp.int32)
    lab = labels.astype(jnp.int32)[:, None]

    def body(i, carry):
        dx, dw = carry
        wc = _chunk(wp, i, block_v)
        logits = jnp.dot(x, wc, precision=precision, preferred_element_type=jnp.float32)
        cols = i * block_v + cols0
        p = jnp.where(cols[None, :] < v, jnp.exp(logits - lse[:, None]), 0.0)
        p = (p - (cols[None, :] == lab).astype(jnp.float32)) * coef
        pc = p.astype(w.dtype)
        dx = dx + jnp.dot(pc, wc.T, precision=precision, preferred_element_type=jnp.float32)
        dwc = jnp.dot(x.T, pc, precision=precision, preferred_element_type=jnp.float32)
        return dx, lax.dynamic_update_slice_in_dim(dw, dwc.astype(dw.dtype), i * block_v, axis=1)

    init = (jnp.zeros(x.shape, jnp.float32), jnp.zeros(wp.shape, w.dtype))
    dx, dw = lax.fori_loop(0, wp.shape[1] // block_v, body, init)
    return dx.astype(x.dtype), dw[:, :v]


def make_loss(stats: Callable[..., tuple[jax.Array, jax.Array]], block_v: int, precision: Any) -> Callable[..., Any]:
    """A differentiable ``loss(x, labels, w, reduction)`` from a forward ``stats`` function
    (``(lse, label_logit)`` per token) and the chunked XLA backward."""

    def reduce(per_token, reduction):
        total = per_token.sum()
        return total / per_token.shape[0] if reduction == "mean" else total

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def loss(x, labels, w, reduction):
        lse, ll = stats(x, labels, w)
        return reduce(lse - ll, reduction)

    def fwd(x, labels, w, reduction):
        lse, ll = stats(x, labels, w)
        return reduce(lse - ll, reduction), (x, labels, w, lse)

    def bwd(reduction, res, g):
        x, labels, w, lse = res
        coef = g / x.shape[0] if reduction == "mean" else g
        dx, dw = grads_xla(x, labels, w, lse, coef.astype(jnp.float32), block_v=block_v, precision=precision)
        return dx, None, dw

    loss.defvjp(fwd, bwd)
    return loss


def cross_entropy_xla(
    x: jax.Array,
    labels: jax.Array,
    weights: jax.Array,
    *,
    config: Mapping[str, Any],
    interpret: bool = False,
    reduction: str = "sum",
    precision: Any = None,
) -> jax.Array:
    """The XLA implementation; ``config["block_v"]`` is the vocabulary chunk."""
    del interpret
    block_v = int(config.get("block_v", 2048))
    if block_v < 1:
        raise ValueError(f"config block_v={block_v} does not fit: must be positive")
    block_v = min(block_v, weights.shape[1])
    stats = functools.partial(stats_xla, block_v=block_v, precision=precision)
    return make_loss(stats, block_v, precision)(x, labels, weights, reduction)
