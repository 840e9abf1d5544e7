"""Second-moment scaling: RMSProp (``scale_by_rms``, centred ``scale_by_stddev``), Adagrad
(``scale_by_rss``), AdaDelta, SM3, and the optimizers built on them (``rmsprop``,
``adagrad``, ``adadelta``, ``sm3``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _validate
from cairn.optim._adding import add_decayed_weights
from cairn.optim._base import (
    GradientTransformation,
    ScalarOrSchedule,
    chain,
    identity,
    mark_extra,
    packed_transformation,
)
from cairn.optim._momentum import trace
from cairn.optim._packed_state import (
    BiasCorrection,
    abs_sq,
    check_moment,
    safe_increment,
    state_zeros,
    step_buffers,
)
from cairn.optim._packing import Packed
from cairn.optim._placement import full_like_param, zeros_for_axes
from cairn.optim._scaling import learning_rate_step
from cairn.optim._types import resolve_annotations

__all__ = [
    "scale_by_rms", "scale_by_stddev", "scale_by_rss", "scale_by_adadelta", "scale_by_sm3",
    "rmsprop", "adagrad", "adadelta", "sm3",
]


class ScaleByRmsState(NamedTuple):
    nu: Packed


class ScaleByRmsWithCountState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]
    nu: Packed


def scale_by_rms(decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0,
                 eps_in_sqrt: bool = True,
                 bias_correction: bool = False, *,
                 nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """RMSProp scaling: :math:`v_t = \\rho v_{t-1} + (1-\\rho) g_t^2`,
    :math:`u_t = g_t/\\sqrt{v_t+\\epsilon}` (or :math:`g_t/(\\sqrt{v_t}+\\epsilon)` when
    ``eps_in_sqrt=False``), :math:`v_t` bias-corrected when ``bias_correction``.

    Args:
      decay: :math:`\\rho`, decay of the squared-gradient EMA.
      eps: :math:`\\epsilon`, inside the square root (outside with ``eps_in_sqrt=False``).
      initial_scale: the starting value of :math:`v`.
      eps_in_sqrt: put ``eps`` inside the square root.
      bias_correction: divide :math:`v_t` by :math:`1-\\rho^t` (the state then keeps a step count).
      nu_dtype: dtype of :math:`v`; None keeps the parameters' dtype.
    """

    _validate.check("scale_by_rms", decay=decay, eps=eps, initial_scale=initial_scale)
    def init(layout, params):
        nu = state_zeros(params, layout, nu_dtype, initial_scale, offsets=True)
        if bias_correction:
            return ScaleByRmsWithCountState(jnp.zeros([], jnp.int32), nu)
        return ScaleByRmsState(nu)

    def update(u, state, p=None, **extra):
        check_moment(u, state.nu, "scale_by_rms")
        count: Any = safe_increment(state.count) if bias_correction else None
        bc: Any = BiasCorrection(count) if bias_correction else None

        def step(g, v0):
            v = (1 - decay) * abs_sq(g) + decay * v0
            v_hat = v / bc(decay, v.dtype) if bias_correction else v
            sc = jax.lax.rsqrt(v_hat + eps) if eps_in_sqrt else 1 / (jnp.sqrt(v_hat) + eps)
            return sc * g, v

        out, (nu,) = step_buffers(u, (state.nu,), step)
        new = ScaleByRmsWithCountState(count, nu) if bias_correction else ScaleByRmsState(nu)
        return out, new

    return packed_transformation(init, update, name="scale_by_rms")


class ScaleByRStdDevState(NamedTuple):
    mu: Packed
    nu: Packed


class ScaleByRStdDevWithCountState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]
    mu: Packed
    nu: Packed


def scale_by_stddev(decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0,
                    eps_in_sqrt: bool = True,
                    bias_correction: bool = False, *, mu_dtype: jax.typing.DTypeLike | None = None,
                    nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """Centred RMSProp: :math:`u_t = g_t/\\sqrt{v_t - m_t^2 + \\epsilon}` with EMAs
    :math:`m_t` of :math:`g` and :math:`v_t` of :math:`g^2` (decay :math:`\\rho`).

    Args:
      decay: :math:`\\rho`, decay of both EMAs.
      eps: :math:`\\epsilon`, inside the square root (outside with ``eps_in_sqrt=False``).
      initial_scale: the starting value of :math:`v`.
      eps_in_sqrt: put ``eps`` inside the square root.
      bias_correction: divide the EMAs by :math:`1-\\rho^t` (the state then keeps a step count).
      mu_dtype: dtype of :math:`m`; None keeps the parameters' dtype.
      nu_dtype: dtype of :math:`v`; None keeps the parameters' dtype.
    """

    _validate.check("scale_by_stddev", decay=decay, eps=eps, initial_scale=initial_scale)
    def init(layout, params):
        mu = state_zeros(params, layout, mu_dtype, offsets=True)
        nu = state_zeros(params, layout, nu_dtype, initial_scale)
        if bias_correction:
            return ScaleByRStdDevWithCountState(jnp.zeros([], jnp.int32), mu, nu)
        return ScaleByRStdDevState(mu, nu)

    def update(u, state, p=None, **extra):
        check_moment(u, state.mu, "scale_by_stddev")
        count: Any = safe_increment(state.count) if bias_correction else None
        bc: Any = BiasCorrection(count) if bias_correction else None

        def step(g, m0, v0):
            m = (1 - decay) * g + decay * m0
            v = (1 - decay) * abs_sq(g) + decay * v0
            if bias_correction:
                mh, vh = m / bc(decay, m.dtype), v / bc(decay, v.dtype)
            else:
                mh, vh = m, v
            if eps_in_sqrt:
                sc = jax.lax.rsqrt(vh - abs_sq(mh) + eps)
            else:
                sc = 1 / (jnp.sqrt(vh - abs_sq(mh)) + eps)
            return sc * g, m, v

        out, (mu, nu) = step_buffers(u, (state.mu, state.nu), step)
        new = (ScaleByRStdDevWithCountState(count, mu, nu) if bias_correction
               else ScaleByRStdDevState(mu, nu))
        return out, new

    return packed_transformation(init, update, name="scale_by_stddev")


class ScaleByRssState(NamedTuple):
    sum_of_squares: Packed


def scale_by_rss(initial_accumulator_value: float = 0.1,
                 eps: float = 1e-7) -> GradientTransformation:
    """Adagrad scaling: :math:`s_t = s_{t-1} + g_t^2`, :math:`u_t = g_t/\\sqrt{s_t+\\epsilon}`
    (0 where :math:`s_t = 0`).

    Args:
      initial_accumulator_value: the starting value of :math:`s`.
      eps: :math:`\\epsilon`, added inside the square root.
    """

    _validate.check("scale_by_rss", initial_accumulator_value=initial_accumulator_value, eps=eps)
    def init(layout, params):
        return ScaleByRssState(state_zeros(params, layout, None, initial_accumulator_value,
                                            offsets=True))

    def update(u, state, p=None, **extra):
        check_moment(u, state.sum_of_squares, "scale_by_rss")

        def step(g, s0):
            s = abs_sq(g) + s0
            return jnp.where(s > 0, jax.lax.rsqrt(s + eps), 0.0) * g, s

        out, new = step_buffers(u, (state.sum_of_squares,), step)
        return out, ScaleByRssState(*new)

    return packed_transformation(init, update, name="scale_by_rss")


class ScaleByAdaDeltaState(NamedTuple):
    e_g: Packed
    e_x: Packed


def scale_by_adadelta(rho: float = 0.9, eps: float = 1e-6) -> GradientTransformation:
    """AdaDelta: :math:`E[g^2]_t = \\rho E[g^2]_{t-1} + (1-\\rho) g_t^2`,
    :math:`u_t = \\sqrt{E[x^2]_{t-1}+\\epsilon}/\\sqrt{E[g^2]_t+\\epsilon}\\,g_t`,
    :math:`E[x^2]_t = \\rho E[x^2]_{t-1} + (1-\\rho) u_t^2`.

    Args:
      rho: :math:`\\rho`, decay of both EMAs, in ``[0, 1)``.
      eps: :math:`\\epsilon`, added inside both square roots.
    """

    _validate.check("scale_by_adadelta", rho=rho, eps=eps)
    def init(layout, params):
        return ScaleByAdaDeltaState(state_zeros(params, layout, offsets=True),
                                    state_zeros(params, layout))

    def update(u, state, p=None, **extra):
        check_moment(u, state.e_g, "scale_by_adadelta")

        def step(g, eg0, ex0):
            eg = (1 - rho) * abs_sq(g) + rho * eg0
            out = jnp.sqrt(ex0 + eps) / jnp.sqrt(eg + eps) * g
            ex = (1 - rho) * abs_sq(out) + rho * ex0
            return out, eg, ex

        out, new = step_buffers(u, (state.e_g, state.e_x), step)
        return out, ScaleByAdaDeltaState(*new)

    return packed_transformation(init, update, name="scale_by_adadelta")


class ScaleBySM3State(NamedTuple):
    mu: object
    nu: object


def scale_by_sm3(b1: float = 0.9, b2: float = 1.0, eps: float = 1e-8) -> GradientTransformation:
    """SM3 (Anil et al. 2019): one accumulator per axis; the per-element accumulator is
    :math:`a = g^2 + \\min_i \\mu_i` (broadcast), :math:`\\mu_i \\leftarrow \\max` of :math:`a`
    over the other axes, update :math:`\\nu_t = \\beta_1 \\nu_{t-1} + (1-\\beta_1) g/\\sqrt{a+\\epsilon}`.

    Args:
      b1: :math:`\\beta_1`, decay of the update EMA :math:`\\nu`.
      b2: decay of the per-axis accumulators, in ``[0, 1]`` (1 sums as in the paper).
      eps: :math:`\\epsilon`, added inside the square root.
    """
    _validate.check("scale_by_sm3", {"b2": _validate.UNIT}, b1=b1, b2=b2, eps=eps)

    def init(params):
        def per(p):
            return [zeros_for_axes(p, [i]) for i in range(p.ndim)]

        leaves, td = jax.tree_util.tree_flatten(params)
        mu = [per(p) for p in leaves]
        return ScaleBySM3State(jax.tree_util.tree_unflatten(td, mu),
                               jax.tree.map(full_like_param, params))

    @mark_extra
    def update(updates, state, params=None, **extra):
        gl, td = jax.tree_util.tree_flatten(updates)
        mus = td.flatten_up_to(state.mu)  # type: ignore[attr-defined]
        nus = td.flatten_up_to(state.nu)  # type: ignore[attr-defined]
        new_mu, new_nu = [], []
        c0 = (1.0 - b2) if b2 != 1.0 else 1.0
        for g, ms, n0 in zip(gl, mus, nus):
            exp = [jnp.reshape(ms[i], [1] * i + [g.shape[i]] + [1] * (g.ndim - i - 1))
                   for i in range(g.ndim)]
            if g.ndim < 2:
                acc = c0 * g ** 2 + b2 * (exp[0] if exp else 0.0)
            else:
                mn = exp[0]
                for e in exp[1:]:
                    mn = jnp.minimum(mn, e)
                acc = c0 * g ** 2 + b2 * mn
            inv = jnp.where(acc > 0, jax.lax.rsqrt(acc + eps), 0.0)
            n = ((1 - b1) * (g * inv) + b1 * n0).astype(n0.dtype)
            if g.ndim < 2:
                nm = [acc] if g.ndim == 1 else []
            else:
                nm = [jnp.max(acc, axis=tuple(j for j in range(g.ndim) if j != i))
                      for i in range(g.ndim)]
            new_mu.append([m.astype(g.dtype) for m in nm])
            new_nu.append(n)
        un = lambda xs: jax.tree_util.tree_unflatten(td, xs)  # noqa: E731
        nu = un(new_nu)
        return nu, ScaleBySM3State(un(new_mu), nu)

    return GradientTransformation(init, update)


def rmsprop(learning_rate: ScalarOrSchedule, decay: float = 0.9, eps: float = 1e-8,
            initial_scale: float = 0.0, eps_in_sqrt: bool = True,
            centered: bool = False, momentum: float | None = None, nesterov: bool = False,
            bias_correction: bool = False) -> GradientTransformation:
    """RMSProp (optionally centred, with momentum).

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      decay: :math:`\\rho`, decay of the squared-gradient EMA.
      eps: :math:`\\epsilon`, inside the square root (or outside with ``eps_in_sqrt=False``).
      initial_scale: the starting value of the squared-gradient EMA.
      eps_in_sqrt: put ``eps`` inside the square root.
      centered: subtract the squared mean gradient (centred RMSProp, :func:`scale_by_stddev`).
      momentum: decay of momentum applied after the learning rate; None for none.
      nesterov: use Nesterov momentum.
      bias_correction: divide the EMAs by :math:`1-\\rho^t`.
    """
    _validate.check(
        "rmsprop",
        learning_rate=learning_rate, decay=decay, eps=eps, initial_scale=initial_scale,
        momentum=momentum,
    )
    if centered:
        head = scale_by_stddev(decay, eps, initial_scale, eps_in_sqrt, bias_correction)
    else:
        head = scale_by_rms(decay, eps, initial_scale, eps_in_sqrt, bias_correction)
    tail = trace(momentum, nesterov) if momentum is not None else identity()
    return chain(head, learning_rate_step(learning_rate), tail)


def adagrad(learning_rate: ScalarOrSchedule, initial_accumulator_value: float = 0.1,
            eps: float = 1e-7) -> GradientTransformation:
    """Adagrad: :math:`s_t = s_{t-1} + g_t^2`, :math:`u = -\\eta g_t/\\sqrt{s_t+\\epsilon}`.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      initial_accumulator_value: the starting value of :math:`s`.
      eps: :math:`\\epsilon` inside the square root.
    """
    _validate.check(
        "adagrad",
        learning_rate=learning_rate, initial_accumulator_value=initial_accumulator_value, eps=eps,
    )
    return chain(scale_by_rss(initial_accumulator_value, eps), learning_rate_step(learning_rate))


def adadelta(learning_rate: ScalarOrSchedule | None = None, rho: float = 0.9, eps: float = 1e-6,
             weight_decay: ScalarOrSchedule = 0.0,
             weight_decay_mask: Any = None) -> GradientTransformation:
    """AdaDelta (Zeiler 2012), with optional weight decay added to the gradient first;
    ``learning_rate=None`` means 1.

    Args:
      learning_rate: a float or a schedule; None means 1.
      rho: decay of the squared-gradient and squared-update EMAs, in ``[0, 1)``.
      eps: added inside both square roots.
      weight_decay: :math:`\\lambda`, added to the gradient as :math:`\\lambda\\theta` first (0
        turns it off); a float or a schedule.
      weight_decay_mask: which leaves get weight decay (see :func:`add_decayed_weights`); None means
        all.
    """
    _validate.check(
        "adadelta", {"learning_rate": _validate.LR},  # None means 1
        learning_rate=learning_rate, rho=rho, eps=eps, weight_decay=weight_decay,
    )
    return chain(add_decayed_weights(weight_decay, weight_decay_mask),
                 scale_by_adadelta(rho, eps),
                 learning_rate_step(1.0 if learning_rate is None else learning_rate))


def sm3(learning_rate: ScalarOrSchedule, momentum: float = 0.9) -> GradientTransformation:
    """SM3 with momentum, times :math:`-\\eta`.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      momentum: :math:`\\beta_1` of :func:`scale_by_sm3`.
    """
    _validate.check("sm3", learning_rate=learning_rate, momentum=momentum)
    return chain(scale_by_sm3(momentum), learning_rate_step(learning_rate))


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
