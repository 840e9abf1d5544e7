"""Smaller behaviours Flax NNX's own test suite relies on (issue 30): layer structure
independent of initializers, nested State views, the empty Sequential, ``Dict.setdefault``
and the error messages Flax's tests match."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn

LAYERS = [
    (nn.Linear, (2, 4), ("kernel_init", "bias_init")),
    (nn.LinearGeneral, (2, (3, 4)), ("kernel_init", "bias_init")),
    (nn.Einsum, ("ik,kj->ij", (5, 4), 5), ("kernel_init", "bias_init")),
    (nn.Conv, (2, 4, 3), ("kernel_init", "bias_init")),
    (nn.ConvTranspose, (2, 4, 3), ("kernel_init", "bias_init")),
    (nn.Embed, (2, 4), ("embedding_init",)),
    (nn.MultiHeadAttention, (8, 5, 16), ("kernel_init", "out_kernel_init", "bias_init", "out_bias_init")),
]


@pytest.mark.parametrize(("cls", "args", "inits"), LAYERS, ids=[c.__name__ for c, _, _ in LAYERS])
def test_initializers_are_not_part_of_a_layers_structure(cls, args, inits):
    zeros = cls(*args, **{k: nn.initializers.zeros for k in inits}, rngs=nn.Rngs(0))
    ones = cls(*args, **{k: nn.initializers.ones for k in inits}, rngs=nn.Rngs(0))
    assert nn.graphdef(zeros) == nn.graphdef(ones)
    assert not any(k in vars(zeros) for k in inits)
    first = nn.state(zeros).flat_paths()[0]
    assert not np.any(np.asarray(nn.state(zeros)._flat[tuple(first.split("/"))][...]))


def test_nested_state_views_write_through():
    s = nn.State({"a": nn.Param(jnp.array(1)), "b": {"c": nn.Param(jnp.array(2))}})
    s.b.d = nn.Param(jnp.array(5))
    assert int(s["b"]["d"][...]) == 5
    s["b"]["e"] = {"f": nn.Param(jnp.array(6))}
    assert int(s["b"]["e"]["f"][...]) == 6
    s["b"]["e"]["f"] = nn.Param(jnp.array(7))  # two levels down
    assert int(s["b"]["e"]["f"][...]) == 7
    del s["b"]["c"]
    assert "c" not in s["b"] and sorted(s.flat_paths()) == ["a", "b/d", "b/e/f"]
    del s.b.d
    del s["b"]["e"]
    assert not s["b"] and [p for p in s.flat_paths() if p != "b"] == ["a"]  # an empty entry stays (Flax)
    s.x = 3  # a plain leaf, as in Flax NNX's State
    assert s.x == 3 and s.flat_paths() == ["a", "b", "x"]


def test_empty_sequential_is_the_identity():
    iden = nn.Sequential()
    assert iden(12) == 12
    assert iden(12, 23) == (12, 23)
    assert iden() is None
    assert iden(k=2) == {"k": 2}
    with pytest.raises(TypeError, match="not both"):
        iden(1, k=2)


def test_dict_setdefault():
    d = nn.Dict({"a": 1, "b": 2})
    assert d.setdefault("a", 10) == 1 and d["a"] == 1
    p = nn.Param(jnp.zeros(2))
    assert d.setdefault("c", p) is p and len(d) == 3
    assert nn.state(d)["c"] is p


def test_filter_errors_name_the_problem():
    m = nn.Dict(a=nn.List([nn.Param(1), nn.Variable(3)]), b=nn.BatchStat(2))
    with pytest.raises(ValueError, match="`...` or `True` can only be used as the last filters"):
        nn.split(m, ..., nn.Param)
    with pytest.raises(ValueError, match="can only be used as the last filters"):
        nn.state(m, True, nn.Param)
    with pytest.raises(ValueError, match=r"Non-exhaustive filters, got a non-empty remainder: .*'a/1'"):
        nn.split(m, nn.Param, nn.BatchStat)


def test_messages_flax_tests_match():
    with pytest.raises(AttributeError, match="No RngStream named 'dropout'"):
        nn.Rngs(some_name=0).dropout()
    drop = nn.Dropout(0.5, deterministic=False)
    with pytest.raises(ValueError, match="`deterministic` is False, but no `rngs` argument was provided to Dropout"):
        drop(jnp.ones((1, 4)))
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match="depths must match"):
        nn.dot_product_attention(q, jnp.ones((1, 4, 2, 7)), jnp.ones((1, 4, 2, 7)))
    with pytest.raises(ValueError, match="lengths must match"):
        nn.dot_product_attention(q, q, jnp.ones((1, 3, 2, 8)))


def test_string_filter_also_selects_a_streams_state_by_tag():
    rngs = nn.Rngs(params=0, dropout=1)
    drop, rest = nn.state(rngs, "dropout", ...)
    assert sorted(drop.flat_paths()) == ["dropout/count", "dropout/key"]
    assert sorted(rest.flat_paths()) == ["params/count", "params/key"]
    m = nn.Dict(dropout=nn.Param(jnp.ones(2)), other=nn.Param(jnp.ones(2)))
    assert nn.state(m, "dropout").flat_paths() == ["dropout"]  # the path, as before
    assert nn.state(m, "drop").flat_paths() == []  # a full match, not a prefix


def test_vmap_state_axes_by_stream_name():
    class Block(nn.Module):
        def __init__(self, rngs: nn.Rngs):
            self.linear = nn.Linear(2, 3, rngs=rngs)
            self.bn = nn.BatchNorm(3, use_running_average=False, rngs=rngs)
            self.dropout = nn.Dropout(0.1, deterministic=False, rngs=rngs)

    axes = nn.StateAxes({(nn.BatchStat, "dropout"): 0, ...: None})
    make = nn.split_rngs(splits=5, only="dropout")(nn.vmap(in_axes=(axes,), out_axes=axes)(Block))
    b = make(nn.Rngs(params=0, dropout=1))
    assert b.linear.kernel.shape == (2, 3) and b.bn.mean.shape == (5, 3)
    assert b.dropout.rngs.key.shape == (5,)


def test_shared_transform_arguments_report_inconsistent_aliasing():
    lin = nn.Linear(2, 2, rngs=nn.Rngs(0))
    seen = []
    nn.vmap(lambda a, b: seen.append(a is b), in_axes=(None, None), axis_size=2)(lin, lin)
    assert seen == [True]  # graph mode: one object inside the transform
    with pytest.raises(nn.SharedReferenceError, match="Inconsistent aliasing detected"):
        nn.vmap(lambda a, b: None, in_axes=(0, None))(lin, lin)
    with pytest.raises(ValueError, match="Inconsistent aliasing detected: the same Param object is found at paths"):
        nn.jit(lambda a, b: None, graph=False)(lin, lin.kernel)
