r"""Adan, the adaptive Nesterov momentum algorithm (Xie et al., 2022).

With :math:`\Delta_t = g_t - g_{t-1}` (:math:`\Delta_1 = 0`: no previous gradient) and
Optax's decay convention (:math:`\beta` weighs the old value, defaults 0.98, 0.92, 0.99):

.. math::

    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) \Delta_t,\quad
    n_t = \beta_3 n_{t-1} + (1-\beta_3) \bigl(g_t + \beta_2\Delta_t\bigr)^2

    u_t = \frac{\hat m_t + \beta_2\hat v_t}{\sqrt{\hat n_t + \epsilon_\text{root}} + \epsilon}

with the bias corrections :math:`\hat x_t = x_t / (1 - \beta^t)`. This is the paper's
Algorithm 1 (whose :math:`\beta_k^\text{paper}` is our :math:`1 - \beta_k`, so its
:math:`1 - \beta_2^\text{paper}` is our :math:`\beta_2`) and the authors' implementation.
Optax 0.2.8 writes :math:`1 - \beta_2` for those two coefficients (0.08 instead of 0.92 by
default), so its numbers differ from ours. :func:`adan` adds decoupled weight decay
:math:`\lambda\theta` (the authors' ``no_prox`` variant, as Optax; the paper's proximal
form divides by :math:`1 + \lambda\eta`) and scales by :math:`-\eta`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _validate
from cairn.optim._adding import add_decayed_weights
from cairn.optim._base import GradientTransformation, ScalarOrSchedule, chain, mark_extra
from cairn.optim._packed_state import safe_increment
from cairn.optim._placement import full_like_param
from cairn.optim._scaling import learning_rate_step
from cairn.optim._types import resolve_annotations

__all__ = ["ScaleByAdanState", "adan", "scale_by_adan"]


class ScaleByAdanState(NamedTuple):
    """Optax's fields: the moments ``m``, ``v``, ``n``, the previous gradient ``g`` and the
    step count ``t`` (each moment a tree with the params' structure).

    Args:
      m: the gradient EMA.
      v: the EMA of gradient differences :math:`g_t - g_{t-1}`.
      n: the EMA of the squared term.
      g: the previous gradient.
      t: int32 scalar, steps taken.
    """

    m: Any
    v: Any
    n: Any
    g: Any
    t: jax.Array


def scale_by_adan(b1: float = 0.98, b2: float = 0.92, b3: float = 0.99, eps: float = 1e-8,
                  eps_root: float = 0.0) -> GradientTransformation:
    r"""Rescale updates by Adan's moments (module docstring): :math:`u_t =
    (\hat m_t + \beta_2\hat v_t)/(\sqrt{\hat n_t + \epsilon_\text{root}} + \epsilon)`.

    Args:
      b1: decay of the gradient EMA :math:`m`, in ``[0, 1)``.
      b2: decay of the gradient-difference EMA :math:`v`, in ``[0, 1)``.
      b3: decay of the squared-term EMA :math:`n`, in ``[0, 1)``.
      eps: added to the denominator.
      eps_root: added inside the square root.
    """
    _validate.check("scale_by_adan", {"b3": _validate.BETA}, b1=b1, b2=b2, b3=b3, eps=eps,
                    eps_root=eps_root)

    def init(params):
        m, v, n, g = (jax.tree.map(full_like_param, params) for _ in range(4))
        return ScaleByAdanState(m, v, n, g, jnp.zeros([], jnp.int32))

    @mark_extra
    def update(updates, state, params=None, **extra):
        del params
        t = safe_increment(state.t)
        first = state.t == 0
        def debias(x, b):
            return x / (1 - jnp.asarray(b, x.dtype) ** t.astype(x.dtype))

        def leaf(g, m, v, n, g_prev):
            diff = jnp.where(first, jnp.zeros_like(g), g - g_prev)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * diff
            sq = g + b2 * diff
            n = b3 * n + (1 - b3) * jnp.real(jnp.conj(sq) * sq)
            u = (debias(m, b1) + b2 * debias(v, b2)) / (jnp.sqrt(debias(n, b3) + eps_root) + eps)
            return u.astype(g.dtype), m, v, n

        out = jax.tree.map(leaf, updates, state.m, state.v, state.n, state.g)
        td: Any = jax.tree.structure(updates)
        u, m, v, n = (td.unflatten(x) for x in zip(*td.flatten_up_to(out), strict=True)) \
            if td.num_leaves else (updates,) * 4
        return u, ScaleByAdanState(m, v, n, updates, t)

    return GradientTransformation(init, update)


def adan(learning_rate: ScalarOrSchedule, b1: float = 0.98, b2: float = 0.92, b3: float = 0.99,
         eps: float = 1e-8, eps_root: float = 1e-8, weight_decay: ScalarOrSchedule = 0.0,
         mask: Any = None) -> GradientTransformation:
    r"""Adan (Xie et al., 2022): :func:`scale_by_adan`, then :math:`+\lambda\theta` where
    ``mask`` selects, then :math:`\times(-\eta)`; Optax's defaults (``eps_root=1e-8``
    here, 0 in ``scale_by_adan``, as Optax).

    Args:
      learning_rate: :math:`\eta`, a float or a schedule.
      b1: see :func:`scale_by_adan`.
      b2: see :func:`scale_by_adan`.
      b3: see :func:`scale_by_adan`.
      eps: see :func:`scale_by_adan`.
      eps_root: see :func:`scale_by_adan`.
      weight_decay: :math:`\lambda` (decoupled), a float or a schedule.
      mask: where the weight decay applies (pytree, callable or path rules).

    >>> import jax, jax.numpy as jnp
    >>> from cairn import optim
    >>> f = lambda x: x @ x
    >>> solver, params = optim.adan(1e-1), jnp.array([1.0, 2.0, 3.0])
    >>> state = solver.init(params)
    >>> for _ in range(2):
    ...     updates, state = solver.update(jax.grad(f)(params), state, params)
    ...     params = optim.apply_updates(params, updates)
    >>> print(f"{float(f(params)):.2E}")
    1.17E+01
    """
    _validate.check("adan", {"b3": _validate.BETA}, learning_rate=learning_rate, b1=b1, b2=b2,
                    b3=b3, eps=eps, eps_root=eps_root, weight_decay=weight_decay)
    return chain(scale_by_adan(b1, b2, b3, eps, eps_root), add_decayed_weights(weight_decay, mask),
                 learning_rate_step(learning_rate))


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
