"""Core behaviour: packing, chain, groups by path rules, traced hyperparameters, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import optim
from cairn.core_array import flatten_with_paths
from cairn.optim import _packing as pk


def _params():
    f = lambda x: jnp.asarray(np.asarray(x, np.float32))  # noqa: E731  (strong float32)
    return {"embed": {"table": f(np.arange(12.0).reshape(4, 3) / 10)},
            "layers": [{"kernel": f(np.ones((3, 2))), "bias": f(np.zeros((2,)))},
                       {"kernel": f(-np.ones((2, 2))), "bias": f(np.full((2,), 0.5))}]}


def _grads(seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), _params())


# --- packing ---


def test_pack_unpack_round_trip_groups_by_dtype():
    tree = {"a": jnp.ones((2, 3)), "b": jnp.arange(4, dtype=jnp.bfloat16), "c": jnp.zeros((5,))}
    layout = optim.layout_of(tree)
    assert [g.dtype for g in layout.groups] == ["float32", "bfloat16"]
    p = optim.pack(tree, layout)
    assert [b.shape for b in p.buffers] == [(11,), (4,)]
    back = optim.unpack(p)
    for k in tree:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(tree[k]))
        assert back[k].dtype == tree[k].dtype
    # dynamic-offset unpacking gives the same leaves
    back2 = pk.unpack(p, pk.make_offsets(layout))
    np.testing.assert_array_equal(np.asarray(back2["c"]), np.zeros(5))
    np.testing.assert_array_equal(np.asarray(p["a"]), np.ones((2, 3)))


def test_runtime_offset_table_is_small_and_unpacks_every_leaf():
    # many same-shape leaves plus odd sizes and a second dtype: the table holds a few
    # digit scalars (not one per leaf), and runtime unpacking equals static slicing
    rng = np.random.default_rng(3)
    tree = {f"w{i:03d}": jnp.asarray(rng.normal(size=(7, 3)), jnp.float32) for i in range(300)}
    tree["odd"] = jnp.asarray(rng.normal(size=(5,)), jnp.float32)
    tree["half"] = [jnp.asarray(rng.normal(size=(4,)), jnp.bfloat16),
                    jnp.asarray(rng.normal(size=(2, 2)), jnp.bfloat16)]
    layout = optim.layout_of(tree)
    offsets = pk.make_offsets(layout)
    # offsets below 8**5 (6,305 floats): at most 8 * 5 entries, not 300
    assert len(offsets) == pk.offset_table_size(layout) <= 8 * 5
    p = optim.pack(tree, layout)
    back = jax.jit(lambda p, o: pk.unpack(p, o))(p, offsets)
    want = pk.unpack(p)
    for a, b, c in zip(jax.tree.leaves(back), jax.tree.leaves(want), jax.tree.leaves(tree)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
    # every leaf's start is recovered exactly from the table
    values, picks = pk._offset_plan(layout)
    for (gi, pos), row in picks.items():
        assert sum(values[j] for j in row) == layout.groups[gi].offsets[pos]


def test_runtime_offset_table_of_other_layout_is_rejected():
    a = {f"w{i}": jnp.ones((3,)) for i in range(20)}
    b = {f"w{i}": jnp.ones((3,)) for i in range(400)}
    la, lb = optim.layout_of(a), optim.layout_of(b)
    assert pk.offset_table_size(la) != pk.offset_table_size(lb)
    with pytest.raises(ValueError, match="runtime offsets table has"):
        pk.unpack(optim.pack(a, la), pk.make_offsets(lb))


def test_pytree_step_state_has_few_runtime_offset_scalars():
    # 500 same-shape leaves: the packed AdamW state (opt-in) carries count + mu + nu + a
    # small table
    params = {f"w{i:03d}": jnp.zeros((4,)) for i in range(500)}
    state = optim.pack(optim.adamw(1e-3)).init(params)
    assert len(jax.tree.leaves(state)) < 60
    grads = jax.tree.map(jnp.ones_like, params)

    @jax.jit
    def step(p, s, g):
        u, s = optim.adamw(1e-3).update(g, s, p)
        return optim.apply_updates(p, u), s

    new_p, _ = step(params, state, grads)
    # first Adam step moves every parameter by -lr * sign(g) (up to eps)
    for v in jax.tree.leaves(new_p):
        np.testing.assert_allclose(np.asarray(v), -1e-3, rtol=1e-4)


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_pytree_step_compiles_one_kernel_body_per_leaf_shape():
    # 300 same-shape leaves: the per-leaf unpack kernels must be identical fused
    # computations (XLA then compiles the body once), i.e. the distinct bodies do not
    # grow with the number of leaves
    import re

    def distinct_bodies(n):
        params = {f"w{i:03d}": jnp.zeros((6,)) for i in range(n)}
        tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, weight_decay=0.1))

        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optim.apply_updates(p, u), s

        txt = jax.jit(step).lower(params, tx.init(params), params).compile().as_text()
        bodies = re.findall(r"\n%fused_computation[^\n]*\{\n(.*?)\n\}", txt, re.S)
        assert len(bodies) >= n
        return len({re.sub(r"%[\w.\-]+", "%x", b) for b in bodies})

    assert distinct_bodies(300) == distinct_bodies(40) < 20


def test_state_moments_are_packed_buffers_with_paths():
    tx = optim.pack(optim.adamw(1e-3))
    state = tx.init(_params())
    mu = state[0].mu
    assert isinstance(mu, optim.Packed) and len(mu.buffers) == 1
    assert mu.buffers[0].shape == (12 + 6 + 2 + 4 + 2,)
    np.testing.assert_array_equal(np.asarray(mu["layers/0/kernel"]), np.zeros((3, 2)))


def test_chain_packs_once_and_matches_unpacked_composition():
    params, grads = _params(), _grads()
    a, b, c = optim.clip_by_global_norm(0.5), optim.scale_by_adam(), optim.scale(-0.1)
    tx = optim.chain(a, b, c)
    u_chain, _ = tx.update(grads, tx.init(params), params)
    # the same transforms applied one by one on ordinary pytrees
    u = grads
    for t in (a, b, c):
        u, _ = t.update(u, t.init(params), params)
    for x, y in zip(jax.tree.leaves(u_chain), jax.tree.leaves(u)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    # per-parameter state (the default): only the global norm concatenates (one transient
    # buffer per dtype on one device, for one reduction); nothing stored is concatenated
    jaxpr = jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(grads, tx.init(params))
    assert str(jaxpr).count("concatenate") == 1
    # packed state (opt-in): exactly one concatenate for the grads (one dtype group)
    ptx = optim.pack(tx)
    jaxpr = jax.make_jaxpr(lambda g, s: ptx.update(g, s, params))(grads, ptx.init(params))
    assert str(jaxpr).count("concatenate") == 1


def test_packed_params_mode_matches_pytree_mode():
    params, grads = _params(), _grads()
    tx = optim.adamw(0.1, weight_decay=0.1)
    layout = optim.layout_of(params)
    pp, gp = optim.pack(params, layout), optim.pack(grads, layout)
    s1, s2 = tx.init(params), tx.init(pp)
    for _ in range(3):
        u1, s1 = tx.update(grads, s1, params)
        params = optim.apply_updates(params, u1)
        u2, s2 = tx.update(gp, s2, pp)
        pp = optim.apply_updates(pp, u2)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(optim.unpack(pp))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


def test_global_norm_is_one_reduction_value():
    g = _grads()
    ref = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(g)))
    np.testing.assert_allclose(float(optim.global_norm(g)), ref, rtol=1e-6)


# --- hyperparameters ---


def test_learning_rate_in_state_changes_without_recompiling():
    params, grads = _params(), _grads()
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=1e-3))
    traces = []

    def step(p, s, g):
        traces.append(1)
        u, s = tx.update(g, s, p)
        return optim.apply_updates(p, u), s

    step = jax.jit(step)
    state = tx.init(params)
    hp = optim.get_hyperparams(state)
    assert float(hp["learning_rate"]) == pytest.approx(1e-2)
    assert float(hp["weight_decay"]) == pytest.approx(1e-3)
    p1, s1 = step(params, state, grads)
    s1 = optim.set_hyperparams(s1, learning_rate=0.0, weight_decay=0.0)
    p2, s2 = step(p1, s1, grads)
    assert len(traces) == 1, "changing hyperparameters retraced the step"
    # with lr = 0 the params do not move
    for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert float(optim.get_hyperparams(s2)["learning_rate"]) == 0.0


def test_schedule_value_is_readable_from_state():
    tx = optim.sgd(lambda step: 0.1 / (1.0 + step))
    s = tx.init(_params())
    for _ in range(3):
        _, s = tx.update(_grads(), s, _params())
    # value used at the last (third, step index 2) update
    assert float(optim.get_hyperparams(s)["learning_rate"]) == pytest.approx(0.1 / 3)


def test_inject_hyperparams_exposes_every_numeric_argument():
    tx = optim.inject_hyperparams(optim.adam)(learning_rate=0.1, b1=0.8)
    s = tx.init(_params())
    hp = optim.get_hyperparams(s)
    assert float(hp["b1"]) == pytest.approx(0.8)
    s = optim.set_hyperparams(s, b1=0.5)
    assert float(optim.get_hyperparams(s)["b1"]) == pytest.approx(0.5)


def test_set_hyperparams_unknown_name_raises():
    s = optim.adam(0.1).init(_params())
    with pytest.raises(KeyError, match="no hyperparameter 'momentum'.*learning_rate"):
        optim.set_hyperparams(s, momentum=0.9)


def test_partition_groups_have_path_qualified_hyperparams():
    tx = optim.partition({"a": optim.sgd(0.1), "b": optim.sgd(0.2)},
                         {"embed/.*": "a", ".*": "b"})
    hp = optim.get_hyperparams(tx.init(_params()))
    assert set(hp) == {"inner_states/a/1/learning_rate", "inner_states/b/1/learning_rate"}


# --- dtypes ---


@pytest.mark.parametrize("name", ["adam", "adamw", "nadam", "nadamw", "amsgrad", "adamax",
                                  "adamaxw", "adabelief", "radam", "yogi", "lamb", "muon"])
def test_mu_and_nu_dtype_on_adam_family(name):
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
    tx = getattr(optim, name)(1e-3, mu_dtype=jnp.float32, nu_dtype=jnp.float32)
    state = tx.init(params)
    # per-parameter moments: every mu / nu leaf (not the counts) is float32
    moments = [v for k, v in flatten_with_paths(state).items()
               if "/mu/" in k or "/nu/" in k or "/nu_max/" in k]
    assert moments and all(v.dtype == jnp.float32 for v in moments)
    packed = optim.pack(tx).init(params)
    packs = [x for x in jax.tree.leaves(packed, is_leaf=lambda t: isinstance(t, optim.Packed))
             if isinstance(x, optim.Packed)]
    assert packs and all(b.dtype == jnp.float32 for p in packs for b in p.buffers)
    u, state2 = jax.jit(tx.update)(_grads_bf16(), state, params)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(u))
    assert [a.dtype for a in jax.tree.leaves(state2)] == [a.dtype for a in jax.tree.leaves(state)]


def _grads_bf16():
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), _grads())


def test_lion_mu_dtype():
    s = optim.lion(1e-3, mu_dtype=jnp.bfloat16).init(_params())
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(s[0].mu))
    s = optim.pack(optim.lion(1e-3, mu_dtype=jnp.bfloat16)).init(_params())
    assert s[0].mu.buffers[0].dtype == jnp.bfloat16


# --- groups by path ---


def test_partition_with_path_rules_first_match_wins_and_frozen_has_no_state():
    params, grads = _params(), _grads()
    tx = optim.partition({"frozen": optim.set_to_zero(), "adamw": optim.adamw(0.1)},
                         {"embed/.*": "frozen", ".*": "adamw"})
    state = tx.init(params)
    assert state.inner_states["frozen"] == optim.EmptyState()
    mu = flatten_with_paths(state.inner_states["adamw"][0].mu)
    assert "embed/table" not in mu and len(mu) == 4
    u, _ = jax.jit(tx.update)(grads, state, params)
    np.testing.assert_array_equal(np.asarray(u["embed"]["table"]), np.zeros((4, 3)))
    ref, _ = optim.adamw(0.1).update({"layers": grads["layers"]},
                                     optim.adamw(0.1).init({"layers": params["layers"]}),
                                     {"layers": params["layers"]})
    np.testing.assert_allclose(np.asarray(u["layers"][1]["kernel"]),
                               np.asarray(ref["layers"][1]["kernel"]), rtol=1e-6)


def test_frozen_group_costs_no_compute():
    params, grads = _params(), _grads()
    tx = optim.partition({"frozen": optim.set_to_zero(), "sgd": optim.sgd(0.1)},
                         {"embed/.*": "frozen", ".*": "sgd"})
    closed = jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(grads, tx.init(params))
    jaxpr = closed.jaxpr
    embed_grad = jaxpr.invars[0]  # flatten order: embed/table first
    assert embed_grad.aval.shape == (4, 3)
    used = {id(v) for e in jaxpr.eqns for v in e.invars}
    assert id(embed_grad) not in used, "the frozen group's gradient was read"


def test_partition_rule_matching_nothing_names_the_rule():
    tx = optim.partition({"a": optim.sgd(0.1), "b": optim.sgd(0.2)},
                         {"decoder/.*": "a", ".*": "b"})
    with pytest.raises(ValueError, match=r"rule 'decoder/\.\*' matches no parameter"):
        tx.init(_params())


def test_partition_parameter_matched_by_no_rule_names_the_path():
    tx = optim.partition({"a": optim.sgd(0.1)}, {"embed/.*": "a"})
    with pytest.raises(ValueError, match="path 'layers/0/bias' matches none of the rules"):
        tx.init(_params())


def test_partition_shadowed_rule_is_an_error():
    tx = optim.partition({"a": optim.sgd(0.1), "b": optim.sgd(0.2)},
                         [(".*", "a"), ("embed/.*", "b")])
    with pytest.raises(ValueError, match="only matches parameters already claimed"):
        tx.init(_params())


def test_partition_unknown_label_and_unused_transform():
    with pytest.raises(ValueError, match="label 'c' which is not a key"):
        optim.partition({"a": optim.sgd(0.1)}, {".*": "c"}).init(_params())
    # a transform no parameter uses is kept with an empty state, as in Optax
    tx = optim.partition({"a": optim.sgd(0.1), "b": optim.adam(0.1)}, {".*": "a"})
    state = tx.init(_params())
    assert jax.tree.leaves(state.inner_states["b"][0].mu) == []
    u, _ = tx.update(_grads(), state, _params())
    ref, _ = optim.sgd(0.1).update(_grads(), optim.sgd(0.1).init(_params()), _params())
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b), u, ref)


def test_partition_accepts_label_tree_like_optax():
    labels = {"embed": "x", "layers": "y"}
    tx = optim.multi_transform({"x": optim.sgd(0.0), "y": optim.sgd(1.0)}, labels)
    u, _ = tx.update(_grads(), tx.init(_params()), _params())
    np.testing.assert_array_equal(np.asarray(u["embed"]["table"]), np.zeros((4, 3)))
    np.testing.assert_allclose(np.asarray(u["layers"][0]["bias"]),
                               -np.asarray(_grads()["layers"][0]["bias"]), rtol=1e-6)


def test_masked_with_regex_and_freeze():
    g = _grads()
    tx = optim.masked(optim.scale(2.0), ".*/kernel")
    u, _ = tx.update(g, tx.init(_params()))
    np.testing.assert_allclose(np.asarray(u["layers"][0]["kernel"]),
                               2 * np.asarray(g["layers"][0]["kernel"]))
    np.testing.assert_array_equal(np.asarray(u["layers"][0]["bias"]),
                                  np.asarray(g["layers"][0]["bias"]))
    f = optim.freeze({"embed/.*": True, ".*": False})
    u, _ = f.update(g, f.init(_params()))
    np.testing.assert_array_equal(np.asarray(u["embed"]["table"]), np.zeros((4, 3)))


def test_add_decayed_weights_mask_on_packed_buffer():
    params = _params()
    mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    tx = optim.add_decayed_weights(0.5, mask)
    u, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    np.testing.assert_allclose(np.asarray(u["layers"][0]["kernel"]), 0.5 * np.ones((3, 2)))
    np.testing.assert_array_equal(np.asarray(u["layers"][1]["bias"]), np.zeros(2))


def test_mask_with_many_runs_uses_searchsorted_path():
    params = {f"p{i:02d}": jnp.ones((3,)) for i in range(40)}
    mask = {f"p{i:02d}": i % 2 == 0 for i in range(40)}
    tx = optim.add_decayed_weights(1.0, mask)
    u, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    for i in range(40):
        np.testing.assert_array_equal(np.asarray(u[f"p{i:02d}"]), np.full(3, float(i % 2 == 0)))


# --- MultiSteps ---


def test_multisteps_single_packed_accumulator_and_mean():
    params = _params()
    inner = optim.sgd(1.0)
    ms = optim.MultiSteps(inner, every_k_schedule=3)
    assert ms.inner_opt is inner  # Optax's name for the wrapped optimizer
    packed = optim.pack(ms.gradient_transformation()).init(params)
    accs = [x for x in jax.tree.leaves(packed, is_leaf=lambda t: isinstance(t, optim.Packed))
            if isinstance(x, optim.Packed)]
    assert len(accs) == 1 and len(accs[0].buffers) == 1
    state = ms.init(params)
    # by default one accumulator per parameter, keyed by its path
    assert sorted(flatten_with_paths(state.acc_grads)) == sorted(flatten_with_paths(params))
    gs = [_grads(i) for i in range(3)]
    step = jax.jit(ms.update)
    for i, g in enumerate(gs):
        u, state = step(g, state, params)
        if i < 2:
            assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(u))
            assert not bool(ms.has_updated(state))
    mean = jax.tree.map(lambda *x: sum(x) / 3, *gs)
    for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(mean)):
        np.testing.assert_allclose(np.asarray(a), -np.asarray(b), rtol=1e-5, atol=1e-6)
    assert bool(ms.has_updated(state))


# --- bad input ---


def _drop_embed(g):
    del g["embed"]


def _bias_to_bf16(g):
    g["layers"][1]["bias"] = g["layers"][1]["bias"].astype(jnp.bfloat16)


def _transposed_table(g):
    g["embed"]["table"] = jnp.zeros((3, 4))


@pytest.mark.parametrize("make_tx, corrupt, error, match", [
    pytest.param(lambda: optim.adam(0.1), _drop_embed, ValueError,
                 r"missing paths \['embed/table'\]", id="mismatched_tree"),
    pytest.param(lambda: optim.sgd(0.1, momentum=0.9), _transposed_table, ValueError,
                 r"'embed/table' has shape \(3, 4\), expected \(4, 3\)", id="wrong_shape"),
])
def test_bad_update_tree_names_the_path(make_tx, corrupt, error, match):
    tx = make_tx()
    state = tx.init(_params())
    bad = _grads()
    corrupt(bad)
    with pytest.raises(error, match=match):
        tx.update(bad, state)


def test_update_of_another_dtype_is_computed_against_the_state_dtype():
    # per-parameter state keeps its own dtype (as Optax): a bfloat16 gradient for a
    # float32 parameter is computed against the float32 moments and keeps its dtype
    tx = optim.adam(0.1)
    state = tx.init(_params())
    g = _grads()
    _bias_to_bf16(g)
    u, s = tx.update(g, state)
    assert u["layers"][1]["bias"].dtype == jnp.bfloat16
    assert s[0].mu["layers"][1]["bias"].dtype == jnp.float32


def test_mismatched_params_tree_names_paths():
    tx = optim.adamw(0.1)
    state = tx.init(_params())
    p = _params()
    p["extra"] = jnp.zeros(2)
    with pytest.raises(ValueError, match=r"params tree structure.*unexpected paths \['extra'\]"):
        tx.update(_grads(), state, p)


class _Box:
    """A pytree node holding one dict (another container for the same leaf paths)."""

    def __init__(self, d):
        self.d = d


jax.tree_util.register_pytree_with_keys(
    _Box, lambda b: ([(jax.tree_util.DictKey(k), v) for k, v in b.d.items()], tuple(b.d)),
    lambda keys, vals: _Box(dict(zip(keys, vals))),
)


def test_a_structure_mismatch_of_containers_alone_names_where_and_which_types():
    a = {"w": jnp.ones(3), "b": {"c": jnp.ones(2)}}
    boxed = {"w": jnp.ones(3), "b": _Box({"c": jnp.ones(2)})}
    with pytest.raises(ValueError, match=r"tree.vdot: .*same leaf paths, but the containers differ "
                                         r"at \['b'\]: dict in the first, _Box in argument 1"):
        optim.tree.vdot(a, boxed)
    with pytest.raises(ValueError, match=r"containers differ at the root: dict in params, _Box in updates"):
        optim.apply_updates(a, _Box(dict(a)))
    assert float(optim.tree.vdot(a, a)) == pytest.approx(5.0)


def test_apply_updates_mismatch_names_paths():
    u = _grads()
    del u["layers"]
    with pytest.raises(ValueError, match="paths only in params.*layers/0/bias"):
        optim.apply_updates(_params(), u)


@pytest.mark.parametrize("factory", [optim.sgd, optim.adam, optim.adamw, optim.lion,
                                     optim.rmsprop, optim.muon, optim.shampoo])
def test_negative_learning_rate_rejected(factory):
    with pytest.raises(ValueError, match="learning_rate must be >= 0"):
        factory(-1e-3)


def test_nan_learning_rate_and_nan_schedule_rejected():
    with pytest.raises(ValueError, match="learning_rate is NaN"):
        optim.adam(float("nan"))
    tx = optim.adam(lambda step: jnp.where(step >= 2, jnp.nan, 0.1))
    state = tx.init(_params())
    for _ in range(2):
        _, state = tx.update(_grads(), state)
    with pytest.raises(ValueError, match="learning_rate schedule returned NaN at step 2"):
        tx.update(_grads(), state)
    with pytest.raises(ValueError, match="schedule returned NaN at step 0"):
        optim.sgd(lambda s: jnp.nan).init(_params())


def test_bad_learning_rate_type():
    with pytest.raises(TypeError, match="learning_rate must be a number or a schedule"):
        optim.adam("fast")


def test_chain_rejects_non_transformations_and_bad_state():
    with pytest.raises(TypeError, match="chain member 1 is not a GradientTransformation"):
        optim.chain(optim.sgd(0.1), 3)
    tx = optim.chain(optim.sgd(0.1), optim.scale(1.0))
    with pytest.raises(ValueError, match="expected a tuple of 2 member states, got a dict"):
        tx.update(_grads(), {"not": "a state"})


def test_missing_params_for_weight_decay():
    tx = optim.adamw(0.1)
    with pytest.raises(ValueError, match="needs `params`"):
        tx.update(_grads(), tx.init(_params()))


# --- misc API ---


def test_apply_if_finite_skips_nan_steps():
    tx = optim.apply_if_finite(optim.sgd(1.0), max_consecutive_errors=2)
    s = tx.init(_params())
    g = jax.tree.map(lambda x: x.at[...].set(jnp.nan), _grads())
    u, s = tx.update(g, s)
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(u))
    assert int(s.notfinite_count) == 1 and not bool(s.last_finite)


def test_named_chain_and_tree_module():
    tx = optim.named_chain(("clip", optim.clip(0.1)), ("sgd", optim.sgd(1.0)))
    s = tx.init(_params())
    assert set(s) == {"clip", "sgd"}
    u, _ = tx.update(_grads(), s)
    assert float(optim.tree.max(optim.tree.real(u))) <= 0.1 + 1e-7
    a = _grads()
    np.testing.assert_allclose(float(optim.tree.vdot(a, a)), float(optim.tree.norm(a)) ** 2,
                               rtol=1e-5)
    with pytest.raises(ValueError, match="different structure"):
        optim.tree.add(a, {"x": 1})


def test_incremental_and_periodic_update():
    new, old = {"a": jnp.ones(2)}, {"a": jnp.zeros(2)}
    np.testing.assert_allclose(np.asarray(optim.incremental_update(new, old, 0.25)["a"]),
                               [0.25, 0.25])
    assert float(optim.periodic_update(new, old, 4, 2)["a"][0]) == 1.0
    assert float(optim.periodic_update(new, old, 3, 2)["a"][0]) == 0.0


def test_lookahead_syncs_slow_weights():
    params = optim.LookaheadParams.init_synced({"w": jnp.ones(2)})
    tx = optim.lookahead(optim.sgd(1.0), sync_period=2, slow_step_size=0.5)
    s = tx.init(params)
    g = {"w": jnp.ones(2)}
    for _ in range(2):
        u, s = tx.update(g, s, params)
        params = optim.apply_updates(params, u)
    # fast went 1 -> 0 -> -1, slow moves half way to -1 and fast is reset to it
    np.testing.assert_allclose(np.asarray(params.slow["w"]), [0.0, 0.0])
    np.testing.assert_allclose(np.asarray(params.fast["w"]), [0.0, 0.0])


def test_schedule_free_eval_params_recovers_x():
    tx = optim.schedule_free_sgd(0.1)
    p = {"w": jnp.ones(3)}
    s = tx.init(p)
    u, s = tx.update({"w": jnp.ones(3)}, s, p)
    p = optim.apply_updates(p, u)
    x = optim.schedule_free_eval_params(s, p)
    np.testing.assert_allclose(np.asarray(x["w"]), np.full(3, 0.9), rtol=1e-6)


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_packed_params_training_loop_with_grad_of_packed():
    params = _params()
    layout = optim.layout_of(params)
    pp = optim.pack(params, layout)

    def loss(p):
        t = p.unpack()
        return sum(jnp.sum((x - 0.25) ** 2) for x in jax.tree.leaves(t))

    tx = optim.adamw(0.05)
    state = tx.init(pp)

    @jax.jit
    def step(p, s):
        g = jax.grad(loss)(p)
        assert isinstance(g, optim.Packed) and g.layout == layout
        u, s = tx.update(g, s, p)
        return optim.apply_updates(p, u), s

    l0 = float(loss(pp))
    for _ in range(30):
        pp, state = step(pp, state)
    assert float(loss(pp)) < 0.2 * l0
    # same trajectory as the pytree path
    tx2 = optim.adamw(0.05)
    s2, p2 = tx2.init(params), params
    for _ in range(30):
        u, s2 = tx2.update(jax.grad(lambda t: loss(optim.pack(t, layout)))(p2), s2, p2)
        p2 = optim.apply_updates(p2, u)
    for a, b in zip(jax.tree.leaves(pp.unpack()), jax.tree.leaves(p2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_masked_and_partition_align_leaves_past_a_none_subtree():
    # a None subtree in the params is an empty node, not a leaf: the leaves after it keep
    # their own updates (they came back shifted by one, the selected one as None)
    params = {"a": jnp.ones(2), "b": None, "c": jnp.ones(3)}
    grads = {"a": jnp.full(2, 2.0), "b": None, "c": jnp.full(3, 2.0)}
    tx = optim.masked(optim.scale(-1.0), {"a": False, "b": False, "c": True})
    u, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_array_equal(np.asarray(u["a"]), [2.0, 2.0])
    np.testing.assert_array_equal(np.asarray(u["c"]), [-2.0, -2.0, -2.0])
    assert u["b"] is None
    tx = optim.partition({"x": optim.scale(-1.0), "y": optim.scale(3.0)},
                         {"a": "x", "b": "x", "c": "y"})
    u, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_array_equal(np.asarray(u["a"]), [-2.0, -2.0])
    np.testing.assert_array_equal(np.asarray(u["c"]), [6.0, 6.0, 6.0])
