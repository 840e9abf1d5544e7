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
    "update_infinity_moment", "allclose", "batch_shape", "dtype", "random_like", "split_key_like",
    "unwrap_random_key_data",
]


def _check(trees, name):
    td = jax.tree_util.tree_structure(trees[0])
    for i, t in enumerate(trees[1:], 1):
        if jax.tree_util.tree_structure(t) != td:  # type: ignore[operator]
            raise ValueError(f"tree.{name}: argument {i} has a different structure: "
                             + structure_difference(trees[0], t, "the first", f"argument {i}"))


def _children(x: Any) -> list[tuple[str, Any]]:
    """``(key, child)`` of one level of pytree node ``x`` (empty for a leaf)."""
    kids, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    if len(kids) == 1 and kids[0][0] == () and kids[0][1] is x:
        return []
    return [(jax.tree_util.keystr(kp), y) for kp, y in kids]


def _first_container_change(a: Any, b: Any, path: str) -> tuple[str, str, str] | None:
    """Where two trees with the same leaf paths first differ in a node's type or data."""
    ka, kb = _children(a), _children(b)
    level_a: Any = jax.tree_util.tree_structure(a, is_leaf=lambda y: y is not a)
    level_b: Any = jax.tree_util.tree_structure(b, is_leaf=lambda y: y is not b)
    if (ka or kb) and (type(a) is not type(b) or level_a != level_b):
        return path or "the root", type(a).__name__, type(b).__name__
    for (k, x), (_, y) in zip(ka, kb):
        found = _first_container_change(x, y, path + k)
        if found is not None:
            return found
    return None


def structure_difference(a: Any, b: Any, what_a: str, what_b: str) -> str:
    """What differs between the structures of pytrees ``a`` and ``b``: the leaf paths
    found in one only, or, when the paths agree, the first container whose type (or node
    data) differs, e.g. a ``dict`` against a ``State`` holding the same keys.

    Args:
      a: a pytree.
      b: another pytree.
      what_a: how the message names ``a`` ("the first", "params").
      what_b: how the message names ``b``.
    """
    from cairn.core_array import tree_paths

    pa, pb = set(tree_paths(a)), set(tree_paths(b))
    if pa != pb:
        return (f"paths only in {what_a} {sorted(pa - pb)[:5]}, paths only in {what_b} "
                f"{sorted(pb - pa)[:5]}")
    found = _first_container_change(a, b, "")
    if found is None:
        return "the same leaf paths, held in differently defined pytree nodes"
    where, ta, tb = found
    return (f"the same leaf paths, but the containers differ at {where}: {ta} in {what_a}, "
            f"{tb} in {what_b} (convert one, e.g. a State to a pure dict, so both match)")


def add(tree: Any, *others: Any) -> Any:
    """Leaf-wise sum of trees.

    Args:
      tree: a pytree of arrays.
      others: more pytrees with the structure of ``tree``.
    """
    _check((tree, *others), "add")
    return jax.tree.map(lambda *xs: functools.reduce(operator.add, xs), tree, *others)


def sub(a: Any, b: Any) -> Any:
    """Leaf-wise ``a - b``.

    Args:
      a: a pytree of arrays.
      b: a pytree with the structure of ``a``.
    """
    _check((a, b), "sub")
    return jax.tree.map(operator.sub, a, b)


def mul(a: Any, b: Any) -> Any:
    """Leaf-wise ``a * b``.

    Args:
      a: a pytree of arrays.
      b: a pytree with the structure of ``a``.
    """
    _check((a, b), "mul")
    return jax.tree.map(operator.mul, a, b)


def div(a: Any, b: Any) -> Any:
    """Leaf-wise ``a / b``.

    Args:
      a: the dividend pytree.
      b: the divisor pytree, same structure as ``a``.
    """
    _check((a, b), "div")
    return jax.tree.map(operator.truediv, a, b)


def scale(s: jax.typing.ArrayLike, tree: Any) -> Any:
    """``s * tree``.

    Args:
      s: the scalar factor.
      tree: a pytree of arrays.
    """
    return jax.tree.map(lambda x: s * x, tree)


def add_scale(a: Any, s: jax.typing.ArrayLike, b: Any) -> Any:
    """``a + s * b``; a None in ``a`` stays None (as Optax).

    Args:
      a: a pytree (None leaves kept).
      s: the scalar multiplying ``b``.
      b: a pytree with the structure of ``a``.
    """
    return _map_skipping_none("add_scale", lambda x, y: x + s * y, a, b)


def _map_skipping_none(name: str, fn: Any, first: Any, second: Any) -> Any:
    """``fn`` over the leaves of two trees, None where ``first`` has None (Optax's rule for
    the moment helpers); other structure differences raise naming the paths."""
    if not any(x is None for x in jax.tree.leaves(first, is_leaf=lambda x: x is None)):
        _check((first, second), name)
    return jax.tree.map(lambda x, y: None if x is None else fn(x, y), first, second,
                        is_leaf=lambda x: x is None)


def vdot(a: Any, b: Any) -> jax.Array:
    """:math:`\\sum_i \\langle a_i, b_i\\rangle` (conjugating ``a``).

    Args:
      a: a pytree of arrays (conjugated).
      b: a pytree with the structure of ``a``.
    """
    _check((a, b), "vdot")
    parts = [jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return functools.reduce(operator.add, parts) if parts else jnp.zeros([])  # keeps int dtypes


def sum(tree: Any) -> jax.Array:  # noqa: A001
    """Sum of all elements.

    Args:
      tree: a pytree of arrays (an empty tree gives 0.0).
    """
    parts = [jnp.sum(x) for x in jax.tree.leaves(tree)]
    return functools.reduce(operator.add, parts) if parts else jnp.zeros([])


def max(tree: Any) -> jax.Array:  # noqa: A001
    """Largest element; empty leaves are skipped, and a tree with no element gives
    ``-inf`` (as Optax).

    Args:
      tree: a pytree of real arrays.
    """
    return _extremum(tree, jnp.max, jnp.maximum, -jnp.inf)


def min(tree: Any) -> jax.Array:  # noqa: A001
    """Smallest element; empty leaves are skipped, and a tree with no element gives
    ``inf`` (as Optax).

    Args:
      tree: a pytree of real arrays.
    """
    return _extremum(tree, jnp.min, jnp.minimum, jnp.inf)


def _extremum(tree: Any, reduce_leaf, combine, empty: float) -> jax.Array:
    values = [reduce_leaf(x) for x in jax.tree.leaves(tree) if jnp.size(x) > 0]
    if not values:
        return jnp.asarray(empty)
    return functools.reduce(combine, values)


def norm(tree: Any, ord: int | str | None = 2, squared: bool = False) -> jax.Array:  # noqa: A002
    """Norm of all elements as one vector (``ord`` 1, 2 or ``inf``).

    Args:
      tree: a pytree of arrays (complex leaves count :math:`|x|`).
      ord: 1, 2, or ``"inf"`` / ``jnp.inf``.
      squared: return the norm squared.

    Raises:
      ValueError: another ``ord``.
    """
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
    """A pytree like ``tree`` with every element 0.

    Args:
      tree: a pytree of arrays.
      dtype: the leaves' dtype; None keeps each leaf's own.
    """
    return jax.tree.map(lambda x: jnp.zeros_like(x, dtype=dtype), tree)


def ones_like(tree: Any, dtype: jax.typing.DTypeLike | None = None) -> Any:
    """A pytree like ``tree`` with every element 1.

    Args:
      tree: a pytree of arrays.
      dtype: the leaves' dtype; None keeps each leaf's own.
    """
    return jax.tree.map(lambda x: jnp.ones_like(x, dtype=dtype), tree)


def full_like(tree: Any, fill_value: jax.typing.ArrayLike,
              dtype: jax.typing.DTypeLike | None = None) -> Any:
    """A pytree like ``tree`` with every element ``fill_value``.

    Args:
      tree: a pytree of arrays.
      fill_value: the value of every element.
      dtype: the leaves' dtype; None keeps each leaf's own.
    """
    return jax.tree.map(lambda x: jnp.full_like(x, fill_value, dtype=dtype), tree)


def cast(tree: Any, dtype: jax.typing.DTypeLike | None) -> Any:
    """Cast every leaf to ``dtype`` (``None`` leaves the tree unchanged).

    Args:
      tree: a pytree of arrays.
      dtype: the target dtype, or None.
    """
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: jnp.asarray(x).astype(dtype), tree)


def cast_like(tree: Any, other: Any) -> Any:
    """Cast each leaf to the dtype of the matching leaf of ``other``.

    Args:
      tree: a pytree of arrays.
      other: a pytree with the structure of ``tree`` whose leaves give the dtypes.
    """
    _check((tree, other), "cast_like")
    return jax.tree.map(lambda x, y: jnp.asarray(x).astype(jnp.asarray(y).dtype), tree, other)


def where(condition: Any, a: Any, b: Any) -> Any:
    """Leaf-wise ``jnp.where``; ``condition`` is a scalar or a tree.

    Args:
      condition: a bool scalar, or a pytree of bool arrays like ``a``.
      a: the pytree taken where ``condition`` is True.
      b: the pytree taken elsewhere, same structure as ``a``.
    """
    if isinstance(condition, (bool, jax.Array)) and jnp.ndim(condition) == 0:
        return jax.tree.map(lambda x, y: jnp.where(condition, x, y), a, b)
    return jax.tree.map(jnp.where, condition, a, b)


def clip(tree: Any, min_value: jax.typing.ArrayLike | None = None,
         max_value: jax.typing.ArrayLike | None = None) -> Any:
    """Each leaf clipped to ``[min_value, max_value]`` (``jnp.clip``).

    Args:
      tree: a pytree of arrays.
      min_value: the lower bound; None for none.
      max_value: the upper bound; None for none.
    """
    return jax.tree.map(lambda x: jnp.clip(x, min_value, max_value), tree)


def conj(tree: Any) -> Any:
    """The complex conjugate of each leaf (real leaves unchanged).

    Args:
      tree: a pytree of arrays.
    """
    return jax.tree.map(jnp.conj, tree)


def real(tree: Any) -> Any:
    """The real part of each leaf.

    Args:
      tree: a pytree of arrays.
    """
    return jax.tree.map(jnp.real, tree)


def size(tree: Any) -> int:
    """Total number of elements.

    Args:
      tree: a pytree of arrays.
    """
    return int(functools.reduce(operator.add, [jnp.size(x) for x in jax.tree.leaves(tree)], 0))


def update_moment(updates: Any, moments: Any, decay: float, order: int) -> Any:
    """:math:`(1-\\delta) g^k + \\delta m`.

    Args:
      updates: the gradients :math:`g` (pytree).
      moments: the previous :math:`m`, same structure (None leaves kept).
      decay: :math:`\\delta`.
      order: :math:`k` (1 for the mean, 2 for the uncentred variance).
    """
    return _map_skipping_none("update_moment",
                              lambda g, t: (1 - decay) * (g ** order) + decay * t, updates, moments)


def update_moment_per_elem_norm(updates: Any, moments: Any, decay: float, order: int) -> Any:
    """:math:`(1-\\delta) |g|^k + \\delta m`.

    Args:
      updates: the gradients :math:`g` (pytree).
      moments: the previous :math:`m`, same structure (None leaves kept).
      decay: :math:`\\delta`.
      order: :math:`k`.
    """
    return _map_skipping_none("update_moment_per_elem_norm",
                              lambda g, t: (1 - decay) * (jnp.abs(g) ** order) + decay * t,
                              updates, moments)


def bias_correction(moment: Any, decay: float, count: jax.Array) -> Any:
    """:math:`m / (1-\\delta^t)`.

    Args:
      moment: a pytree of moment estimates :math:`m`.
      decay: :math:`\\delta`, the moment's EMA decay.
      count: :math:`t`, the int step count (>= 1).

    Returns:
      the pytree :math:`m / (1-\\delta^t)`, leaves in their own dtypes.
    """
    bc = jnp.asarray(1 - decay ** count)   # in >= float32: decay**t rounds to 1 in bfloat16
    return jax.tree.map(lambda t: t / bc.astype(t.dtype), moment)


def update_infinity_moment(updates: Any, moments: Any, decay: float, eps: float) -> Any:
    """:math:`\\max(\\delta m, |g| + \\epsilon)` (Adamax's infinity norm).

    Args:
      updates: the gradients :math:`g` (pytree).
      moments: the previous :math:`m`, same structure (None leaves kept).
      decay: :math:`\\delta`.
      eps: :math:`\\epsilon`.
    """
    return _map_skipping_none("update_infinity_moment",
                              lambda g, t: jnp.maximum(jnp.abs(g) + eps, decay * t), updates, moments)


def allclose(a: Any, b: Any, rtol: float = 1e-05, atol: float = 1e-08,
             equal_nan: bool = False) -> bool:
    """Same structure and every pair of leaves :func:`jnp.allclose`.

    Args:
      a: a pytree of arrays.
      b: another pytree (a different structure gives False).
      rtol: relative tolerance of :func:`jnp.allclose`.
      atol: absolute tolerance of :func:`jnp.allclose`.
      equal_nan: count NaNs in the same place as equal.
    """
    if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):  # type: ignore[operator]
        return False
    return all(bool(jnp.allclose(x, y, rtol=rtol, atol=atol, equal_nan=equal_nan))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def batch_shape(tree: Any, shape: tuple[int, ...] = ()) -> Any:
    """Each leaf broadcast to ``(*shape, *leaf.shape)`` (leading batch dimensions added).

    Args:
      tree: a pytree of arrays.
      shape: the leading dims to add.
    """
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (*shape, *jnp.shape(x))), tree)


def dtype(tree: Any, mixed_dtype_handler: str | None = None) -> Any:
    """The dtype of the leaves.

    ``mixed_dtype_handler``: None (all leaves must agree), ``"promote"`` (JAX promotion),
    ``"highest"`` / ``"lowest"`` (the dtype every other one promotes to / from).

    Args:
      tree: a pytree of arrays (an empty tree gives the default float dtype).
      mixed_dtype_handler: how to combine different leaf dtypes (see above).

    Raises:
      ValueError: leaves disagree with ``None``, or have no highest/lowest, or an unknown handler.
    """
    dts = [jnp.result_type(x) for x in jax.tree.leaves(tree)]
    if not dts:
        return jnp.result_type(float)
    if mixed_dtype_handler is None:
        if len(set(dts)) > 1:
            raise ValueError(f"tree.dtype: leaves have several dtypes {sorted(map(str, set(dts)))};"
                             " pass mixed_dtype_handler='promote', 'highest' or 'lowest'")
        return dts[0]
    if mixed_dtype_handler == "promote":
        return functools.reduce(jnp.promote_types, dts)
    if mixed_dtype_handler not in ("highest", "lowest"):
        raise ValueError(f"tree.dtype: unknown mixed_dtype_handler {mixed_dtype_handler!r}; "
                         "expected None, 'promote', 'highest' or 'lowest'")
    for cand in dts:
        if mixed_dtype_handler == "highest":
            ok = all(jnp.promote_types(d, cand) == cand for d in dts)
        else:
            ok = all(jnp.promote_types(d, cand) == d for d in dts)
        if ok:
            return cand
    raise ValueError(f"tree.dtype: dtypes {sorted(map(str, set(dts)))} have no "
                     f"{mixed_dtype_handler} element under JAX promotion")


def split_key_like(rng_key: jax.Array, target_tree: Any) -> Any:
    """One independent key per leaf of ``target_tree`` (same structure).

    Args:
      rng_key: the PRNG key to split.
      target_tree: the pytree whose structure the keys take.
    """
    leaves, td = jax.tree_util.tree_flatten(target_tree)
    keys = jax.random.split(rng_key, len(leaves))
    return jax.tree_util.tree_unflatten(td, list(keys))


def random_like(rng_key: jax.Array, target_tree: Any, sampler: Any = jax.random.normal,
                dtype: jax.typing.DTypeLike | None = None) -> Any:
    """Random leaves shaped like ``target_tree``: ``sampler(key, shape, dtype)`` per leaf.

    Args:
      rng_key: the PRNG key, split into one key per leaf.
      target_tree: the pytree whose leaves give the shapes (and default dtypes).
      sampler: ``sampler(key, shape, dtype) -> array`` (``jax.random.normal`` by default).
      dtype: the leaves' dtype; None uses each target leaf's own.
    """
    keys = split_key_like(rng_key, target_tree)
    return jax.tree.map(lambda k, x: sampler(k, jnp.shape(x), dtype or jnp.result_type(x)),
                        keys, target_tree)


def unwrap_random_key_data(tree: Any) -> Any:
    """Typed PRNG key leaves replaced by their raw ``uint32`` data; other leaves unchanged.

    Args:
      tree: any pytree.
    """
    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(x)
        return x

    return jax.tree.map(one, tree)
