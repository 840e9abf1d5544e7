"""Additive terms: decoupled weight decay (``add_decayed_weights``) and gradient noise
(``add_noise``)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cairn.optim import _packing as pk
from cairn.optim import _validate
from cairn.optim._base import (
    GradientTransformation,
    ScalarOrSchedule,
    check_scalar,
    eval_schedule,
    need_params,
    packed_transformation,
)
from cairn.optim._packed_state import current_value, safe_increment
from cairn.optim._packing import Packed
from cairn.optim._rules import resolve_per_leaf

__all__ = ["add_decayed_weights", "add_noise", "AddDecayedWeightsState"]


class AddDecayedWeightsState(NamedTuple):
    """``count`` of steps (advanced only when ``weight_decay`` is a schedule) and the
    ``weight_decay`` used at the last step (traced).

    Args:
      count: int32 scalar, steps taken (advanced only when ``weight_decay`` is a schedule).
      weight_decay: float scalar, the decay rate :math:`\\lambda_t` used at the last step.
    """

    count: jax.Array  # type: ignore[assignment]
    weight_decay: jax.Array


def _leaf_mask(mask, layout: pk.Layout) -> tuple[bool, ...]:
    """One bool per leaf of ``layout`` for a mask (pytree, callable or path rules)."""
    like = jax.tree_util.tree_unflatten(
        layout.treedef, [jax.ShapeDtypeStruct(s, d) for s, d in zip(layout.shapes, layout.dtypes)])
    return tuple(resolve_per_leaf(mask, like, what="mask", mask_mode=True))


def _element_mask(layout: pk.Layout, gi: int, bools: tuple[bool, ...]):
    """Per-element mask of group ``gi``: None (all True), False (none) or a bool vector."""
    g = layout.groups[gi]
    vals = [bools[i] for i in g.leaves]
    if all(vals):
        return None
    if not any(vals):
        return False
    runs, start = [], None
    for pos, v in enumerate(vals):
        if v and start is None:
            start = g.offsets[pos]
        if not v and start is not None:
            runs.append((start, g.offsets[pos]))
            start = None
    if start is not None:
        runs.append((start, g.total))
    iota = jax.lax.iota(jnp.int32, g.total)
    if len(runs) <= 16:
        m = jnp.zeros((g.total,), bool)
        for s, e in runs:
            m = m | ((iota >= s) & (iota < e))
        return m
    ends = jnp.asarray(np.cumsum(g.sizes), jnp.int32)
    idx = jnp.searchsorted(ends, iota, side="right", method="scan")
    return jnp.asarray(vals)[idx]


def _decay_buffer(layout: pk.Layout, bools, gi: int, g, w, wd):
    """``g + wd * w`` on buffer ``gi``, only on the elements of the leaves ``bools`` selects."""
    em = None if bools is None else _element_mask(layout, gi, bools)
    if em is False:
        return g
    term = wd.astype(g.dtype) * w
    if em is not None:
        term = jnp.where(em, term, jnp.zeros_like(term))
    return (g + term).astype(g.dtype)


def _decay_leaf(bools, i: int, x, w, wd):
    """:func:`_decay_buffer` restricted to leaf ``i`` (the pending term, added at the unpack)."""
    if bools is not None and not bools[i]:
        return x
    if w.dtype == x.dtype and w.shape == x.shape:  # lax: same primitives, no dispatch
        return jax.lax.add(jax.lax.mul(jax.lax.convert_element_type(wd, x.dtype), w), x)
    return (wd.astype(x.dtype) * w + x).astype(x.dtype)


def add_decayed_weights(weight_decay: ScalarOrSchedule = 0.0,
                        mask: Any = None) -> GradientTransformation:
    """:math:`u \\leftarrow u + \\lambda_t\\,\\theta` on the leaves selected by ``mask``.

    ``mask`` is a pytree of bools (or a prefix), a callable ``params -> mask``, or
    path-regex rules (a regex string, or ``{pattern: bool}``; first match wins).
    The decay lives in the state (``state.weight_decay``): changing it does not recompile.

    Args:
      weight_decay: :math:`\\lambda_t`, a float or a schedule ``step -> float`` (0 adds nothing).
      mask: which leaves are decayed: a pytree of bools (or a prefix), a callable ``params ->
        mask``, a regex string or ``{pattern: bool}`` rules on leaf paths; None decays every leaf.
    """
    _validate.check("add_decayed_weights", weight_decay=weight_decay)
    check_scalar("weight_decay", weight_decay, minimum=None)
    masks: dict = {}  # layout -> one bool per leaf

    def bools_for(layout):
        if mask is not None and layout not in masks:
            masks[layout] = _leaf_mask(mask, layout)  # errors name the path
        return masks.get(layout)

    def init(layout, params):
        bools_for(layout)  # validate early
        wd = eval_schedule("weight_decay", weight_decay, jnp.zeros([], jnp.int32))
        return AddDecayedWeightsState(jnp.zeros([], jnp.int32), wd)

    def update(u, state, p=None, **extra):
        need_params(p, "add_decayed_weights")
        wd = current_value("weight_decay", weight_decay, state.weight_decay, state.count)
        count = safe_increment(state.count) if callable(weight_decay) else state.count
        bools = bools_for(u.layout)
        decay_buffer = functools.partial(_decay_buffer, u.layout, bools)
        out: Packed
        if isinstance(p, pk.LazyParams):
            # pytree params: keep the term pending; it is added per leaf when the
            # updates are unpacked (no concatenate of the params)
            out = pk.PendingDecay(u.layout, u.buffers, p, decay_buffer,
                                  functools.partial(_decay_leaf, bools), wd, offsets=u.offsets)
        else:
            out = Packed(u.layout, [decay_buffer(gi, g, w, wd)
                                    for gi, (g, w) in enumerate(zip(u.buffers, p.buffers))])
        return out, AddDecayedWeightsState(count, wd)

    return packed_transformation(init, update, needs_params=True, name="add_decayed_weights")


class AddNoiseState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]
    rng_key: jax.Array


def add_noise(eta: float, gamma: float, key: jax.Array | int | None = None, *,
              seed: int | None = None) -> GradientTransformation:
    """:math:`u \\leftarrow u + \\mathcal N(0, \\eta/(1+t)^{\\gamma})` (one draw per element),
    :math:`t` the number of earlier steps (variance :math:`\\eta` on the first step).

    Key derivation (stable; it is what makes a run reproducible): the state holds one key,
    initially ``key`` (an int ``n`` means ``jax.random.PRNGKey(n)``). Each step splits it,
    ``keys = jax.random.split(state_key, B + 1)``; ``keys[0]`` is the next state key and
    buffer ``b`` gets ``jax.random.normal(keys[b + 1], (size_b,), dtype_b)``, scaled by the
    standard deviation cast to ``dtype_b``. The ``B`` buffers are the ones the update
    runs on: by default one buffer per leaf, in flatten order (the leaf itself); when the
    surrounding chain keeps packed state (:func:`~cairn.optim.pack`), one buffer per dtype
    (and per sharding), in order of first appearance in ``jax.tree`` flatten order, its
    leaves raveled and concatenated in that order. So the
    random numbers differ from Optax's (one split per step, then one key per leaf); the
    distribution is the same.

    Args:
      eta: :math:`\\eta > 0`, the noise variance at the first step.
      gamma: :math:`\\gamma`, the decay exponent of the variance.
      key: the initial PRNG key (a ``jax.random`` key, or an int seed for ``PRNGKey``).
      seed: an int seed, accepted when ``key`` is not given (Optax's spelling).

    Raises:
      ValueError: neither ``key`` nor ``seed`` is given.
    """
    _validate.check("add_noise", eta=eta, gamma=gamma)
    if key is None and seed is None:
        raise ValueError("add_noise needs a `key` (jax.random key or int) or a `seed`")
    if key is None:
        key = seed
    if isinstance(key, int):
        key = jax.random.PRNGKey(key)

    def init(layout, params):
        return AddNoiseState(jnp.zeros([], jnp.int32), jnp.asarray(key))

    def update(u, state, p=None, **extra):
        count = safe_increment(state.count)
        std = jnp.sqrt(eta / count.astype(jnp.float32) ** gamma)
        keys = jax.random.split(state.rng_key, len(u.buffers) + 1)
        outs = [(g + std.astype(g.dtype) * jax.random.normal(k, g.shape, g.dtype)).astype(g.dtype)
                for g, k in zip(u.buffers, keys[1:])]
        return Packed(u.layout, outs), AddNoiseState(count, keys[0])

    return packed_transformation(init, update, name="add_noise")
