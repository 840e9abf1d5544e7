"""The Optax-shaped public surface: type aliases, submodules, tree look-ups, selective_transform.

Numbers are compared with Optax 0.2.8 (installed as a test dependency)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cairn.optim as optim

# --- type aliases and submodules ---


def test_annotations_with_optax_aliases_evaluate_at_definition_time():
    def fit(params: optim.Params, opt: optim.GradientTransformation) -> optim.Params:
        return params

    def sched(lr: optim.ScalarOrSchedule, s: optim.Schedule, st: optim.OptState,
              u: optim.Updates) -> None:
        return None

    init: optim.TransformInitFn = optim.sgd(0.1).init
    upd: optim.TransformUpdateFn = optim.sgd(0.1).update
    assert fit({"w": 1}, optim.sgd(0.1)) == {"w": 1} and sched(0.1, abs, (), {}) is None
    assert callable(init) and callable(upd)
    assert optim.GradientTransformationExtraArgs is not None


@pytest.mark.parametrize("name", ["tree", "tree_utils", "transforms", "losses", "schedules",
                                  "contrib", "projections", "assignment"])
def test_submodules_import_like_optax(name):
    mod = importlib.import_module(f"cairn.optim.{name}")
    assert getattr(optim, name) is mod
    assert mod.__all__ and all(hasattr(mod, n) for n in mod.__all__)


@pytest.mark.parametrize("name,skip", [
    ("tree", set()),
    ("tree_utils", {"NamedTupleKey", "functools", "typing"}),
])
def test_tree_namespaces_cover_optax(name, skip):
    ours, theirs = getattr(optim, name), getattr(optax, name)
    missing = [n for n in dir(theirs) if not n.startswith("_") and n not in skip
               and not hasattr(ours, n)]
    assert missing == []


def _trees():
    k = jax.random.PRNGKey(0)
    a = {"x": jax.random.normal(k, (3, 2)), "y": [jnp.arange(4.0), jnp.ones(())]}
    b = jax.tree.map(lambda t: t * 2.5 - 1.0, a)
    return a, b


@pytest.mark.parametrize("fn", ["add", "sub", "mul", "div", "vdot", "sum", "max", "min",
                                "zeros_like", "ones_like", "conj", "real", "size"])
def test_tree_maths_match_optax(fn):
    a, b = _trees()
    nargs = {"add": 2, "sub": 2, "mul": 2, "div": 2, "vdot": 2}.get(fn, 1)
    args = (a, b)[:nargs]
    ours, theirs = getattr(optim.tree, fn)(*args), getattr(optax.tree, fn)(*args)
    jax.tree.map(lambda o, t: np.testing.assert_allclose(o, t, rtol=1e-6), ours, theirs)


@pytest.mark.parametrize("ord_", [1, 2, "inf"])
def test_tree_norm_and_l2_norm(ord_):
    a, _ = _trees()
    ref = np.linalg.norm(np.concatenate([np.ravel(x) for x in jax.tree.leaves(a)]),
                         ord=np.inf if ord_ == "inf" else ord_)
    np.testing.assert_allclose(optim.tree.norm(a, ord_), ref, rtol=1e-6)
    np.testing.assert_allclose(optim.tree_utils.tree_l2_norm(a), np.sqrt(sum(
        np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(a))), rtol=1e-6)


def test_tree_random_split_batch_infinity_match_optax():
    a, b = _trees()
    k = jax.random.PRNGKey(3)
    for fn, args in [("random_like", (k, a)), ("split_key_like", (k, a)),
                     ("batch_shape", (a, (2,))), ("update_infinity_moment", (a, b, 0.9, 1e-3)),
                     ("full_like", (a, 3.0)), ("add_scale", (a, 0.5, b))]:
        jax.tree.map(lambda o, t: np.testing.assert_array_equal(o, t),
                     getattr(optim.tree, fn)(*args), getattr(optax.tree, fn)(*args))


def test_tree_dtype_handlers_and_allclose():
    t = {"a": jnp.ones(2, jnp.float16), "b": jnp.ones(2, jnp.float32)}
    assert optim.tree.dtype(t, "lowest") == jnp.float16
    assert optim.tree.dtype(t, "highest") == jnp.float32
    assert optim.tree.dtype(t, "promote") == jnp.float32
    with pytest.raises(ValueError, match="several dtypes"):
        optim.tree.dtype(t)
    with pytest.raises(ValueError, match="mixed_dtype_handler"):
        optim.tree.dtype(t, "median")
    assert optim.tree.allclose(t, t) and not optim.tree.allclose(t, {"a": t["a"]})


def test_tree_get_set_on_optimizer_state():
    params = {"w": jnp.zeros(3)}
    tx = optim.inject_hyperparams(optim.adam)(learning_rate=0.1)
    st = tx.init(params)
    assert float(optim.tree.get(st, "learning_rate")) == pytest.approx(0.1)
    st2 = optim.tree.set(st, learning_rate=jnp.asarray(0.5, jnp.float32))
    assert float(optim.tree.get(st2, "learning_rate")) == pytest.approx(0.5)
    assert jax.tree_util.tree_structure(st2) == jax.tree_util.tree_structure(st)
    # NamedTuple class names find the whole tuple; several matches are an error naming paths
    adam_state = optim.tree.get(st, "ScaleByAdamState")
    assert isinstance(adam_state, optim.ScaleByAdamState)
    assert int(optim.tree.get(st, "count")) == 0  # equal copies give their value
    with pytest.raises(KeyError, match="2 values are named"):
        optim.tree.get({"a": {"v": 1}, "b": {"v": 2}}, "v")
    assert optim.tree.get(st, "nothing", default=7) == 7
    with pytest.raises(KeyError, match="nothing"):
        optim.tree.set(st, nothing=1)


def test_tree_get_all_with_path_and_filter_match_optax_on_plain_trees():
    tree = {"a": {"count": 1, "b": 2}, "c": [{"count": 3}], "d": optax.EmptyState()}
    ours = optim.tree.get_all_with_path(tree, "count")
    theirs = optax.tree.get_all_with_path(tree, "count")
    assert [v for _, v in ours] == [v for _, v in theirs] == [1, 3]
    assert [jax.tree_util.keystr(p) for p, _ in ours] == \
        [jax.tree_util.keystr(p) for p, _ in theirs]
    only3 = optim.tree.get(tree, "count", filtering=lambda p, v: v == 3)
    assert only3 == optax.tree.get(tree, "count", filtering=lambda p, v: v == 3) == 3
    new = optim.tree.set(tree, count=0)
    assert new == optax.tree.set(tree, count=0)


@pytest.mark.parametrize("make", [
    lambda m: m.adam(1e-3),
    lambda m: m.sgd(0.1, momentum=0.9),
    lambda m: m.chain(m.clip_by_global_norm(1.0), m.adamw(1e-3)),
])
def test_tree_map_params_finds_the_same_param_copies_as_optax(make):
    params = {"a": jnp.zeros((3, 2)), "b": jnp.ones(2)}
    specs = {"a": "spec_a", "b": "spec_b"}

    def copies(m):
        tx = make(m)
        out = m.tree_utils.tree_map_params(tx, lambda _, s: s, tx.init(params), specs,
                                           transform_non_params=lambda _: None)
        return [x for x in jax.tree.leaves(out) if isinstance(x, str)]

    assert copies(optim) == copies(optax)


# --- freeze and selective_transform ---


@pytest.mark.parametrize("mask", [
    {"a": True, "b": False}, {"a": False, "b": False}, True, jnp.asarray(False),
])
def test_selective_transform_and_freeze_match_optax_over_steps(mask):
    params = {"a": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.arange(3.0)}

    def run(m):
        txs = [m.transforms.selective_transform(m.adam(0.1), freeze_mask=mask),
               m.chain(m.transforms.freeze(mask), m.sgd(0.1))]
        out = []
        for tx in txs:
            p, st = params, tx.init(params)
            for i in range(4):
                g = jax.tree.map(lambda x, i=i: jnp.sin(x + i), p)
                u, st = jax.jit(tx.update)(g, st, p)
                p = m.apply_updates(p, u)
            out.append(p)
        return out

    for o, t in zip(run(optim), run(optax)):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), o, t)


def test_selective_transform_keeps_no_state_for_frozen_leaves_and_takes_path_rules():
    params = {"embed": {"table": jnp.ones((4, 2))}, "head": jnp.ones(2)}
    tx = optim.selective_transform(optim.adam(0.1), freeze_mask={"embed/.*": True, ".*": False})
    st = tx.init(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(st)]
    assert not any("table" in p for p in paths)
    u, _ = tx.update(params, st, params)
    assert float(jnp.abs(u["embed"]["table"]).sum()) == 0.0
    assert float(jnp.abs(u["head"]).sum()) > 0.0


def test_top_level_helpers_with_optax_names():
    x = {"a": jnp.ones(2)}
    tx = optim.with_extra_args_support(optim.stateless(lambda u, p: u))
    assert isinstance(tx, optim.GradientTransformationExtraArgs)
    assert optim.with_extra_args_support(tx) is tx
    np.testing.assert_array_equal(tx.update(x, tx.init(x), x, value=1.0)[0]["a"], x["a"])
    assert int(optim.safe_int32_increment(jnp.asarray(np.iinfo(np.int32).max))) == \
        np.iinfo(np.int32).max
    assert optim.init_empty_state(x) == optim.EmptyState()
    m = optim.update_moment(x, x, 0.9, 2)
    np.testing.assert_allclose(m["a"], optax.tree.update_moment(x, x, 0.9, 2)["a"])


@pytest.mark.parametrize("name", ["multiclass_hinge_loss", "multiclass_perceptron_loss",
                                  "perceptron_loss", "kl_divergence_with_log_targets",
                                  "generalized_kl_divergence"])
def test_added_losses_match_optax(name):
    s = jax.random.normal(jax.random.PRNGKey(0), (4, 5))
    y = jnp.asarray([0, 3, 4, 1])
    lp, lt = jax.nn.log_softmax(s), jax.nn.log_softmax(0.3 * s + 1.0)
    args = {"multiclass_hinge_loss": (s, y), "multiclass_perceptron_loss": (s, y),
            "perceptron_loss": (s[:, 0], jnp.sign(s[:, 1])),
            "kl_divergence_with_log_targets": (lp, lt),
            "generalized_kl_divergence": (lp, 2 * jnp.exp(lt))}[name]
    np.testing.assert_allclose(getattr(optim.losses, name)(*args),
                               getattr(optax.losses, name)(*args), rtol=1e-6, atol=1e-6)
    ref = {  # float64 NumPy formulas
        "multiclass_hinge_loss": lambda a, b: np.max(a + 1 - np.eye(5)[b], -1)
        - a[np.arange(4), b],
        "multiclass_perceptron_loss": lambda a, b: np.max(a, -1) - a[np.arange(4), b],
        "perceptron_loss": lambda a, b: np.maximum(0, -a * b),
        "kl_divergence_with_log_targets": lambda a, b: np.sum(np.exp(b) * (b - a), -1),
        "generalized_kl_divergence": lambda a, b: np.sum(b * (np.log(b) - a) + np.exp(a) - b,
                                                         -1),
    }[name](*[np.asarray(x, np.float64) if x.dtype != jnp.int32 else np.asarray(x)
              for x in args])
    np.testing.assert_allclose(getattr(optim, name)(*args), ref, rtol=1e-5, atol=1e-6)


def test_multiclass_losses_reject_bad_labels():
    with pytest.raises(ValueError, match="labels"):
        optim.multiclass_hinge_loss(jnp.ones((2, 3)), jnp.ones((2,)))
    with pytest.raises(ValueError, match="labels"):
        optim.multiclass_perceptron_loss(jnp.ones((2, 3)), jnp.zeros((3,), jnp.int32))


@pytest.mark.parametrize("kw", [dict(), dict(variant="sps+", f_min=1.0, scaling=0.5),
                                dict(max_learning_rate=0.1, eps=1e-3)])
def test_polyak_sgd_matches_optax_over_steps(kw):
    def f(x):
        return jnp.sum((x - 1.0) ** 2) + 0.5

    def run(m):
        tx = m.polyak_sgd(**kw)
        x = jnp.asarray([3.0, -2.0, 0.5])
        st = tx.init(x)
        upd = jax.jit(lambda g, s, x, v: tx.update(g, s, x, value=v))
        out = []
        for _ in range(6):
            v, g = jax.value_and_grad(f)(x)
            u, st = upd(g, st, x, v)
            x = m.apply_updates(x, u)
            out.append(x)
        return out

    for a, b in zip(run(optim), run(optax)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="variant"):
        optim.polyak_sgd(variant="sps++")
