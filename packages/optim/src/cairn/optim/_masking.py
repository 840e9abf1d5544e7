"""Masking: apply a transformation to some leaves (``masked``) or zero others (``freeze``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim._base import EmptyState, GradientTransformation, call_update, mark_extra
from cairn.optim._rules import resolve_per_leaf

__all__ = ["masked", "freeze", "MaskedState", "MaskedNode"]


class MaskedNode(NamedTuple):
    """What :func:`masked` puts in place of a leaf its inner transformation does not see (in
    the inner updates, params and state), as Optax: a node with no children, so
    ``jax.tree.map`` skips it (``is_leaf=lambda x: isinstance(x, MaskedNode)`` finds it)."""


def select_leaves(tree: Any, keep: list[bool], fill: Any = None) -> Any:
    """``tree`` with the leaves where ``keep`` is False replaced by ``fill`` (None or a
    ``MaskedNode()``: empty subtrees either way)."""
    if tree is None:
        return None
    leaves, td = jax.tree_util.tree_flatten(tree)
    if len(leaves) != len(keep):
        raise ValueError(f"tree has {len(leaves)} leaves, expected {len(keep)}")
    return jax.tree_util.tree_unflatten(td, [x if k else fill for x, k in zip(leaves, keep)])


def leaves_like(td: Any, tree: Any) -> list:
    """The leaves of an inner transformation's updates ``tree`` at the leaf positions of
    ``td`` (the full updates' treedef): None where the inner tree left a leaf out. A None
    subtree of the params is an empty node of ``td``, so it shifts nothing."""
    return td.flatten_up_to(tree)


def is_zero_tx(tx: Any) -> bool:
    return getattr(tx, "_cairn_zero", False) or getattr(tx.update, "_cairn_zero", False)


class MaskedState(NamedTuple):
    """The state of :func:`masked`.

    Args:
      inner_state: the wrapped transformation's state, built for the selected leaves only.
    """
    inner_state: Any


def masked(inner: GradientTransformation, mask: Any, *,
           mask_compatible_extra_args: bool = False) -> GradientTransformation:
    """Apply ``inner`` to the leaves selected by ``mask``; the others pass through unchanged.

    ``mask``: a pytree of bools (or prefix), a callable ``params -> mask``, or path-regex
    rules (a regex string, or ``{pattern: bool}`` / ``[(pattern, bool)]``, first match
    wins). The inner state holds only the selected leaves.

    Args:
      inner: the transformation applied to the selected leaves.
      mask: True selects: a pytree of bools (or prefix), a callable ``params -> mask``, or
        path-regex rules.
      mask_compatible_extra_args: accepted for Optax compatibility and ignored (extra arguments are
        passed on whole).
    """
    del mask_compatible_extra_args

    def keep_for(tree):
        return resolve_per_leaf(mask, tree, what="mask", mask_mode=True)

    def init(params):
        return MaskedState(inner.init(select_leaves(params, keep_for(params), MaskedNode())))

    @mark_extra
    def update(updates, state, params=None, **extra):
        keep = keep_for(updates)
        leaves, td = jax.tree_util.tree_flatten(updates)
        sub_u = select_leaves(updates, keep, MaskedNode())
        sub_p = select_leaves(params, keep, MaskedNode()) if params is not None else None
        u_m, s = call_update(inner, sub_u, state.inner_state, sub_p, extra)
        out = [v if k else x for x, v, k in zip(leaves, leaves_like(td, u_m), keep)]
        return jax.tree_util.tree_unflatten(td, out), MaskedState(s)

    return GradientTransformation(init, update)


def freeze(mask: Any) -> GradientTransformation:
    """Zero the updates of the leaves selected by ``mask`` (no state, no compute).

    ``mask``: True freezes; a bool (or 0-d bool array), a tree of bools (or prefix), a
    callable ``params -> mask``, or path-regex rules, as for :func:`masked`.

    Args:
      mask: True freezes: a bool (or 0-d bool array), a pytree of bools (or a prefix), a callable
        ``params -> mask``, or path-regex rules as for :func:`masked`.
    """
    if hasattr(mask, "ndim") and getattr(mask, "ndim", 1) == 0 and not callable(mask):
        mask = bool(mask)

    def init(params):
        resolve_per_leaf(mask, params, what="freeze mask", mask_mode=True)
        return EmptyState()

    @mark_extra
    def update(updates, state, params=None, **extra):
        keep = resolve_per_leaf(mask, updates, what="freeze mask", mask_mode=True)
        leaves, td = jax.tree_util.tree_flatten(updates)
        out = [jnp.zeros_like(x) if k else x for x, k in zip(leaves, keep)]
        return jax.tree_util.tree_unflatten(td, out), state

    return GradientTransformation(init, update)
