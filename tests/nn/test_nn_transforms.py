"""Lifted transforms: values against the functional form, state written back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn
from nn._nn_helpers import f64


class Lin(nn.Module):
    def __init__(self, din, dout, rngs):
        self.kernel = nn.Param(jax.random.normal(rngs.params(), (din, dout)) / np.sqrt(din))
        self.bias = nn.Param(jax.random.normal(rngs.params(), (dout,)) * 0.1)

    def __call__(self, x):
        return x @ self.kernel + self.bias


class Counted(nn.Module):
    """A layer that counts its calls (state that changes inside transforms)."""

    def __init__(self, d, rngs):
        self.lin = Lin(d, d, rngs)
        self.calls = nn.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls.value = self.calls.value + 1
        return jnp.tanh(self.lin(x))


class Noisy(nn.Module):
    def __init__(self, rngs):
        self.rngs = rngs.fork()

    def __call__(self, x):
        return x + jax.random.normal(self.rngs.default(), x.shape)


def _fn(params, x):
    return jnp.tanh(x @ params["lin"]["kernel"] + params["lin"]["bias"])


def test_jit_writes_back_and_matches_functional():
    m = Counted(3, nn.Rngs(0))
    x = jnp.ones((2, 3))
    f = nn.jit(lambda m, x: m(x))
    y1 = f(m, x)
    y2 = f(m, x)
    np.testing.assert_allclose(y1, _fn(nn.to_pure_dict(nn.state(m, nn.Param)), x), rtol=1e-6)
    np.testing.assert_allclose(y1, y2)
    assert int(m.calls.value) == 2
    assert len(f._cache) == 1  # no retrace for the same structure


def test_jit_params_unchanged_not_rewritten_and_structure_change_retraces():
    m = Counted(2, nn.Rngs(0))
    k = m.lin.kernel.value
    f = nn.jit(lambda m: m(jnp.ones((1, 2))))
    f(m)
    assert m.lin.kernel.value is k  # unchanged variables are not replaced
    m.lin.extra = nn.Param(jnp.ones(()))
    f(m)
    assert len(f._cache) == 2


def test_jit_structure_change_inside_flows_back():
    class Lazy(nn.Module):
        def __init__(self):
            self.w = nn.Param(jnp.ones(2))

        def __call__(self, x):
            if not hasattr(self, "seen"):
                self.seen = nn.Cache(jnp.zeros(2))
            self.seen.value = self.seen.value + x
            self.sow(nn.Intermediate, "act", x * self.w)
            return (x * self.w).sum()

    m = Lazy()
    f = nn.jit(lambda m, x: m(x))
    f(m, jnp.array([1.0, 2.0]))
    assert isinstance(m.seen, nn.Cache)
    np.testing.assert_allclose(m.seen.value, [1.0, 2.0])
    np.testing.assert_allclose(m.act.value[0], [1.0, 2.0])
    f(m, jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(m.seen.value, [2.0, 4.0])
    # act was sown again into the existing tuple
    assert len(m.act.value) == 2


def test_jit_static_kwargs_donation_and_decorator():
    m = Counted(2, nn.Rngs(0))

    @nn.jit(static_argnames="scale", donate_argnums=0)
    def f(m, x, scale=1.0):
        return m(x) * scale

    x = jnp.ones((1, 2))
    old = m.lin.kernel.value
    a = f(m, x, scale=2.0)
    b = f(m, x, 3.0)
    np.testing.assert_allclose(a / 2.0, b / 3.0, rtol=1e-6)
    assert int(m.calls.value) == 2
    assert old.is_deleted()  # donated buffers were consumed and replaced
    assert not m.lin.kernel.value.is_deleted()
    with pytest.raises(TypeError, match="hashable"):
        nn.jit(lambda m, s: m(x), static_argnums=1)(m, [1])


def test_jit_modules_inside_containers_and_shared_args():
    m1, m2 = Counted(2, nn.Rngs(0)), Counted(2, nn.Rngs(1))
    f = nn.jit(lambda ms, x: ms["a"](x) + ms["b"](x))
    f({"a": m1, "b": m2}, jnp.ones((1, 2)))
    assert int(m1.calls.value) == 1 and int(m2.calls.value) == 1
    x = jnp.ones((1, 2))
    g = nn.jit(lambda a, b: (a is b, a(x) + b(x)))  # graph mode: one object inside
    for n in (3, 5):  # the second call takes the cached path for shared arguments
        same, _ = g(m1, m1)
        assert same and int(m1.calls.value) == n  # both calls counted on one variable
    with pytest.raises(nn.SharedReferenceError, match="Duplicate"):
        nn.jit(lambda a, b: a(x), graph=False)(m1, m1)
    with pytest.raises(nn.SharedReferenceError, match="Duplicate"):
        nn.jit(lambda a, b: a(x), donate_argnums=0)(m1, m1)  # a donated buffer used twice


def test_jit_creates_module_and_advances_rngs():
    rngs = nn.Rngs(0)
    make = nn.jit(lambda r: Lin(2, 3, r))
    a = make(rngs)
    b = make(rngs)
    assert isinstance(a, Lin) and a.kernel.shape == (2, 3)
    assert int(rngs.params.count.value) == 4
    assert not np.allclose(a.kernel.value, b.kernel.value)
    eager = Lin(2, 3, nn.Rngs(0))
    np.testing.assert_allclose(a.kernel.value, eager.kernel.value, rtol=1e-6)


def test_jit_lower_compiles():
    m = Counted(2, nn.Rngs(0))
    f = nn.jit(lambda m, x: m(x))
    compiled = f.lower(m, jnp.ones((1, 2))).compile()
    assert compiled is not None


def test_grad_equals_jax_grad_of_functional_form():
    m = Counted(3, nn.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 3))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    g = nn.grad(loss)(m, x)
    params = nn.to_pure_dict(nn.state(m, nn.Param))
    ref = jax.grad(lambda p: jnp.sum(_fn(p, x) ** 2))(params)
    assert isinstance(g, nn.State) and g.flat_paths() == ["lin/kernel", "lin/bias"]
    assert isinstance(g["lin"]["kernel"], nn.Param)
    np.testing.assert_allclose(g["lin"]["kernel"].value, ref["lin"]["kernel"], rtol=1e-5)
    np.testing.assert_allclose(g["lin"]["bias"].value, ref["lin"]["bias"], rtol=1e-5)
    assert int(m.calls.value) == 1  # non-differentiated state written back
    (val, aux), g2 = nn.value_and_grad(lambda m, x: (loss(m, x), 7), has_aux=True)(m, x)
    np.testing.assert_allclose(val, jnp.sum(_fn(params, x) ** 2), rtol=1e-5)
    assert aux == 7
    np.testing.assert_allclose(g2["lin"]["kernel"].value, ref["lin"]["kernel"], rtol=1e-5)
    # several argnums, arrays included
    gm, gx = nn.grad(loss, argnums=(0, 1))(m, x)
    np.testing.assert_allclose(gm["lin"]["bias"].value, ref["lin"]["bias"], rtol=1e-5)
    ref_x = jax.grad(lambda x: jnp.sum(_fn(params, x) ** 2))(x)
    np.testing.assert_allclose(gx, ref_x, rtol=1e-5)
    # wrt a filter
    gk = nn.grad(loss, wrt=r".*kernel")(m, x)
    assert gk.flat_paths() == ["lin/kernel"]
    # inside jit
    gj = nn.jit(nn.grad(loss))(m, x)
    np.testing.assert_allclose(gj["lin"]["kernel"].value, ref["lin"]["kernel"], rtol=1e-5)


def test_vmap_independent_rng_and_stacked_creation():
    rngs = nn.Rngs(0)
    noisy = Noisy(rngs)
    x = jnp.zeros((4, 3))
    # split streams: one key per batch element
    noisy.rngs = noisy.rngs.split(4)
    out = nn.vmap(lambda m, x: m(x), in_axes=(0, 0))(noisy, x)
    assert out.shape == (4, 3)
    rows = np.asarray(out)
    assert all(not np.allclose(rows[i], rows[j]) for i in range(4) for j in range(i))
    np.testing.assert_array_equal(noisy.rngs.default.count.value, np.ones(4))
    # broadcast module, batched input
    lin = Lin(3, 2, nn.Rngs(1))
    y = nn.vmap(lambda m, x: m(x), in_axes=(None, 0))(lin, jnp.ones((5, 3)))
    np.testing.assert_allclose(y, jnp.ones((5, 3)) @ lin.kernel.value + lin.bias.value, rtol=1e-6)
    # stacked creation from split keys
    stacked = nn.vmap(lambda r: Lin(3, 3, r))(nn.Rngs(0).split(5))
    assert stacked.kernel.shape == (5, 3, 3)


def test_scan_over_stacked_layers_equals_unrolled_loop():
    n = 4
    stacked = nn.vmap(lambda r: Counted(3, r))(nn.Rngs(0).split(n))
    x = jax.random.normal(jax.random.key(2), (2, 3))

    def body(h, layer):
        return layer(h), h.sum()

    out, ys = nn.scan(body)(x, stacked)
    h = x
    sums = []
    for i in range(n):
        params = jax.tree.map(lambda a, i=i: a[i], nn.to_pure_dict(nn.state(stacked, nn.Param)))
        sums.append(h.sum())
        h = _fn(params, h)
    np.testing.assert_allclose(out, h, rtol=1e-5)
    np.testing.assert_allclose(ys, np.array(sums), rtol=1e-5)
    np.testing.assert_array_equal(stacked.calls.value, np.ones(n))  # per-layer state restacked
    # a module in the carry is threaded through
    c = Counted(3, nn.Rngs(5))
    (c2, h2), _ = nn.scan(lambda carry, _: ((carry[0], carry[0](carry[1])), None), length=3)((c, x), None)
    assert c2 is c and int(c.calls.value) == 3 and h2.shape == x.shape
    # inside jit as well
    out_j, _ = nn.jit(lambda x, s: nn.scan(body)(x, s))(x, stacked)
    np.testing.assert_allclose(out_j, out, rtol=1e-5)


def test_remat_same_values_and_grads():
    m = Counted(3, nn.Rngs(0))
    x = jnp.ones((2, 3))

    def loss(m, x):
        return jnp.sum(m(m(x)) ** 2)

    g1 = nn.grad(loss)(m, x)
    g2 = nn.grad(lambda m, x: nn.remat(loss)(m, x))(m, x)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(nn.remat(loss)(m, x), loss(m, x), rtol=1e-6)
    assert int(m.calls.value) == 8


def test_cond_switch_fori_while():
    m = Counted(2, nn.Rngs(0))
    x = jnp.ones((1, 2))
    y = nn.cond(True, lambda m, x: m(x), lambda m, x: x, m, x)
    np.testing.assert_allclose(y, jnp.tanh(m.lin(x)), rtol=1e-6)
    assert int(m.calls.value) == 1
    nn.cond(jnp.array(False), lambda m, x: m(x), lambda m, x: x, m, x)
    assert int(m.calls.value) == 1
    nn.switch(1, [lambda m, x: x, lambda m, x: m(x), lambda m, x: m(m(x))], m, x)
    assert int(m.calls.value) == 2
    with pytest.raises(ValueError, match="branch 1 leaves its module arguments with a different structure"):
        def add_var(m, x):
            m.extra = nn.Cache(jnp.zeros(()))
            return x
        nn.cond(True, add_var, lambda m, x: x, m, x)

    def body(i, carry):
        mod, h = carry
        return mod, mod(h)

    m2 = Counted(2, nn.Rngs(0))
    mod, h = nn.fori_loop(0, 3, body, (m2, x))
    assert mod is m2 and int(m2.calls.value) == 3
    ref = x
    for _ in range(3):
        ref = jnp.tanh(m2.lin(ref))
    np.testing.assert_allclose(h, ref, rtol=1e-6)
    m3 = Counted(2, nn.Rngs(0))
    out = nn.while_loop(lambda c: c[0].calls.value < 5, lambda c: (c[0], c[0](c[1])), (m3, x))
    assert int(m3.calls.value) == 5 and out[0] is m3


def test_eval_shape_does_not_touch_inputs():
    rngs = nn.Rngs(0)
    abstract = nn.eval_shape(lambda r: Lin(4, 5, r), rngs)
    assert isinstance(abstract.kernel.value, jax.ShapeDtypeStruct)
    assert abstract.kernel.shape == (4, 5)
    assert int(rngs.params.count.value) == 0


def test_shard_map_single_device_mesh():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    from jax.sharding import PartitionSpec as P

    m = Counted(2, nn.Rngs(0))
    x = jnp.ones((4, 2))
    sm = nn.shard_map(lambda m, x: m(x), mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"))
    y = nn.jit(sm)(m, x)
    np.testing.assert_allclose(y, jnp.tanh(m.lin(x)), rtol=1e-6)
    assert int(m.calls.value) == 1


def test_optimizer_step_in_jit_matches_raw_optax():
    optax = pytest.importorskip("optax")
    m = Counted(3, nn.Rngs(0))
    tx = optax.adamw(1e-2)
    opt = nn.Optimizer(m, tx, wrt=nn.Param)
    x = jax.random.normal(jax.random.key(3), (8, 3))

    def loss(m, x):
        return jnp.mean(m(x) ** 2)

    @nn.jit(donate_argnums=(0, 1))
    def step(m, opt, x):
        value, g = nn.value_and_grad(loss)(m, x)
        opt.update(m, g)
        return value

    params = nn.to_pure_dict(nn.state(m, nn.Param))
    ostate = tx.init(params)
    for _ in range(3):
        l_ref, g = jax.value_and_grad(lambda p: jnp.mean(_fn(p, x) ** 2))(params)
        upd, ostate = tx.update(g, ostate, params)
        params = optax.apply_updates(params, upd)
        value = step(m, opt, x)
        np.testing.assert_allclose(value, l_ref, rtol=1e-5)
    got = nn.to_pure_dict(nn.state(m, nn.Param))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert int(opt.step.value) == 3 and int(m.calls.value) == 3
    paths = nn.state(opt).flat_paths()
    assert "opt_state/0/mu/lin/kernel" in paths and "step" in paths


def test_optimizer_errors():
    optax = pytest.importorskip("optax")
    m = Counted(2, nn.Rngs(0))
    with pytest.raises(TypeError, match="Optax-style init and update"):
        nn.Optimizer(m, object())
    opt = nn.Optimizer(m, optax.sgd(0.1))
    bad = nn.State({"lin": {"kernel": nn.Param(jnp.zeros((2, 2)))}})
    with pytest.raises(ValueError, match=r"missing \['lin/bias'\]"):
        opt.update(m, bad)


def test_errors_inside_transforms_name_the_module_path():
    class Net(nn.Module):
        def __init__(self, rngs):
            self.layers = [Counted(3, rngs), Counted(3, rngs)]

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    net = Net(nn.Rngs(0))
    bad = jnp.ones((2, 5))  # wrong feature count
    vmap = lambda f: nn.vmap(f, in_axes=(None, 0))  # noqa: E731
    for transform, arg in ((nn.jit, bad), (nn.grad, bad), (nn.remat, bad), (vmap, bad[None])):
        f = transform(lambda m, x: m(x).sum())
        with pytest.raises(TypeError) as info:
            f(net, arg)
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "(raised in Lin at path 'layers/0/lin' of " in notes, (transform, notes)

    with pytest.raises(ValueError, match=r"'layers/0/calls' .* has rank 0"):
        nn.vmap(lambda m, x: m(x), in_axes=(0, 0))(net, bad[None])


def test_eager_errors_name_the_module_path():
    class Net(nn.Module):
        def __init__(self, rngs):
            self.blocks = nn.Dict(first=Counted(3, rngs))

        def __call__(self, x):
            return self.blocks["first"](x)

    with pytest.raises(TypeError) as info:
        Net(nn.Rngs(0))(jnp.ones((2, 4)))
    assert "(raised in Lin at path 'blocks/first/lin' of Net)" in info.value.__notes__


def test_vmap_state_axes():
    # batched parameters, broadcast counter
    stacked = nn.vmap(lambda r: Counted(3, r))(nn.Rngs(0).split(4))
    stacked.calls.value = jnp.zeros((), jnp.int32)
    x = jnp.ones((4, 2, 3))
    axes = nn.StateAxes({nn.Param: 0, ...: None})
    y = nn.vmap(lambda m, x: jnp.tanh(m.lin(x)), in_axes=(axes, 0))(stacked, x)
    for i in range(4):
        ref = jnp.tanh(x[i] @ stacked.lin.kernel.value[i] + stacked.lin.bias.value[i])
        np.testing.assert_allclose(y[i], ref, rtol=1e-6)
    with pytest.raises(ValueError, match=r"'calls' \(BatchStat\) matches none"):
        nn.vmap(lambda m, x: m(x), in_axes=(nn.StateAxes({nn.Param: 0}), 0))(stacked, x)


def test_jit_structure_change_for_nested_and_keyword_modules():
    class Grow(nn.Module):
        def __init__(self):
            self.w = nn.Param(jnp.ones(2))

        def __call__(self):
            self.sow(nn.Intermediate, "seen", self.w.value * 2)
            return self.w.value.sum()

    a, b = Grow(), Grow()
    f = nn.jit(lambda d, *, other: d["m"]() + other())
    np.testing.assert_allclose(f({"m": a}, other=b), 4.0)
    for m in (a, b):
        assert isinstance(m.seen, nn.Intermediate)
        np.testing.assert_allclose(m.seen.value[0], [2.0, 2.0])
    f({"m": a}, other=b)
    assert len(a.seen.value) == 2 and len(b.seen.value) == 2


class _Momentum:
    """A hand-written Optax-style transformation (no Optax import): heavy-ball momentum,
    with an extra keyword argument forwarded by Optimizer.update."""

    def __init__(self, lr, beta):
        self.lr, self.beta = lr, beta

    def init(self, params):
        return {"m": jax.tree.map(jnp.zeros_like, params), "n": jnp.zeros((), jnp.int32)}

    def update(self, grads, state, params=None, *, scale=1.0):
        m = jax.tree.map(lambda m, g: self.beta * m + g, state["m"], grads)
        return jax.tree.map(lambda m: -self.lr * scale * m, m), {"m": m, "n": state["n"] + 1}


def test_optimizer_duck_typed_tx_matches_numpy_and_wrt_filter():
    lin = nn.Linear(3, 2, bias_init=nn.initializers.normal(1.0), rngs=nn.Rngs(0))
    x = np.random.default_rng(0).standard_normal((6, 3))
    y = np.random.default_rng(1).standard_normal((6, 2))
    # only the kernel is trained: wrt is any filter
    opt = nn.Optimizer(lin, _Momentum(0.1, 0.9), wrt=nn.All(nn.Param, nn.PathContains("kernel")))
    assert nn.state(opt, nn.OptState).flat_paths() == ["step", "opt_state/m/kernel", "opt_state/n"]

    @nn.jit
    def step(m, opt, x, y):
        loss = lambda m: jnp.mean((m(x) - y) ** 2)  # noqa: E731
        g = nn.grad(loss, wrt=opt.wrt)(m)
        opt.update(m, g, scale=0.5)

    w, b = f64(lin.kernel[...]), f64(lin.bias[...])
    mom = np.zeros_like(w)
    for _ in range(3):
        step(lin, opt, jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
        gw = 2.0 / y.size * x.T @ (x @ w + b - y)
        mom = 0.9 * mom + gw
        w = w - 0.1 * 0.5 * mom
    np.testing.assert_allclose(f64(lin.kernel[...]), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f64(lin.bias[...]), b)  # not selected by wrt: unchanged
    assert int(opt.step.value) == 3 and int(opt.opt_state["n"].value) == 3


def test_rngs_inside_scan_equal_the_unrolled_loop_and_give_independent_masks():
    drop = nn.Dropout(0.5)
    x = jnp.ones((6, 16))

    # 1. Rngs in the carry: each step draws the next key, the counter flows back
    def body(r, xt):
        return r, drop(xt, rngs=r)

    r_scan = nn.Rngs(dropout=3)
    _, ys = nn.scan(body)(r_scan, x)
    r_loop = nn.Rngs(dropout=3)
    loop = np.stack([np.asarray(drop(x[t], rngs=r_loop)) for t in range(6)])
    np.testing.assert_array_equal(np.asarray(ys), loop)
    assert int(r_scan.dropout.count.value) == int(r_loop.dropout.count.value) == 6
    masks = {tuple(row != 0) for row in np.asarray(ys)}
    assert len(masks) == 6  # 16 fair coins per row: a repeat has probability < 1e-3

    # 2. split Rngs scanned over as xs: step t uses key t
    r_split = nn.Rngs(dropout=4).split(6)

    def body2(c, inp):
        r, xt = inp
        return c, drop(xt, rngs=r)

    _, ys2 = nn.scan(body2)(0, (r_split, x))
    keys = jax.random.split(nn.Rngs(dropout=4).dropout(), 6)
    ref = np.stack([np.asarray(drop(x[t], rngs=nn.Rngs(dropout=keys[t]))) for t in range(6)])
    np.testing.assert_array_equal(np.asarray(ys2), ref)
    np.testing.assert_array_equal(np.asarray(r_split.dropout.count.value), np.ones(6))
    assert len({tuple(row != 0) for row in np.asarray(ys2)}) == 6


def test_state_arguments_get_their_variables_changes_back():
    # a State's Variables are the caller's (nn.split shares them); a function that
    # merges the State and changes a variable inside a transform changes them, as in Flax
    model = Counted(3, nn.Rngs(0))
    graphdef, params, rest = nn.split(model, nn.Param, ...)

    def run(params, rest, x):
        m = nn.merge(graphdef, params, rest)
        return m(x)

    x = jnp.ones((2, 3))
    for transform in (nn.jit, lambda f: nn.vmap(f, in_axes=(None, None, 0))):
        before = int(model.calls.value)
        transform(run)(params, rest, x if transform is nn.jit else x[None])
        assert int(model.calls.value) == before + 1
        assert rest["calls"] is model.calls
    for mode in (True, False):
        g = nn.grad(lambda p, r: run(p, r, x).sum(), graph=mode, graph_updates=mode)(params, rest)
        assert isinstance(g, nn.State) and set(g.flat_paths()) == set(params.flat_paths())
        # a State of the parameters' Variable types holding plain arrays
        assert type(g["lin"]["bias"]) is nn.Param
        assert isinstance(g["lin"]["bias"].value, jax.Array)
    np.testing.assert_allclose(
        g["lin"]["bias"].value,
        jax.grad(lambda b: jnp.tanh(x @ model.lin.kernel.value + b).sum())(model.lin.bias.value),
        rtol=1e-6,
    )


def test_vmap_names_the_broadcast_variable_given_a_batched_value():
    class Env(nn.Module):
        def __init__(self):
            self.shared = nn.BatchStat(jnp.array(1))
            self.index = nn.Param(jnp.arange(4))

    @nn.vmap(in_axes=(nn.StateAxes({nn.BatchStat: None, nn.Param: 0}),))
    def bad(env):
        env.shared.value = env.shared.value + env.index.value  # batched into a broadcast

    with pytest.raises(ValueError, match=r"at vmap out_axes.*'shared'.*got axis spec None"):
        bad(Env())

    @nn.vmap(in_axes=(nn.StateAxes({nn.BatchStat: None, nn.Param: 0}),))
    def good(env):
        env.index.value = env.index.value * 2

    env = Env()
    good(env)
    np.testing.assert_array_equal(env.index.value, 2 * np.arange(4))
