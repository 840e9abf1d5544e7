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

__all__ = [
    "adaptive_grad_clip", "clip", "clip_by_block_rms", "clip_by_global_norm",
    "per_example_global_norm_clip", "per_example_layer_norm_clip", "unitwise_clip",
    "unitwise_norm", "zero_nans",
]


def clip(max_delta: float) -> GradientTransformation:
    """:math:`u \\leftarrow \\mathrm{clip}(u, -\\delta, \\delta)`.

    Args:
      max_delta: :math:`\\delta \\ge 0`, the largest allowed absolute value of each update element.
    """
    _validate.check("clip", max_delta=max_delta)
    check_scalar("max_delta", max_delta)

    def update(u, state, p=None, **extra):
        return u.map(lambda g: jnp.clip(g, -max_delta, max_delta).astype(g.dtype)), state

    return packed_transformation(lambda layout, params: EmptyState(), update, name="clip")


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """:math:`u \\leftarrow u \\cdot \\min(1, c/\\|u\\|_2)` with :math:`\\|u\\|_2` the norm over
    all leaves (one reduction per packed buffer, or per dtype on one device).

    Args:
      max_norm: :math:`c`, the largest allowed global L2 norm of the updates.
    """
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
    """Per leaf: :math:`u \\leftarrow u / \\max(1, \\mathrm{rms}(u)/c)`.

    Args:
      threshold: :math:`c > 0`, the largest allowed RMS of each leaf (``inf`` clips nothing).
    """
    _validate.check("clip_by_block_rms", {"threshold": _validate.Rule(lo=0.0, lo_open=True, inf_ok=True)},
                    threshold=threshold)

    def f(u):
        rms = jnp.sqrt(jnp.mean(jnp.real(jnp.conj(u) * u)))
        denom = jnp.maximum(1.0, rms / threshold)
        return (u / denom).astype(u.dtype)

    return per_leaf("clip_by_block_rms", f, needs_params=False)


def unitwise_norm(x: jax.typing.ArrayLike,
                  axis: int | tuple[int, ...] | None = None) -> jax.Array:
    r"""The L2 norm of each unit of ``x``, broadcast back to ``x``'s shape (as Optax).

    A unit is the slice summed over ``axis``; without ``axis`` the axes follow the rank of
    ``x``: the whole array when ``x`` squeezed has rank <= 1 (vectors, scalars, ``(1, n)``),
    axis 0 for rank 2 and 3 (a linear ``[in, out]`` or multi-head kernel: one norm per output
    unit), axes ``(0, 1, 2)`` for rank 4 (conv ``HWIO``), ``(0, 1, 2, 3)`` for rank 5.

    Args:
      x: an array (complex: :math:`|x|^2` is summed).
      axis: the axes to reduce, or None for the rank rule.

    Raises:
      ValueError: rank above 5 without ``axis``.

    >>> from cairn import optim
    >>> print(optim.transforms.unitwise_norm(jnp.array([[3.0, 0.0], [4.0, 1.0]])))
    [[5. 1.]
     [5. 1.]]
    """
    x = jnp.asarray(x)
    if axis is not None:
        sq = jnp.sum(abs_sq(x), axis=axis, keepdims=True)
    elif jnp.squeeze(x).ndim <= 1:
        sq = jnp.sum(abs_sq(x), keepdims=True)
    elif x.ndim in (2, 3):
        sq = jnp.sum(abs_sq(x), axis=0, keepdims=True)
    elif x.ndim in (4, 5):
        sq = jnp.sum(abs_sq(x), axis=tuple(range(x.ndim - 1)), keepdims=True)
    else:
        raise ValueError(f"unitwise_norm: no default units for rank {x.ndim} (shape "
                         f"{x.shape}); pass `axis`")
    return jnp.broadcast_to(jnp.sqrt(sq), x.shape)


def unitwise_clip(g_norm: jax.typing.ArrayLike, max_norm: jax.typing.ArrayLike,
                  grad: jax.typing.ArrayLike, div_eps: float = 1e-6) -> jax.Array:
    r"""``grad`` where ``g_norm < max_norm``, else ``grad * max_norm / max(g_norm, div_eps)``
    (the three arrays of one shape, e.g. from :func:`unitwise_norm`).

    Args:
      g_norm: the unit-wise gradient norms (shape of ``grad``).
      max_norm: the unit-wise largest allowed norms (shape of ``grad``).
      grad: the gradient to clip.
      div_eps: the smallest divisor (guards against 0/0).

    Raises:
      ValueError: the shapes differ.
    """
    g_norm, max_norm, grad = jnp.asarray(g_norm), jnp.asarray(max_norm), jnp.asarray(grad)
    if not g_norm.shape == max_norm.shape == grad.shape:
        raise ValueError(f"unitwise_clip: g_norm, max_norm and grad must have one shape, got "
                         f"{g_norm.shape}, {max_norm.shape} and {grad.shape}")
    clipped = grad * (max_norm / jnp.maximum(g_norm, div_eps))
    return jnp.where(g_norm < max_norm, grad, clipped)


def adaptive_grad_clip(clipping: float, eps: float = 1e-3,
                       axis: int | tuple[int, ...] | None = None) -> GradientTransformation:
    """AGC (Brock et al. 2021): :math:`u \\leftarrow u\\cdot\\min(1, \\lambda\\max(\\|\\theta\\|,
    \\epsilon)/\\|u\\|)` with unit-wise norms.

    Args:
      clipping: :math:`\\lambda \\ge 0`, the largest allowed ratio of update norm to parameter norm.
      eps: :math:`\\epsilon`, the smallest parameter norm used (so zero-initialised weights can
        move).
      axis: the axes each unit-wise norm reduces over; None uses the rank rule of
        :func:`unitwise_norm` (all but the last axis for rank >= 2).
    """
    _validate.check("adaptive_grad_clip", {"clipping": _validate.NONNEG}, clipping=clipping, eps=eps)

    def f(g, p):
        g_norm = unitwise_norm(g, axis)
        max_norm = jnp.maximum(unitwise_norm(p, axis), eps) * clipping
        return unitwise_clip(g_norm, max_norm, g).astype(g.dtype)

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


def _batched_leaves(fn: str, grads: Any) -> list[jax.Array]:
    leaves = [jnp.asarray(g) for g in jax.tree.leaves(grads)]
    if not leaves or any(g.ndim < 1 or g.shape[0] != leaves[0].shape[0] for g in leaves):
        shapes = jax.tree.map(jnp.shape, grads)
        raise ValueError(f"{fn}: every gradient needs the same batch (example) axis 0; "
                         f"got shapes {shapes}")
    return leaves


def _clip_examples(grads: Any, clip_norm: Any) -> tuple[Any, jax.Array]:
    """Sum over axis 0 of the per-example gradients, each scaled to norm <= ``clip_norm``."""
    sq = sum(jnp.sum(abs_sq(g).reshape(g.shape[0], -1), axis=1) for g in jax.tree.leaves(grads))
    norms = jnp.sqrt(sq)
    scale = jnp.nan_to_num(jnp.minimum(clip_norm / norms, 1.0), nan=1.0)
    total = jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1), grads)
    return total, jnp.sum(scale < 1.0)


def per_example_global_norm_clip(grads: Any, l2_norm_clip: float) -> tuple[Any, jax.Array]:
    r"""DP-SGD's clipping (Abadi et al., 2016): each example's gradient (axis 0 of every
    leaf) scaled to global norm at most :math:`C`, then summed over examples:
    :math:`\sum_i g_i \min(1, C/\lVert g_i
Vert)` (a zero gradient is kept as is).

    Args:
      grads: a pytree whose leaves share a leading example axis.
      l2_norm_clip: :math:`C \ge 0` (``inf`` clips nothing).

    Returns:
      ``(sum of the clipped gradients, number of examples that were clipped)``.

    Raises:
      ValueError: leaves without a common axis 0.

    >>> from cairn import optim
    >>> grads = [jnp.array([[0, 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]])]
    >>> total, clipped = optim.per_example_global_norm_clip(grads, 1.25)
    >>> print(total[0], int(clipped))
    [1.75 1.75 1.75] 3
    """
    _batched_leaves("per_example_global_norm_clip", grads)
    return _clip_examples(grads, l2_norm_clip)


def per_example_layer_norm_clip(grads: Any, global_l2_norm_clip: float,
                                uniform: bool = True) -> tuple[Any, Any]:
    r"""Per-layer DP clipping (McMahan et al., 2017): each leaf ("layer") :math:`k` of each
    example is clipped on its own to :math:`C_k`, then summed over examples, with
    :math:`C_k = C/\sqrt{K}` (``uniform``, :math:`K` leaves) or
    :math:`C\sqrt{D_k/D}` (:math:`D_k` the leaf's size per example, :math:`D` the total).

    Args:
      grads: a pytree whose leaves share a leading example axis.
      global_l2_norm_clip: :math:`C \ge 0`.
      uniform: the clip norm rule above.

    Returns:
      ``(tree of clipped sums, tree of clipped-example counts)``, both with ``grads``'
      structure.

    Raises:
      ValueError: leaves without a common axis 0.
    """
    leaves = _batched_leaves("per_example_layer_norm_clip", grads)
    total = sum(g[0].size for g in leaves)
    results = []
    for g in leaves:
        share = 1.0 / len(leaves) if uniform else g[0].size / total
        results.append(_clip_examples(g, global_l2_norm_clip * share**0.5))
    td: Any = jax.tree.structure(grads)
    return td.unflatten([r[0] for r in results]), td.unflatten([r[1] for r in results])
