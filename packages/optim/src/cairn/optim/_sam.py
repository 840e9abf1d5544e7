"""Sharpness-aware minimisation (Foret et al. 2021), in Optax's "look-SAM" form."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _tree
from cairn.optim._base import EmptyState, GradientTransformation, apply_updates, mark_extra

__all__ = ["SAMState", "NormalizeState", "normalize", "sam"]

NormalizeState = EmptyState


def normalize() -> GradientTransformation:
    """:math:`u = g / \\|g\\|` (global norm over the whole tree); SAM's adversarial direction."""
    def init(params: Any) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        del params
        n = _tree.norm(updates)
        return jax.tree.map(lambda g: g / n, updates), state

    return GradientTransformation(init, update)


class SAMState(NamedTuple):
    """The state of :func:`sam`.

    Args:
      steps_since_sync: int32 scalar, steps since the last outer step.
      opt_state: the outer optimizer's state.
      adv_state: the adversarial optimizer's state.
      cache: the outer params while adversarial steps run (None in opaque mode).
    """
    steps_since_sync: jax.Array
    opt_state: Any
    adv_state: Any
    cache: Any  # the outer params while adversarial steps run (None in opaque mode)


def _select(flag: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: flag * x + (1 - flag) * y, a, b)


def sam(optimizer: GradientTransformation, adv_optimizer: GradientTransformation,
        sync_period: int = 2, reset_state: bool = True, opaque_mode: bool = False,
        batch_axis_name: str | None = None) -> GradientTransformation:
    """SAM: ``sync_period - 1`` adversarial ascent steps, then one outer step from the start.

    Transparent mode (default): every call to ``update`` is one step of the loop. The first
    ``sync_period - 1`` calls return *ascent* updates :math:`-\\mathrm{adv}(g)` (so
    ``apply_updates`` moves the params to the adversarial point); the last returns the
    update that takes the params back to the cached outer point :math:`x` and applies
    ``optimizer`` to the gradient at the adversarial point. Opaque mode: one call does the
    whole loop; ``update(..., grad_fn=f)`` with ``f(params, i) -> grads`` evaluates the
    adversarial gradients.

    Args:
      optimizer: the outer optimizer, applied to the gradient at the adversarial point.
      adv_optimizer: the adversary, whose updates are negated into ascent steps; typically
        ``chain(contrib.normalize(), sgd(rho))`` (SAM with radius rho).
      sync_period: calls per outer step: ``sync_period - 1`` ascent steps then one outer step.
      reset_state: re-initialise the adversary's state after each outer step.
      opaque_mode: run the whole loop in one call (needs ``update(..., grad_fn=f)``).
      batch_axis_name: in opaque mode, the mapped axis the adversarial gradients are averaged
        over with ``pmean``; None for none.

    Raises:
      ValueError: ``sync_period < 1``; opaque mode without ``grad_fn``.

    Example:
      >>> import jax.numpy as jnp
      >>> from cairn import optim
      >>> tx = optim.contrib.sam(optim.sgd(0.1), optim.sgd(0.05))
      >>> p = jnp.array([1.0])
      >>> s = tx.init(p)
      >>> u1, s = tx.update(2 * p, s, p)        # ascent: p -> 1 + 0.05 * 2
      >>> p1 = p + u1
      >>> u2, s = tx.update(2 * p1, s, p1)      # back to 1, then sgd on grad at 1.1
      >>> [round(float(x), 5) for x in (p1[0], (p1 + u2)[0])]
      [1.1, 0.78]
    """
    if sync_period < 1:
        raise ValueError(f"sam: sync_period must be >= 1, got {sync_period}")

    def init(params: Any) -> SAMState:
        return SAMState(jnp.zeros([], jnp.int32), optimizer.init(params),
                        adv_optimizer.init(params), None if opaque_mode else params)

    @mark_extra
    def transparent(updates: Any, state: SAMState, params: Any = None, *,
                    grad_fn: Callable | None = None, **extra: Any) -> tuple[Any, SAMState]:
        del grad_fn, extra
        first = state.steps_since_sync == 0
        last = state.steps_since_sync == sync_period - 1
        adv_u, adv_s = adv_optimizer.update(updates, state.adv_state, params)
        adv_u = jax.tree.map(jnp.negative, adv_u)
        opt_u, opt_s = optimizer.update(updates, state.opt_state, state.cache)
        opt_u = jax.tree.map(lambda c, p, u: c - p + u, state.cache, params, opt_u)
        cache = _select(first, params, state.cache)
        out = _select(last, opt_u, adv_u)
        keep = adv_optimizer.init(params) if reset_state else state.adv_state
        return out, SAMState((state.steps_since_sync + 1) % sync_period, opt_state=_select(
            last, opt_s, state.opt_state), adv_state=_select(last, keep, adv_s), cache=cache)

    @mark_extra
    def opaque(updates: Any, state: SAMState, params: Any = None, *,
               grad_fn: Callable | None = None, **extra: Any) -> tuple[Any, SAMState]:
        del extra
        if grad_fn is None:
            raise ValueError("sam(opaque_mode=True): update(...) needs grad_fn=f(params, i)")
        adv_p, g, adv_s = params, updates, state.adv_state
        for i in range(sync_period - 1):
            step, adv_s = adv_optimizer.update(g, adv_s, adv_p)
            adv_p = apply_updates(adv_p, jax.tree.map(jnp.negative, step))
            g = grad_fn(adv_p, i)
            if batch_axis_name is not None:
                g = jax.lax.pmean(g, axis_name=batch_axis_name)
        if reset_state:
            adv_s = adv_optimizer.init(params)
        out, opt_s = optimizer.update(g, state.opt_state, params)
        return out, SAMState(jnp.zeros([], jnp.int32), opt_s, adv_s, None)

    return GradientTransformation(init, opaque if opaque_mode else transparent)
