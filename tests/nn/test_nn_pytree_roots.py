"""``nn.split`` / ``state`` / ``graphdef`` / ``merge`` / ``update`` of roots that are not
modules (issue 30, Flax NNX's own suite): pytrees holding modules and Variables, a
lone Variable, a plain leaf."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn


def test_list_of_modules_splits_by_position_and_merges_back():
    rngs = nn.Rngs(0)
    ls = [nn.Linear(2, 3, rngs=rngs), nn.BatchNorm(3, rngs=rngs)]
    gd, st = nn.split(ls)
    assert st[0]["kernel"].shape == (2, 3) and st[1]["mean"].shape == (3,)
    assert sorted(st.flat_paths()) == ["0/bias", "0/kernel", "1/bias", "1/mean", "1/scale", "1/var"]
    assert repr(gd) == "GraphDef(pytree, num_variables=6)"
    assert nn.graphdef(ls) == gd
    out = nn.merge(gd, st)
    assert type(out) is list and out[0].kernel is ls[0].kernel
    x = jnp.ones((1, 2))
    np.testing.assert_array_equal(np.asarray(out[0](x)), np.asarray(ls[0](x)))


def test_nested_pytree_keeps_its_plain_leaves_and_containers():
    a = {"a": 1, "b": nn.Param(jnp.array(2))}
    g = [a, 3, (nn.Param(jnp.array(4)), jnp.array(5.0), "s")]
    gd, st = nn.split(g)
    # every leaf of a pytree root is state (Flax NNX's), kept as the plain leaf
    assert sorted(st.flat_paths()) == ["0/a", "0/b", "1", "2/0", "2/1", "2/2"]
    assert st[1] == 3 and st[2][2] == "s" and isinstance(st[0]["b"], nn.Param)
    g2 = nn.merge(gd, st)
    assert type(g2) is list and type(g2[2]) is tuple
    assert g2[0]["a"] == 1 and g2[1] == 3 and g2[2][2] == "s"
    assert int(g2[0]["b"][...]) == 2 and int(g2[2][0][...]) == 4
    assert g2[2][1] is g[2][1]


def test_update_of_a_pytree_root_writes_into_its_variables():
    rngs = nn.Rngs(0)
    d = {"enc": nn.Linear(2, 2, rngs=rngs)}
    st = nn.state(d)
    st["enc"]["bias"].value = jnp.full((2,), 7.0)
    new = nn.State({"enc": {"bias": nn.Param(jnp.full((2,), 3.0))}})
    nn.update(d, new)
    np.testing.assert_array_equal(np.asarray(d["enc"].bias[...]), [3.0, 3.0])
    with pytest.raises(ValueError, match="nn.update: dict has no variable at 'enc/w'"):
        nn.update(d, nn.State({"enc": {"w": nn.Param(jnp.zeros(2))}}))


def test_shared_variables_in_a_pytree_root_tree_mode_refused_graph_mode_kept():
    v = nn.Param(jnp.array(1.0))
    for fn in (nn.split, nn.state, nn.graphdef):
        with pytest.raises(ValueError, match="same object is found at paths '0' and '1'"):
            fn([v, v], graph=False)
    gd, st = nn.split([v, v])
    assert st.flat_paths() == ["0"]
    a, b = nn.merge(gd, st)
    assert a is b is v
    r = jax.new_ref(jnp.array(1.0))
    with pytest.raises(ValueError, match="tree mode"):
        nn.split([r, r], graph=False)


def test_lone_variable_is_its_own_state():
    v = nn.Param(jnp.array(1.0))
    gd, st = nn.split(v)
    assert st is v and repr(gd) == "VariableDef(Param)"
    gd, bs, params, rest = nn.split(v, nn.BatchStat, nn.Param, ...)
    assert params is v and bs == {} and rest == {}
    assert nn.merge(gd, bs, params, rest) is v
    assert nn.merge(gd, params, copy=True) is not v
    nn.update(v, bs, nn.Param(jnp.array(5.0)), rest)
    assert float(v[...]) == 5.0
    with pytest.raises(ValueError, match="matched none of the filters"):
        nn.split(v, nn.BatchStat)
    with pytest.raises(ValueError, match="needs exactly one value"):
        nn.merge(gd, bs, rest)
    with pytest.raises(TypeError, match="needs a Variable, got int"):
        nn.merge(gd, 3)


def test_plain_leaf_is_its_own_state():
    x = jnp.array([1.0, 2.0])
    gd, st = nn.split(x)
    assert st is x and nn.merge(gd, st) is x
    gd, arrays, rest = nn.split(x, jax.Array, ...)
    assert arrays is x and rest == {}
    assert nn.merge(gd, arrays, rest) is x
    gd, st = nn.split(42)
    assert nn.merge(gd, st) == 42
    # a GraphDef of a leaf goes through jax.jit as a pytree with no leaves
    assert jax.jit(lambda g, s: nn.merge(g, s) * 2)(gd, jnp.int32(3)) == 6
