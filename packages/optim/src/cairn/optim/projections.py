"""``cairn.optim.projections``: Euclidean projections onto convex sets, with
``optax.projections``' names (re-exports of :mod:`cairn.optim._projections`).

>>> import jax.numpy as jnp
>>> from cairn.optim import projections
>>> projections.projection_non_negative(jnp.array([-1.0, 2.0])).tolist()
[0.0, 2.0]
"""

from cairn.optim._projections import (
    projection_box,
    projection_halfspace,
    projection_hypercube,
    projection_hyperplane,
    projection_l1_ball,
    projection_l1_sphere,
    projection_l2_ball,
    projection_l2_sphere,
    projection_linf_ball,
    projection_non_negative,
    projection_simplex,
    projection_vector,
)

__all__ = [
    "projection_box", "projection_halfspace", "projection_hypercube", "projection_hyperplane",
    "projection_l1_ball", "projection_l1_sphere", "projection_l2_ball", "projection_l2_sphere",
    "projection_linf_ball", "projection_non_negative", "projection_simplex", "projection_vector",
]
