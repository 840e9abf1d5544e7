"""Blocked Shampoo with RMSProp grafting (Gupta et al. 2018; Anil et al. 2020)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _validate
from cairn.optim._adding import add_decayed_weights
from cairn.optim._base import (
    GradientTransformation,
    ScalarOrSchedule,
    chain,
    mark_extra,
)
from cairn.optim._momentum import ema
from cairn.optim._packed_state import safe_increment
from cairn.optim._placement import full_like_param, replicated_like, stacked_blocks_like
from cairn.optim._scaling import learning_rate_step
from cairn.optim._types import resolve_annotations

__all__ = ["shampoo", "scale_by_shampoo", "matrix_inverse_root", "ShampooState"]


def matrix_inverse_root(a: Any, p: int = 4, eps: float = 1e-6) -> jax.Array:
    """:math:`(A + \\epsilon\\,\\lambda_{max} I)^{-1/p}` of a symmetric PSD matrix (batched),
    computed in float32 by an eigendecomposition; eigenvalues are floored at the ridge.

    Args:
      a: a symmetric positive semi-definite matrix ``[..., n, n]`` (any leading batch dims).
      p: the root :math:`p` (4 gives :math:`A^{-1/4}`).
      eps: :math:`\\epsilon`, the ridge relative to the largest eigenvalue.

    Returns:
      float32 ``[..., n, n]``.
    """
    _validate.check("matrix_inverse_root", eps=eps)
    a = a.astype(jnp.float32)
    a = 0.5 * (a + jnp.swapaxes(a, -1, -2))
    w, v = jnp.linalg.eigh(a)
    lam_max = jnp.maximum(jnp.max(w, axis=-1, keepdims=True), 1e-30)
    ridge = eps * lam_max
    w = jnp.maximum(w, 0.0) + ridge
    return (v * w[..., None, :] ** (-1.0 / p)) @ jnp.swapaxes(v, -1, -2)


def _as_matrix(shape):
    if len(shape) < 2:
        return None
    return (math.prod(shape[:-1]), shape[-1])


def _blocks(m, n, bs):
    bm, bn = min(bs, m), min(bs, n)
    return bm, bn, -(-m // bm), -(-n // bn)


def _to_blocks(g2, bm, bn, a, c):
    m, n = g2.shape
    g2 = jnp.pad(g2, ((0, a * bm - m), (0, c * bn - n)))
    return g2.reshape(a, bm, c, bn).transpose(0, 2, 1, 3).reshape(a * c, bm, bn)


def _from_blocks(b, m, n, bm, bn, a, c):
    return b.reshape(a, c, bm, bn).transpose(0, 2, 1, 3).reshape(a * bm, c * bn)[:m, :n]


class ShampooState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]
    stats_l: object
    stats_r: object
    precond_l: object
    precond_r: object
    graft_nu: object


def _init_leaf(p, block_size: int):
    """Shampoo's initial ``(stats_l, stats_r, precond_l, precond_r)`` of one leaf (empty
    for vectors and scalars)."""
    mat = _as_matrix(p.shape)
    if mat is None:
        z = replicated_like(p, jnp.zeros((0,), jnp.float32))
        return z, z, z, z
    bm, bn, a, c = _blocks(mat[0], mat[1], block_size)
    eye_l = jnp.broadcast_to(jnp.eye(bm, dtype=jnp.float32), (a * c, bm, bm))
    eye_r = jnp.broadcast_to(jnp.eye(bn, dtype=jnp.float32), (a * c, bn, bn))
    # the per-block statistics are spread over the parameter's mesh axes
    return tuple(stacked_blocks_like(p, x) for x in (
        jnp.zeros((a * c, bm, bm), jnp.float32), jnp.zeros((a * c, bn, bn), jnp.float32),
        eye_l, eye_r))


def _update_leaf(g, L0, R0, PL0, PR0, v0, *, b2, eps, graft_eps, block_size: int, refresh):
    """One leaf's Shampoo step: ``(update, L, R, P_L, P_R, v)`` (see :func:`scale_by_shampoo`)."""
    g32 = g.astype(jnp.float32)
    v = b2 * v0 + (1 - b2) * g32 * g32
    graft = g32 / (jnp.sqrt(v) + graft_eps)
    mat = _as_matrix(g.shape)
    if mat is None:
        return graft.astype(g.dtype), L0, R0, PL0, PR0, v
    m, n = mat
    bm, bn, a, c = _blocks(m, n, block_size)
    blk = _to_blocks(g32.reshape(m, n), bm, bn, a, c)
    L = b2 * L0 + (1 - b2) * blk @ jnp.swapaxes(blk, -1, -2)
    R = b2 * R0 + (1 - b2) * jnp.swapaxes(blk, -1, -2) @ blk
    PL = jax.lax.cond(refresh, lambda a_, b_: matrix_inverse_root(a_, 4, eps),
                      lambda a_, b_: b_, L, PL0)
    PR = jax.lax.cond(refresh, lambda a_, b_: matrix_inverse_root(a_, 4, eps),
                      lambda a_, b_: b_, R, PR0)
    d = _from_blocks(PL @ blk @ PR, m, n, bm, bn, a, c).reshape(g.shape)
    d_norm = jnp.linalg.norm(d)
    scale = jnp.where(d_norm > 0, jnp.linalg.norm(graft) / jnp.where(d_norm > 0, d_norm, 1), 0.0)
    return (d * scale).astype(g.dtype), L, R, PL, PR, v


def scale_by_shampoo(b2: float = 0.999, eps: float = 1e-6, block_size: int = 128,
                     precondition_every: int = 10,
                     graft_eps: float = 1e-8) -> GradientTransformation:
    """Blocked Shampoo direction with RMSProp grafting.

    A leaf is viewed as a matrix :math:`G` (``prod(shape[:-1]) x shape[-1]``) cut into blocks of at
    most ``block_size``. Per block: :math:`L_t = \\beta_2 L_{t-1} + (1-\\beta_2) GG^T`,
    :math:`R_t = \\beta_2 R_{t-1} + (1-\\beta_2) G^TG`; every ``precondition_every`` steps
    :math:`P_L = (L+\\epsilon\\lambda_{max}I)^{-1/4}`, :math:`P_R` likewise; direction
    :math:`D = P_L G P_R`. Grafting: :math:`v_t = \\beta_2 v_{t-1} + (1-\\beta_2)g^2`,
    :math:`r = g/(\\sqrt{v_t}+\\epsilon_g)` and the update is :math:`D\\,\\|r\\|_F/\\|D\\|_F`
    (vectors and scalars use :math:`r` directly).

    Args:
      b2: :math:`\\beta_2`, decay of the preconditioner statistics and of the grafting RMS.
      eps: :math:`\\epsilon`, the ridge relative to the largest eigenvalue.
      block_size: the largest block side a matrix is cut into.
      precondition_every: recompute the inverse roots every this many steps.
      graft_eps: :math:`\\epsilon_g` of the RMSProp grafting.
    """
    _validate.check(
        "scale_by_shampoo",
        b2=b2, eps=eps, block_size=block_size, precondition_every=precondition_every,
        graft_eps=graft_eps,
    )

    def init(params):
        leaves, td = jax.tree_util.tree_flatten(params)
        parts = [_init_leaf(p, block_size) for p in leaves]
        un = lambda i: jax.tree_util.tree_unflatten(td, [q[i] for q in parts])  # noqa: E731
        return ShampooState(jnp.zeros([], jnp.int32), un(0), un(1), un(2), un(3),
                            jax.tree.map(lambda p: full_like_param(p, 0.0, jnp.float32), params))

    @mark_extra
    def update(updates, state, params=None, **extra):
        count = safe_increment(state.count)
        refresh = (state.count % precondition_every) == 0
        gl, td = jax.tree_util.tree_flatten(updates)
        f = td.flatten_up_to  # type: ignore[attr-defined]
        parts = [_update_leaf(g, *olds, b2=b2, eps=eps, graft_eps=graft_eps,
                              block_size=block_size, refresh=refresh)
                 for g, *olds in zip(gl, f(state.stats_l), f(state.stats_r),
                                     f(state.precond_l), f(state.precond_r), f(state.graft_nu))]
        un = lambda i: jax.tree_util.tree_unflatten(td, [q[i] for q in parts])  # noqa: E731
        return un(0), ShampooState(count, un(1), un(2), un(3), un(4), un(5))

    return GradientTransformation(init, update)


def shampoo(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
            block_size: int = 128,
            precondition_every: int = 10, weight_decay: ScalarOrSchedule = 0.0,
            graft_eps: float = 1e-8) -> GradientTransformation:
    """Shampoo: :func:`scale_by_shampoo`, then momentum :math:`m_t = \\beta_1 m_{t-1} + (1-\\beta_1)
    u_t` (if ``b1 > 0``), decoupled decay :math:`+\\lambda\\theta`, times :math:`-\\eta`.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      b1: :math:`\\beta_1`, the momentum decay (0 for none).
      b2: :math:`\\beta_2`, decay of the preconditioner statistics and of the grafting RMS.
      eps: :math:`\\epsilon`, the ridge relative to the largest eigenvalue.
      block_size: the largest block side a matrix is cut into.
      precondition_every: recompute the inverse roots every this many steps.
      weight_decay: :math:`\\lambda`, decoupled weight decay; a float or a schedule.
      graft_eps: :math:`\\epsilon_g` of the RMSProp grafting.
    """
    _validate.check(
        "shampoo",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, block_size=block_size,
        precondition_every=precondition_every, weight_decay=weight_decay, graft_eps=graft_eps,
    )
    txs = [scale_by_shampoo(b2, eps, block_size, precondition_every, graft_eps)]
    if b1:
        txs.append(ema(b1, debias=False))
    txs.append(add_decayed_weights(weight_decay))
    txs.append(learning_rate_step(learning_rate))
    return chain(*txs)


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
