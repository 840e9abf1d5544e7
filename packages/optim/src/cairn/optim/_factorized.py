"""Factored second moments: Adafactor (``scale_by_factored_rms`` and ``adafactor``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cairn.optim import _validate
from cairn.optim._adding import add_decayed_weights
from cairn.optim._base import (
    GradientTransformation,
    ScalarOrSchedule,
    chain,
    mark_extra,
    need_params,
)
from cairn.optim._clipping import clip_by_block_rms
from cairn.optim._momentum import ema
from cairn.optim._packed_state import safe_increment
from cairn.optim._placement import full_like_param, replicated_like, zeros_for_axes
from cairn.optim._scaling import learning_rate_step, scale, scale_by_param_block_rms
from cairn.optim._types import resolve_annotations

__all__ = ["scale_by_factored_rms", "adafactor"]


class FactoredState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]
    v_row: object
    v_col: object
    v: object


def _factored_dims(shape, factored, min_dim):
    if not factored or len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < min_dim:
        return None
    return int(order[-2]), int(order[-1])


def _decay_rate_pow(i, exponent=0.8):
    t = jnp.asarray(i + 1, jnp.float32)
    return 1.0 - t ** (-exponent)


def scale_by_factored_rms(factored: bool = True, decay_rate: float = 0.8, step_offset: int = 0,
                          min_dim_size_to_factor: int = 128, epsilon: float = 1e-30,
                          decay_rate_fn: Callable[[jax.Array, float],
                          jax.Array] = _decay_rate_pow) -> GradientTransformation:
    """Adafactor scaling (Shazeer & Stern 2018).

    With :math:`\\beta_t = 1-(t+1)^{-0.8}` and :math:`G = g^2+\\epsilon`: for matrices whose two
    largest dims are >= ``min_dim_size_to_factor``, :math:`R_t = \\beta_t R_{t-1} + (1-\\beta_t)
    \\mathrm{mean}_{cols}(G)`, :math:`C_t` likewise over rows, and
    :math:`u = g / \\sqrt{R_t C_t / \\mathrm{mean}(R_t)}`; otherwise
    :math:`v_t = \\beta_t v_{t-1} + (1-\\beta_t) G`, :math:`u = g/\\sqrt{v_t}`.

    Args:
      factored: factor the second moment of large enough matrices (False keeps a full one per leaf).
      decay_rate: the exponent of :math:`\\beta_t = 1-(t+1)^{-c}` (0.8 above).
      step_offset: subtracted from the step count before the decay is computed.
      min_dim_size_to_factor: a leaf is factored only when its two largest dims are at least this.
      epsilon: :math:`\\epsilon`, added to :math:`g^2`.
      decay_rate_fn: ``fn(step, decay_rate) -> beta_t``, the decay schedule (the default is the
        formula above).
    """
    _validate.check("scale_by_factored_rms", {"step_offset": _validate.COUNT, "epsilon": _validate.NONNEG},
                    decay_rate=decay_rate, step_offset=step_offset,
                    min_dim_size_to_factor=min_dim_size_to_factor, epsilon=epsilon)

    def init(params):
        def per(p):
            # each factor takes the parameter's sharding along the axes it keeps
            dims = _factored_dims(p.shape, factored, min_dim_size_to_factor)
            z1 = replicated_like(p, jnp.zeros((1,), p.dtype))
            if dims is not None:
                d1, d0 = dims
                axes = range(p.ndim)
                return (zeros_for_axes(p, [a for a in axes if a != d0]),
                        zeros_for_axes(p, [a for a in axes if a != d1]), z1)
            return z1, z1, full_like_param(p)

        leaves, td = jax.tree_util.tree_flatten(params)
        parts = [per(p) for p in leaves]
        return FactoredState(jnp.zeros([], jnp.int32),
                             jax.tree_util.tree_unflatten(td, [q[0] for q in parts]),
                             jax.tree_util.tree_unflatten(td, [q[1] for q in parts]),
                             jax.tree_util.tree_unflatten(td, [q[2] for q in parts]))

    @mark_extra
    def update(updates, state, params=None, **extra):
        need_params(params, "scale_by_factored_rms")
        beta = decay_rate_fn(state.count - step_offset, decay_rate)
        gl, td = jax.tree_util.tree_flatten(updates)
        rows = td.flatten_up_to(state.v_row)  # type: ignore[attr-defined]
        cols = td.flatten_up_to(state.v_col)  # type: ignore[attr-defined]
        vs = td.flatten_up_to(state.v)  # type: ignore[attr-defined]
        outs, nr, nc, nv = [], [], [], []
        for g, vr, vc, v in zip(gl, rows, cols, vs):
            dims = _factored_dims(g.shape, factored, min_dim_size_to_factor)
            g2 = jnp.real(jnp.conj(g) * g) + epsilon
            if dims is not None:
                d1, d0 = dims
                r = (beta * vr + (1.0 - beta) * jnp.mean(g2, axis=d0)).astype(vr.dtype)
                c = (beta * vc + (1.0 - beta) * jnp.mean(g2, axis=d1)).astype(vc.dtype)
                rd1 = d1 - 1 if d1 > d0 else d1
                row_factor = (r / jnp.mean(r, axis=rd1, keepdims=True)) ** -0.5
                col_factor = c ** -0.5
                out = g * jnp.expand_dims(row_factor, d0) * jnp.expand_dims(col_factor, d1)
                nr.append(r)
                nc.append(c)
                nv.append(v)
            else:
                nv_ = (beta * v + (1.0 - beta) * g2).astype(v.dtype)
                out = g * nv_ ** -0.5
                nr.append(vr)
                nc.append(vc)
                nv.append(nv_)
            outs.append(out.astype(g.dtype))
        un = lambda xs: jax.tree_util.tree_unflatten(td, xs)  # noqa: E731
        return un(outs), FactoredState(safe_increment(state.count), un(nr), un(nc), un(nv))

    return GradientTransformation(init, update)


def adafactor(learning_rate: ScalarOrSchedule | None = None, min_dim_size_to_factor: int = 128,
              decay_rate: float = 0.8,
              decay_offset: int = 0, multiply_by_parameter_scale: bool = True,
              clipping_threshold: float = 1.0,
              momentum: float | None = None,
              dtype_momentum: jax.typing.DTypeLike | None = "float32",
              weight_decay_rate: ScalarOrSchedule | None = None,
              eps: float = 1e-30,
              factored: bool = True, weight_decay_mask: Any = None) -> GradientTransformation:
    """Adafactor: factored RMS scaling (:func:`scale_by_factored_rms`), block-RMS clipping,
    learning rate, scaling by the parameter RMS, optional momentum and weight decay, then
    :math:`u \\leftarrow -u`.

    Args:
      learning_rate: a float or a schedule; None leaves the update unscaled by a learning rate.
      min_dim_size_to_factor: a leaf is factored only when both of its two largest dims are at least
        this.
      decay_rate: exponent of the second-moment decay :math:`1 - t^{-c}`.
      decay_offset: subtracted from the step count in the decay (for fine-tuning a pretrained
        state).
      multiply_by_parameter_scale: scale updates by the parameter's block RMS.
      clipping_threshold: clip each update's block RMS to this; None turns clipping off.
      momentum: EMA decay of the updates; None for no momentum.
      dtype_momentum: dtype of the momentum accumulator.
      weight_decay_rate: weight decay added after the learning rate; None for none.
      eps: regularises the squared gradient.
      factored: use the factored second moment (False keeps a full one per leaf).
      weight_decay_mask: which leaves get weight decay (see :func:`add_decayed_weights`); None means
        all.
    """
    _validate.check(
        "adafactor", {"learning_rate": _validate.LR},  # None: no learning-rate step
        learning_rate=learning_rate, min_dim_size_to_factor=min_dim_size_to_factor,
        decay_rate=decay_rate, decay_offset=decay_offset, clipping_threshold=clipping_threshold,
        momentum=momentum, weight_decay_rate=weight_decay_rate, eps=eps,
    )
    txs = [scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor,
                                    eps)]
    if clipping_threshold is not None:
        txs.append(clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        txs.append(learning_rate_step(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        txs.append(scale_by_param_block_rms())
    if momentum is not None:
        txs.append(ema(momentum, debias=False, accumulator_dtype=dtype_momentum))
    if weight_decay_rate is not None:
        txs.append(add_decayed_weights(weight_decay_rate, weight_decay_mask))
    txs.append(scale(-1))
    return chain(*txs)


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
