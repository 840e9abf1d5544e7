"""Momentum (``trace``, ``ema``) and the SGD family built on it: ``sgd``, ``signum``,
``noisy_sgd``, ``lars``."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _validate
from cairn.optim._adding import add_decayed_weights, add_noise
from cairn.optim._base import (
    GradientTransformation,
    ScalarOrSchedule,
    chain,
    identity,
    packed_transformation,
)
from cairn.optim._masking import masked
from cairn.optim._packed_state import (
    BiasCorrection,
    check_moment,
    safe_increment,
    state_zeros,
    step_buffers,
)
from cairn.optim._packing import Packed
from cairn.optim._scaling import learning_rate_step, scale_by_sign, scale_by_trust_ratio
from cairn.optim._types import resolve_annotations

__all__ = ["trace", "ema", "sgd", "signum", "noisy_sgd", "lars"]


class TraceState(NamedTuple):
    trace: Packed


def trace(decay: float, nesterov: bool = False,
          accumulator_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """Momentum: :math:`f_t = g_t + \\mu f_{t-1}`, :math:`u_t = f_t`
    (Nesterov: :math:`u_t = g_t + \\mu f_t`).

    Args:
      decay: :math:`\\mu`, the momentum.
      nesterov: return :math:`g_t + \\mu f_t` instead of :math:`f_t`.
      accumulator_dtype: dtype of :math:`f`; None keeps the parameters' dtype.
    """

    _validate.check("trace", decay=decay)
    def init(layout, params):
        return TraceState(state_zeros(params, layout, accumulator_dtype, offsets=True))

    def update(u, state, p=None, **extra):
        check_moment(u, state.trace, "trace")

        def step(g, t0):
            f = g + decay * t0
            return (g + decay * f if nesterov else f), f

        out, new = step_buffers(u, (state.trace,), step)
        return out, TraceState(*new)

    return packed_transformation(init, update, name="trace")


class EmaState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]
    ema: Packed


def ema(decay: float, debias: bool = True,
        accumulator_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """:math:`e_t = \\delta e_{t-1} + (1-\\delta) g_t`, :math:`u_t = e_t/(1-\\delta^t)` when
    ``debias`` else :math:`e_t`.

    Args:
      decay: :math:`\\delta`, in ``[0, 1)`` with ``debias`` (``[0, 1]`` without).
      debias: divide by :math:`1-\\delta^t` so early averages are not biased towards 0.
      accumulator_dtype: dtype of :math:`e`; None keeps the parameters' dtype.
    """

    _validate.check("ema", {"decay": _validate.BETA if debias else _validate.UNIT}, decay=decay)
    def init(layout, params):
        return EmaState(jnp.zeros([], jnp.int32),
                        state_zeros(params, layout, accumulator_dtype, offsets=True))

    def update(u, state, p=None, **extra):
        check_moment(u, state.ema, "ema")
        count = safe_increment(state.count)
        bc = BiasCorrection(count)

        def step(g, e0):
            e = (1 - decay) * g + decay * e0
            return (e / bc(decay, e.dtype) if debias else e), e

        out, (ema_,) = step_buffers(u, (state.ema,), step)
        return out, EmaState(count, ema_)

    return packed_transformation(init, update, name="ema")


def sgd(learning_rate: ScalarOrSchedule, momentum: float | None = None, nesterov: bool = False,
        accumulator_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """SGD: :math:`u = -\\eta g`; with momentum :math:`f_t = g_t + \\mu f_{t-1}`, :math:`u = -\\eta f_t`
    (Nesterov: :math:`u = -\\eta (g_t + \\mu f_t)`).

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      momentum: :math:`\\mu`; None for plain SGD.
      nesterov: use Nesterov momentum.
      accumulator_dtype: dtype of the momentum buffer; None keeps the parameters' dtype.

    >>> import jax.numpy as jnp
    >>> tx = sgd(0.1)
    >>> u, _ = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.zeros(2)}))
    >>> u["w"].tolist()
    [-0.10000000149011612, -0.10000000149011612]
    """
    _validate.check("sgd", learning_rate=learning_rate, momentum=momentum)
    head = (trace(momentum, nesterov, accumulator_dtype) if momentum is not None
            else identity())
    return chain(head, learning_rate_step(learning_rate))


def signum(learning_rate: ScalarOrSchedule, beta: float = 0.9,
           accumulator_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """Signum: :math:`u = -\\eta\\,\\mathrm{sign}(m_t)` with :math:`m_t` an EMA of gradients.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      beta: decay of the gradient EMA :math:`m_t` (not debiased).
      accumulator_dtype: dtype of :math:`m_t`; None keeps the parameters' dtype.
    """
    _validate.check("signum", learning_rate=learning_rate, beta=beta)
    return chain(ema(beta, debias=False, accumulator_dtype=accumulator_dtype),
                 scale_by_sign(), learning_rate_step(learning_rate))


def noisy_sgd(learning_rate: ScalarOrSchedule, eta: float = 0.01, gamma: float = 0.55,
              key: jax.Array | int | None = None, *,
              seed: int | None = None) -> GradientTransformation:
    """Noisy SGD: :math:`u = -\\eta(g + \\mathcal N(0, \\eta_n/(1+t)^\\gamma))`.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      eta: :math:`\\eta_n`, the noise variance at the first step.
      gamma: :math:`\\gamma`, the decay exponent of the noise variance.
      key: the PRNG key of the noise (a ``jax.random`` key or an int seed).
      seed: an int seed used when ``key`` is None (0 when both are None).
    """
    _validate.check("noisy_sgd", learning_rate=learning_rate, eta=eta, gamma=gamma)
    if key is None and seed is None:
        seed = 0
    return chain(add_noise(eta, gamma, key, seed=seed), learning_rate_step(learning_rate))


def lars(learning_rate: ScalarOrSchedule, weight_decay: ScalarOrSchedule = 0.0,
         weight_decay_mask: Any = True, trust_coefficient: float = 0.001,
         eps: float = 0.0, trust_ratio_mask: bool = True, momentum: float = 0.9,
         nesterov: bool = False) -> GradientTransformation:
    """LARS: decay, per-leaf trust ratio :math:`c\\|\\theta\\|/(\\|u\\|+\\epsilon)`, :math:`-\\eta`,
    then momentum.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      weight_decay: :math:`\\lambda`, added to the gradient as :math:`\\lambda\\theta` first; a
        float or a schedule.
      weight_decay_mask: which leaves get weight decay (see :func:`add_decayed_weights`); True means
        all.
      trust_coefficient: :math:`c`, multiplies the trust ratio.
      eps: :math:`\\epsilon`, added to the update norm in the trust ratio.
      trust_ratio_mask: which leaves are rescaled by the trust ratio (a mask as for :func:`masked`);
        True means all.
      momentum: decay of the momentum applied last (see :func:`trace`).
      nesterov: use Nesterov momentum.
    """
    _validate.check(
        "lars",
        learning_rate=learning_rate, weight_decay=weight_decay,
        trust_coefficient=trust_coefficient, eps=eps, momentum=momentum,
    )
    return chain(add_decayed_weights(weight_decay, weight_decay_mask),
                 masked(scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps),
                        trust_ratio_mask),
                 learning_rate_step(learning_rate), trace(momentum, nesterov))


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
