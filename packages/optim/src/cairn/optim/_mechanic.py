"""Mechanic (Cutkosky, Defazio and Mehta 2023): learn a scale for any base optimizer's steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _tree
from cairn.optim._base import GradientTransformation, call_update, mark_extra
from cairn.optim._packed_state import safe_increment

__all__ = ["MechanicState", "mechanize"]


class MechanicState(NamedTuple):
    """The state of :func:`mechanize`.

    Args:
      base_optimizer_state: the base optimizer's state.
      count: int32 scalar, steps taken.
      r: per :math:`\\beta_j`, the discounted reward.
      m: per :math:`\\beta_j`, the discounted maximum of :math:`|h|`.
      v: per :math:`\\beta_j`, the discounted sum of :math:`h^2`.
      s: per :math:`\\beta_j`, the scale bets (their sum scales the base updates).
      x0: the reference point (the params at the first update).
    """
    base_optimizer_state: Any
    count: jax.Array  # type: ignore[assignment]
    r: jax.Array  # per beta: discounted reward
    m: jax.Array  # per beta: discounted max |h|
    v: jax.Array  # per beta: discounted sum of h^2
    s: jax.Array  # per beta: the scale bets, summed into the learning-rate scale
    x0: Any  # the reference point (the params at the first update)


def mechanize(base_optimizer: GradientTransformation, weight_decay: float = 0.01,
              eps: float = 1e-8, s_init: float = 1e-6,
              num_betas: int = 6) -> GradientTransformation:
    """Run ``base_optimizer`` and rescale its accumulated steps by a learned :math:`S=\\sum_j s_j`.

    The base's updates are summed into :math:`\\Delta` (:math:`x_t = x_0 + S\\,\\Delta_t`).
    Each step, with :math:`\\tilde g = g + \\lambda S\\,\\|g\\|/(\\|x\\|+\\epsilon)\\,x` and
    :math:`h = \\langle \\tilde g, \\Delta_{t-1}\\rangle`, for
    :math:`\\beta_j = 1 - 10^{-j}`: :math:`m_j \\leftarrow \\max(\\beta_j m_j, |h|+\\epsilon)`,
    :math:`v_j \\leftarrow \\beta_j^2 v_j + h^2`,
    :math:`r_j \\leftarrow \\beta_j r_j + \\mathrm{clip}(h, \\pm m_j^{old}) s_j`,
    :math:`s_j = (s_{init} m_j / n + \\max(r_j, 0))/(\\sqrt{v_j}+\\epsilon)`, and the update is
    :math:`x_0 + S\\,\\Delta_t - x_t`.

    Args:
      base_optimizer: any transformation (its updates are the direction; it sees the raw
        gradient and extra args).
      weight_decay: :math:`\\lambda`, scaled as above.
      eps: small constant in the norms and divisions.
      s_init: initial scale of every bet.
      num_betas: number of :math:`\\beta_j` (``j = 1..num_betas``).

    Raises:
      ValueError: ``update`` without ``params``.

    Example:
      >>> import jax.numpy as jnp
      >>> from cairn import optim
      >>> tx = optim.contrib.mechanize(optim.sgd(0.1))
      >>> p = jnp.array([1.0])
      >>> s = tx.init(p)
      >>> u, s = tx.update(p, s, p)
      >>> s.s.shape
      (6,)
    """
    def init(params: Any) -> MechanicState:
        dt = _tree.dtype(params, "lowest")
        z = jnp.zeros([num_betas], dt)
        return MechanicState(base_optimizer.init(params), jnp.zeros([], jnp.int32), z, z, z,
                             jnp.full([num_betas], s_init, dt), params)

    @mark_extra
    def update(updates: Any, state: MechanicState, params: Any = None,
               **extra: Any) -> tuple[Any, MechanicState]:
        if params is None:
            raise ValueError("mechanize needs `params` in update(updates, state, params)")
        step, base_state = call_update(base_optimizer, updates, state.base_optimizer_state,
                                       params, extra)
        x0 = jax.lax.cond(state.count == 0, lambda: params, lambda: state.x0)
        total = jnp.sum(state.s)
        coef = weight_decay * total * _tree.norm(updates) / (_tree.norm(params) + eps)
        g = jax.tree.map(lambda gi, pi: gi + coef * pi, updates, params)
        delta_prev = jax.tree.map(lambda x, a: (a - x) / (total + eps), params, x0)
        delta = jax.tree.map(lambda a, b: a - b, delta_prev, step)
        h = _tree.vdot(g, delta_prev)
        betas = jnp.asarray([1.0 - 0.1 ** j for j in range(1, num_betas + 1)], state.s.dtype)
        clipped = jnp.clip(h, -state.m, state.m)
        m = jnp.maximum(betas * state.m, jnp.abs(h) + eps)
        v = betas ** 2 * state.v + h ** 2
        r = betas * state.r + clipped * state.s
        s = (s_init / num_betas * m + jnp.maximum(r, 0.0)) / (jnp.sqrt(v) + eps)
        new_params = jax.tree.map(lambda a, d: a - jnp.sum(s) * d, x0, delta)
        out = jax.tree.map(lambda n, o: n - o, new_params, params)
        return out, MechanicState(base_state, safe_increment(state.count), r, m, v, s, x0)

    return GradientTransformation(init, update)
