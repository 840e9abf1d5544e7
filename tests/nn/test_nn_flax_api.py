"""The Flax NNX 0.12.8 names and behaviours added for issue 30 (Flax's own tests run
against cairn.nn): the graph-mode keywords and switches, DiffState, prefix, unpack,
map, with_rngs, capture, view_info, jit_partial, ModelAndOptimizer, Variable ``==``,
``Param[...]`` subscripting, GraphDef through ``jax.jit``, the optimizer's ``wrt``
filtering of gradients and ``optimizer_sharding`` under ``jax.set_mesh``."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import nn


class W(nn.Module):
    def __init__(self, w):
        self.w = nn.Param(jnp.asarray(w))


# --- graph mode ---


def test_graph_keywords_are_accepted_by_every_transform_and_checked():
    m = nn.Linear(2, 3, rngs=nn.Rngs(0))
    x = jnp.ones((1, 2))
    ref = np.asarray(x) @ np.asarray(m.kernel.value) + np.asarray(m.bias.value)
    for graph, updates in ((True, True), (True, False), (False, False)):
        y = nn.jit(lambda m, x: m(x), graph=graph, graph_updates=updates)(m, x)
        np.testing.assert_allclose(y, ref, rtol=1e-6)
        g = nn.grad(lambda m: m(x).sum(), graph=graph, graph_updates=updates)(m)
        # a State in full graph mode, a module-shaped gradient in Flax's tree mode
        bias = g["bias"] if graph and updates else g.bias
        np.testing.assert_allclose(bias.value, np.ones(3))
    gd, s = nn.split(m, graph=False)
    assert nn.merge(gd, s).kernel is m.kernel
    with pytest.raises(TypeError, match="graph= expects True, False or None"):
        nn.jit(lambda m: m, graph="yes")


def test_set_graph_mode_sets_restores_and_decorates():
    assert nn.set_graph_mode.current_value() is True
    with nn.set_graph_mode(False):
        assert nn.set_graph_mode.current_value() is False
        with nn.set_graph_mode(True):
            assert nn.set_graph_mode.current_value() is True
        assert nn.set_graph_mode.current_value() is False
    assert nn.set_graph_mode.current_value() is True

    @nn.set_graph_updates(False)
    def inside():
        return nn.set_graph_updates.current_value()

    assert inside() is False and nn.set_graph_updates.current_value() is True
    with pytest.raises(TypeError, match="expects a bool"):
        nn.set_graph_mode(1)


def test_var_defaults_refuses_hijax_when_used():
    assert repr(nn.var_defaults()) == "var_defaults(hijax=False, ref=False)"
    with nn.var_defaults(hijax=False):
        pass

    @nn.var_defaults(hijax=True)
    def f():
        return 1

    with pytest.raises(NotImplementedError, match="hijax=True"):
        f()


# --- variables and GraphDef ---


@settings(max_examples=20, deadline=None)
@given(
    a=st.lists(st.integers(-3, 3), min_size=1, max_size=4),
    b=st.integers(-3, 3),
)
def test_variable_equality_compares_values_like_arrays(a, b):
    pa, pb = nn.Param(jnp.asarray(a)), nn.Param(jnp.asarray(b))
    np.testing.assert_array_equal(pa == pb, np.asarray(a) == b)
    np.testing.assert_array_equal(pa != pb, np.asarray(a) != b)
    assert (nn.Param(3) == nn.Param(3)) is True
    d = {pa: 1}  # still hashable, by identity
    assert d[pa] == 1


def test_param_is_subscriptable_for_annotations():
    alias = nn.Param[jax.Array]
    assert alias.__origin__ is nn.Param
    assert isinstance(alias(jnp.ones(2)), nn.Param)


def test_graphdef_passes_through_plain_jax_jit():
    m = nn.Linear(2, 3, rngs=nn.Rngs(0))
    gd, s = nn.split(m)
    calls = []

    @jax.jit
    def f(gd, s, x):
        calls.append(1)
        return nn.merge(gd, s)(x), gd

    x = jnp.ones((4, 2))
    y, gd_out = f(gd, s, x)
    f(gd, s, x)
    assert gd_out == gd and len(calls) == 1 and jax.tree.leaves(gd) == []
    np.testing.assert_allclose(y, x @ m.kernel.value + m.bias.value, rtol=1e-6)


# --- DiffState, prefix, unpack, map, flatten ---


def test_diffstate_differentiates_its_own_filter():
    m = nn.Linear(2, 1, rngs=nn.Rngs(0))
    x = jnp.array([[1.0, 2.0], [3.0, 5.0]])
    g = nn.grad(lambda m: m(x).sum(), argnums=nn.DiffState(0, nn.PathContains("kernel")))(m)
    assert g.flat_paths() == ["kernel"]
    # d/dW sum(x @ W + b) = column sums of x
    np.testing.assert_allclose(g["kernel"].value[:, 0], x.sum(0))
    _, (gm, gx) = nn.value_and_grad(
        lambda m, x: m(x).sum(), argnums=(nn.DiffState(0, ...), 1)
    )(m, x)
    np.testing.assert_allclose(gx, np.tile(np.asarray(m.kernel.value)[:, 0], (2, 1)))
    assert sorted(gm.flat_paths()) == ["bias", "kernel"]
    with pytest.raises(TypeError, match="ints or nn.DiffState"):
        nn.grad(lambda m: 0.0, argnums=("a",))


def test_prefix_gives_per_variable_axes_to_vmap_and_jax_vmap():
    w = np.arange(24.0).reshape(4, 2, 3)
    m = W(w)
    axes = nn.prefix(m, {nn.Param: 0})
    assert axes.w.value == 0
    x = jnp.array([1.0, -2.0])
    want = np.einsum("i,bij->bj", np.asarray(x), w)
    np.testing.assert_allclose(nn.vmap(lambda m, x: x @ m.w, in_axes=(axes, None))(m, x), want)
    np.testing.assert_allclose(jax.vmap(lambda m, x: x @ m.w, in_axes=(axes, None))(m, x), want)
    with pytest.raises(ValueError, match="No filter matched the variable at 'w'"):
        nn.prefix(m, {nn.BatchStat: 0})
    bcast = nn.prefix(m, {nn.Param: None})  # None (broadcast) is a value, not "keep"
    assert bcast.w.value is None
    xs = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    got = nn.vmap(lambda m, x: x @ m.w[0], in_axes=(bcast, 0))(m, xs)
    np.testing.assert_allclose(got, np.asarray(xs) @ w[0])


def test_unpack_merge_roundtrip_and_errors():
    bn = nn.BatchNorm(2, rngs=nn.Rngs(0))
    params, rest = nn.unpack(bn, nn.Param, ...)
    assert isinstance(params, nn.GraphState) and params.graphdef == nn.graphdef(bn)
    new = nn.merge(params, rest)
    assert isinstance(new, nn.BatchNorm) and new.scale is bn.scale
    mapped = jax.tree.map(lambda x: x * 0, params)
    assert isinstance(mapped, nn.GraphState)
    np.testing.assert_array_equal(mapped["scale"].value, np.zeros(2))
    with pytest.raises(ValueError, match="GraphDef must be the same"):
        nn.merge(nn.unpack(nn.Linear(2, 2, rngs=nn.Rngs(0))), rest)
    with pytest.raises(ValueError, match="Expected GraphState"):
        nn.merge(params, nn.state(bn, nn.BatchStat))


def test_map_flatten_and_flat_state():
    m = nn.Linear(2, 3, rngs=nn.Rngs(0))
    z = nn.map(lambda path, v: jnp.zeros_like(v.value), m)
    assert isinstance(z.kernel, nn.Param) and float(jnp.abs(z.kernel.value).sum()) == 0.0
    assert float(jnp.abs(m.kernel.value).sum()) > 0  # the original is unchanged
    gd, pairs = nn.flatten(m)
    assert [p for p, _ in pairs] == list(gd.paths) and pairs[0][1] is m.kernel
    flat = nn.to_flat_state(nn.state(m))
    assert nn.from_flat_state(flat).flat_paths() == nn.state(m).flat_paths()


# --- rngs, capture, view_info ---


def test_with_rngs_splits_forks_and_keeps_the_original():
    rngs = nn.Rngs(params=0, dropout=1)
    key0 = rngs.params.key.value
    new = nn.with_rngs(rngs, split={"params": 4}, fork=...)
    # the split keys are jax.random.split of the stream's next key, fold_in(key, 0)
    want = jax.random.split(jax.random.fold_in(key0, 0), 4)
    np.testing.assert_array_equal(jax.random.key_data(new.params.key.value),
                                  jax.random.key_data(want))
    assert new.dropout.key.shape == () and rngs.params.key.shape == ()
    assert int(rngs.params.count.value) == 1  # the original advanced by one draw
    with pytest.raises(ValueError, match="multiple rules"):
        nn.with_rngs(rngs, split={"params": 4}, fork="params")
    b = rngs.broadcast({"params": 3})
    assert b.params.key.shape == (3,) and b.dropout.key.shape == ()


def test_capture_returns_sown_values_and_leaves_the_module_clean():
    class Foo(nn.Module):
        def __init__(self):
            self.w = nn.Param(jnp.array([2.0, 3.0]))

        def __call__(self, x):
            h = x * self.w
            self.sow(nn.Intermediate, "h", h)
            return h.sum()

    foo = Foo()
    x = jnp.array([1.0, 4.0])
    y, inter = nn.capture(foo, nn.Intermediate)(x)
    assert float(y) == 14.0
    np.testing.assert_allclose(inter["h"].value[0], [2.0, 12.0])
    assert nn.state(foo, nn.Intermediate).flat_paths() == []
    y2, inter2 = nn.capture(nn.Intermediate)(lambda m, x: m(x))(foo, x)
    assert float(y2) == 14.0 and len(inter2["h"].value) == 1


def test_view_info_lists_the_set_view_hooks():
    class Block(nn.Module):
        def __init__(self, rngs):
            self.linear = nn.Linear(2, 2, rngs=rngs)
            self.bn = nn.BatchNorm(2, rngs=rngs)
            self.drop = nn.Dropout(0.1, rngs=rngs)

    info = nn.view_info(Block(nn.Rngs(0)))
    assert info.index("BatchNorm:") < info.index("Dropout:")
    assert "  use_running_average: bool | None = None" in info
    assert nn.view_info(Block(nn.Rngs(0)), only=nn.MultiHeadAttention) == ""
    assert nn.view(nn.Dropout(0.1, rngs=nn.Rngs(0)), deterministic=True).deterministic


# --- training ---


def _sgd(lr):
    import types

    return types.SimpleNamespace(
        init=lambda p: (),
        update=lambda g, s, p=None: (jax.tree.map(lambda x: -lr * x, g), s),
    )


def test_optimizer_ignores_gradients_outside_wrt_like_flax():
    base = nn.Linear(2, 2, rngs=nn.Rngs(0))
    model = nn.LoRA(2, 1, 2, base_module=base, rngs=nn.Rngs(1))
    opt = nn.Optimizer(model, _sgd(0.5), wrt=nn.LoRAParam)
    x = jnp.ones((3, 2))
    a0, b0, k0 = (np.asarray(v) for v in (model.lora_a.value, model.lora_b.value,
                                          base.kernel.value))
    grads = nn.grad(lambda m: m(x).sum())(model)  # every Param, LoRA's included
    assert set(grads.flat_paths()) > {"lora_a", "lora_b"}
    updates = opt.update(model, grads)
    np.testing.assert_allclose(model.lora_b.value, b0 - 0.5 * np.asarray(grads["lora_b"].value))
    np.testing.assert_allclose(model.lora_a.value, a0 - 0.5 * np.asarray(grads["lora_a"].value))
    np.testing.assert_array_equal(base.kernel.value, k0)  # frozen
    assert set(updates) == {"lora_a", "lora_b"}
    with pytest.raises(ValueError, match=r"missing \['lora_b'\]"):
        opt.update(model, nn.State.from_flat({("lora_a",): grads["lora_a"]}))


def test_model_and_optimizer_and_jit_partial_match_optimizer():
    x = jnp.ones((2, 2))

    def step(model, opt):
        g = nn.grad(lambda m: (m(x) ** 2).sum())(model)
        opt.update(model, g)

    m1, m2 = nn.Linear(2, 1, rngs=nn.Rngs(0)), nn.Linear(2, 1, rngs=nn.Rngs(0))
    o1 = nn.Optimizer(m1, _sgd(0.1), wrt=nn.Param)
    o2 = nn.ModelAndOptimizer(m2, _sgd(0.1))
    stepper = nn.jit_partial(step, m1, o1)
    for _ in range(3):
        stepper()
        o2.update(nn.grad(lambda m: (m(x) ** 2).sum())(m2))
    np.testing.assert_allclose(m1.kernel.value, m2.kernel.value, rtol=1e-6)
    assert int(o1.step.value) == 3 and int(o2.step.value) == 3


def test_optimizer_state_dicts_read_by_attribute_and_keep_their_paths():
    import collections

    Moments = collections.namedtuple("Moments", "count mu")
    tx = types_ns(
        init=lambda p: (Moments(jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, p)),),
        update=lambda g, s, p=None: (
            jax.tree.map(lambda x: -x, g),
            (Moments(s[0].count + 1, jax.tree.map(lambda m, x: m + x, s[0].mu, g)),),
        ),
    )
    model = nn.Sequential(nn.Linear(2, 3, rngs=nn.Rngs(0)))
    opt = nn.Optimizer(model, tx, wrt=nn.Param)
    g = nn.grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
    opt.update(model, g)
    mu = opt.opt_state[0].mu.layers[0]["kernel"]
    assert isinstance(mu, nn.OptState)
    np.testing.assert_allclose(mu.value, g["layers"][0]["kernel"].value)
    assert "opt_state/0/mu/layers/0/kernel" in nn.state(opt).flat_paths()
    assert int(opt.opt_state[0].count.value) == 1


def types_ns(**kw):
    import types

    return types.SimpleNamespace(**kw)


SHARDED = textwrap.dedent(
    """
    import types
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from cairn import nn

    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    jax.set_mesh(mesh)
    init = nn.with_metadata(jax.nn.initializers.lecun_normal(), optimizer_sharding=P("x", "y"))
    model = nn.Linear(8, 8, kernel_init=init, rngs=nn.Rngs(0))
    tx = types.SimpleNamespace(
        init=lambda p: {"mu": jax.tree.map(jnp.zeros_like, p)},
        update=lambda g, s, p=None: (jax.tree.map(lambda x: -0.1 * x, g),
                                     {"mu": jax.tree.map(lambda m, x: 0.9 * m + x, s["mu"], g)}),
    )
    opt = nn.Optimizer(model, tx, wrt=nn.Param)
    want = NamedSharding(mesh, P("x", "y"))
    assert opt.opt_state["mu"]["kernel"].value.sharding == want

    @nn.jit
    def step(model, opt, x):
        g = nn.grad(lambda m: (m(x) ** 2).sum())(model)
        opt.update(model, g)

    for _ in range(2):
        step(model, opt, jnp.ones((4, 8)))
    mu = opt.opt_state["mu"]["kernel"].value
    assert mu.sharding.spec == P("x", "y"), mu.sharding
    assert model.kernel.value.sharding.spec != P("x", "y")
    print("ok")
    """
)


def test_optimizer_sharding_over_the_set_mesh_survives_jitted_steps(run_on_cpu_devices):
    r = run_on_cpu_devices(SHARDED, devices=8)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_einsum_accepts_ellipsis_in_input_and_kernel():
    m = nn.Einsum("d...ab,bc...->ad...c", (4, 5, 6, 7), (6, 7, 5), rngs=nn.Rngs(42))
    x = np.asarray(jax.random.normal(jax.random.key(1), (8, 6, 7, 3, 4)), np.float64)
    k = np.asarray(m.kernel.value, np.float64)
    b = np.asarray(m.bias.value, np.float64)
    want = np.einsum("d...ab,bc...->ad...c", x, k) + b
    np.testing.assert_allclose(m(jnp.asarray(x, jnp.float32)), want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="kernel subscripts 'bc' name 2 axes"):
        nn.Einsum("ab,bc->ac", (4, 5, 6), rngs=nn.Rngs(0))


def test_train_state_applies_and_steps_like_sgd():
    class TS(nn.TrainState):
        batch_stats: nn.State

    class Foo(nn.Module):
        def __init__(self, rngs):
            self.linear = nn.Linear(2, 3, rngs=rngs)
            self.bn = nn.BatchNorm(3, rngs=rngs)

        def __call__(self, x, train):
            return self.bn(self.linear(x), use_running_average=not train)

    gd, params, stats = nn.split(Foo(nn.Rngs(0)), nn.Param, nn.BatchStat)
    ts = TS.create(gd, params=params, tx=_sgd(0.5), batch_stats=stats)
    x = jnp.array([[1.0, 2.0], [3.0, -1.0]])
    y, (_, new_state) = ts.apply("params", "batch_stats")(x, train=True)
    h = np.asarray(x) @ np.asarray(params["linear"]["kernel"].value)
    h = h + np.asarray(params["linear"]["bias"].value)
    want = (h - h.mean(0)) / np.sqrt(h.var(0) + 1e-5)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
    # the running mean moved (momentum 0.99), the state given did not
    np.testing.assert_allclose(new_state["bn"]["mean"].value, 0.01 * h.mean(0), rtol=1e-4)
    assert float(jnp.abs(ts.batch_stats["bn"]["mean"].value).sum()) == 0.0
    ones = jax.tree.map(jnp.ones_like, ts.params)
    ts2 = jax.jit(lambda t: t.apply_gradients(ones))(ts)
    assert int(ts2.step) == 1
    np.testing.assert_allclose(
        ts2.params["linear"]["kernel"].value, params["linear"]["kernel"].value - 0.5
    )


def test_dataclass_metadata_clone_and_children():
    @nn.dataclass
    class Pair(nn.Module):
        a: nn.Param
        b: nn.Module
        scale: float = 2.0

    p = Pair(nn.Param(jnp.ones(2)), nn.Linear(2, 2, rngs=nn.Rngs(0)))
    assert p.scale == 2.0 and [k for k, _ in nn.iter_children(p)] == ["b"]
    nn.set_metadata(p, frozen=True, only=nn.PathContains("kernel"))
    assert p.b.kernel.get_metadata("frozen") is True
    assert p.a.get_metadata("frozen", None) is None
    with pytest.raises(KeyError, match="no metadata 'frozen'"):
        p.a.get_metadata("frozen")
    c = nn.clone(p, arrays=True)
    assert c.a is not p.a and not np.shares_memory(np.asarray(c.a.value), np.asarray(p.a.value))
    np.testing.assert_array_equal(c.a.value, p.a.value)
    assert nn.clone(p, variables=False).a is p.a
    assert nn.GraphDef[Pair].__origin__ is nn.GraphDef


def test_tree_mode_grad_returns_a_module_shaped_gradient():
    m = nn.BatchNorm(2, rngs=nn.Rngs(0))

    def loss(m):
        return (m.scale.value * jnp.array([1.0, 3.0])).sum() + m.bias.value.sum()

    as_state = nn.grad(loss)(m)
    assert isinstance(as_state, nn.State) and sorted(as_state.flat_paths()) == ["bias", "scale"]
    for kw in ({"graph": False}, {"graph": True, "graph_updates": False}):
        g = nn.grad(loss, **kw)(m)
        assert isinstance(g, nn.BatchNorm) and g.scale is not m.scale
        np.testing.assert_array_equal(g.scale.value, [1.0, 3.0])
        np.testing.assert_array_equal(g.mean.value, [0.0, 0.0])  # not differentiated
    with nn.set_graph_updates(False):
        assert isinstance(nn.grad(loss)(m), nn.BatchNorm)


def test_lowered_and_compiled_take_modules_and_write_back():
    class Counter(nn.Module):
        def __init__(self):
            self.count = nn.Variable(jnp.array(0))

        def __call__(self, x):
            self.count.value += 1
            return x * 2

    m = Counter()
    f = nn.jit(lambda m, x: m(x))
    compiled = f.lower(m, jnp.array(3.0)).compile()
    assert "HloModule" in compiled.as_text() or compiled.as_text()
    assert float(compiled(m, jnp.array(3.0))) == 6.0
    compiled(m, jnp.array(1.0))
    assert int(m.count.value) == 2


def test_missing_view_attributes_raise_value_errors_worded_as_flax():
    b = nn.Sequential(nn.Dropout(0.5, rngs=nn.Rngs(0)))
    with pytest.raises(ValueError, match=r"Unused keys found in nnx.view: \['unknown'\]"):
        nn.view(b, deterministic=True, unknown=1)
    with pytest.raises(ValueError, match=r"following attributes: \['unknown'\]"):
        nn.with_attributes(b, unknown=1)
    with pytest.raises(AttributeError, match=r"following attributes: \['unknown'\]"):
        b.set_attributes(unknown=2)
    assert nn.view(b, deterministic=True, unknown=1, raise_if_not_found=False).layers[0].deterministic


def test_state_of_a_state_filters_it():
    bn = nn.BatchNorm(2, rngs=nn.Rngs(0))
    s = nn.state(bn)
    assert nn.state(s, nn.BatchStat).flat_paths() == ["mean", "var"]
    assert sorted(nn.state(s).flat_paths()) == sorted(s.flat_paths())
    assert nn.state(s)["scale"] is bn.scale
    assert nn.state((bn,))[0]["scale"] is bn.scale  # a pytree of modules: its paths


def test_optimized_lstm_cell_computes_the_lstm_cell():
    a = nn.OptimizedLSTMCell(3, 4, rngs=nn.Rngs(0))
    b = nn.LSTMCell(3, 4, rngs=nn.Rngs(0))
    x = jnp.ones((2, 3))
    carry = a.initialize_carry((2, 3))
    _, ya = a(carry, x)
    _, yb = b(carry, x)
    np.testing.assert_array_equal(ya, yb)
    assert isinstance(a, nn.LSTMCell) and a.dense_i.kernel.shape == (3, 16)
    assert a.dense_h.kernel.shape == (4, 16) and a.dense_h.bias.shape == (16,)
    assert b.ii.kernel.shape == (3, 4) and b.ii.bias is None and b.hi.bias.shape == (4,)


def test_view_info_heads_a_block_with_the_qualified_name():
    class Block(nn.Module):
        def set_view(self, arg1: bool | None = None, **kwargs) -> dict:
            """Hook.

            Args:
              arg1: The first argument.
                Second line.
            """
            return {"arg1": arg1, **kwargs}

    info = nn.view_info(Block())
    assert info == (
        f"{Block.__qualname__}:\n  arg1: bool | None = None\n    The first argument.\n    Second line."
    )
