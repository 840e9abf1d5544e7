"""cairn.optim.assignment.hungarian_algorithm against SciPy's linear_sum_assignment (float64)
and Optax's hungarian_algorithm: the same minimal total cost (assignments may differ on ties)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.optimize
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from cairn.optim import assignment


def _check(cost, i, j):
    i, j = np.asarray(i), np.asarray(j)
    n, m = cost.shape
    assert len(i) == len(j) == min(n, m)
    assert len(set(i.tolist())) == len(i) and len(set(j.tolist())) == len(j)
    r, c = scipy.optimize.linear_sum_assignment(np.asarray(cost, np.float64))
    ref = np.asarray(cost, np.float64)[r, c].sum()
    got = np.asarray(cost, np.float64)[i, j].sum()
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-4 * (1 + float(np.abs(cost).max())))


@settings(max_examples=15, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 4)),
              elements=st.floats(-100, 100, width=32)))
@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_minimal_total_cost_like_scipy(cost):
    i, j = assignment.hungarian_algorithm(jnp.asarray(cost))
    _check(cost, i, j)


@pytest.mark.parametrize("shape", [(4, 3), (3, 4), (6, 6)])
def test_same_total_cost_as_optax_and_integer_costs(shape):
    rng = np.random.default_rng(sum(shape))
    cost = rng.integers(0, 5, size=shape)  # many ties
    i, j = jax.jit(assignment.hungarian_algorithm)(jnp.asarray(cost))
    oi, oj = optax.assignment.hungarian_algorithm(jnp.asarray(cost))
    assert int(cost[np.asarray(i), np.asarray(j)].sum()) == int(cost[np.asarray(oi),
                                                                     np.asarray(oj)].sum())
    _check(cost, i, j)


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_vmap_and_errors():
    costs = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 5))
    i, j = jax.vmap(assignment.hungarian_algorithm)(costs)
    for b in range(3):
        _check(np.asarray(costs[b]), i[b], j[b])
    with pytest.raises(ValueError, match="2-D"):
        assignment.hungarian_algorithm(jnp.ones(3))
    e, f = assignment.hungarian_algorithm(jnp.ones((0, 3)))
    assert e.shape == f.shape == (0,)
    bi, bj = assignment.base_hungarian_algorithm(costs[0].T)
    assert bi.tolist() == sorted(bi.tolist())
    _check(np.asarray(costs[0].T), bi, bj)
