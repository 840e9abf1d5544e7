"""The Hungarian algorithm (Kuhn 1955; shortest augmenting paths with potentials, O(n^2 m)),
jittable, for ``optax.assignment``'s ``hungarian_algorithm``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["hungarian_algorithm", "base_hungarian_algorithm"]


def _augment(cost: jax.Array, state: tuple, row: jax.Array) -> tuple:
    """Add ``row`` (1-based) to the matching by one shortest augmenting path (Dijkstra on
    reduced costs :math:`c_{ij} - u_i - v_j`), updating the potentials ``u``, ``v``."""
    u, v, owner, way = state
    m = v.shape[0] - 1
    owner = owner.at[0].set(row)
    big = jnp.asarray(jnp.inf, cost.dtype)

    def search(c):
        u, v, owner, way, minv, used, j0, _ = c
        used = used.at[j0].set(True)
        i0 = owner[j0]
        red = cost[i0 - 1] - u[i0] - v[1:]  # reduced costs of the free columns
        free = ~used[1:]
        better = free & (red < minv[1:])
        minv = minv.at[1:].set(jnp.where(better, red, minv[1:]))
        way = way.at[1:].set(jnp.where(better, j0, way[1:]))
        j1 = jnp.argmin(jnp.where(free, minv[1:], big)) + 1
        delta = minv[j1]
        u = u.at[owner].add(jnp.where(used, delta, 0))
        v = jnp.where(used, v - delta, v)
        minv = jnp.where(used, minv, minv - delta)
        return u, v, owner, way, minv, used, j1, owner[j1]

    init = (u, v, owner, way, jnp.full(m + 1, big), jnp.zeros(m + 1, bool), jnp.asarray(0),
            row)
    u, v, owner, way, _, _, j0, _ = jax.lax.while_loop(lambda c: c[7] != 0, search, init)

    def back(c):
        owner, j0 = c
        j1 = way[j0]
        return owner.at[j0].set(owner[j1]), j1

    owner, _ = jax.lax.while_loop(lambda c: c[1] != 0, back, (owner, j0))
    return u, v, owner, way


def _solve_wide(cost: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows 0..n-1 and their columns for an ``n <= m`` matrix."""
    n, m = cost.shape
    ints = jnp.zeros(m + 1, jnp.int32)
    state = (jnp.zeros(n + 1, cost.dtype), jnp.zeros(m + 1, cost.dtype), ints, ints)
    state = jax.lax.fori_loop(1, n + 1, lambda i, s: _augment(cost, s, i), state)
    owner = state[2][1:]  # owner[j] = 1-based row of column j, 0 if free
    cols = jnp.zeros(n + 1, jnp.int32).at[owner].set(jnp.arange(m, dtype=jnp.int32))[1:]
    return jnp.arange(n, dtype=jnp.int32), cols


def hungarian_algorithm(cost_matrix: Any) -> tuple[jax.Array, jax.Array]:
    """A minimum-cost assignment of rows to columns of an ``(n, m)`` cost matrix.

    Returns ``(i, j)``, two int32 arrays of length ``min(n, m)``: row ``i[k]`` is assigned to
    column ``j[k]``, each row and column at most once, and ``cost_matrix[i, j].sum()`` is
    minimal. Pairs are sorted by row when ``n <= m`` and by column otherwise. Works under
    ``jit`` and ``vmap``; costs may be any real dtype (ints are computed in float32).

    Args:
      cost_matrix: an ``(n, m)`` array of real costs (ints are computed in float32).

    Raises:
      ValueError: ``cost_matrix`` is not 2-D.

    Example:
      >>> import jax.numpy as jnp
      >>> from cairn.optim import assignment
      >>> cost = jnp.array([[8, 4, 7], [5, 2, 3], [9, 6, 7], [9, 4, 8]])
      >>> i, j = assignment.hungarian_algorithm(cost)
      >>> int(cost[i, j].sum())
      15
    """
    cost = jnp.asarray(cost_matrix)
    if cost.ndim != 2:
        raise ValueError(f"hungarian_algorithm: cost_matrix must be 2-D, got shape {cost.shape}")
    if not jnp.issubdtype(cost.dtype, jnp.floating):
        cost = cost.astype(jnp.float32)
    n, m = cost.shape
    if n == 0 or m == 0:
        empty = jnp.zeros(0, jnp.int32)
        return empty, empty
    if n <= m:
        return _solve_wide(cost)
    cols, rows = _solve_wide(cost.T)
    return rows, cols


def base_hungarian_algorithm(cost_matrix: Any) -> tuple[jax.Array, jax.Array]:
    """:func:`hungarian_algorithm` with the pairs always sorted by row (as Optax's
    ``base_hungarian_algorithm`` returns them).

    Args:
      cost_matrix: an ``(n, m)`` array of real costs.

    Raises:
      ValueError: ``cost_matrix`` is not 2-D.

    Returns:
      ``(i, j)``, int32 arrays of length ``min(n, m)``, sorted by row ``i``.
    """
    i, j = hungarian_algorithm(cost_matrix)
    order = jnp.argsort(i)
    return i[order], j[order]
