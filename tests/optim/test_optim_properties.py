"""Hypothesis properties over every optimizer: jit, vmap, stable state, dtypes, no retrace,
finite updates for zero gradients, packed and unpacked paths agree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cairn import optim

OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.1),
    "sgd_momentum": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optim.adam(0.01),
    "adamw": lambda: optim.adamw(0.01),
    "nadam": lambda: optim.nadam(0.01),
    "nadamw": lambda: optim.nadamw(0.01),
    "adamax": lambda: optim.adamax(0.01),
    "adamaxw": lambda: optim.adamaxw(0.01),
    "amsgrad": lambda: optim.amsgrad(0.01),
    "adagrad": lambda: optim.adagrad(0.1),
    "adadelta": lambda: optim.adadelta(1.0),
    "adafactor": lambda: optim.adafactor(0.01),
    "adabelief": lambda: optim.adabelief(0.01),
    "lamb": lambda: optim.lamb(0.01),
    "lars": lambda: optim.lars(0.1),
    "lion": lambda: optim.lion(0.01),
    "novograd": lambda: optim.novograd(0.01),
    "radam": lambda: optim.radam(0.01),
    "rmsprop": lambda: optim.rmsprop(0.01, momentum=0.9),
    "rprop": lambda: optim.rprop(0.01),
    "sm3": lambda: optim.sm3(0.1),
    "yogi": lambda: optim.yogi(0.01),
    "fromage": lambda: optim.fromage(0.01),
    "noisy_sgd": lambda: optim.noisy_sgd(0.01, seed=1),
    "sign_sgd": lambda: optim.sign_sgd(0.01),
    "signum": lambda: optim.signum(0.01),
    "muon": lambda: optim.muon(0.01),
    "shampoo": lambda: optim.shampoo(0.01, block_size=4, precondition_every=2),
    "schedule_free_adamw": lambda: optim.schedule_free_adamw(0.01),
    "schedule_free_sgd": lambda: optim.schedule_free_sgd(0.1),
    "clip_adamw": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.01)),
}

# The default suite runs a few examples per property (each example compiles a step); the slow
# suite runs many more of the same properties.
FAST = settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shape_st = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)
tree_st = st.fixed_dictionaries({"a": shape_st, "b": shape_st, "m": st.tuples(st.integers(1, 5),
                                                                               st.integers(1, 5))})


def _tree(shapes, seed, dtype=jnp.float32, zero=False):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(np.zeros(s) if zero else rng.normal(size=s), dtype)
            for k, s in shapes.items()}


def _test_jit_matches_eager_state_stable_no_retrace(name, shapes, seed):
    tx = OPTIMIZERS[name]()
    params = _tree(shapes, seed)
    state = tx.init(params)
    traces = []

    def step(p, s, g):
        traces.append(1)
        u, s = tx.update(g, s, p)
        return optim.apply_updates(p, u), s, u

    jstep = jax.jit(step)
    p, s = params, state
    ep, es = params, state
    for i in range(2):
        g = _tree(shapes, seed + 100 + i)
        p, s, u = jstep(p, s, g)
        ep, es, eu = step(ep, es, g)
        for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(eu)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-5)
        assert [x.shape for x in jax.tree.leaves(s)] == [x.shape for x in
                                                         jax.tree.leaves(state)]
        assert [x.dtype for x in jax.tree.leaves(s)] == [x.dtype for x in
                                                         jax.tree.leaves(state)]
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p))
    assert len(traces) == 1 + 2, f"{name}: the jitted step was traced {len(traces) - 2} times"


test_jit_matches_eager_state_stable_no_retrace = FAST(given(name=st.sampled_from(sorted(OPTIMIZERS)), shapes=tree_st, seed=st.integers(0, 99))(_test_jit_matches_eager_state_stable_no_retrace))
test_jit_matches_eager_state_stable_no_retrace_slow = pytest.mark.slow(SLOW(given(name=st.sampled_from(sorted(OPTIMIZERS)), shapes=tree_st, seed=st.integers(0, 99))(_test_jit_matches_eager_state_stable_no_retrace)))



def _test_zero_gradients_give_finite_updates_and_bf16_is_preserved(name, shapes):
    tx = OPTIMIZERS[name]()
    params = _tree(shapes, 3, jnp.bfloat16)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(2):
        u, state = update(_tree(shapes, 0, jnp.bfloat16, zero=True), state, params)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u)), name
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(u)), name
        params = optim.apply_updates(params, u)
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params)), name


test_zero_gradients_give_finite_updates_and_bf16_is_preserved = FAST(given(name=st.sampled_from(sorted(OPTIMIZERS)), shapes=tree_st)(_test_zero_gradients_give_finite_updates_and_bf16_is_preserved))
test_zero_gradients_give_finite_updates_and_bf16_is_preserved_slow = pytest.mark.slow(SLOW(given(name=st.sampled_from(sorted(OPTIMIZERS)), shapes=tree_st)(_test_zero_gradients_give_finite_updates_and_bf16_is_preserved)))



def _test_vmap_over_independent_problems(name, shapes, seed):
    tx = OPTIMIZERS[name]()
    batch = 3
    params = {k: jnp.stack([v] * batch) for k, v in _tree(shapes, seed).items()}
    grads = {k: jnp.asarray(np.random.default_rng(seed).normal(size=v.shape), jnp.float32)
             for k, v in params.items()}

    def one(p, g):
        u, _ = tx.update(g, tx.init(p), p)
        return u

    batched = jax.vmap(one)(params, grads)
    for i in range(batch):
        single = one({k: v[i] for k, v in params.items()}, {k: v[i] for k, v in grads.items()})
        for k in single:
            np.testing.assert_allclose(np.asarray(batched[k][i]), np.asarray(single[k]),
                                       rtol=1e-5, atol=1e-6)


# one example by default (each compiles a vmapped and a single update of a whole optimizer: 10 s at 3);
# the slow twin draws 25
test_vmap_over_independent_problems = settings(FAST, max_examples=1)(given(name=st.sampled_from(["adam", "adamw", "lion", "sgd_momentum", "rmsprop", "clip_adamw",
                             "lamb", "muon", "adafactor"]),
       shapes=tree_st, seed=st.integers(0, 99))(_test_vmap_over_independent_problems))
test_vmap_over_independent_problems_slow = pytest.mark.slow(SLOW(given(name=st.sampled_from(["adam", "adamw", "lion", "sgd_momentum", "rmsprop", "clip_adamw",
                             "lamb", "muon", "adafactor"]),
       shapes=tree_st, seed=st.integers(0, 99))(_test_vmap_over_independent_problems)))



PACKED_AWARE = ["sgd", "sgd_momentum", "adam", "adamw", "nadamw", "adamax", "amsgrad", "adagrad",
                "adadelta", "adabelief", "lion", "radam", "rmsprop", "rprop", "yogi", "signum",
                "clip_adamw"]


def _test_packed_and_unpacked_paths_agree(name, shapes, seed):
    tx = OPTIMIZERS[name]()
    params = _tree(shapes, seed)
    layout = optim.layout_of(params)
    s1, s2 = tx.init(params), tx.init(optim.pack(params, layout))
    pp = optim.pack(params, layout)
    for i in range(2):
        g = _tree(shapes, seed + i + 1)
        u1, s1 = tx.update(g, s1, params)
        u2, s2 = tx.update(optim.pack(g, layout), s2, pp)
        assert isinstance(u2, optim.Packed)
        for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(optim.unpack(u2))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
        params = optim.apply_updates(params, u1)
        pp = optim.apply_updates(pp, u2)


test_packed_and_unpacked_paths_agree = FAST(given(name=st.sampled_from(PACKED_AWARE), shapes=tree_st, seed=st.integers(0, 99))(_test_packed_and_unpacked_paths_agree))
test_packed_and_unpacked_paths_agree_slow = pytest.mark.slow(SLOW(given(name=st.sampled_from(PACKED_AWARE), shapes=tree_st, seed=st.integers(0, 99))(_test_packed_and_unpacked_paths_agree)))



@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_is_a_pytree_of_arrays(name):
    tx = OPTIMIZERS[name]()
    state = tx.init(_tree({"a": (2, 3), "b": (4,)}, 0))
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
