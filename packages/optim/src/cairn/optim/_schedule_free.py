"""Schedule-free optimisation (Defazio et al. 2024)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _validate
from cairn.optim._adding import add_decayed_weights
from cairn.optim._base import (
    GradientTransformation,
    ScalarOrSchedule,
    call_update,
    chain,
    identity,
    mark_extra,
)
from cairn.optim._packed_state import safe_increment
from cairn.optim._rms import scale_by_rms
from cairn.optim._scaling import learning_rate_step
from cairn.optim._types import resolve_annotations

__all__ = ["schedule_free", "schedule_free_adamw", "schedule_free_sgd",
           "schedule_free_eval_params", "ScheduleFreeState"]


class ScheduleFreeState(NamedTuple):
    """The state of :func:`schedule_free`.

    Args:
      b1: float32 scalar, :math:`\\beta_1`, the interpolation weight between :math:`x` and
        :math:`z`.
      weight_sum: :math:`\\sum_i \\gamma_{max,i}^p`, the sum of the averaging weights so far.
      step_count: int32 scalar, steps taken (the schedule's argument).
      max_lr: :math:`\\gamma_{max}`, the largest learning rate seen so far.
      base_optimizer_state: the base optimizer's state.
      z: the base iterate :math:`z_t`, a pytree like the params.
    """
    b1: jax.Array
    weight_sum: jax.Array
    step_count: jax.Array
    max_lr: jax.Array
    base_optimizer_state: Any
    z: Any


def _warmup(learning_rate, warmup_steps):
    if warmup_steps is None:
        return learning_rate

    def sched(step):
        frac = jnp.clip(jnp.asarray(step, jnp.float32) / warmup_steps, 0.0, 1.0)
        return frac * learning_rate

    return sched


def schedule_free(base_optimizer: GradientTransformation, learning_rate: ScalarOrSchedule,
                  b1: float = 0.9,
                  weight_lr_power: float = 2.0,
                  state_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """Wrap ``base_optimizer`` (which moves :math:`z`) in the schedule-free averaging.

    :math:`z_{t+1} = z_t + \\mathrm{base}(g_t)`, :math:`c_{t+1} = \\gamma_{max}^p/\\sum_{i\\le t+1}
    \\gamma_{max,i}^p`, :math:`x_{t+1} = (1-c_{t+1})x_t + c_{t+1}z_{t+1}` and the returned params
    are :math:`y_{t+1} = \\beta_1 x_{t+1} + (1-\\beta_1) z_{t+1}` (as an update ``y_{t+1}-y_t``).

    Args:
      base_optimizer: the optimizer that moves :math:`z` (its learning rate included).
      learning_rate: :math:`\\gamma`, the same learning rate the base uses, a float or a schedule
        (it sets the averaging weights).
      b1: :math:`\\beta_1`, the interpolation between :math:`x` and :math:`z` in the returned
        params.
      weight_lr_power: :math:`p`, the power of the largest learning rate so far in the averaging
        weight.
      state_dtype: dtype of :math:`z`; None keeps the parameters' dtype.
    """
    _validate.check(
        "schedule_free",
        learning_rate=learning_rate, b1=b1, weight_lr_power=weight_lr_power,
    )
    return _schedule_free(base_optimizer, learning_rate, b1, weight_lr_power, state_dtype)


def _schedule_free(base_optimizer: GradientTransformation, learning_rate: ScalarOrSchedule, b1: float,
                   weight_lr_power: float, state_dtype: jax.typing.DTypeLike | None) -> GradientTransformation:
    """:func:`schedule_free` once its arguments are checked (by it or by the factories below)."""

    def init(params):
        # The averaging scalars stay float32 even for bf16 params: c_t multiplies O(1)
        # iterates, so bf16 rounding of the weight sum would swamp the O(lr) update.
        pdt = jnp.float32
        z = jax.tree.map(lambda t: jnp.array(t, dtype=state_dtype or t.dtype, copy=True), params)
        return ScheduleFreeState(jnp.asarray(b1, pdt), jnp.zeros([], pdt),
                                 jnp.ones([], jnp.int32), jnp.zeros([], pdt),
                                 base_optimizer.init(params), z)

    @mark_extra
    def update(grads, state, params=None, **extra):
        if params is None:
            raise ValueError("schedule_free needs `params` in update(updates, state, params)")
        lr: Any = learning_rate
        if callable(learning_rate):
            lr = jnp.asarray(learning_rate(state.step_count), state.max_lr.dtype)
        max_lr = jnp.maximum(state.max_lr, lr)
        weight = max_lr ** weight_lr_power
        total = state.weight_sum + weight
        ck = jnp.where(jnp.isnan(weight) | jnp.isnan(total), jnp.full(weight.shape, jnp.nan),
                       jnp.nan_to_num(weight / total, nan=0.0, posinf=jnp.inf))
        base_u, base_s = call_update(base_optimizer, grads, state.base_optimizer_state, params,
                                     extra)
        z = jax.tree.map(lambda zi, ui: (zi + ui).astype(zi.dtype), state.z, base_u)
        prev_x = jax.tree.map(lambda yi, zi: (yi - (1.0 - b1) * zi) / b1, params, state.z)
        x = jax.tree.map(lambda xi, zi: (1.0 - ck) * xi + ck * zi, prev_x, z)
        new_p = jax.tree.map(lambda xi, zi: b1 * xi + (1.0 - b1) * zi, x, z)
        upd = jax.tree.map(lambda n, p: (n - p).astype(p.dtype), new_p, params)
        return upd, ScheduleFreeState(state.b1, total, safe_increment(state.step_count),
                                      max_lr, base_s, z)

    return GradientTransformation(init, update)


def schedule_free_eval_params(state: ScheduleFreeState, params: Any) -> Any:
    """The averaged iterate :math:`x = (y - (1-\\beta_1) z)/\\beta_1` to evaluate with,
    in the dtype of ``params`` (computed in float32 at least, since ``b1`` is kept in float32).

    Args:
      state: the :class:`~cairn.optim.contrib.ScheduleFreeState` (found in the optimizer state).
      params: the current (training) params :math:`y`.

    Returns:
      a pytree like ``params``.
    """
    def x(yi, zi):
        return ((yi - (1.0 - state.b1) * zi) / state.b1).astype(jnp.asarray(yi).dtype)

    return jax.tree.map(x, params, state.z)


def schedule_free_sgd(learning_rate: ScalarOrSchedule = 1.0, warmup_steps: int | None = None,
                      b1: float = 0.9,
                      weight_decay: ScalarOrSchedule | None = None,
                      weight_lr_power: float = 2.0,
                      state_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """Schedule-free SGD (base: SGD with optional decay), optional linear warmup.

    Args:
      learning_rate: :math:`\\gamma`, a float or a schedule.
      warmup_steps: steps of linear warmup from 0 to ``learning_rate``; None for none.
      b1: :math:`\\beta_1` of the schedule-free interpolation.
      weight_decay: :math:`\\lambda`, added to the gradient first; None for none.
      weight_lr_power: :math:`p` of :func:`schedule_free`.
      state_dtype: dtype of :math:`z`; None keeps the parameters' dtype.
    """
    _validate.check(
        "schedule_free_sgd",
        learning_rate=learning_rate, warmup_steps=warmup_steps, b1=b1, weight_decay=weight_decay,
        weight_lr_power=weight_lr_power,
    )
    lr = _warmup(learning_rate, warmup_steps)
    base = chain(identity(), learning_rate_step(lr))  # sgd(lr), its learning rate checked above
    if weight_decay is not None:
        base = chain(add_decayed_weights(weight_decay), base)
    return _schedule_free(base, lr, b1, weight_lr_power, state_dtype)


def schedule_free_adamw(learning_rate: ScalarOrSchedule = 0.0025, warmup_steps: int | None = None,
                        b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                        weight_decay: ScalarOrSchedule = 0.0, weight_lr_power: float = 2.0,
                        state_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """Schedule-free AdamW (base: bias-corrected RMS scaling, decay, learning rate).

    Args:
      learning_rate: :math:`\\gamma`, a float or a schedule.
      warmup_steps: steps of linear warmup from 0 to ``learning_rate``; None for none.
      b1: :math:`\\beta_1` of the schedule-free interpolation.
      b2: decay of the squared-gradient EMA (bias corrected).
      eps: added outside the square root.
      weight_decay: :math:`\\lambda`, decoupled weight decay; a float or a schedule.
      weight_lr_power: :math:`p` of :func:`schedule_free`.
      state_dtype: dtype of :math:`z`; None keeps the parameters' dtype.
    """
    _validate.check(
        "schedule_free_adamw",
        learning_rate=learning_rate, warmup_steps=warmup_steps, b1=b1, b2=b2, eps=eps,
        weight_decay=weight_decay, weight_lr_power=weight_lr_power,
    )
    lr = _warmup(learning_rate, warmup_steps)
    base = chain(scale_by_rms(b2, eps, eps_in_sqrt=False, bias_correction=True),
                 add_decayed_weights(weight_decay), learning_rate_step(lr))
    return _schedule_free(base, lr, b1, weight_lr_power, state_dtype)


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
