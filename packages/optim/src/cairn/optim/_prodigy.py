"""Prodigy (Mishchenko and Defazio 2023): Adam whose step size D is estimated on the fly."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _tree, _validate
from cairn.optim._base import GradientTransformation, ScalarOrSchedule, mark_extra
from cairn.optim._packed_state import safe_increment
from cairn.optim._types import resolve_annotations

__all__ = ["ProdigyState", "prodigy"]


class ProdigyState(NamedTuple):
    """The state of :func:`prodigy`.

    Args:
      exp_avg: :math:`m`, the EMA of :math:`d\\,g`.
      exp_avg_sq: :math:`v`, the EMA of :math:`(d\\,g)^2`.
      grad_sum: :math:`s`, the weighted sum of :math:`d^2 g` terms.
      params0: :math:`x_0`, the params at init.
      estim_lr: :math:`d`, the distance estimate.
      numerator_weighted: :math:`r`, the weighted :math:`\\langle g, x_0 - x\\rangle`.
      count: int32 scalar, steps taken.
    """
    exp_avg: Any  # :math:`m`, EMA of :math:`d g`
    exp_avg_sq: Any  # :math:`v`, EMA of :math:`(d g)^2`
    grad_sum: Any  # :math:`s`, the weighted sum of :math:`d^2 g`-like terms
    params0: Any  # :math:`x_0`
    estim_lr: jax.Array  # :math:`d`, the distance estimate
    numerator_weighted: jax.Array  # :math:`r`, the weighted :math:`\langle g, x_0 - x\rangle`
    count: jax.Array  # type: ignore[assignment]


def prodigy(learning_rate: ScalarOrSchedule = 1.0, betas: tuple[float, float] = (0.9, 0.999),
            beta3: float | None = None, eps: float = 1e-8, estim_lr0: float = 1e-6,
            estim_lr_coef: float = 1.0, weight_decay: float = 0.0,
            safeguard_warmup: bool = False) -> GradientTransformation:
    """Prodigy (Algorithm 4 of the paper, Adam form, decoupled weight decay).

    With :math:`d` the current estimate, :math:`\\gamma_t` the learning rate (schedule) and
    :math:`\\hat\\eta = d\\,\\gamma_t \\sqrt{1-\\beta_2^t}/(1-\\beta_1^t)`:
    :math:`m \\leftarrow \\beta_1 m + (1-\\beta_1) d g`,
    :math:`v \\leftarrow \\beta_2 v + (1-\\beta_2) d^2 g^2`,
    :math:`s \\leftarrow \\beta_3 s + \\hat\\eta\\, d g / d_0` (:math:`d\\,d g/d_0` with
    ``safeguard_warmup``), :math:`r \\leftarrow \\beta_3 r + (d/d_0)\\hat\\eta\\langle g,
    x_0 - x\\rangle`, :math:`d \\leftarrow \\max(d, c\\, r/\\|s\\|_1)`, and the update
    :math:`-\\hat\\eta\\,(m/(\\sqrt v + d'\\epsilon) + \\lambda x)` (:math:`\\hat\\eta` with the
    previous :math:`d`, :math:`d'` the new one).

    Args:
      learning_rate: :math:`\\gamma`, a multiplier of the estimated step (1 is the method).
      betas: :math:`(\\beta_1, \\beta_2)`.
      beta3: EMA of the D estimate's sums (default :math:`\\sqrt{\\beta_2}`).
      eps: added to :math:`\\sqrt v` (scaled by d).
      estim_lr0: :math:`d_0`, the initial estimate.
      estim_lr_coef: :math:`c`, multiplies the estimate.
      weight_decay: :math:`\\lambda`, decoupled.
      safeguard_warmup: drop the learning rate from :math:`s` (for warmup schedules).

    Example:
      >>> import jax.numpy as jnp
      >>> from cairn.optim import contrib
      >>> tx = contrib.prodigy()
      >>> p = jnp.array([1.0, -1.0])
      >>> s = tx.init(p)
      >>> for _ in range(10):
      ...     u, s = tx.update(p, s, p)   # gradient of |p|^2 / 2
      ...     p = p + u
      >>> bool(s.estim_lr > 10 * 1e-6)   # d grows geometrically from d0 = 1e-6
      True
    """
    _validate.check("prodigy", learning_rate=learning_rate, eps=eps, weight_decay=weight_decay)
    beta1, beta2 = betas
    b3 = beta2 ** 0.5 if beta3 is None else beta3

    def init(params: Any) -> ProdigyState:
        dt = _tree.dtype(params, "lowest")
        z = jax.tree.map(jnp.zeros_like, params)
        return ProdigyState(z, z, z, params, jnp.asarray(estim_lr0, dt), jnp.zeros([], dt),
                            jnp.zeros([], jnp.int32))

    @mark_extra
    def update(updates: Any, state: ProdigyState, params: Any = None,
               **extra: Any) -> tuple[Any, ProdigyState]:
        del extra
        if params is None:
            raise ValueError("prodigy needs `params` in update(updates, state, params)")
        t = safe_increment(state.count)
        gamma = learning_rate(state.count) if callable(learning_rate) else learning_rate
        d = state.estim_lr
        step = jnp.asarray(d * gamma * (1 - beta2 ** t) ** 0.5 / (1 - beta1 ** t), d.dtype)
        dg = jax.tree.map(lambda g: d * g, updates)
        m = jax.tree.map(lambda a, x: beta1 * a + (1 - beta1) * x, state.exp_avg, dg)
        v = jax.tree.map(lambda a, x: beta2 * a + (1 - beta2) * x * x, state.exp_avg_sq, dg)
        weight = d if safeguard_warmup else step
        s = jax.tree.map(lambda a, x: b3 * a + weight * x / estim_lr0, state.grad_sum, dg)
        moved = _tree.vdot(updates, _tree.sub(state.params0, params))
        r = b3 * state.numerator_weighted + d / estim_lr0 * step * moved
        d_new = jnp.maximum(d, estim_lr_coef * r / _tree.sum(jax.tree.map(jnp.abs, s)))
        out = jax.tree.map(lambda a, b, x: -weight_decay * step * x - step * a / (jnp.sqrt(b)
                                                                               + d_new * eps),
                           m, v, params)
        return out, ProdigyState(m, v, s, state.params0, d_new, r, t)

    return GradientTransformation(init, update)


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
