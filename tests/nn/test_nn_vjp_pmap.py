"""nn.vjp / nn.jvp / nn.custom_vjp / nn.pmap, StateSharding in nn.shard_map and
nn.jit's in_shardings / out_shardings, and the bound-method check of the transforms.

References are closed-form derivatives computed with NumPy in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cairn import nn

F32 = {"rtol": 1e-5, "atol": 1e-6}  # float32 against float64 references


class Lin(nn.Module):
    def __init__(self, w, b):
        self.w = nn.Param(jnp.asarray(w, jnp.float32))
        self.b = nn.Param(jnp.asarray(b, jnp.float32))
        self.calls = nn.BatchStat(jnp.array(0, jnp.int32))

    def __call__(self, x):
        self.calls.value += 1
        return x @ self.w.value + self.b.value


def _lin():
    rng = np.random.default_rng(0)
    return Lin(rng.normal(size=(3, 2)), rng.normal(size=(2,))), rng.normal(size=(4, 3))


def test_vjp_module_cotangents_match_closed_form_and_state_is_written_back():
    m, x = _lin()
    w64 = np.asarray(m.w.value, np.float64)
    out, vjp_fn = nn.vjp(lambda m, x: jnp.sum(m(x) ** 2), m, jnp.asarray(x, jnp.float32))
    y = x @ w64 + np.asarray(m.b.value, np.float64)
    np.testing.assert_allclose(out, (y**2).sum(), rtol=1e-5)
    assert int(m.calls.value) == 1
    m_ct, x_ct = vjp_fn(jnp.ones(()))
    assert isinstance(m_ct, Lin)
    np.testing.assert_allclose(m_ct.w.value, x.T @ (2 * y), **F32)
    np.testing.assert_allclose(m_ct.b.value, (2 * y).sum(0), **F32)
    np.testing.assert_allclose(x_ct, (2 * y) @ w64.T, **F32)


def test_vjp_has_aux_and_decorator_form():
    m, x = _lin()

    @nn.vjp(has_aux=True)
    def f(m, x):
        y = m(x)
        return y.sum(), {"n": y.shape[0]}

    _, vjp_fn, aux = f(m, jnp.asarray(x, jnp.float32))
    assert aux == {"n": 4}
    (m_ct, _) = vjp_fn(jnp.ones(()))
    np.testing.assert_allclose(m_ct.b.value, [4.0, 4.0], **F32)


def test_jvp_module_tangent_matches_closed_form():
    m, x = _lin()
    t = jax.tree.map(jnp.ones_like, m)
    xs = jnp.asarray(x, jnp.float32)
    _, t_out = nn.jvp(lambda m, x: m(x).sum(), (m, xs), (t, jnp.zeros_like(xs)))
    # d/dW sum(xW + b) . 1 = sum over rows of x, times out columns; d/db . 1 = rows * cols
    expected = x.sum() * 2 + 4 * 2
    np.testing.assert_allclose(t_out, expected, rtol=1e-5)
    assert int(m.calls.value) == 1


def test_jvp_rejects_mismatched_tangents():
    m, _ = _lin()
    with pytest.raises(TypeError, match="structure of primals"):
        nn.jvp(lambda m, x: m(x).sum(), (m, jnp.ones((4, 3))), (jnp.ones(()), jnp.ones((4, 3))))


def _custom_sin(graph_updates: bool):
    class Foo(nn.Module):
        def __init__(self):
            self.x = nn.Param(jnp.array(0.5))
            self.y = nn.Param(jnp.array(2.0))
            self.n = nn.BatchStat(jnp.array(0, jnp.int32))

    @nn.custom_vjp(graph=True, graph_updates=graph_updates)
    def f(m):
        m.n.value += 1
        return jnp.sin(m.x.value) * m.y.value

    def fwd(m):
        return f(m), (jnp.cos(m.x.value), jnp.sin(m.x.value), m.y.value)

    if graph_updates:
        def bwd(res, g):
            cos_x, _, y = res
            (m_g,), out_g = g
            assert isinstance(m_g, nn.State)
            # a rule that doubles the true gradient, so the test sees it was used
            return (nn.State({"x": nn.Param(2 * cos_x * y * out_g)}),)
    else:
        def bwd(res, out_g):
            cos_x, sin_x, y = res
            m_g = jax.tree.map(jnp.zeros_like, Foo())
            m_g.x.value = 2 * cos_x * y * out_g
            m_g.y.value = 2 * sin_x * out_g
            return (m_g,)

    f.defvjp(fwd, bwd)
    return Foo, f


@pytest.mark.parametrize("graph_updates", [True, False])
def test_custom_vjp_rule_is_used_and_state_changes_come_back(graph_updates):
    foo, f = _custom_sin(graph_updates)
    m = foo()
    grads = nn.grad(f, argnums=nn.DiffState(0, nn.Param), graph=True, graph_updates=True)(m)
    np.testing.assert_allclose(grads["x"].value, 2 * np.cos(0.5) * 2.0, **F32)
    # a State left out of the rule's result is a zero cotangent
    expected_y = 0.0 if graph_updates else 2 * np.sin(0.5)
    np.testing.assert_allclose(grads["y"].value, expected_y, **F32)
    assert int(m.n.value) == 1
    np.testing.assert_allclose(f(m), np.sin(0.5) * 2.0, **F32)
    assert int(m.n.value) == 2


@pytest.mark.parametrize("graph_updates", [True, False])
def test_custom_vjp_static_changes_stay_inside_without_graph_updates(graph_updates):
    class Foo(nn.Module):
        def __init__(self):
            self.x = nn.Param(jnp.array(0.5))
            self.calls = 0  # a static attribute
            self.n = nn.BatchStat(jnp.array(0, jnp.int32))

    @nn.custom_vjp(graph=True, graph_updates=graph_updates)
    def f(m):
        m.calls += 1
        m.n.value += 1
        return jnp.sin(m.x.value) * 3.0

    f.defvjp(lambda m: (f(m), jnp.cos(m.x.value)),
             lambda cos_x, g, *updates: (nn.State({"x": nn.Param(cos_x * 3.0 * (g[1] if graph_updates else g))})
                                         if graph_updates else _module_ct(cos_x * 3.0 * g),))

    def _module_ct(gx):
        ct = jax.tree.map(jnp.zeros_like, Foo())
        ct.x.value = gx
        return ct

    m = Foo()
    y = f(m)
    np.testing.assert_allclose(y, 3.0 * np.sin(0.5), **F32)
    assert int(m.n.value) == 1  # a variable's new value comes back in both modes
    assert m.calls == (1 if graph_updates else 0)  # a static change only with graph_updates
    g = nn.grad(lambda m: f(m), graph=True, graph_updates=graph_updates)(m)
    gx = g["x"].value if isinstance(g, nn.State) else g.x.value
    np.testing.assert_allclose(gx, 3.0 * np.cos(0.5), **F32)


def test_custom_vjp_nondiff_python_values_stay_constants():
    seen = []

    @nn.custom_vjp(nondiff_argnums=(0,))
    def f(k, x):
        seen.append(k)
        return x * k

    f.defvjp(lambda k, x: (f(k, x), None), lambda k, res, g: ((g[1] * 10.0,)))
    np.testing.assert_allclose(jax.grad(lambda x: f(3, x))(1.0), 10.0)
    assert all(k == 3 for k in seen)


def test_custom_vjp_errors():
    with pytest.raises(TypeError, match="defvjp"):
        nn.custom_vjp(lambda x: x)(1.0)
    with pytest.raises(ValueError, match="DiffState"):
        nn.custom_vjp(lambda m: m, nondiff_argnums=(nn.DiffState(0, ...),), graph=False)
    with pytest.raises(NotImplementedError, match="symbolic_zeros"):
        nn.custom_vjp(lambda x: x).defvjp(lambda x: (x, None), lambda r, g: g, symbolic_zeros=True)


def test_pmap_maps_modules_and_writes_state_back():
    m, x = _lin()
    xs = jnp.asarray(x, jnp.float32)[None]
    y = nn.pmap(lambda m, x: m(x), in_axes=(None, 0), axis_size=1)(m, xs)
    np.testing.assert_allclose(
        y[0], x @ np.asarray(m.w.value, np.float64) + np.asarray(m.b.value, np.float64), **F32
    )
    assert int(m.calls.value) == 1
    with pytest.raises(NotImplementedError, match="donate_argnums"):
        nn.pmap(lambda m: m, donate_argnums=0)


def test_pmap_out_axes_state_axes_for_a_created_module():
    axes = nn.StateAxes({nn.Param: 0, ...: None})
    made = nn.pmap(lambda k: Lin(jax.random.normal(k, (3, 2)), jnp.zeros(2)), out_axes=axes,
                   axis_size=1)(jax.random.split(jax.random.key(0), 1))
    assert made.w.shape == (1, 3, 2)
    assert made.calls.value.shape == ()


def test_transforms_reject_bound_methods_of_modules():
    m, _ = _lin()
    for t in (nn.jit, nn.vmap, nn.pmap, nn.grad, nn.remat, nn.custom_vjp):
        with pytest.raises(ValueError, match="bound methods"):
            t(m.__call__)
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    with pytest.raises(ValueError, match="bound methods"):
        nn.shard_map(m.__call__, mesh=mesh, in_specs=P(), out_specs=P())


def test_shard_map_decorator_with_state_sharding():
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    m, x = _lin()
    specs = nn.StateSharding({nn.PathContains("w"): P(None, "d"), ...: P()})

    @nn.shard_map(mesh=mesh, in_specs=(specs, P()), out_specs=P(None, "d"))
    def f(m, x):
        return m(x)

    y = f(m, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(
        y, x @ np.asarray(m.w.value, np.float64) + np.asarray(m.b.value, np.float64), **F32
    )
    assert int(m.calls.value) == 1
    assert isinstance(m.w.value.sharding, NamedSharding)


def test_jit_in_and_out_shardings_for_modules():
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    sh = NamedSharding(mesh, P(None, "d"))
    rep = NamedSharding(mesh, P())
    m, _ = _lin()
    specs = nn.StateSharding({nn.PathContains("w"): sh, ...: rep})

    @nn.jit(in_shardings=(specs,))
    def touch(m):
        return None

    assert not isinstance(m.w.value.sharding, NamedSharding)
    touch(m)  # the state comes back with its in_shardings (one device: specs normalize)
    assert isinstance(m.w.value.sharding, NamedSharding) and m.w.value.sharding.mesh == mesh

    @nn.jit(out_shardings=specs)
    def make():
        return Lin(jnp.ones((3, 2)), jnp.zeros(2))

    made = make().w.value.sharding
    assert isinstance(made, NamedSharding) and made.mesh == mesh
    with pytest.raises(ValueError, match="in_shardings has 2 entries"):
        nn.jit(lambda m: m, in_shardings=(rep, rep))(m)


def test_jit_partial_lower_compile_writes_state_back():
    m, _ = _lin()
    f = nn.jit_partial(lambda m, x: m(x), m)
    compiled = f.lower(jnp.ones((4, 3))).compile()
    compiled(jnp.ones((4, 3)))
    compiled(jnp.ones((4, 3)))
    assert int(m.calls.value) == 2


def test_scan_over_axis_1_and_negative_out_axis_match_a_python_loop():
    xs = np.random.default_rng(1).normal(size=(2, 5)).astype(np.float32)

    def step(c, x):
        c = c + x
        return c, c * 2

    scanned = nn.scan(step, in_axes=(nn.Carry, 1), out_axes=(nn.Carry, -1))
    c, ys = scanned(jnp.zeros(2), jnp.asarray(xs))
    ref_c = np.zeros(2)
    ref_ys = []
    for t in range(5):
        ref_c = ref_c + xs[:, t].astype(np.float64)
        ref_ys.append(ref_c * 2)
    np.testing.assert_allclose(c, ref_c, **F32)
    np.testing.assert_allclose(ys, np.stack(ref_ys, -1), **F32)


def test_vmap_binds_keyword_arguments_to_in_axes_positions():
    m, x = _lin()

    @nn.vmap(in_axes=(None, 0))
    def f(m, x):
        return m(x)

    xs = jnp.asarray(x, jnp.float32)
    y = f(m=m, x=xs)  # both by keyword: in_axes still means (m: None, x: 0)
    ref = x @ np.asarray(m.w.value, np.float64) + np.asarray(m.b.value, np.float64)
    np.testing.assert_allclose(y, ref, **F32)


def test_checkify_reports_nan_and_writes_state_back():
    from jax.experimental import checkify

    m, x = _lin()

    def f(m, x):
        return jnp.log(m(x).sum() * 0 - 1.0)

    err, _ = nn.checkify(f, errors=checkify.float_checks)(m, jnp.asarray(x, jnp.float32))
    with pytest.raises(ValueError, match="nan generated by primitive: log"):
        err.throw()
    assert int(m.calls.value) == 1
    with pytest.raises(ValueError, match="bound methods"):
        nn.checkify(m.__call__)


def test_make_jaxpr_leaves_modules_unchanged():
    m, _ = _lin()
    jaxpr = nn.make_jaxpr(lambda m, x: m(x))(m, jnp.ones((4, 3)))
    assert "dot_general" in str(jaxpr)
    assert int(m.calls.value) == 0
    with pytest.raises(ValueError, match="graph_updates=True"):
        nn.make_jaxpr(lambda m: m, graph_updates=True)


def test_clone_of_pytrees_states_and_variables():
    a, _ = _lin()
    b, _ = _lin()
    ca, (cb,) = nn.clone((a, [b]))
    assert ca is not a and ca.w is not a.w and cb.w is not b.w
    np.testing.assert_array_equal(ca.w.value, a.w.value)
    s = nn.state(a)
    s2 = nn.clone(s)
    assert isinstance(s2, nn.State) and s2["w"] is not s["w"]
    assert nn.clone(a.w) is not a.w
    c1, c2 = nn.clone((a, a))  # graph mode: the copy keeps the sharing
    assert c1 is c2 and c1 is not a and c1.w is not a.w
    with pytest.raises(nn.SharedReferenceError, match="two entries"):
        nn.clone((a, a), graph=False)
    with pytest.raises(TypeError, match="pytree holding them"):
        nn.clone([1, 2])
