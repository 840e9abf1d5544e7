"""Linear softmax cross-entropy, the XLA implementation: never materialises ``[tokens, vocab]``.

The loss: a loop over chunks of ``block_b`` tokens computes each chunk's logits, their
logsumexp and the label logit, so the peak extra memory is one ``[block_b, vocab]`` chunk.
Under differentiation (``custom_vjp``) the same loop also forms ``softmax - onehot`` and
the chunk's share of ``dx`` and ``dw`` (the gradient up to the scalar cotangent), so a
training step costs the naive form's three matmuls. The Triton implementation's backward
instead recomputes vocabulary chunks of ``block_v`` from the saved logsumexp
(:func:`grads_xla`).
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


def _logits(xc: Any, w: Any, col_scale: Any, precision: Any) -> jax.Array:
    """``xc @ w`` in float32; quantized ``w`` (integer values) times its column scale."""
    if col_scale is None:
        return jnp.dot(xc, w, precision=precision, preferred_element_type=jnp.float32)
    return jnp.dot(xc, w.astype(xc.dtype), precision=precision, preferred_element_type=jnp.float32) * col_scale


def stats_xla(
    x: Any, labels: Any, w: Any, *, block_b: int, precision: Any = None, col_scale: Any = None
) -> tuple[jax.Array, jax.Array]:
    """``(logsumexp, label_logit)`` per token, float32, one chunk of ``block_b`` tokens (all
    their logits) at a time: the naive form's operations, ``block_b / tokens`` of its memory."""
    b = x.shape[0]
    pad = -b % block_b
    xp = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
    lab = jnp.pad(labels.astype(jnp.int32), (0, pad)) if pad else labels.astype(jnp.int32)

    def body(i, carry):
        lse, ll = carry
        xc = lax.dynamic_slice_in_dim(xp, i * block_b, block_b, 0)
        lc = lax.dynamic_slice_in_dim(lab, i * block_b, block_b, 0)
        logits = _logits(xc, w, col_scale, precision)
        lse = lax.dynamic_update_slice_in_dim(lse, jax.nn.logsumexp(logits, axis=1), i * block_b, 0)
        pick = jnp.take_along_axis(logits, lc[:, None], axis=1)[:, 0]
        return lse, lax.dynamic_update_slice_in_dim(ll, pick, i * block_b, 0)

    n = xp.shape[0]
    lse, ll = lax.fori_loop(0, n // block_b, body, (jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.float32)))
    return lse[:b], ll[:b]


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


def fused_xla(
    x: Any, labels: Any, w: Any, *, block_b: int, precision: Any = None, col_scale: Any = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(sum of per-token losses, dx, dw)`` in one pass over token chunks of ``block_b``.

    Under differentiation the loss's gradient (up to the scalar cotangent) is computed with
    the loss: each chunk's ``[block_b, vocab]`` logits give its logsumexp, its
    ``softmax - onehot`` and its share of ``dx`` and ``dw`` at once, so a training step
    runs three matmuls (as the naive form) instead of four (a recomputing backward) and
    holds one chunk of logits instead of all of them.
    """
    b, h = x.shape
    pad = -b % block_b
    xp = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
    lab = jnp.pad(labels.astype(jnp.int32), (0, pad)) if pad else labels.astype(jnp.int32)
    rows0 = jnp.arange(block_b, dtype=jnp.int32)
    cols = jnp.arange(w.shape[1], dtype=jnp.int32)

    def body(i, carry):
        total, dx, dw = carry
        xc = lax.dynamic_slice_in_dim(xp, i * block_b, block_b, 0)
        lc = lax.dynamic_slice_in_dim(lab, i * block_b, block_b, 0)
        valid = (i * block_b + rows0 < b)[:, None]
        logits = _logits(xc, w, col_scale, precision)
        m = logits.max(axis=1, keepdims=True)
        e = jnp.exp(logits - m)
        s = e.sum(axis=1, keepdims=True)
        onehot = cols[None, :] == lc[:, None]
        per = (m + jnp.log(s))[:, 0] - jnp.where(onehot, logits, 0.0).sum(axis=1)
        total = total + jnp.where(valid[:, 0], per, 0.0).sum()
        p = jnp.where(valid, e / s - onehot.astype(jnp.float32), 0.0)
        if col_scale is not None:  # a frozen quantized weight: dx only
            dxc = jnp.dot((p * col_scale).astype(xc.dtype), w.astype(xc.dtype).T, precision=precision,
                          preferred_element_type=jnp.float32)
            return total, lax.dynamic_update_slice_in_dim(dx, dxc, i * block_b, 0), dw
        p = p.astype(w.dtype)
        dxc = jnp.dot(p, w.T, precision=precision, preferred_element_type=jnp.float32)
        dx = lax.dynamic_update_slice_in_dim(dx, dxc, i * block_b, 0)
        dw = dw + jnp.dot(xc.T, p, precision=precision, preferred_element_type=jnp.float32)
        return total, dx, dw

    dw_shape = (h, w.shape[1]) if col_scale is None else (1, 1)
    init = (jnp.zeros((), jnp.float32), jnp.zeros(xp.shape, jnp.float32), jnp.zeros(dw_shape, jnp.float32))
    total, dx, dw = lax.fori_loop(0, xp.shape[0] // block_b, body, init)
    return total, dx[:b], dw


def make_loss(
    stats: Callable[..., tuple[jax.Array, jax.Array]],
    block_v: int,
    precision: Any,
    fused: Callable[..., tuple[jax.Array, jax.Array, jax.Array]] | None = None,
) -> Callable[..., Any]:
    """A differentiable ``loss(x, labels, w, reduction)`` from a forward ``stats`` function
    (``(lse, label_logit)`` per token) and the chunked XLA backward; with ``fused``
    (see :func:`fused_xla`) the gradient is computed with the loss under differentiation."""

    def reduce(per_token, reduction):
        total = per_token.sum()
        return total / per_token.shape[0] if reduction == "mean" else total

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def loss(x, labels, w, reduction):
        lse, ll = stats(x, labels, w)
        return reduce(lse - ll, reduction)

    def fwd(x, labels, w, reduction):
        if fused is not None:
            total, dx, dw = fused(x, labels, w)
            value = total / x.shape[0] if reduction == "mean" else total
            return value, (x, labels, w, (dx, dw))
        lse, ll = stats(x, labels, w)
        return reduce(lse - ll, reduction), (x, labels, w, lse)

    def bwd(reduction, res, g):
        x, labels, w, saved = res
        coef = (g / x.shape[0] if reduction == "mean" else g).astype(jnp.float32)
        if fused is not None:
            dx, dw = saved
            dw_out = None if not jnp.issubdtype(w.dtype, jnp.floating) else (dw * coef).astype(w.dtype)
            return (dx * coef).astype(x.dtype), None, dw_out
        dx, dw = grads_xla(x, labels, w, saved, coef, block_v=block_v, precision=precision)
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
    col_scale: Any = None,
) -> jax.Array:
    """The XLA implementation (``col_scale``: ``weights`` holds a quantized weight's
    integer values and ``col_scale[vocab]`` its per-column scale; no weight gradient): ``config["block_b"]`` is the token chunk (all its logits are
    held at once); ``config["block_v"]`` the vocabulary chunk of the recomputing backward
    (used when the gradient is not computed with the loss)."""
    del interpret
    block_v = int(config.get("block_v", 2048))
    block_b = int(config.get("block_b", 256))
    for key, v in (("block_v", block_v), ("block_b", block_b)):
        if v < 1:
            raise ValueError(f"config {key}={v} does not fit: must be positive")
    block_v = min(block_v, weights.shape[1])
    block_b = min(block_b, x.shape[0])
    stats = functools.partial(stats_xla, block_b=block_b, precision=precision, col_scale=col_scale)
    fused = functools.partial(fused_xla, block_b=block_b, precision=precision, col_scale=col_scale)
    return make_loss(stats, block_v, precision, fused)(x, labels, weights, reduction)
