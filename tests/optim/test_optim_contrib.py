"""cairn.optim.contrib against optax.contrib 0.2.8: the same trajectories over several steps.

Problem: a badly conditioned quadratic plus a small quartic on a dict of two leaves (a matrix
and a vector), float32, gradients from jax.grad, both optimizers jitted. Tolerances: the
methods do the same float32 arithmetic up to operation order, so the params agree to a few
float32 ulps after 10 steps (rtol 1e-5 / atol 1e-6) unless a test states otherwise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import cairn.optim as optim
from cairn.optim import contrib

A = jnp.asarray(np.diag(np.linspace(0.5, 4.0, 6)).reshape(6, 6), jnp.float32)


def loss(p):
    w, b = p["w"], p["b"]
    q = jnp.sum((w - 1.0) @ A * (w - 1.0)) + jnp.sum((b + 0.5) ** 2)
    return q + 0.1 * jnp.sum(w ** 4)


def params0():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w": jax.random.normal(k1, (3, 6)), "b": jax.random.normal(k2, (6,))}


def run(tx, steps=10, extra=None, params=None):
    p = params0() if params is None else params
    st = tx.init(p)

    @jax.jit
    def step(p, st):
        v, g = jax.value_and_grad(loss)(p)
        kw = extra(v) if extra else {}
        u, st = tx.update(g, st, p, **kw)
        return optax.apply_updates(p, u), st

    traj = []
    for _ in range(steps):
        p, st = step(p, st)
        traj.append(p)
    return traj, st


def assert_same(make, steps=10, rtol=1e-5, atol=1e-6, extra=None):
    ours, st = run(make(contrib, optim), steps, extra)
    theirs, st_ref = run(make(optax.contrib, optax), steps, extra)
    for t, (a, b) in enumerate(zip(ours, theirs)):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol,
                                       err_msg=f"step {t + 1}, leaf {k}")
    return st, st_ref


CASES = {
    "cocob": lambda c, o: c.cocob(),
    "cocob_lr_wd": lambda c, o: c.cocob(learning_rate=0.5, alpha=50.0, weight_decay=1e-2),
    "dog": lambda c, o: c.dog(),
    "dog_distance": lambda c, o: c.dog(learning_rate=0.5, init_step=("distance", 1e-2)),
    "dog_lr_wd": lambda c, o: c.dog(init_step=("learning_rate", 1e-2), weight_decay=1e-3),
    "dowg": lambda c, o: c.dowg(),
    "prodigy": lambda c, o: c.prodigy(),
    "prodigy_options": lambda c, o: c.prodigy(learning_rate=0.5, betas=(0.8, 0.99),
                                              weight_decay=1e-2, safeguard_warmup=True),
    "prodigy_schedule": lambda c, o: c.prodigy(
        learning_rate=o.linear_schedule(0.1, 1.0, 5), estim_lr0=1e-3),
    "mechanize_adam": lambda c, o: c.mechanize(o.adam(1e-2)),
    "mechanize_sgd": lambda c, o: c.mechanize(o.sgd(0.05, momentum=0.9), weight_decay=0.0,
                                              num_betas=3),
    "sam": lambda c, o: c.sam(o.sgd(0.05), o.chain(c.normalize(), o.sgd(0.05))),
    "sam_period3_keep": lambda c, o: c.sam(o.adam(1e-2), o.sgd(0.02), sync_period=3,
                                           reset_state=False),
    "schedule_free_adamw": lambda c, o: c.schedule_free_adamw(1e-2, warmup_steps=3),
    "schedule_free_sgd": lambda c, o: c.schedule_free_sgd(0.05),
}


# option variants run in the slow session (each case compiles two jitted steps)
SLOW = {"cocob_lr_wd", "dog_distance", "prodigy_schedule", "mechanize_sgd", "sam_period3_keep",
        "schedule_free_sgd"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in sorted(CASES)])
def test_contrib_matches_optax_contrib_over_steps(name):
    assert_same(CASES[name])


def test_muon_matches_optax_contrib_muon():
    """Muon on the 2-D leaf (Newton-Schulz in float32, 5 iterations: rtol 1e-4), Adam on the
    1-D leaf."""
    assert_same(lambda c, o: c.muon(1e-2), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_muon_options_match_optax_contrib_muon():
    assert_same(lambda c, o: c.muon(1e-2, beta=0.9, nesterov=False, weight_decay=1e-2,
                                    adam_b1=0.8), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(factor=0.5, patience=2, cooldown=1),
    dict(factor=0.5, patience=1, accumulation_size=3, min_scale=0.3, rtol=0.0, atol=1e-3),
])
def test_reduce_on_plateau_matches_optax(kw):
    values = [3.0, 2.0, 2.0, 2.0, 1.9999, 2.5, 2.5, 2.5, 2.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]

    def drive(c):
        tx = c.reduce_on_plateau(**kw)
        g = {"w": jnp.ones(3)}
        st = tx.init(g)
        out = []
        for v in values:
            u, st = jax.jit(tx.update)(g, st, value=jnp.asarray(v))
            out.append((float(u["w"][0]), float(st.scale), int(st.plateau_count),
                        int(st.cooldown_count)))
        return out

    assert drive(contrib) == drive(optax.contrib)


def test_reduce_on_plateau_in_a_chain_reads_value_and_tree_get_finds_scale():
    def make(c, o):
        return o.chain(o.adam(0.05), c.reduce_on_plateau(factor=0.5, patience=1))

    st, st_ref = assert_same(make, steps=12, extra=lambda v: {"value": v})
    assert float(optim.tree.get(st, "scale")) == float(optax.tree.get(st_ref, "scale"))


def test_state_names_match_optax_for_tree_get():
    p = params0()
    for name, field in [("cocob", "reward"), ("dog", "max_dist"), ("prodigy", "estim_lr"),
                        ("mechanize_adam", "s")]:
        ours = CASES[name](contrib, optim).init(p)
        theirs = CASES[name](optax.contrib, optax).init(p)
        a, b = optim.tree.get(ours, field), optax.tree.get(theirs, field)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y), a, b)


def test_sam_opaque_mode_matches_optax():
    def grad_fn(p, i):
        del i
        return jax.grad(loss)(p)

    def drive(c, o):
        tx = c.sam(o.sgd(0.05), o.chain(c.normalize(), o.sgd(0.05)), sync_period=3,
                   opaque_mode=True)
        p = params0()
        st = tx.init(p)
        for _ in range(4):
            u, st = tx.update(jax.grad(loss)(p), st, p, grad_fn=grad_fn)
            p = o.apply_updates(p, u)
        return p

    a, b = drive(contrib, optim), drive(optax.contrib, optax)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_contrib_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="factor"):
        contrib.reduce_on_plateau(factor=1.5)
    with pytest.raises(ValueError, match="rtol"):
        contrib.reduce_on_plateau(rtol=0.0, atol=0.0)
    with pytest.raises(ValueError, match="init_step"):
        contrib.dog(init_step=("bogus", 1.0))
    with pytest.raises(ValueError, match="sync_period"):
        contrib.sam(optim.sgd(0.1), optim.sgd(0.1), sync_period=0)
    tx = contrib.sam(optim.sgd(0.1), optim.sgd(0.1), opaque_mode=True)
    p = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="grad_fn"):
        tx.update(p, tx.init(p), p)
    tx = contrib.reduce_on_plateau()
    with pytest.raises(ValueError, match="value=loss"):
        tx.update(p, tx.init(p))
    for make in (contrib.prodigy, lambda: contrib.mechanize(optim.sgd(0.1)), contrib.cocob,
                 contrib.dog):
        tx = make()
        with pytest.raises(ValueError, match="params"):
            tx.update(p, tx.init(p))
