"""L-BFGS and the line searches against Optax 0.2.8 and SciPy.

scale_by_lbfgs and the backtracking search are deterministic algorithms with the same
equations as Optax, so the trajectories agree to float32 rounding (rtol 1e-5). The zoom search
is our own strong-Wolfe implementation (Nocedal & Wright 3.5/3.6): its trial steps differ from
Optax's, so it is checked by the conditions it guarantees and by the minimiser it reaches
(SciPy's BFGS in float64 as reference, rtol 1e-3 in float32).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.optimize

import cairn.optim as optim

A = jnp.asarray(np.diag(np.linspace(0.5, 8.0, 5)), jnp.float32)


def quad(p):
    return 0.5 * jnp.sum((p["x"] - 1.0) @ A * (p["x"] - 1.0)) + jnp.sum((p["y"] + 2.0) ** 2)


def rosen(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


P0 = {"x": jnp.linspace(-1.0, 1.0, 5), "y": jnp.asarray([0.3, -0.7])}


def solve(m, opt, f, x0, steps, *, linesearch=True):
    vg = m.value_and_grad_from_state(f) if linesearch else jax.value_and_grad(f)
    state = opt.init(x0)

    @jax.jit
    def step(x, state):
        if linesearch:
            v, g = vg(x, state=state)
            u, state = opt.update(g, state, x, value=v, grad=g, value_fn=f)
        else:
            v, g = vg(x)
            u, state = opt.update(g, state, x)
        return m.apply_updates(x, u), state

    traj = []
    for _ in range(steps):
        x0, state = step(x0, state)
        traj.append(x0)
    return traj, state


def _same(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


@pytest.mark.parametrize("kw", [dict(), dict(memory_size=3), dict(scale_init_precond=False)])
def test_lbfgs_without_linesearch_matches_optax_step_for_step(kw):
    ours, _ = solve(optim, optim.lbfgs(0.3, linesearch=None, **kw), quad, P0, 12,
                    linesearch=False)
    theirs, _ = solve(optax, optax.lbfgs(0.3, linesearch=None, **kw), quad, P0, 12,
                      linesearch=False)
    for a, b in zip(ours, theirs):
        _same(a, b)


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("store_grad", [False, True])
def test_lbfgs_with_backtracking_matches_optax(store_grad):
    def make(m):
        return m.lbfgs(linesearch=m.scale_by_backtracking_linesearch(
            max_backtracking_steps=15, store_grad=store_grad))

    def run(m):
        f = quad
        opt = make(m)
        x, state = P0, opt.init(P0)
        out = []
        upd = jax.jit(lambda g, s, x, v: opt.update(g, s, x, value=v, grad=g, value_fn=f))
        for _ in range(8):
            v, g = jax.value_and_grad(f)(x)
            u, state = upd(g, state, x, v)
            x = m.apply_updates(x, u)
            info = m.tree.get(state, "info")
            assert int(info.num_linesearch_steps) >= 1
            out.append((x, float(m.tree.get(state, "learning_rate",
                                             filtering=lambda p, v: "Backtracking" in str(p)))))
        return out

    for (a, la), (b, lb) in zip(run(optim), run(optax)):
        _same(a, b)
        assert la == pytest.approx(lb, rel=1e-6)


def test_backtracking_with_sgd_direction_matches_optax_and_raises_on_unknown_kwargs():
    def run(m):
        opt = m.chain(m.sgd(1.0), m.scale_by_backtracking_linesearch(max_backtracking_steps=30,
                                                                       decrease_factor=0.5))
        x = jnp.asarray([2.0, -3.0, 0.5])
        s = opt.init(x)
        out = []
        upd = jax.jit(lambda g, s, x, v: opt.update(g, s, x, value=v, grad=g, value_fn=rosen))
        for _ in range(5):
            v, g = jax.value_and_grad(rosen)(x)
            u, s = upd(g, s, x, v)
            x = x + u
            out.append(x)
        return out

    for a, b in zip(run(optim), run(optax)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    opt = optim.scale_by_backtracking_linesearch(5)
    x = jnp.ones(2)
    with pytest.raises(TypeError, match="not parameters of value_fn"):
        opt.update(x, opt.init(x), x, value=1.0, grad=x, value_fn=lambda p: 0.0, batch=1)


@pytest.mark.parametrize("x0", [np.asarray([-1.2, 1.0, 0.5, -0.3]),
                                pytest.param(np.zeros(6), marks=pytest.mark.slow)])
@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_lbfgs_zoom_reaches_scipys_minimiser_with_wolfe_steps(x0):
    ref = scipy.optimize.minimize(_rosen_np, x0, jac=_rosen_grad_np, method="BFGS",
                                  options={"gtol": 1e-10}).x
    traj, _ = solve(optim, optim.lbfgs(), rosen, jnp.asarray(x0, jnp.float32), 60)
    np.testing.assert_allclose(traj[-1], ref, rtol=1e-3, atol=1e-3)
    theirs, _ = solve(optax, optax.lbfgs(), rosen, jnp.asarray(x0, jnp.float32), 60)
    np.testing.assert_allclose(traj[-1], theirs[-1], rtol=1e-3, atol=1e-3)
    assert float(rosen(traj[-1])) < 1e-6


def _rosen_np(x):
    return float(np.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2))


def _rosen_grad_np(x):
    g = np.zeros_like(x)
    g[:-1] = -400.0 * x[:-1] * (x[1:] - x[:-1] ** 2) - 2.0 * (1.0 - x[:-1])
    g[1:] += 200.0 * (x[1:] - x[:-1] ** 2)
    return g


def test_zoom_steps_satisfy_strong_wolfe_and_store_value_and_grad():
    c1, c2 = 1e-4, 0.9
    ls = optim.scale_by_zoom_linesearch(max_linesearch_steps=30, approx_dec_rtol=None)
    opt = optim.chain(optim.scale_by_lbfgs(), optim.scale(-1.0), ls)
    x = jnp.asarray([-1.2, 1.0, 0.5], jnp.float32)
    state = opt.init(x)
    upd = jax.jit(lambda g, s, x, v: opt.update(g, s, x, value=v, grad=g, value_fn=rosen))
    for _ in range(15):
        v, g = jax.value_and_grad(rosen)(x)
        u, state = upd(g, state, x, v)
        s = state[-1]
        eta = float(s.learning_rate)
        d = u / eta if eta > 0 else u
        slope0 = float(jnp.vdot(d, g))
        x_new = x + u
        assert float(rosen(x_new)) <= float(v) + c1 * eta * slope0 + 1e-6 * abs(float(v))
        assert abs(float(jnp.vdot(d, jax.grad(rosen)(x_new)))) <= c2 * abs(slope0) + 1e-5
        np.testing.assert_allclose(s.value, rosen(x_new), rtol=1e-6)
        # stored at x + eta * d, recomputed at x + u: the points differ by rounding
        np.testing.assert_allclose(s.grad, jax.grad(rosen)(x_new), rtol=1e-4, atol=1e-4)
        assert float(s.info.decrease_error) == 0.0 and float(s.info.curvature_error) == 0.0
        assert 1 <= int(s.info.num_linesearch_steps) <= 30
        x = x_new
        if float(jnp.linalg.norm(jax.grad(rosen)(x))) < 1e-3:
            break


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_lbfgs_on_a_quadratic_matches_optax_minimiser_and_value_and_grad_reuses_state():
    ours, st = solve(optim, optim.lbfgs(), quad, P0, 10)
    theirs, _ = solve(optax, optax.lbfgs(), quad, P0, 10)
    _same(ours[-1], theirs[-1], rtol=1e-4, atol=1e-5)
    _same(ours[-1], {"x": jnp.ones(5), "y": jnp.full(2, -2.0)}, rtol=1e-4, atol=1e-5)
    calls = []

    def f(p):
        calls.append(1)
        return quad(p)

    vg = optim.value_and_grad_from_state(f)
    v, _ = vg(ours[-1], state=st)  # stored: f is not traced again
    assert calls == [] or len(calls) == 1  # lax.cond traces both branches once
    np.testing.assert_allclose(v, quad(ours[-1]), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="no 'value'"):
        optim.value_and_grad_from_state(quad)(P0, state=optim.adam(0.1).init(P0))


def test_lbfgs_bad_arguments():
    with pytest.raises(ValueError, match="memory_size"):
        optim.scale_by_lbfgs(memory_size=0)
    with pytest.raises(ValueError, match="initial_guess_strategy"):
        optim.scale_by_zoom_linesearch(10, initial_guess_strategy="max")
