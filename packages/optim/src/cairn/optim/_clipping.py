"""Clipping: element-wise (``clip``), by global norm, by block RMS, adaptive (AGC), and
replacing NaNs (``zero_nans``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _packing as pk
from cairn.optim import _validate
from cairn.optim._base import (
    EmptyState,
    GradientTransformation,
    check_scalar,
    packed_transformation,
    per_leaf,
)
from cairn.optim._packed_state import abs_sq

__all__ = ["clip", "clip_by_global_norm", "clip_by_block_rms", "adaptive_grad_clip", "zero_nans"]


def clip(max_delta: float) -> GradientTransformation:
    """:math:`u \\leftarrow \\mathrm{clip}(u, -\\delta, \\delta)`."""
    _validate.check("clip", max_delta=max_delta)
    check_scalar("max_delta", max_delta)

    def update(u, state, p=None, **extra):
        return u.map(lambda g: jnp.clip(g, -max_delta, max_delta).astype(g.dtype)), state

    return packed_transformation(lambda layout, params: EmptyState(), update, name="clip")


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """:math:`u \\leftarrow u \\cdot \\min(1, c/\\|u\\|_2)` with :math:`\\|u\\|_2` the norm over
    all leaves (one reduction per packed buffer, or per dtype on one device)."""
    _validate.check("clip_by_global_norm", max_norm=max_norm)
    check_scalar("max_norm", max_norm)

    def update(u, state, p=None, **extra):
        # per-parameter leaves on one device: one reduction per dtype over a transient
        # concatenation (not stored), as packed state does; sharded leaves reduce per leaf
        sq = [jnp.sum(abs_sq(g).astype(jnp.float32)) for g in pk.transient_flat(u)]
        g_norm = jnp.sqrt(sum(sq)) if sq else jnp.zeros([], jnp.float32)
        trigger = g_norm < max_norm

        def f(g):
            return jnp.where(trigger, g, (g / g_norm.astype(g.dtype)) * max_norm).astype(g.dtype)

        return u.map(f), state

    return packed_transformation(lambda layout, params: EmptyState(), update,
                                 name="clip_by_global_norm")


def clip_by_block_rms(threshold: float) -> GradientTransformation:
    """Per leaf: :math:`u \\leftarrow u / \\max(1, \\mathrm{rms}(u)/c)`."""
    _validate.check("clip_by_block_rms", {"threshold": _validate.Rule(lo=0.0, lo_open=True, inf_ok=True)},
                    threshold=threshold)

    def f(u):
        rms = jnp.sqrt(jnp.mean(jnp.real(jnp.conj(u) * u)))
        denom = jnp.maximum(1.0, rms / threshold)
        return (u / denom).astype(u.dtype)

    return per_leaf("clip_by_block_rms", f, needs_params=False)


def _unitwise_norm(x, axis=None):
    if axis is not None:
        return jnp.sqrt(jnp.sum(x * x, axis=axis, keepdims=True))
    if x.ndim <= 1:
        return jnp.sqrt(jnp.sum(x * x))
    if x.ndim in (2, 3):
        ax: int | tuple[int, ...] = 0
    elif x.ndim == 4:  # conv kernels HWIO
        ax = (0, 1, 2)
    elif x.ndim == 5:  # 3-D conv kernels DHWIO
        ax = (0, 1, 2, 3)
    else:
        raise ValueError(f"adaptive_grad_clip: unsupported parameter rank {x.ndim} "
                         f"(shape {x.shape}); pass `axis`")
    return jnp.sqrt(jnp.sum(x * x, axis=ax, keepdims=True))


def adaptive_grad_clip(clipping: float, eps: float = 1e-3,
                       axis: int | tuple[int, ...] | None = None) -> GradientTransformation:
    """AGC (Brock et al. 2021): :math:`u \\leftarrow u\\cdot\\min(1, \\lambda\\max(\\|\\theta\\|,
    \\epsilon)/\\|u\\|)` with unit-wise norms."""
    _validate.check("adaptive_grad_clip", {"clipping": _validate.NONNEG}, clipping=clipping, eps=eps)

    def f(g, p):
        g_norm = _unitwise_norm(g, axis)
        p_norm = _unitwise_norm(p, axis)
        max_norm = jnp.maximum(p_norm, eps) * clipping
        trigger = g_norm < max_norm
        clipped = g * (max_norm / jnp.maximum(g_norm, 1e-6))
        return jnp.where(trigger, g, clipped).astype(g.dtype)

    return per_leaf("adaptive_grad_clip", f, needs_params=True)


class ZeroNansState(NamedTuple):
    """``found_nan``: one flag per parameter (a tree with the params' structure, as in
    Optax); with packed state (:func:`~cairn.optim.pack`), one per packed buffer, keyed by
    group name."""

    found_nan: Any


def zero_nans() -> GradientTransformation:
    """Replace NaNs in the updates by 0; the state records whether a leaf had one."""

    def flags(layout, values):
        if layout.shaped:
            return jax.tree_util.tree_unflatten(layout.treedef, list(values))
        return {g.name: v for g, v in zip(layout.groups, values)}

    def init(layout, params):
        return ZeroNansState(flags(layout, [jnp.array(False)] * len(layout.groups)))

    def update(u, state, p=None, **extra):
        found = flags(u.layout, [jnp.any(jnp.isnan(b)) for b in u.buffers])
        return u.map(lambda g: jnp.where(jnp.isnan(g), jnp.zeros_like(g), g)), ZeroNansState(found)

    return packed_transformation(init, update, name="zero_nans")
