"""``reduce_on_plateau``: scale the updates down when a monitored value stops improving."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _tree
from cairn.optim._base import GradientTransformation, mark_extra
from cairn.optim._packed_state import safe_increment

__all__ = ["ReduceLROnPlateauState", "reduce_on_plateau"]


class ReduceLROnPlateauState(NamedTuple):
    """The state of :func:`reduce_on_plateau`.

    Args:
      scale: float scalar, the factor applied to the updates.
      best_value: float scalar, the best window-averaged value seen so far.
      plateau_count: int32 scalar, accumulation windows without improvement.
      cooldown_count: int32 scalar, windows left before plateaus count again.
      count: int32 scalar, values accumulated in the current window.
      avg_value: float scalar, the running mean of the current window.
    """
    scale: jax.Array  # the factor applied to the updates
    best_value: jax.Array  # best accumulated value seen so far
    plateau_count: jax.Array  # accumulation windows without improvement
    cooldown_count: jax.Array  # windows left before plateaus count again
    count: jax.Array  # type: ignore[assignment]  # values accumulated in this window
    avg_value: jax.Array  # running mean of the current window


def _check(factor: float, rtol: float, atol: float) -> None:
    if not 0.0 < factor < 1.0:
        raise ValueError(f"reduce_on_plateau: factor must be in (0, 1), got {factor}")
    if rtol < 0.0 or atol < 0.0 or (rtol == 0.0 and atol == 0.0):
        raise ValueError("reduce_on_plateau: rtol and atol must be >= 0 and one of them > 0, "
                         f"got rtol={rtol}, atol={atol}")
    if rtol > 1.0:
        raise ValueError(f"reduce_on_plateau: rtol must be <= 1, got {rtol}")


def reduce_on_plateau(factor: float = 0.1, patience: int = 10, rtol: float = 1e-4,
                      atol: float = 0.0, cooldown: int = 0, accumulation_size: int = 1,
                      min_scale: float = 0.0) -> GradientTransformation:
    """Multiply the updates by ``scale``; shrink ``scale`` by ``factor`` on a plateau.

    ``update(updates, state, params, value=loss)`` accumulates ``value``; every
    ``accumulation_size`` calls the window's mean :math:`\\bar v` is compared with the best
    so far: it improves when :math:`\\bar v < (1-\\text{rtol})\\,v_{best} - \\text{atol}`.
    After ``patience`` windows without improvement (outside a cooldown),
    :math:`s \\leftarrow \\max(s\\cdot\\text{factor}, \\text{min\\_scale})` and ``cooldown``
    windows follow during which plateaus are not counted. Chain it after the optimizer
    (``chain(adam(lr), reduce_on_plateau())``) to scale the learning rate.

    Args:
      factor: in (0, 1), the shrink factor.
      patience: windows without improvement before shrinking.
      rtol: relative improvement threshold (>= 0, <= 1; not 0 together with ``atol``).
      atol: absolute improvement threshold (>= 0).
      cooldown: windows to wait after a shrink.
      accumulation_size: values averaged per window.
      min_scale: lower bound of ``scale``.

    Raises:
      ValueError: ``factor``, ``rtol`` or ``atol`` out of range; ``update`` without ``value``.

    Example:
      >>> import jax.numpy as jnp
      >>> from cairn.optim import contrib
      >>> tx = contrib.reduce_on_plateau(factor=0.5, patience=2)
      >>> g = jnp.ones(2)
      >>> s = tx.init(g)
      >>> for v in (1.0, 1.0, 1.0):
      ...     u, s = tx.update(g, s, value=v)
      >>> float(s.scale), u.tolist()   # value 1.0 improved once, then 2 windows flat
      (0.5, [0.5, 0.5])
    """
    _check(factor, rtol, atol)

    def init(params: Any) -> ReduceLROnPlateauState:
        lo, hi = _tree.dtype(params, "lowest"), _tree.dtype(params, "highest")
        return ReduceLROnPlateauState(jnp.asarray(1.0, lo), jnp.asarray(jnp.inf, hi),
                                      jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32),
                                      jnp.zeros([], jnp.int32), jnp.asarray(0.0, hi))

    def end_window(st: ReduceLROnPlateauState) -> ReduceLROnPlateauState:
        improved = st.avg_value < (1 - rtol) * st.best_value - atol
        best = jnp.where(improved, st.avg_value, st.best_value).astype(st.best_value.dtype)
        plateau = jnp.where(improved, 0, safe_increment(st.plateau_count))
        cooling = st.cooldown_count > 0
        hit = jnp.logical_and(~cooling, plateau == patience)
        new_scale = jnp.where(hit, jnp.maximum(st.scale * factor, min_scale),
                              jnp.where(cooling, st.scale, jnp.maximum(st.scale, min_scale)))
        plateau = jnp.where(cooling | hit, 0, plateau).astype(jnp.int32)
        cool = jnp.where(cooling, st.cooldown_count - 1, jnp.where(hit, cooldown, 0))
        return ReduceLROnPlateauState(new_scale.astype(st.scale.dtype), best, plateau,
                                      cool.astype(jnp.int32), jnp.zeros([], jnp.int32),
                                      jnp.zeros([], st.avg_value.dtype))

    @mark_extra
    def update(updates: Any, state: ReduceLROnPlateauState, params: Any = None, *,
               value: Any = None, **extra: Any) -> tuple[Any, ReduceLROnPlateauState]:
        del params, extra
        if value is None:
            raise ValueError("reduce_on_plateau: update(...) needs the monitored value, "
                             "e.g. tx.update(grads, state, params, value=loss)")
        n = safe_increment(state.count)
        avg = (state.count * state.avg_value + jnp.asarray(value).astype(state.avg_value.dtype)) / n
        st = state._replace(avg_value=avg.astype(state.avg_value.dtype), count=n)
        st = jax.lax.cond(n == accumulation_size, end_window, lambda x: x, st)
        return jax.tree.map(lambda g: st.scale * g, updates), st

    return GradientTransformation(init, update)
