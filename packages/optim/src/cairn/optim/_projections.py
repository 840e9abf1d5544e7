"""Euclidean projections of a pytree onto convex sets (``optax.projections``' names).

Every function returns :math:`\\mathrm{argmin}_y \\|x - y\\|_2^2` subject to a constraint,
where the norm and inner products run over the whole tree as one vector (so an l1 ball
constrains the sum over every leaf). Leaves keep their shapes and dtypes.

>>> import jax.numpy as jnp
>>> from cairn.optim import projections
>>> p = projections.projection_simplex({"w": jnp.array([2.5, 3.2]), "b": jnp.array(0.5)})
>>> {k: [round(float(x), 3) for x in jnp.atleast_1d(v)] for k, v in sorted(p.items())}
{'b': [0.0], 'w': [0.15, 0.85]}
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from cairn.optim import _tree

__all__ = [
    "projection_box", "projection_halfspace", "projection_hypercube", "projection_hyperplane",
    "projection_l1_ball", "projection_l1_sphere", "projection_l2_ball", "projection_l2_sphere",
    "projection_linf_ball", "projection_non_negative", "projection_simplex", "projection_vector",
]


def projection_non_negative(tree: Any) -> Any:
    """Onto :math:`y \\ge 0`: ``max(x, 0)`` leaf-wise.

    Args:
      tree: the pytree to project.
    """
    return jax.tree.map(jax.nn.relu, tree)


def _bound(b: Any, tree: Any) -> Any:
    if not isinstance(b, (dict, list, tuple)) and len(jax.tree.leaves(b)) == 1:
        return jax.tree.map(lambda _: b, tree)
    return b


def projection_box(tree: Any, lower: Any, upper: Any) -> Any:
    """Onto :math:`\\text{lower} \\le y \\le \\text{upper}` (scalars or trees like ``tree``).

    Args:
      tree: the pytree to project.
      lower: the lower bound, a scalar or a pytree like ``tree``.
      upper: the upper bound, a scalar or a pytree like ``tree``.
    """
    return jax.tree.map(jnp.clip, tree, _bound(lower, tree), _bound(upper, tree))


def projection_hypercube(tree: Any, scale: Any = 1) -> Any:
    """Onto :math:`0 \\le y \\le \\text{scale}`.

    Args:
      tree: the pytree to project.
      scale: the upper bound, a scalar or a pytree like ``tree``.
    """
    return projection_box(tree, 0, scale)


def projection_linf_ball(tree: Any, scale: jax.typing.ArrayLike = 1) -> Any:
    """Onto :math:`\\|y\\|_\\infty \\le \\text{scale}`.

    Args:
      tree: the pytree to project.
      scale: the radius, a scalar or a pytree like ``tree``.
    """
    return projection_box(tree, jnp.negative(scale), scale)


def projection_l2_ball(tree: Any, scale: jax.typing.ArrayLike = 1) -> Any:
    """Onto :math:`\\|y\\|_2 \\le \\text{scale}`: :math:`x\\min(1, s/\\|x\\|_2)`.

    Args:
      tree: the pytree to project (all leaves form one vector).
      scale: the radius :math:`s > 0`.
    """
    n = _tree.norm(tree)
    factor = jnp.where(n > scale, scale / jnp.where(n > 0, n, 1.0), 1.0)
    return jax.tree.map(lambda x: (x * factor).astype(jnp.result_type(x)), tree)


def projection_l2_sphere(tree: Any, scale: jax.typing.ArrayLike = 1) -> Any:
    """Onto :math:`\\|y\\|_2 = \\text{scale}`: :math:`s\\,x/\\|x\\|_2` (undefined at 0).

    Args:
      tree: the pytree to project (all leaves form one vector, nonzero).
      scale: the radius :math:`s > 0`.
    """
    factor = scale / _tree.norm(tree)
    return jax.tree.map(lambda x: (x * factor).astype(jnp.result_type(x)), tree)


def _simplex_vector(v: jax.Array, scale: jax.typing.ArrayLike) -> jax.Array:
    """Sort-based projection onto :math:`\\{p \\ge 0, \\sum p = s\\}` (Duchi et al. 2008)."""
    u = jnp.sort(v)[::-1]
    css = jnp.cumsum(u) - scale
    k = jnp.arange(1, v.size + 1, dtype=v.dtype)
    rho = jnp.max(jnp.where(u - css / k > 0, jnp.arange(v.size), 0))
    theta = css[rho] / (rho + 1).astype(v.dtype)
    return jnp.maximum(v - theta, 0)


def projection_simplex(tree: Any, scale: jax.typing.ArrayLike = 1) -> Any:
    """Onto :math:`\\{y \\ge 0, \\sum y = \\text{scale}\\}` over all leaves together:
    :math:`y = \\max(x - \\theta, 0)` with the threshold :math:`\\theta` found by sorting.

    Args:
      tree: the pytree to project (all leaves form one vector).
      scale: the sum :math:`s > 0` of the projected vector.
    """
    flat, unravel = ravel_pytree(tree)
    return unravel(_simplex_vector(flat, scale))


def projection_l1_sphere(tree: Any, scale: jax.typing.ArrayLike = 1) -> Any:
    """Onto :math:`\\|y\\|_1 = \\text{scale}`: :math:`\\mathrm{sign}(x)\\,
    \\Pi_{\\Delta_s}(|x|)`.

    Args:
      tree: the pytree to project (all leaves form one vector).
      scale: the radius :math:`s > 0`.
    """
    flat, unravel = ravel_pytree(tree)
    return unravel(jnp.sign(flat) * _simplex_vector(jnp.abs(flat), scale))


def projection_l1_ball(tree: Any, scale: jax.typing.ArrayLike = 1) -> Any:
    """Onto :math:`\\|y\\|_1 \\le \\text{scale}`: ``tree`` itself when inside, else the l1
    sphere's projection.

    Args:
      tree: the pytree to project (all leaves form one vector).
      scale: the radius :math:`s > 0`.
    """
    flat, unravel = ravel_pytree(tree)
    inside = jnp.sum(jnp.abs(flat)) <= scale
    return unravel(jnp.where(inside, flat,
                             jnp.sign(flat) * _simplex_vector(jnp.abs(flat), scale)))


def projection_hyperplane(x: Any, a: Any, b: jax.typing.ArrayLike) -> Any:
    """Onto :math:`\\langle a, y\\rangle = b`: :math:`x - \\frac{\\langle a,x\\rangle - b}
    {\\|a\\|^2} a`.

    Args:
      x: the pytree to project.
      a: the normal vector, a pytree like ``x`` (nonzero).
      b: the scalar offset.
    """
    c = (_tree.vdot(a, x) - b) / _tree.vdot(a, a)
    return jax.tree.map(lambda xi, ai: xi - c * ai, x, a)


def projection_halfspace(x: Any, a: Any, b: jax.typing.ArrayLike) -> Any:
    """Onto :math:`\\langle a, y\\rangle \\le b`: :math:`x - \\frac{\\max(\\langle a,x\\rangle
    - b, 0)}{\\|a\\|^2} a`.

    Args:
      x: the pytree to project.
      a: the normal vector, a pytree like ``x``.
      b: the scalar offset.
    """
    c = jax.nn.relu(_tree.vdot(a, x) - b) / _tree.vdot(a, a)
    return jax.tree.map(lambda xi, ai: xi - c * ai, x, a)


def projection_vector(x: Any, a: Any) -> Any:
    """Onto the line spanned by ``a``: :math:`\\frac{\\langle a,x\\rangle}{\\|a\\|^2} a`.

    Args:
      x: the pytree to project.
      a: the direction, a pytree like ``x`` (nonzero).
    """
    c = _tree.vdot(a, x) / _tree.vdot(a, a)
    return jax.tree.map(lambda ai: c * ai, a)
