"""``cairn.optim.assignment``: the linear assignment problem, with ``optax.assignment``'s names.

>>> import jax.numpy as jnp
>>> from cairn.optim import assignment
>>> assignment.hungarian_algorithm(jnp.array([[1.0, 0.0], [0.0, 1.0]]))[1].tolist()
[1, 0]
"""

from cairn.optim._hungarian import base_hungarian_algorithm, hungarian_algorithm

__all__ = ["hungarian_algorithm", "base_hungarian_algorithm"]
