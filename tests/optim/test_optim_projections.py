"""cairn.optim.projections: float64 NumPy references (the KKT conditions / closed forms),
hypothesis properties, and agreement with optax.projections."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from cairn.optim import projections as P

jax.config.update("jax_enable_x64", False)

vec = arrays(np.float64, st.integers(1, 12),
             elements=st.floats(-5, 5, allow_nan=False, allow_infinity=False))
# XLA on CPU flushes float32 subnormals to zero (denormals-are-zero), so an element below
# float32's smallest normal may come back as 0: every float32 comparison allows that much.
F32_TINY = float(np.finfo(np.float32).tiny)


def simplex_ref(v, s):
    """Projection onto the simplex by bisection on the threshold (float64)."""
    lo, hi = v.min() - s, v.max()
    for _ in range(200):
        mid = (lo + hi) / 2
        if np.maximum(v - mid, 0).sum() > s:
            lo = mid
        else:
            hi = mid
    return np.maximum(v - (lo + hi) / 2, 0)


@settings(max_examples=20, deadline=None)
@given(vec, st.floats(0.1, 4.0))
@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_simplex_and_l1_match_float64_references(v, s):
    tree = {"a": jnp.asarray(v[: len(v) // 2], jnp.float32),
            "b": jnp.asarray(v[len(v) // 2:], jnp.float32)}
    flat = np.concatenate([np.asarray(tree["a"], np.float64), np.asarray(tree["b"], np.float64)])
    out = P.projection_simplex(tree, s)
    got = np.concatenate([np.asarray(out["a"]), np.asarray(out["b"])])
    np.testing.assert_allclose(got, simplex_ref(flat, s), atol=2e-5 * (1 + np.abs(flat).max()))
    assert got.min() >= 0 and abs(got.sum() - s) < 1e-4 * (1 + s)
    l1 = P.projection_l1_ball(tree, s)
    got = np.concatenate([np.asarray(l1["a"]), np.asarray(l1["b"])])
    ref = flat if np.abs(flat).sum() <= s else np.sign(flat) * simplex_ref(np.abs(flat), s)
    np.testing.assert_allclose(got, ref, atol=2e-5 * (1 + np.abs(flat).max()))


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@settings(max_examples=15, deadline=None)
@given(vec, st.floats(0.1, 4.0))
@example(np.array([5.9636495e-39, -1e-40]), 1.0)  # subnormal float32 inputs, which XLA flushes to 0
def test_balls_boxes_and_planes_closed_forms(v, s):
    x = jnp.asarray(v, jnp.float32)
    xf = np.asarray(x, np.float64)
    n = np.linalg.norm(xf)
    ref_l2 = xf if n <= s else xf * s / n
    np.testing.assert_allclose(P.projection_l2_ball(x, s), ref_l2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(P.projection_linf_ball(x, s), np.clip(xf, -s, s), rtol=1e-6, atol=F32_TINY)
    np.testing.assert_allclose(P.projection_hypercube(x, s), np.clip(xf, 0, s), rtol=1e-6, atol=F32_TINY)
    np.testing.assert_allclose(P.projection_non_negative(x), np.maximum(xf, 0), atol=F32_TINY)
    a = np.linspace(1.0, 2.0, len(xf))
    plane = P.projection_hyperplane(x, jnp.asarray(a, jnp.float32), s)
    assert abs(float(np.dot(a, np.asarray(plane, np.float64))) - s) < 1e-4 * (1 + np.abs(xf).sum())
    half = np.asarray(P.projection_halfspace(x, jnp.asarray(a, jnp.float32), s), np.float64)
    assert np.dot(a, half) <= s + 1e-4 * (1 + np.abs(xf).sum())
    if np.dot(a, xf) <= s:
        np.testing.assert_allclose(half, xf, rtol=1e-6, atol=F32_TINY)


CASES = [
    ("projection_non_negative", ()), ("projection_box", (-0.5, 0.7)),
    ("projection_hypercube", (0.6,)), ("projection_linf_ball", (0.4,)),
    ("projection_l2_ball", (0.8,)), ("projection_l2_sphere", (2.0,)),
    ("projection_simplex", (1.5,)), ("projection_l1_ball", (1.0,)),
    ("projection_l1_sphere", (3.0,)),
]


@pytest.mark.parametrize("name,args", CASES)
def test_projections_match_optax(name, args):
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    tree = {"w": jax.random.normal(k1, (3, 4)), "b": jax.random.normal(k2, (5,))}
    ours = getattr(P, name)(tree, *args)
    if name == "projection_box":
        # Optax 0.2.8 rejects a scalar bound for a dict tree (a tree.map prefix error),
        # although its docstring allows scalars; give it bounds shaped like the tree
        args = tuple(jax.tree.map(lambda x, a=a: jnp.full_like(x, a), tree) for a in args)
    if name == "projection_hypercube":  # same Optax limitation (lower=0): leaf by leaf
        theirs = {k: optax.projections.projection_hypercube(v, *args) for k, v in tree.items()}
    else:
        theirs = getattr(optax.projections, name)(tree, *args)
    for k in tree:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6)
        assert ours[k].shape == tree[k].shape and ours[k].dtype == tree[k].dtype


@pytest.mark.parametrize("name", ["projection_hyperplane", "projection_halfspace"])
def test_plane_projections_match_optax(name):
    x = {"u": jnp.arange(4.0), "v": jnp.ones(2)}
    a = {"u": jnp.asarray([1.0, -1.0, 2.0, 0.5]), "v": jnp.asarray([0.3, 0.0])}
    for b in (-1.0, 0.5, 10.0):
        ours, theirs = getattr(P, name)(x, a, b), getattr(optax.projections, name)(x, a, b)
        for k in x:
            np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6)
    ours, theirs = P.projection_vector(x, a), optax.projections.projection_vector(x, a)
    for k in x:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6)


def test_projections_jit_and_box_with_tree_bounds():
    tree = {"a": jnp.asarray([-2.0, 0.5, 3.0]), "b": jnp.asarray([1.0])}
    lo = {"a": jnp.zeros(3), "b": jnp.asarray([2.0])}
    hi = {"a": jnp.ones(3), "b": jnp.asarray([4.0])}
    out = jax.jit(P.projection_box)(tree, lo, hi)
    assert out["a"].tolist() == [0.0, 0.5, 1.0] and out["b"].tolist() == [2.0]
    out = jax.jit(P.projection_simplex)(tree)
    assert abs(float(out["a"].sum() + out["b"].sum()) - 1.0) < 1e-6
