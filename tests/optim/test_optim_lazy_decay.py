"""Weight decay kept pending on pytree params (no concatenate of the params).

``add_decayed_weights`` in a chain over ordinary pytree params returns updates carrying a
pending ``+ wd * params`` term; ``scale``/``scale_by_learning_rate``/``scale_by_schedule``
scale it, and the unpack adds it leaf by leaf. These tests check that the results equal
the materialised computation (a member that reads the buffers in between forces it), the
float64 NumPy references, and that the params are never packed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import optim
from cairn.optim import _packing as pk
from optim import _optim_refs as R

SHAPES = {"enc": {"kernel": (4, 3), "bias": (3,)}, "dec": {"kernel": (3, 5), "bias": (5,)},
          "scale": (2, 2)}


def _tree(rng, dtype, shapes=SHAPES):
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), dtype), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def _flat(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_leaves_with_path(tree)}


def _materialising():
    """A packed-aware member that reads the buffers and leaves the values unchanged."""
    return optim.clip(float("inf"))


def _run_pair(lazy_tx, eager_tx, dtype, steps=4, seed=0):
    rng = np.random.default_rng(seed)
    params = _tree(rng, dtype)
    s_lazy, s_eager = lazy_tx.init(params), eager_tx.init(params)
    upd_lazy, upd_eager = jax.jit(lazy_tx.update), jax.jit(eager_tx.update)
    outs = []
    for _ in range(steps):
        g = _tree(rng, dtype)
        u1, s_lazy = upd_lazy(g, s_lazy, params)
        u2, s_eager = upd_eager(g, s_eager, params)
        outs.append((u1, u2))
        params = optim.apply_updates(params, u1)
    return outs


def _adamw_chain(extra=(), lr=0.05, wd=0.1, mask=None, mu_dtype=None, materialise=False):
    mid = (_materialising(),) if materialise else ()
    return optim.chain(*extra, optim.scale_by_adam(mu_dtype=mu_dtype),
                       optim.add_decayed_weights(wd, mask), *mid,
                       optim.scale_by_learning_rate(lr))


CASES = {
    "adamw": lambda m: _adamw_chain(materialise=m),
    "clip+adamw": lambda m: _adamw_chain((optim.clip_by_global_norm(0.5),), materialise=m),
    "masked": lambda m: _adamw_chain(mask=".*/kernel", materialise=m),
    "masked_dict": lambda m: _adamw_chain(mask={"dec/.*": True, ".*": False}, materialise=m),
    "wd_schedule": lambda m: _adamw_chain(wd=optim.linear_schedule(0.2, 0.0, 5),
                                          materialise=m),
    "two_scales": lambda m: optim.chain(
        optim.scale_by_adam(), optim.add_decayed_weights(0.1),
        *((_materialising(),) if m else ()), optim.scale(0.5),
        optim.scale_by_schedule(lambda c: 0.1 / (1.0 + c)), optim.scale(-1.0)),
    "mu_dtype_bf16": lambda m: _adamw_chain(mu_dtype=jnp.bfloat16, materialise=m),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pending_decay_equals_materialised_float32(name):
    for u_lazy, u_eager in _run_pair(CASES[name](False), CASES[name](True), jnp.float32):
        for k, v in _flat(u_lazy).items():
            want = np.asarray(_flat(u_eager)[k])
            if name.startswith("masked"):
                # the materialised masked term goes through a select on the flat buffer,
                # which changes whether the compiler fuses the multiply-add into an FMA:
                # one float32 rounding of the (pre-cancellation) sum apart
                atol = 2.0 ** -22 * float(np.max(np.abs(want)))
                np.testing.assert_allclose(np.asarray(v), want, rtol=0, atol=atol,
                                           err_msg=f"{name} at {k}")
            else:  # same operations in the same order: bit-identical
                np.testing.assert_array_equal(np.asarray(v), want, err_msg=f"{name} at {k}")


@pytest.mark.parametrize("name", ["adamw", "masked", "mu_dtype_bf16"])
def test_pending_decay_equals_materialised_bfloat16(name):
    # bf16: same element-wise operations in the same order; XLA may keep excess
    # precision differently in the per-leaf and the flat kernels, so allow one bf16 ulp
    for u_lazy, u_eager in _run_pair(CASES[name](False), CASES[name](True), jnp.bfloat16):
        for k, v in _flat(u_lazy).items():
            assert v.dtype == jnp.bfloat16
            a = np.asarray(v, np.float64)
            b = np.asarray(_flat(u_eager)[k], np.float64)
            np.testing.assert_allclose(a, b, rtol=2 ** -7, atol=1e-6, err_msg=f"{name} at {k}")


def _ref_run(tx, ref_for, steps=6, seed=3, wd_at=lambda t: 0.1):
    """Our updates against float64 references (``ref_for(path)`` picks each leaf's)."""
    rng = np.random.default_rng(seed)
    params = _tree(rng, jnp.float32)
    paths = list(_flat(params))
    refs = {k: ref_for(k).init({k: np.asarray(v, np.float64)})
            for k, v in _flat(params).items()}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t in range(steps):
        g = _tree(rng, jnp.float32)
        u, state = update(g, state, params)
        fu = _flat(u)
        for k in paths:
            ref = refs[k]
            if "wd" in ref.hp:
                ref.hp["wd"] = wd_at(t)
            r = ref.step({k: np.asarray(_flat(g)[k], np.float64)},
                         {k: np.asarray(_flat(params)[k], np.float64)})[k]
            scale = np.max(np.abs(r)) + 1e-12
            err = np.max(np.abs(np.asarray(fu[k], np.float64) - r)) / scale
            assert err <= 1e-4, f"step {t} at {k}: relative error {err:.2e}"
        params = optim.apply_updates(params, u)


def test_adamw_matches_float64_reference():
    _ref_run(optim.adamw(0.05, weight_decay=0.1), lambda k: R.Adam(lr=0.05, wd=0.1))


def test_clip_adamw_matches_float64_reference():
    # clip_by_global_norm with a large bound is the identity on these gradients, so the
    # reference is AdamW; the clip reads the buffers before the pending term exists
    tx = optim.chain(optim.clip_by_global_norm(1e6), optim.adamw(0.05, weight_decay=0.1))
    _ref_run(tx, lambda k: R.Adam(lr=0.05, wd=0.1))


def test_masked_weight_decay_matches_float64_reference():
    tx = optim.adamw(0.05, weight_decay=0.1, mask=".*/kernel")
    _ref_run(tx, lambda k: R.Adam(lr=0.05, wd=0.1) if k.endswith("kernel")
             else R.Adam(lr=0.05))


def test_weight_decay_schedule_matches_float64_reference():
    sched = optim.linear_schedule(0.3, 0.0, 4)
    tx = optim.adamw(0.05, weight_decay=sched)
    _ref_run(tx, lambda k: R.Adam(lr=0.05, wd=0.3),
             wd_at=lambda t: float(np.float32(sched(t))))


def _step_fn(tx):
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optim.apply_updates(p, u), s

    return step


@pytest.mark.parametrize("mask", [None, ".*/w0[0-4]"])
def test_adamw_pytree_step_concatenates_only_the_grads(mask):
    params = {f"layer{i}": {f"w{i:02d}": jnp.zeros((3,), jnp.float32)} for i in range(50)}
    grads = jax.tree.map(lambda x: x + 1.0, params)
    for tx, norms in ((optim.adamw(1e-3, weight_decay=0.1, mask=mask), 0),
                      (optim.chain(optim.clip_by_global_norm(1.0),
                                   optim.adamw(1e-3, weight_decay=0.1, mask=mask)), 1)):
        # per-parameter state (default): only the global norm's transient concatenate
        jaxpr = str(jax.make_jaxpr(_step_fn(tx))(params, tx.init(params), grads))
        assert jaxpr.count("concatenate") == norms
        # packed state (opt-in): one concatenate (the grads); the params are never packed
        tx = optim.pack(tx)
        jaxpr = str(jax.make_jaxpr(_step_fn(tx))(params, tx.init(params), grads))
        assert jaxpr.count("concatenate") == 1


def test_a_member_reading_the_buffers_still_packs_the_params_once():
    params = {f"w{i:02d}": jnp.zeros((3,), jnp.float32) for i in range(20)}
    tx = optim.pack(_adamw_chain(materialise=True))
    jaxpr = str(jax.make_jaxpr(_step_fn(tx))(params, tx.init(params), params))
    assert jaxpr.count("concatenate") == 2


def test_update_returns_optax_style_pytree_with_decay_applied():
    rng = np.random.default_rng(7)
    params, grads = _tree(rng, jnp.float32), _tree(rng, jnp.float32)
    lr, wd = 0.05, 0.1
    tx = optim.adamw(lr, weight_decay=wd)
    u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    assert jax.tree.structure(u) == jax.tree.structure(params)
    assert not any(isinstance(x, pk.Packed) for x in jax.tree.leaves(
        u, is_leaf=lambda x: isinstance(x, pk.Packed)))
    adam = optim.scale_by_adam()
    a, _ = adam.update(grads, adam.init(params), params)
    for k, v in _flat(u).items():
        want = -lr * (np.asarray(_flat(a)[k], np.float64)
                      + wd * np.asarray(_flat(params)[k], np.float64))
        np.testing.assert_allclose(np.asarray(v, np.float64), want, rtol=1e-6, atol=1e-8,
                                   err_msg=k)


def test_packed_updates_from_a_top_level_call_are_materialised():
    # a caller passing packed grads with pytree params gets plain Packed updates back
    rng = np.random.default_rng(1)
    params, grads = _tree(rng, jnp.float32), _tree(rng, jnp.float32)
    tx = optim.pack(optim.adamw(0.05, weight_decay=0.1))
    state = tx.init(params)
    g = optim.pack(grads, pk.find_layout(state))
    u, _ = tx.update(g, state, params)
    assert type(u) is pk.Packed
    ref, _ = tx.update(grads, tx.init(params), params)
    back = optim.unpack(u)
    for k, v in _flat(ref).items():
        np.testing.assert_array_equal(np.asarray(_flat(back)[k]), np.asarray(v))


def test_weight_decay_change_does_not_recompile_and_takes_effect():
    params = {"a": jnp.ones((3,), jnp.float32), "b": jnp.full((2,), 2.0, jnp.float32)}
    grads = jax.tree.map(jnp.zeros_like, params)
    tx = optim.adamw(0.1, weight_decay=0.0)
    step = jax.jit(_step_fn(tx))
    state = tx.init(params)
    p0, _ = step(params, state, grads)
    state = optim.set_hyperparams(state, weight_decay=0.5)
    p1, _ = step(params, state, grads)
    assert step._cache_size() == 1
    # zero grads: Adam's update is 0, the step is -lr * wd * p
    np.testing.assert_allclose(np.asarray(p0["a"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(p1["a"]), 1.0 - 0.1 * 0.5, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(p1["b"]), 2.0 * (1 - 0.1 * 0.5), rtol=1e-6)


def test_params_of_the_wrong_dtype_name_the_path():
    params = {"a": jnp.ones((3,), jnp.float32), "b": jnp.ones((2,), jnp.float32)}
    tx = optim.adamw(0.1, weight_decay=0.1)
    state = tx.init(params)
    bad = {"a": params["a"], "b": params["b"].astype(jnp.bfloat16)}
    with pytest.raises(TypeError, match="params at path 'b'.*float32"):
        tx.update(params, state, bad)
    with pytest.raises(ValueError, match="missing paths \\['b'\\]"):
        tx.update(params, state, {"a": params["a"]})


def test_packed_params_mode_is_not_pending():
    rng = np.random.default_rng(2)
    params, grads = _tree(rng, jnp.float32), _tree(rng, jnp.float32)
    tx = optim.adamw(0.05, weight_decay=0.1)
    layout = optim.layout_of(params)
    pp, pg = optim.pack(params, layout), optim.pack(grads, layout)
    u, _ = tx.update(pg, tx.init(pp), pp)
    assert type(u) is pk.Packed
    ref, _ = tx.update(grads, tx.init(params), params)
    for k, v in _flat(ref).items():
        np.testing.assert_allclose(np.asarray(u[k]), np.asarray(v), rtol=1e-6, atol=1e-9)
