"""``cairn.optim.tree``: tree maths and state look-ups with the names of ``optax.tree``.

>>> import jax.numpy as jnp
>>> from cairn.optim import tree
>>> float(tree.vdot({"a": jnp.ones(3)}, {"a": jnp.full(3, 2.0)}))
6.0
"""

from cairn.optim._tree import (
    add,
    add_scale,
    allclose,
    batch_shape,
    bias_correction,
    cast,
    cast_like,
    clip,
    conj,
    div,
    dtype,
    full_like,
    max,
    min,
    mul,
    norm,
    ones_like,
    random_like,
    real,
    scale,
    size,
    split_key_like,
    sub,
    sum,
    unwrap_random_key_data,
    update_infinity_moment,
    update_moment,
    update_moment_per_elem_norm,
    vdot,
    where,
    zeros_like,
)
from cairn.optim._tree_state import NamedTupleKey, get, get_all_with_path, map_params, set

__all__ = [
    "add", "add_scale", "allclose", "batch_shape", "bias_correction", "cast", "cast_like", "clip",
    "conj", "div", "dtype", "full_like", "get", "get_all_with_path", "map_params", "max", "min",
    "mul", "norm", "ones_like", "random_like", "real", "scale", "set", "size", "split_key_like",
    "sub", "sum", "unwrap_random_key_data", "update_infinity_moment", "update_moment",
    "update_moment_per_elem_norm", "vdot", "where", "zeros_like", "NamedTupleKey",
]
