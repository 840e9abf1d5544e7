"""``cairn.optim.tree_utils``: the functions of :mod:`cairn.optim.tree` under the ``tree_``
prefixed names of ``optax.tree_utils`` (``tree_add``, ``tree_l2_norm``, ...).

>>> import jax.numpy as jnp
>>> from cairn.optim import tree_utils as otu
>>> float(otu.tree_l2_norm({"a": jnp.array([3.0, 4.0])}))
5.0
"""

from typing import Any

import jax

import cairn.optim.tree as _t
from cairn.optim._tree_state import NamedTupleKey

tree_add = _t.add
tree_add_scale = _t.add_scale
tree_allclose = _t.allclose
tree_batch_shape = _t.batch_shape
tree_bias_correction = _t.bias_correction
tree_cast = _t.cast
tree_cast_like = _t.cast_like
tree_clip = _t.clip
tree_conj = _t.conj
tree_div = _t.div
tree_dtype = _t.dtype
tree_full_like = _t.full_like
tree_get = _t.get
tree_get_all_with_path = _t.get_all_with_path
tree_map_params = _t.map_params
tree_max = _t.max
tree_min = _t.min
tree_mul = _t.mul
tree_norm = _t.norm
tree_ones_like = _t.ones_like
tree_random_like = _t.random_like
tree_real = _t.real
tree_scale = _t.scale
tree_set = _t.set
tree_size = _t.size
tree_split_key_like = _t.split_key_like
tree_sub = _t.sub
tree_sum = _t.sum
tree_unwrap_random_key_data = _t.unwrap_random_key_data
tree_update_infinity_moment = _t.update_infinity_moment
tree_update_moment = _t.update_moment
tree_update_moment_per_elem_norm = _t.update_moment_per_elem_norm
tree_vdot = _t.vdot
tree_where = _t.where
tree_zeros_like = _t.zeros_like


def tree_l2_norm(tree: Any, squared: bool = False) -> jax.Array:
    """Euclidean norm of all elements (``tree.norm(tree, 2, squared)``).

    Args:
      tree: a pytree of arrays.
      squared: return the squared norm.
    """
    return _t.norm(tree, 2, squared)


def tree_l1_norm(tree: Any) -> jax.Array:
    """Sum of absolute values of all elements.

    Args:
      tree: a pytree of arrays.
    """
    return _t.norm(tree, 1)


def tree_linf_norm(tree: Any) -> jax.Array:
    """Largest absolute value of all elements.

    Args:
      tree: a pytree of arrays.
    """
    return _t.norm(tree, "inf")


__all__ = [
    "tree_add",
    "tree_add_scale",
    "tree_allclose",
    "tree_batch_shape",
    "tree_bias_correction",
    "tree_cast",
    "tree_cast_like",
    "tree_clip",
    "tree_conj",
    "tree_div",
    "tree_dtype",
    "tree_full_like",
    "tree_get",
    "tree_get_all_with_path",
    "tree_map_params",
    "tree_max",
    "tree_min",
    "tree_mul",
    "tree_norm",
    "tree_ones_like",
    "tree_random_like",
    "tree_real",
    "tree_scale",
    "tree_set",
    "tree_size",
    "tree_split_key_like",
    "tree_sub",
    "tree_sum",
    "tree_unwrap_random_key_data",
    "tree_update_infinity_moment",
    "tree_update_moment",
    "tree_update_moment_per_elem_norm",
    "tree_vdot",
    "tree_where",
    "tree_zeros_like",
    "tree_l2_norm", "tree_l1_norm", "tree_linf_norm", "NamedTupleKey",
]
