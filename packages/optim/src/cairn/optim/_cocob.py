"""COCOB-Backprop (Orabona and Tommasi 2017): coin betting, no learning rate to tune."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _validate
from cairn.optim._adding import add_decayed_weights
from cairn.optim._base import GradientTransformation, ScalarOrSchedule, chain
from cairn.optim._scaling import learning_rate_step
from cairn.optim._types import resolve_annotations

__all__ = ["COCOBState", "scale_by_cocob", "cocob"]


class COCOBState(NamedTuple):
    """The state of :func:`scale_by_cocob`.

    Args:
      init_particles: the params at init, :math:`w_1`.
      cumulative_gradients: :math:`\\theta = -\\sum g`, per leaf.
      scale: :math:`L`, the largest :math:`|g|` seen (at least ``eps``), per element.
      subgradients: :math:`G = \\sum |g|`, per element.
      reward: :math:`R`, the wealth won so far, per element.
    """
    init_particles: Any  # the params at init, :math:`w_1`
    cumulative_gradients: Any  # :math:`\theta = -\sum g`
    scale: Any  # :math:`L`, the largest |g| seen (at least eps)
    subgradients: Any  # :math:`G = \sum |g|`
    reward: Any  # :math:`R`, the wealth won so far


def scale_by_cocob(alpha: float = 100.0, eps: float = 1e-8) -> GradientTransformation:
    """COCOB-Backprop, per coordinate, returning the update :math:`w_{t+1} - w_t`.

    With :math:`g` the gradient: :math:`L \\leftarrow \\max(L, |g|)`, :math:`G \\leftarrow G+|g|`,
    :math:`R \\leftarrow \\max(R - g(w - w_1), 0)`, :math:`\\theta \\leftarrow \\theta - g`, and
    :math:`w_{t+1} = w_1 + \\frac{\\theta}{L\\max(G+L, \\alpha L)}(L+R)`.

    Args:
      alpha: bounds the bet early on (the paper's :math:`\\alpha`, 100).
      eps: initial :math:`L` (avoids 0/0 before the first gradient).
    """
    def init(params: Any) -> COCOBState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return COCOBState(params, zeros, jax.tree.map(lambda p: jnp.full_like(p, eps), params),
                          zeros, zeros)

    def update(updates: Any, state: COCOBState, params: Any = None) -> tuple[Any, COCOBState]:
        if params is None:
            raise ValueError("scale_by_cocob needs `params` in update(updates, state, params)")
        big_l = jax.tree.map(lambda s, g: jnp.maximum(s, jnp.abs(g)), state.scale, updates)
        big_g = jax.tree.map(lambda s, g: s + jnp.abs(g), state.subgradients, updates)
        reward = jax.tree.map(lambda r, g, w, w1: jnp.maximum(r - g * (w - w1), 0),
                              state.reward, updates, params, state.init_particles)
        theta = jax.tree.map(lambda c, g: c - g, state.cumulative_gradients, updates)

        def new_w(w, w1, th, lv, gv, rv):
            return w1 + th / (lv * jnp.maximum(gv + lv, alpha * lv)) * (lv + rv) - w

        out = jax.tree.map(new_w, params, state.init_particles, theta, big_l, big_g, reward)
        return out, COCOBState(state.init_particles, theta, big_l, big_g, reward)

    return GradientTransformation(init, update)


def cocob(learning_rate: ScalarOrSchedule = 1.0, alpha: float = 100.0, eps: float = 1e-8,
          weight_decay: float = 0.0, mask: Any = None) -> GradientTransformation:
    """COCOB on the (weight-decayed, learning-rate scaled) gradient.

    ``chain(add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate,
    flip_sign=False), scale_by_cocob(alpha, eps))``: ``learning_rate`` multiplies the
    gradient COCOB sees (1 is the method's own setting).

    Args:
      learning_rate: multiplies the gradient COCOB sees (1, the default, is the method itself); a
        float or a schedule.
      alpha: bounds the bet early on (the paper's :math:`\\alpha`).
      eps: the initial :math:`L` (avoids 0/0 before the first gradient).
      weight_decay: :math:`\\lambda`, added to the gradient as :math:`\\lambda\\theta` first (0 for
        none).
      mask: which leaves get weight decay (see :func:`add_decayed_weights`); None means all.

    Example:
      >>> import jax.numpy as jnp
      >>> from cairn.optim import contrib
      >>> tx = contrib.cocob()
      >>> p = jnp.array([1.0])
      >>> u, _ = tx.update(jnp.array([2.0]), tx.init(p), p)
      >>> [round(x, 6) for x in u.tolist()]
      [-0.01]
    """
    _validate.check("cocob", learning_rate=learning_rate, eps=eps, weight_decay=weight_decay)
    return chain(add_decayed_weights(weight_decay, mask),
                 learning_rate_step(learning_rate, flip_sign=False),
                 scale_by_cocob(alpha, eps))


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
