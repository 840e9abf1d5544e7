"""Flax NNX's prefix checks where a mode is asked for by keyword (issue 30): a module is
no prefix in graph mode, a StateAxes / StateSharding / DiffState none in tree mode, a
lone Variable never one in tree mode; the defaults accept them all."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn


def _module():
    return nn.Dict(a=nn.Param(1))


@pytest.mark.parametrize(
    "make",
    [
        lambda m: nn.jit(lambda x: x, in_shardings=m, graph=True, graph_updates=True),
        lambda m: nn.grad(lambda x: x, argnums=m, graph=True, graph_updates=True),
        lambda m: nn.vmap(lambda x: x, in_axes=(m,), graph=True),
        lambda m: nn.scan(lambda c, x: (c, x), in_axes=(nn.Carry, m), graph=True),
    ],
)
def test_a_module_is_no_prefix_in_graph_mode(make):
    with pytest.raises(ValueError, match="Graph nodes are not allowed as prefixes"):
        make(_module())


@pytest.mark.parametrize(
    "make, kind",
    [
        (lambda: nn.jit(lambda x: x, in_shardings=nn.StateSharding({...: None}), graph=False),
         "StateSharding"),
        (lambda: nn.grad(lambda x: x, argnums=nn.DiffState(0, ...), graph_updates=False),
         "DiffState"),
        (lambda: nn.vmap(lambda x: x, in_axes=nn.StateAxes({...: 0}), graph=False), "StateAxes"),
    ],
)
def test_mapping_prefixes_need_graph_mode(make, kind):
    with pytest.raises(ValueError, match=f"cannot contain `{kind}` objects"):
        make()


def test_variable_prefix_in_tree_mode():
    with pytest.raises(ValueError, match="Variables prefixes are not supported"):
        nn.vmap(lambda v: v, in_axes=(nn.Variable(0),), graph=False)


def test_defaults_accept_state_axes_and_prefix_modules():
    lin = nn.Linear(2, 3, rngs=nn.Rngs(0))
    x = jnp.ones((4, 2))
    want = np.asarray(x) @ np.asarray(lin.kernel[...]) + np.asarray(lin.bias[...])
    out = nn.vmap(lambda m, x: m(x), in_axes=(nn.StateAxes({...: None}), 0))(lin, x)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
    axes = nn.prefix(lin, {...: None})
    out = nn.vmap(lambda m, x: m(x), in_axes=(axes, 0), graph=False)(lin, x)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)


def test_flax_words_in_aliasing_and_carry_messages():
    v = nn.Param(jnp.array(1.0))
    with pytest.raises(ValueError, match="found at paths .*Duplicate Param"):
        nn.jit(lambda a, b: None, graph=False)(v, v)
    foo = nn.Dict(a=nn.Param(jnp.zeros((2, 2))))
    with pytest.raises(ValueError, match=r"Inconsistent aliasing detected\. The following nodes "
                       r"have different prefixes:\nNode: Param\n  0/a: 0\n  1/a: 1"):
        nn.vmap(lambda a, b: None, in_axes=(0, 1))(foo, foo)
    with pytest.raises(ValueError, match="Duplicate Param"):
        nn.vmap(lambda a, b: None, in_axes=(0, 0), graph=False)(foo, foo)
    with pytest.raises(ValueError, match="found at paths 'a' and 'b'"):
        nn.split(nn.Dict(a=v, b=v), graph=False)

    @nn.scan(in_axes=nn.Carry, out_axes=nn.Carry, length=3)
    def loop(c, x):
        return c

    with pytest.raises(ValueError, match="When in_axes=Carry, the function must take exactly one"):
        loop(nn.Dict(n=nn.BatchStat(0)), 0)


@pytest.mark.parametrize("graph", [True, False])
def test_prefix_trees_pass_the_checks_in_both_modes(graph):
    w = jax.random.normal(jax.random.key(0), (4, 2, 3))
    m = nn.Dict(w=nn.Param(w))
    x = jnp.ones((2,))
    axes = nn.prefix(m, {nn.Param: 0}, graph=graph)
    y = nn.vmap(lambda m, x: x @ m["w"][...], in_axes=(axes, None), graph=graph, graph_updates=False)(m, x)
    np.testing.assert_allclose(np.asarray(y), np.einsum("j,ijk->ik", np.ones(2), np.asarray(w)), rtol=1e-5)
    v = nn.Param(w)
    assert nn.prefix(v, {nn.Param: 0}) == 0  # a lone Variable's prefix is the value itself
    y = nn.vmap(lambda v, x: x @ v[...], in_axes=(nn.prefix(v, {...: 0}), None), graph=graph)(v, x)
    assert y.shape == (4, 3)


def test_merge_needs_a_state():
    gd, st = nn.split(nn.Linear(2, 3, rngs=nn.Rngs(0)))
    with pytest.raises(TypeError, match=r"merge\(\) missing 1 required positional argument: 'state'"):
        nn.merge(gd)
    empty_gd, empty = nn.split(nn.Dict())
    assert isinstance(nn.merge(empty_gd, empty), nn.Dict)
    assert nn.merge(gd, st).kernel is st["kernel"]
