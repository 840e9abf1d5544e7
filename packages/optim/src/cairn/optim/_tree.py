"""Tree maths on pytrees of arrays (``cairn.optim.tree``), named as in ``optax.tree``."""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "add", "sub", "mul", "div", "scale", "add_scale", "vdot", "sum", "max", "min", "norm",
    "zeros_like", "ones_like", "full_like", "cast", "cast_like", "where", "clip", "conj", "real",
    "size", "bias_correction", "update_moment", "update_moment_per_elem_norm",
]


def _check(trees, name):
    td = jax.tree_util.tree_structure(trees[0])
    for i, t in enumerate(trees[1:], 1):
        if jax.tree_util.tree_structure(t) != td:  # type: ignore[operator]
            from cairn.core_array import tree_paths

            a, b = set(tree_paths(trees[0])), set(tree_paths(t))
            raise ValueError(f"tree.{name}: argument {i} has a different structure: paths only "
                             f"in the first {sorted(a - b)[:5]}, only in argument {i} "
                             f"{sorted(b - a)[:5]}")


def add(tree: Any, *others: Any) -> Any:
    """Leaf-wise sum of trees."""
    _check((tree, *others), "add")
    return jax.tree.map(lambda *xs: functools.reduce(operator.add, xs), tree, *others)


def sub(a: Any, b: Any) -> Any:
    """Leaf-wise ``a - b``."""
    _check((a, b), "sub")
    return jax.tree.map(operator.sub, a, b)


def mul(a: Any, b: Any) -> Any:
    """Leaf-wise ``a * b``."""
    _check((a, b), "mul")
    return jax.tree.map(operator.mul, a, b)


def div(a: Any, b: Any) -> Any:
    """Leaf-wise ``a / b``."""
    _check((a, b), "div")
    return jax.tree.map(operator.truediv, a, b)


def scale(s: jax.typing.ArrayLike, tree: Any) -> Any:
    """``s * tree``."""
    return jax.tree.map(lambda x: s * x, tree)


def add_scale(a: Any, s: jax.typing.ArrayLike, b: Any) -> Any:
    """``a + s * b``."""
    _check((a, b), "add_scale")
    return jax.tree.map(lambda x, y: x + s * y, a, b)


def vdot(a: Any, b: Any) -> jax.Array:
    """:math:`\\sum_i \\langle a_i, b_i\\rangle` (conjugating ``a``)."""
    _check((a, b), "vdot")
    parts = [jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return functools.reduce(operator.add, parts, jnp.zeros([]))


def sum(tree: Any) -> jax.Array:  # noqa: A001
    """Sum of all elements."""
    return functools.reduce(operator.add, [jnp.sum(x) for x in jax.tree.leaves(tree)],
                            jnp.zeros([]))


def max(tree: Any) -> jax.Array:  # noqa: A001
    """Largest element."""
    return functools.reduce(jnp.maximum, [jnp.max(x) for x in jax.tree.leaves(tree)])


def min(tree: Any) -> jax.Array:  # noqa: A001
    """Smallest element."""
    return functools.reduce(jnp.minimum, [jnp.min(x) for x in jax.tree.leaves(tree)])


def norm(tree: Any, ord: int | str | None = 2, squared: bool = False) -> jax.Array:  # noqa: A002
    """Norm of all elements as one vector (``ord`` 1, 2 or ``inf``)."""
    leaves = jax.tree.leaves(tree)
    if ord == 2:
        sq = functools.reduce(operator.add,
                              [jnp.sum(jnp.real(jnp.conj(x) * x)) for x in leaves], jnp.zeros([]))
        return sq if squared else jnp.sqrt(sq)
    if ord == 1:
        out = functools.reduce(operator.add, [jnp.sum(jnp.abs(x)) for x in leaves], jnp.zeros([]))
    elif ord in ("inf", jnp.inf, float("inf")):
        out = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x)) for x in leaves], jnp.zeros([]))
    else:
        raise ValueError(f"tree.norm: unsupported ord {ord!r}; use 1, 2 or inf")
    return out ** 2 if squared else out


def zeros_like(tree: Any, dtype: jax.typing.DTypeLike | None = None) -> Any:
    return jax.tree.map(lambda x: jnp.zeros_like(x, dtype=dtype), tree)


def ones_like(tree: Any, dtype: jax.typing.DTypeLike | None = None) -> Any:
    return jax.tree.map(lambda x: jnp.ones_like(x, dtype=dtype), tree)


def full_like(tree: Any, fill_value: jax.typing.ArrayLike,
              dtype: jax.typing.DTypeLike | None = None) -> Any:
    return jax.tree.map(lambda x: jnp.full_like(x, fill_value, dtype=dtype), tree)


def cast(tree: Any, dtype: jax.typing.DTypeLike | None) -> Any:
    """Cast every leaf to ``dtype`` (``None`` leaves the tree unchanged)."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: jnp.asarray(x).astype(dtype), tree)


def cast_like(tree: Any, other: Any) -> Any:
    """Cast each leaf to the dtype of the matching leaf of ``other``."""
    _check((tree, other), "cast_like")
    return jax.tree.map(lambda x, y: jnp.asarray(x).astype(jnp.asarray(y).dtype), tree, other)


def where(condition: Any, a: Any, b: Any) -> Any:
    """Leaf-wise ``jnp.where``; ``condition`` is a scalar or a tree."""
    if isinstance(condition, (bool, jax.Array)) and jnp.ndim(condition) == 0:
        return jax.tree.map(lambda x, y: jnp.where(condition, x, y), a, b)
    return jax.tree.map(jnp.where, condition, a, b)


def clip(tree: Any, min_value: jax.typing.ArrayLike | None = None,
         max_value: jax.typing.ArrayLike | None = None) -> Any:
    return jax.tree.map(lambda x: jnp.clip(x, min_value, max_value), tree)


def conj(tree: Any) -> Any:
    return jax.tree.map(jnp.conj, tree)


def real(tree: Any) -> Any:
    return jax.tree.map(jnp.real, tree)


def size(tree: Any) -> int:
    """Total number of elements."""
    return int(functools.reduce(operator.add, [jnp.size(x) for x in jax.tree.leaves(tree)], 0))


def update_moment(updates: Any, moments: Any, decay: float, order: int) -> Any:
    """:math:`(1-\\delta) g^k + \\delta m`."""
    return jax.tree.map(lambda g, t: (1 - decay) * (g ** order) + decay * t, updates, moments)


def update_moment_per_elem_norm(updates: Any, moments: Any, decay: float, order: int) -> Any:
    """:math:`(1-\\delta) |g|^k + \\delta m`."""
    return jax.tree.map(lambda g, t: (1 - decay) * (jnp.abs(g) ** order) + decay * t,
                        updates, moments)


def bias_correction(moment: Any, decay: float, count: jax.Array) -> Any:
    """:math:`m / (1-\\delta^t)`."""
    bc = 1 - decay ** count
    return jax.tree.map(lambda t: t / bc.astype(t.dtype), moment)
