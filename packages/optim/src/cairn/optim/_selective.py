"""``selective_transform``: run an optimizer on the trainable leaves only, zero the frozen ones."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from cairn.optim._base import GradientTransformation, call_update, mark_extra, set_to_zero
from cairn.optim._combine import partition
from cairn.optim._rules import resolve_per_leaf

__all__ = ["selective_transform", "static_mask"]


def static_mask(mask: Any) -> Any:
    """A 0-d bool array (NumPy or concrete JAX) as a Python bool; anything else unchanged."""
    if isinstance(mask, (np.ndarray, np.bool_, jax.Array)) and np.ndim(mask) == 0:
        if isinstance(mask, jax.core.Tracer):
            raise TypeError("the freeze mask must be static (a bool or a tree of bools), "
                            "got a traced value")
        return bool(mask)
    return mask


def selective_transform(optimizer: GradientTransformation, *,
                        freeze_mask: Any) -> GradientTransformation:
    """Apply ``optimizer`` to the leaves where ``freeze_mask`` is False; zero the others.

    The frozen leaves get no optimizer state and no compute (they are routed to
    :func:`set_to_zero` by :func:`partition`).

    Args:
      optimizer: the transformation for the trainable leaves.
      freeze_mask: True freezes. A bool (everything or nothing), a tree of bools with the
        params' structure (or a prefix of it), a callable ``params -> tree``, or path-regex
        rules (``{"embed/.*": True}``), all static.

    Example:
      >>> import jax.numpy as jnp
      >>> from cairn import optim
      >>> tx = optim.transforms.selective_transform(optim.sgd(1.0),
      ...                                           freeze_mask={"a": True, "b": False})
      >>> p = {"a": jnp.ones(2), "b": jnp.ones(2)}
      >>> u, _ = tx.update(p, tx.init(p), p)
      >>> u["a"].tolist(), u["b"].tolist()
      ([0.0, 0.0], [-1.0, -1.0])
    """
    mask = static_mask(freeze_mask)

    def labels(params: Any) -> Any:
        frozen = resolve_per_leaf(mask, params, what="freeze_mask", mask_mode=True)
        td = jax.tree_util.tree_structure(params)
        return jax.tree_util.tree_unflatten(td, ["frozen" if f else "trainable" for f in frozen])

    def build(params: Any) -> GradientTransformation:
        used = set(jax.tree_util.tree_leaves(labels(params)))
        groups = {"trainable": optimizer, "frozen": set_to_zero()}
        return partition({k: v for k, v in groups.items() if k in used}, labels)

    def init(params: Any) -> Any:
        return build(params).init(params)

    @mark_extra
    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return call_update(build(updates), updates, state, params, extra)

    return GradientTransformation(init, update)
