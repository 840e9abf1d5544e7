"""Muon: momentum orthogonalised by Newton–Schulz iterations, with an Adam fallback."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _validate
from cairn.optim._adam import scale_by_adam
from cairn.optim._adding import add_decayed_weights
from cairn.optim._base import (
    GradientTransformation,
    ScalarOrSchedule,
    chain,
    mark_extra,
)
from cairn.optim._combine import partition
from cairn.optim._packed_state import safe_increment
from cairn.optim._placement import full_like_param
from cairn.optim._scaling import learning_rate_step
from cairn.optim._types import resolve_annotations

__all__ = ["muon", "scale_by_muon", "orthogonalize_via_newton_schulz", "MuonState"]

_DEFAULT_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize_via_newton_schulz(x: Any,
                                    ns_coeffs: tuple[float, float, float] = _DEFAULT_NS_COEFFS,
                                    ns_steps: int = 5,
                                    eps: float = 1e-8) -> jax.Array:
    """Approximate :math:`UV^T` of a matrix :math:`G = USV^T`.

    :math:`X_0 = G/(\\|G\\|_F+\\epsilon)`, then ``ns_steps`` times
    :math:`X \\leftarrow aX + (bA + cA^2)X` with :math:`A = XX^T` (on the wide orientation).

    Args:
      x: the matrix :math:`G`, 2-D.
      ns_coeffs: the coefficients :math:`(a, b, c)` of each iteration.
      ns_steps: the number of iterations.
      eps: :math:`\\epsilon`, added to the Frobenius norm.

    Returns:
      an array of ``x``'s shape.

    Raises:
      ValueError: ``x`` is not 2-D.
    """
    if x.ndim != 2:
        raise ValueError(f"Newton-Schulz orthogonalisation needs a matrix, got shape {x.shape}")
    a, b, c = ns_coeffs
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (jnp.linalg.norm(x) + eps)
    for _ in range(int(ns_steps)):
        A = x @ x.T
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.T if transposed else x


class MuonState(NamedTuple):
    """The state of :func:`scale_by_muon`.

    Args:
      count: int32 scalar, steps taken.
      mu: the momentum buffer, one per parameter.
    """
    count: jax.Array  # type: ignore[assignment]
    mu: object


def scale_by_muon(ns_coeffs: tuple[float, float, float] = _DEFAULT_NS_COEFFS, ns_steps: int = 5,
                  beta: float = 0.95,
                  eps: float = 1e-8,
                  mu_dtype: jax.typing.DTypeLike | None = None, *,
                  nesterov: bool = True) -> GradientTransformation:
    """Muon direction for matrices: :math:`m_t = \\beta m_{t-1} + (1-\\beta)g_t`, (Nesterov)
    bias-corrected :math:`\\hat m_t`, :math:`u = \\mathrm{NS}(\\hat m_t)\\sqrt{\\max(1, n_{out}/n_{in})}`
    for a ``(n_in, n_out)`` matrix.

    Args:
      ns_coeffs: the Newton-Schulz coefficients :math:`(a, b, c)` (see
        :func:`orthogonalize_via_newton_schulz`).
      ns_steps: Newton-Schulz iterations.
      beta: :math:`\\beta`, the momentum decay.
      eps: added to the Frobenius norm before Newton-Schulz.
      mu_dtype: dtype of the momentum; None keeps the parameters' dtype.
      nesterov: use the Nesterov form of :math:`\\hat m_t`.
    """

    _validate.check("scale_by_muon", ns_steps=ns_steps, beta=beta, eps=eps)
    def init(params):
        return MuonState(jnp.zeros([], jnp.int32),
                         jax.tree.map(lambda p: full_like_param(p, 0.0, mu_dtype), params))

    @mark_extra
    def update(updates, state, params=None, **extra):
        count = safe_increment(state.count)
        mu = jax.tree.map(lambda g, m: (1 - beta) * g + beta * m, updates, state.mu)
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: beta * m / (1 - beta ** safe_increment(count))
                + (1 - beta) * g / (1 - beta ** count), mu, updates)
        else:
            mu_hat = jax.tree.map(lambda m: m / (1 - beta ** count), mu)

        def per(m, g):
            o = orthogonalize_via_newton_schulz(m, ns_coeffs, ns_steps, eps)
            fan_in, fan_out = m.shape
            return (o * jnp.sqrt(jnp.maximum(1.0, fan_out / fan_in))).astype(g.dtype)

        out = jax.tree.map(per, mu_hat, updates)
        mu = jax.tree.map(lambda m, m0: m.astype(m0.dtype), mu, state.mu)
        return out, MuonState(count, mu)

    return GradientTransformation(init, update)


def muon(learning_rate: ScalarOrSchedule,
         ns_coeffs: tuple[float, float, float] = _DEFAULT_NS_COEFFS, ns_steps: int = 5,
         beta: float = 0.95, eps: float = 1e-8,
         weight_decay: ScalarOrSchedule = 0.0, weight_decay_mask: Any = None,
         mu_dtype: jax.typing.DTypeLike | None = None, *, nesterov: bool = True,
         adam_b1: float = 0.9, adam_b2: float = 0.999, adam_eps_root: float = 0.0,
         adam_weight_decay: float = 0.0,
         adam_learning_rate: ScalarOrSchedule | None = None,
         nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """Muon for 2-D parameters, AdamW for the rest (chosen by ``ndim == 2``;
    the AdamW part uses the same ``nesterov`` flag).

    Matrices: :math:`u = -\\eta(\\mathrm{muon}(g) + \\lambda\\theta)`; others:
    :math:`u = -\\eta_{adam}(\\mathrm{adam}(g) + \\lambda_{adam}\\theta)`.

    Args:
      learning_rate: :math:`\\eta`, the matrices' learning rate; a float or a schedule.
      ns_coeffs: the Newton-Schulz coefficients :math:`(a, b, c)`.
      ns_steps: Newton-Schulz iterations.
      beta: momentum decay of the Muon part.
      eps: added to the Frobenius norm before Newton-Schulz, and Adam's :math:`\\epsilon`.
      weight_decay: :math:`\\lambda`, the matrices' decoupled weight decay; a float or a schedule.
      weight_decay_mask: which matrices get weight decay (see :func:`add_decayed_weights`); None
        means all.
      mu_dtype: dtype of both parts' momentum; None keeps the parameters' dtype.
      nesterov: use Nesterov momentum (both parts).
      adam_b1: the AdamW part's :math:`\\beta_1`.
      adam_b2: the AdamW part's :math:`\\beta_2`.
      adam_eps_root: the AdamW part's :math:`\\epsilon_{root}`.
      adam_weight_decay: :math:`\\lambda_{adam}`, the AdamW part's weight decay.
      adam_learning_rate: :math:`\\eta_{adam}`; None uses ``learning_rate``.
      nu_dtype: dtype of the AdamW part's second moment; None keeps the parameters' dtype.
    """
    _validate.check(
        "muon",
        learning_rate=learning_rate, ns_steps=ns_steps, beta=beta, eps=eps,
        weight_decay=weight_decay, adam_b1=adam_b1, adam_b2=adam_b2, adam_eps_root=adam_eps_root,
        adam_weight_decay=adam_weight_decay, adam_learning_rate=adam_learning_rate,
    )
    adam_lr = learning_rate if adam_learning_rate is None else adam_learning_rate

    def labels(params):
        return jax.tree.map(lambda p: "muon" if jnp.ndim(p) == 2 else "adam", params)

    muon_tx = chain(scale_by_muon(ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov),
                    add_decayed_weights(weight_decay, weight_decay_mask),
                    learning_rate_step(learning_rate))
    adam_tx = chain(scale_by_adam(adam_b1, adam_b2, eps, adam_eps_root, mu_dtype,
                                     nesterov=nesterov, nu_dtype=nu_dtype),
                    add_decayed_weights(adam_weight_decay),
                    learning_rate_step(adam_lr))
    inner = partition({"muon": muon_tx, "adam": adam_tx}, labels)

    def init(params):
        labs = jax.tree_util.tree_leaves(labels(params))
        used = {k: tx for k, tx in (("muon", muon_tx), ("adam", adam_tx)) if k in labs}
        return partition(used, labels).init(params)

    @mark_extra
    def update(updates, state, params=None, **extra):
        labs = jax.tree_util.tree_leaves(labels(updates))
        used = {k: tx for k, tx in (("muon", muon_tx), ("adam", adam_tx)) if k in labs}
        return partition(used, labels).update(updates, state, params, **extra)

    del inner
    return GradientTransformation(init, update)


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
