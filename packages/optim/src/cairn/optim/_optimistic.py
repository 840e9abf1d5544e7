r"""Optimistic gradient methods for min-max problems (Optax's ``optimistic_*``).

:func:`scale_by_optimistic_gradient` turns the incoming update :math:`g_t` into

.. math:: u_t = (\alpha + \beta)\,g_t - \beta\,g_{t-1},\qquad g_0 := g_1

(the generalised optimistic gradient of Mokhtari et al., 2019; at the first step there is
no previous gradient and :math:`u_1 = \alpha g_1`). :func:`optimistic_gradient_descent`
scales it by :math:`-\eta`; :func:`optimistic_adam_v2` applies it to Adam's direction
(Daskalakis et al., 2017, "Training GANs with Optimism").
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _validate
from cairn.optim._adam import scale_by_adam
from cairn.optim._base import GradientTransformation, ScalarOrSchedule, chain, mark_extra
from cairn.optim._placement import full_like_param
from cairn.optim._scaling import learning_rate_step
from cairn.optim._types import resolve_annotations

__all__ = [
    "ScaleByOptimisticGradientState", "optimistic_adam", "optimistic_adam_v2",
    "optimistic_gradient_descent", "scale_by_optimistic_gradient",
]

_COEF = {"alpha": _validate.FINITE, "beta": _validate.FINITE, "optimism": _validate.FINITE}


class ScaleByOptimisticGradientState(NamedTuple):
    """Optax's fields: whether no step was taken yet, and the previous incoming update.

    Args:
      is_initial_step: bool scalar, True until the first step.
      previous_gradient: the previous incoming update pytree.
    """

    is_initial_step: jax.Array
    previous_gradient: Any


def scale_by_optimistic_gradient(alpha: float = 1.0, beta: float = 1.0) -> GradientTransformation:
    r""":math:`u_t = (\alpha+\beta) g_t - \beta g_{t-1}`, with :math:`g_0 = g_1`.

    Args:
      alpha: the coefficient of the current gradient (finite).
      beta: the negative-momentum coefficient (finite).
    """
    _validate.check("scale_by_optimistic_gradient", _COEF, alpha=alpha, beta=beta)

    def init(params):
        return ScaleByOptimisticGradientState(jnp.array(True),
                                              jax.tree.map(full_like_param, params))

    @mark_extra
    def update(updates, state, params=None, **extra):
        del params

        def leaf(g, prev):
            prev = jnp.where(state.is_initial_step, g, prev.astype(g.dtype))
            return ((alpha + beta) * g - beta * prev).astype(g.dtype)

        out = jax.tree.map(leaf, updates, state.previous_gradient)
        return out, ScaleByOptimisticGradientState(jnp.array(False), updates)

    return GradientTransformation(init, update)


def optimistic_gradient_descent(learning_rate: ScalarOrSchedule, alpha: ScalarOrSchedule = 1.0,
                                beta: ScalarOrSchedule = 1.0) -> GradientTransformation:
    r"""Optimistic gradient descent: :math:`\theta_{t+1} = \theta_t - \eta_t((\alpha+\beta)
    g_t - \beta g_{t-1})`.

    Args:
      learning_rate: :math:`\eta`, a float or a schedule.
      alpha: the coefficient of the current gradient.
      beta: the negative-momentum coefficient.
    """
    _validate.check("optimistic_gradient_descent", _COEF, learning_rate=learning_rate,
                    alpha=alpha, beta=beta)
    return chain(scale_by_optimistic_gradient(alpha, beta), learning_rate_step(learning_rate))  # type: ignore[arg-type]


def optimistic_adam_v2(learning_rate: ScalarOrSchedule, *, alpha: float = 1.0, beta: float = 1.0,
                       b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                       mu_dtype: Any = None, nesterov: bool = True) -> GradientTransformation:
    r"""Optimistic Adam: with Adam's direction :math:`r_t = \hat m_t/(\sqrt{\hat v_t +
    \epsilon_\text{root}} + \epsilon)` (Nesterov by default, as Optax),
    :math:`u_t = -\eta_t\bigl((\alpha+\beta) r_t - \beta r_{t-1}\bigr)`.

    Args:
      learning_rate: :math:`\eta`, a float or a schedule.
      alpha: the coefficient of the current gradient (:func:`scale_by_optimistic_gradient`).
      beta: the negative-momentum coefficient (:func:`scale_by_optimistic_gradient`).
      b1: Adam's, see :func:`scale_by_adam`.
      b2: Adam's, see :func:`scale_by_adam`.
      eps: Adam's, see :func:`scale_by_adam`.
      eps_root: Adam's, see :func:`scale_by_adam`.
      mu_dtype: Adam's, see :func:`scale_by_adam`.
      nesterov: Adam's, see :func:`scale_by_adam`.
    """
    _validate.check("optimistic_adam_v2", _COEF, learning_rate=learning_rate, alpha=alpha,
                    beta=beta, b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 scale_by_optimistic_gradient(alpha, beta), learning_rate_step(learning_rate))


def optimistic_adam(learning_rate: float, optimism: float | None = None, b1: float = 0.9,
                    b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                    mu_dtype: Any = None, *, nesterov: bool = True) -> GradientTransformation:
    r"""Optax's first interface of optimistic Adam (deprecated there in favour of
    :func:`optimistic_adam_v2`, and so here): :math:`u_t = -(\eta + o) r_t + o\,r_{t-1}`
    with :math:`o` = ``optimism`` (default: ``learning_rate``). A schedule is refused, as
    in Optax.

    Args:
      learning_rate: :math:`\eta`, a float.
      optimism: :math:`o`; None means ``learning_rate``.
      b1: Adam's, see :func:`scale_by_adam`.
      b2: Adam's, see :func:`scale_by_adam`.
      eps: Adam's, see :func:`scale_by_adam`.
      eps_root: Adam's, see :func:`scale_by_adam`.
      mu_dtype: Adam's, see :func:`scale_by_adam`.
      nesterov: Adam's, see :func:`scale_by_adam`.
    """
    warnings.warn("`optimistic_adam` is deprecated, use `optimistic_adam_v2` instead",
                  DeprecationWarning, stacklevel=2)
    if callable(learning_rate):
        raise ValueError("optimistic_adam: learning_rate must be a number (this interface "
                         "takes no schedule; optimistic_adam_v2 does)")
    optimism = learning_rate if optimism is None else optimism
    _validate.check("optimistic_adam", _COEF, learning_rate=learning_rate, optimism=optimism,
                    b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 scale_by_optimistic_gradient(learning_rate, optimism), learning_rate_step(1.0))


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
