"""Shared references (weight tying, a submodule under two parents, cycles): kept in graph
mode (the default), refused in tree mode (``graph=False``), as Flax NNX does."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn


class Lin(nn.Module):
    def __init__(self, din, dout, rngs):
        self.kernel = nn.Param(jax.random.normal(rngs.params(), (din, dout)))


class TiedAE(nn.Module):
    """An auto-encoder whose decoder is its encoder's kernel, transposed."""

    def __init__(self, rngs):
        self.enc = Lin(3, 2, rngs)
        self.dec = nn.Dict(kernel=self.enc.kernel)  # the same Param at a second place
        self.scale = nn.Param(jnp.array(1.5))

    def __call__(self, x):
        h = jnp.tanh(x @ self.enc.kernel[...])
        return self.scale[...] * h @ self.dec["kernel"][...].T


def _loss(params, x):
    """The model's loss written on a params dict (one ``w`` for both uses)."""
    h = jnp.tanh(x @ params["w"])
    return jnp.sum((params["s"] * h @ params["w"].T - x) ** 2)


def _model_loss(m, x):
    return jnp.sum((m(x) - x) ** 2)


X = jnp.arange(12.0).reshape(4, 3) / 10


def test_split_merge_clone_keep_one_object():
    m = TiedAE(nn.Rngs(0))
    gd, st = nn.split(m)
    assert st.flat_paths() == ["enc/kernel", "scale"]  # the tied kernel once, first path
    m2 = nn.merge(gd, st)
    assert m2.dec["kernel"] is m2.enc.kernel is st["enc"]["kernel"]
    for c in (nn.clone(m), copy.deepcopy(m)):
        assert c.dec["kernel"] is c.enc.kernel and c.enc.kernel is not m.enc.kernel
        np.testing.assert_array_equal(c.enc.kernel[...], m.enc.kernel[...])


def test_grad_of_tied_weight_is_the_sum_of_both_uses():
    m = TiedAE(nn.Rngs(0))
    params = {"w": m.enc.kernel[...], "s": m.scale[...]}
    want = jax.grad(_loss)(params, X)
    grads = nn.grad(_model_loss)(m, X)
    assert grads.flat_paths() == ["enc/kernel", "scale"]
    np.testing.assert_allclose(grads["enc"]["kernel"][...], want["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads["scale"][...], want["s"], rtol=1e-5)


def test_jit_train_step_updates_the_tied_weight_once():
    m = TiedAE(nn.Rngs(1))
    params = {"w": m.enc.kernel[...], "s": m.scale[...]}

    @nn.jit
    def step(m, x):
        g = nn.grad(_model_loss)(m, x)
        m.enc.kernel[...] -= 0.1 * g["enc"]["kernel"][...]
        m.scale[...] -= 0.1 * g["scale"][...]

    for _ in range(2):
        step(m, X)
        g = jax.grad(_loss)(params, X)
        params = jax.tree.map(lambda p, d: p - 0.1 * d, params, g)
    assert m.dec["kernel"] is m.enc.kernel
    np.testing.assert_allclose(m.enc.kernel[...], params["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.scale[...], params["s"], rtol=1e-5)


def test_shared_submodule_and_cycle():
    lin = Lin(2, 2, nn.Rngs(0))
    outer = nn.Dict(a=lin, b=nn.List([lin]))
    outer["me"] = outer
    gd, st = nn.split(outer)
    assert st.flat_paths() == ["a/kernel"]
    o2 = nn.merge(gd, st)
    assert o2["b"][0] is o2["a"] and o2["me"] is o2
    assert [p for p, _ in nn.iter_modules(outer)] == ["", "a", "b"]


def test_tree_mode_refuses_shared_references_naming_both_paths():
    m = TiedAE(nn.Rngs(0))
    with pytest.raises(ValueError, match="found at paths 'enc/kernel' and 'dec/kernel'"):
        nn.split(m, graph=False)
    with nn.set_graph_mode(False), pytest.raises(nn.SharedReferenceError, match="tree mode"):
        nn.state(m)
    a = nn.List([1])
    a.append(nn.List([2, a]))  # a cycle
    with pytest.raises(ValueError, match="found at paths '<root>' and '1/1'"):
        list(nn.iter_graph(a, graph=False))
    with pytest.raises(ValueError, match="found at paths"):
        nn.cond(True, lambda m: None, lambda m: None, m, graph=False)


def test_cond_writes_a_shared_variable_back_once():
    v = nn.Variable(jnp.array(0))
    d = nn.Dict(a=v, b=v)

    def inc_a(d):
        d["a"][...] += 1

    def inc_b(d):
        d["b"][...] += 2

    nn.cond(True, inc_a, inc_b, d)
    nn.cond(False, inc_a, inc_b, d)
    assert d["a"] is d["b"] and int(v[...]) == 3


def test_without_graph_updates_an_input_variable_is_not_returned():
    v = nn.Param(jnp.array(1.0))
    with pytest.raises(ValueError, match="does not support Variable aliasing"):
        nn.jit(lambda v: v, graph=False)(v)
    for graph in (True, False):
        with pytest.raises(ValueError, match="Duplicate Param"):
            nn.eval_shape(lambda v: v, v, graph=graph, graph_updates=False)
    assert nn.jit(lambda v: v)(v) is not None  # graph mode with updates: allowed
    new = nn.jit(lambda v: nn.Param(v[...] + 1), graph=False)(v)  # a new Variable is fine
    assert float(new[...]) == 2.0 and float(v[...]) == 1.0


def test_grad_of_a_variable_passed_twice():
    p1, p2 = nn.Param(jnp.array(3.0)), nn.Param(jnp.array(5.0))
    m = {"a": [p1, p2], "b": p1}

    def f(m):
        return m["a"][0][...] * m["a"][1][...] + m["b"][...] ** 2

    want = jax.grad(lambda w, u: w * u + w**2, argnums=(0, 1))(3.0, 5.0)  # (11, 3)
    g = nn.grad(f)(m)  # graph mode: the shared Variable's gradient at its first place
    assert float(g["a"][0][...]) == want[0] and float(g["a"][1][...]) == want[1]
    assert isinstance(g["b"], nn.State) and not g["b"]
    g = nn.grad(f, graph_updates=False)(m)  # tree-shaped: at each place
    assert float(g["a"][0][...]) == float(g["b"][...]) == want[0]
    nn.update(m, nn.state(g))  # the other place's path finds the shared Variable
    assert m["a"][0] is m["b"] and float(p1[...]) == want[0]
    with pytest.raises(ValueError, match="Duplicate Param"):
        nn.grad(f, graph=False)(m)
    with pytest.raises(ValueError, match=r"Inconsistent aliasing detected[\s\S]*Param"):
        nn.grad(lambda a, b: a[...] + b[...], argnums=0)(p1, p1)  # differentiated once only
