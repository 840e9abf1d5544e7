"""Scaling: by a constant, the learning rate, a schedule, the sign, Rprop step sizes, and
the per-leaf parameter norms (trust ratio, block RMS / norm); gradient centralisation.
The optimizers built from them alone: ``sign_sgd``, ``rprop``, ``fromage``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _packing as pk
from cairn.optim import _validate
from cairn.optim._adding import add_decayed_weights
from cairn.optim._base import (
    EmptyState,
    GradientTransformation,
    ScalarOrSchedule,
    chain,
    eval_schedule,
    identity,
    packed_transformation,
    per_leaf,
)
from cairn.optim._packed_state import (
    check_moment,
    current_value,
    safe_increment,
    state_zeros,
    step_buffers,
)
from cairn.optim._packing import Packed
from cairn.optim._types import resolve_annotations

__all__ = [
    "scale", "scale_by_learning_rate", "scale_by_schedule", "scale_by_sign", "scale_by_rprop",
    "scale_by_trust_ratio", "scale_by_param_block_rms", "scale_by_param_block_norm",
    "centralize", "sign_sgd", "rprop", "fromage",
]


def _scale_updates(u: Packed, fn, arg) -> Packed:
    """``fn(buffer, arg)`` on every buffer; a pending weight-decay term stays pending
    (``fn`` is then applied after it, leaf by leaf at the unpack)."""
    if isinstance(u, pk.PendingDecay):
        return u.scaled(fn, arg)
    return u.map(lambda g: fn(g, arg))


# The scalar comes first in these products (and the decay term first in its sum): in a
# leaf's unpack kernel the compiler then numbers the scalars before the slice and its
# runtime offsets, the same way for every leaf, so same-shape leaves share one kernel.
# (Both operations are commutative in IEEE arithmetic: the values are unchanged.)
def _times_cast(g, s):
    if isinstance(s, jax.Array) and s.ndim == 0:
        # lax directly: the same two primitives as ``s.astype(g.dtype) * g`` without
        # jax.numpy's per-call dispatch (this runs once per leaf at the unpack)
        return jax.lax.mul(jax.lax.convert_element_type(s, g.dtype), g)
    return s.astype(g.dtype) * g


def _times_step_size(g, step_size):
    return (step_size * g).astype(g.dtype)


def scale(step_size: float | jax.Array) -> GradientTransformation:
    """:math:`u \\leftarrow \\alpha\\,u`.

    Args:
      step_size: :math:`\\alpha`, a float or a scalar array multiplying every update.

    >>> import jax.numpy as jnp
    >>> tx = scale(-0.1)
    >>> tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))[0]["w"].tolist()
    [-0.10000000149011612, -0.10000000149011612]
    """

    _validate.check("scale", step_size=step_size)
    def update(u, state, p=None, **extra):
        return _scale_updates(u, _times_step_size, step_size), state

    return packed_transformation(lambda layout, params: EmptyState(), update, name="scale")


class ScaleByLearningRateState(NamedTuple):
    """``count`` of steps (the schedule's argument: advanced only when ``learning_rate`` is a
    schedule, so a constant costs no work per step) and the ``learning_rate`` used at the
    last step (traced).

    Args:
      count: int32 scalar, steps taken (advanced only when ``learning_rate`` is a schedule).
      learning_rate: float scalar, the learning rate used at the last step.
    """

    count: jax.Array  # type: ignore[assignment]
    learning_rate: jax.Array


def scale_by_learning_rate(learning_rate: ScalarOrSchedule | None = None, *,
                           flip_sign: bool = True) -> GradientTransformation:
    """:math:`u \\leftarrow -\\eta_t\\,u` (or :math:`+\\eta_t u` when ``flip_sign=False``).

    ``learning_rate=None`` means no scaling (an :func:`identity`, as in Optax).

    ``learning_rate`` is a float or a schedule ``step -> value``. The value lives in
    the state (``state.learning_rate``), so it is a traced value: changing it with
    :func:`set_hyperparams` does not recompile, and :func:`get_hyperparams` reads it.

    Args:
      learning_rate: :math:`\\eta_t`, a float or a schedule ``step -> value``; None returns
        :func:`identity`.
      flip_sign: multiply by :math:`-\\eta_t` (descent) if True, by :math:`+\\eta_t` if False.
    """
    _validate.check("scale_by_learning_rate", {"learning_rate": _validate.LR}, learning_rate=learning_rate)
    return learning_rate_step(learning_rate, flip_sign=flip_sign)


def learning_rate_step(learning_rate: ScalarOrSchedule | None, *, flip_sign: bool = True) -> GradientTransformation:
    """:func:`scale_by_learning_rate` without its check: the step an optimizer factory chains
    after it has checked ``learning_rate`` under its own name (``_validate.check``), so a
    learning rate is validated once, at the call the user made."""
    if learning_rate is None:
        return identity()
    sign = -1.0 if flip_sign else 1.0

    def init(layout, params):
        lr = eval_schedule("learning_rate", learning_rate, jnp.zeros([], jnp.int32))
        return ScaleByLearningRateState(jnp.zeros([], jnp.int32), lr)

    def update(u, state, p=None, **extra):
        lr = current_value("learning_rate", learning_rate, state.learning_rate, state.count)
        out = _scale_updates(u, _times_cast, sign * lr)
        count = safe_increment(state.count) if callable(learning_rate) else state.count
        return out, ScaleByLearningRateState(count, lr)

    return packed_transformation(init, update, name="scale_by_learning_rate")


class ScaleByScheduleState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]


def scale_by_schedule(step_size_fn: Callable[[jax.Array], jax.Array]) -> GradientTransformation:
    """:math:`u \\leftarrow s(t)\\,u` with ``s`` a schedule evaluated at the step count.

    Args:
      step_size_fn: the schedule ``s``, ``step -> value`` (the step an int32 scalar).

    Raises:
      TypeError: ``step_size_fn`` is not callable.
    """
    if not callable(step_size_fn):
        raise TypeError(f"step_size_fn must be callable (step -> value), got "
                        f"{type(step_size_fn).__name__}")

    def init(layout, params):
        eval_schedule("step_size_fn", step_size_fn, jnp.zeros([], jnp.int32))
        return ScaleByScheduleState(jnp.zeros([], jnp.int32))

    def update(u, state, p=None, **extra):
        s = eval_schedule("step_size_fn", step_size_fn, state.count)
        return (_scale_updates(u, _times_cast, s),
                ScaleByScheduleState(safe_increment(state.count)))

    return packed_transformation(init, update, name="scale_by_schedule")


def scale_by_sign() -> GradientTransformation:
    """:math:`u \\leftarrow \\mathrm{sign}(u)`."""

    def update(u, state, p=None, **extra):
        return u.map(jnp.sign), state

    return packed_transformation(lambda layout, params: EmptyState(), update, name="scale_by_sign")


class ScaleByRpropState(NamedTuple):
    step_sizes: Packed
    prev_updates: Packed


def scale_by_rprop(learning_rate: float, eta_minus: float = 0.5, eta_plus: float = 1.2,
                   min_step_size: float = 1e-6,
                   max_step_size: float = 50.0) -> GradientTransformation:
    """Rprop: per-element step sizes grow by ``eta_plus`` when the gradient keeps its sign,
    shrink by ``eta_minus`` when it flips (clipped to [min, max]); the update is
    :math:`\\mathrm{step}\\cdot\\mathrm{sign}(g)`, and 0 right after a sign flip.

    Args:
      learning_rate: the initial per-element step size.
      eta_minus: factor (< 1) applied to the step when the gradient flips sign.
      eta_plus: factor (> 1) applied to the step when the gradient keeps its sign.
      min_step_size: the smallest step size.
      max_step_size: the largest step size.
    """
    _validate.check(
        "scale_by_rprop",
        learning_rate=learning_rate, eta_minus=eta_minus, eta_plus=eta_plus,
        min_step_size=min_step_size, max_step_size=max_step_size,
    )
    return _rprop_steps(learning_rate, eta_minus, eta_plus, min_step_size, max_step_size)


def _rprop_steps(learning_rate: float, eta_minus: float, eta_plus: float, min_step_size: float,
                 max_step_size: float) -> GradientTransformation:
    """:func:`scale_by_rprop` once its arguments are checked (by it or by :func:`rprop`)."""

    def init(layout, params):
        return ScaleByRpropState(state_zeros(params, layout, None, learning_rate, offsets=True),
                                 state_zeros(params, layout))

    def update(u, state, p=None, **extra):
        check_moment(u, state.step_sizes, "scale_by_rprop")

        def step(g, st0, pv0):
            s = g * pv0
            st = jnp.where(s == 0, st0, jnp.clip(st0 * jnp.where(s > 0, eta_plus, eta_minus),
                                                 min_step_size, max_step_size))
            pv = jnp.where(s < 0, jnp.zeros_like(g), st * jnp.sign(g))
            return jnp.where(s < 0, jnp.zeros_like(pv0), pv0), st, pv

        out, new = step_buffers(u, (state.step_sizes, state.prev_updates), step)
        return out, ScaleByRpropState(*new)

    return packed_transformation(init, update, name="scale_by_rprop")


def _safe_norm(x, min_norm, axis=None, keepdims=False):
    """Norm with a gradient-safe floor: ``max(||x||, min_norm)``."""
    sq = jnp.sum(jnp.real(jnp.conj(x) * x), axis=axis, keepdims=keepdims)
    norm = jnp.sqrt(jnp.where(sq > min_norm ** 2, sq, 1.0))
    return jnp.where(sq > min_norm ** 2, norm, min_norm)


def scale_by_trust_ratio(min_norm: float = 0.0, trust_coefficient: float = 1.0,
                         eps: float = 0.0) -> GradientTransformation:
    """LARS/LAMB trust ratio per leaf: :math:`u \\leftarrow u\\cdot c\\,\\|\\theta\\|/(\\|u\\|+\\epsilon)`
    (1 where either norm is 0).

    Args:
      min_norm: the smallest parameter norm used.
      trust_coefficient: :math:`c`, multiplies the ratio.
      eps: :math:`\\epsilon`, added to the update norm.
    """
    _validate.check("scale_by_trust_ratio", min_norm=min_norm, trust_coefficient=trust_coefficient, eps=eps)

    def f(u, p):
        pn = _safe_norm(p, min_norm)
        un = _safe_norm(u, min_norm)
        ratio = trust_coefficient * pn / (un + eps)
        ratio = jnp.where((pn == 0.0) | (un == 0.0), jnp.array(1.0, p.dtype), ratio)
        return (u * ratio).astype(u.dtype)

    return per_leaf("scale_by_trust_ratio", f, needs_params=True)


def scale_by_param_block_rms(min_scale: float = 1e-3) -> GradientTransformation:
    """:math:`u \\leftarrow u\\cdot\\max(\\mathrm{rms}(\\theta), s_{min})` per leaf.

    Args:
      min_scale: :math:`s_{min} \\ge 0`, the smallest factor (for zero or tiny parameters).
    """
    _validate.check("scale_by_param_block_rms", {"min_scale": _validate.NONNEG}, min_scale=min_scale)

    def f(u, p):
        rms = jnp.sqrt(jnp.mean(jnp.real(jnp.conj(p) * p)))
        return (u * jnp.maximum(rms, min_scale)).astype(u.dtype)

    return per_leaf("scale_by_param_block_rms", f, needs_params=True)


def scale_by_param_block_norm(min_scale: float = 1e-3) -> GradientTransformation:
    """:math:`u \\leftarrow u\\cdot\\max(\\|\\theta\\|_2, s_{min})` per leaf.

    Args:
      min_scale: :math:`s_{min} \\ge 0`, the smallest factor (for zero or tiny parameters).
    """
    _validate.check("scale_by_param_block_norm", {"min_scale": _validate.NONNEG}, min_scale=min_scale)

    def f(u, p):
        return (u * _safe_norm(p, min_scale)).astype(u.dtype)

    return per_leaf("scale_by_param_block_norm", f, needs_params=True)


def centralize() -> GradientTransformation:
    """Gradient centralisation: subtract the mean over all axes but the first, for ndim > 1."""

    def f(u):
        if u.ndim <= 1:
            return u
        return u - jnp.mean(u, axis=tuple(range(1, u.ndim)), keepdims=True)

    return per_leaf("centralize", f, needs_params=False)


def sign_sgd(learning_rate: ScalarOrSchedule) -> GradientTransformation:
    """signSGD: :math:`u = -\\eta\\,\\mathrm{sign}(g)`.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
    """
    _validate.check("sign_sgd", learning_rate=learning_rate)
    return chain(scale_by_sign(), learning_rate_step(learning_rate))


def rprop(learning_rate: float, eta_minus: float = 0.5, eta_plus: float = 1.2,
          min_step_size: float = 1e-6, max_step_size: float = 50.0) -> GradientTransformation:
    """Rprop (sign-based adaptive step sizes), :math:`u = -\\mathrm{step}\\cdot\\mathrm{sign}(g)`.

    Args:
      learning_rate: the initial per-element step size.
      eta_minus: factor (< 1) applied to the step when the gradient changes sign.
      eta_plus: factor (> 1) applied to the step when the gradient keeps its sign.
      min_step_size: the smallest step size.
      max_step_size: the largest step size.
    """
    _validate.check(
        "rprop",
        learning_rate=learning_rate, eta_minus=eta_minus, eta_plus=eta_plus,
        min_step_size=min_step_size, max_step_size=max_step_size,
    )
    return chain(_rprop_steps(learning_rate, eta_minus, eta_plus, min_step_size,
                              max_step_size), scale(-1.0))


def fromage(learning_rate: ScalarOrSchedule, min_norm: float = 1e-6) -> GradientTransformation:
    """Fromage: trust-ratio step :math:`-\\eta/\\sqrt{1+\\eta^2}`, weights shrunk by
    :math:`1/\\sqrt{1+\\eta^2}`.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      min_norm: the smallest norm used in the trust ratio (for zero parameters or updates).
    """
    _validate.check("fromage", learning_rate=learning_rate, min_norm=min_norm)
    if callable(learning_rate):
        def mult(c):
            return 1 / (1 + learning_rate(c) ** 2) ** 0.5

        return chain(scale_by_trust_ratio(min_norm),
                     learning_rate_step(lambda c: mult(c) * learning_rate(c)),
                     add_decayed_weights(lambda c: mult(c) - 1))
    m = 1 / (1 + learning_rate ** 2) ** 0.5
    return chain(scale_by_trust_ratio(min_norm), learning_rate_step(learning_rate * m),
                 add_decayed_weights(m - 1))


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
