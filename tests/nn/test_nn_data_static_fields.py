"""``nn.data()`` / ``nn.static()`` as field markers (Flax NNX's field specifiers), and
``nn.data`` of Python numbers (issue 30)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from cairn import nn


def test_data_marker_in_a_class_body_makes_assignments_state():
    class Foo(nn.Module):
        node: jax.Array = nn.data()

        def __init__(self):
            self.node = jnp.array(1)
            self.meta = 1

    m = jax.tree.map(lambda x: x + 1, Foo())
    assert isinstance(m.node, jax.Array) and int(m.node) == 2 and m.meta == 1
    assert nn.state(m).flat_paths() == ["node"]


def test_markers_in_a_dataclass_with_defaults():
    @nn.dataclass
    class Bar(nn.Module):
        node: jax.Array = nn.data()
        meta: int = nn.static(default=3)
        count: int = nn.data(default=6)

    b = Bar(node=jnp.array(1))
    assert [int(x) for x in jax.tree.leaves(b)] == [1, 6]
    m = jax.tree.map(lambda x: x * 10, b)
    assert int(m.node) == 10 and m.count == 60 and m.meta == 3
    assert type(m.count) is int  # a data int stays an int, as Flax NNX's
    assert [f.name for f in dataclasses.fields(Bar)] == ["node", "meta", "count"]


def test_state_in_a_static_field_or_static_call_raises_both_error_types():
    @nn.dataclass
    class S(nn.Module):
        a: jax.Array = nn.static()

    with pytest.raises(ValueError, match="Found unexpected data on value of type ArrayImpl for the static attribute 'a'"):
        S(a=jnp.array(3))
    with pytest.raises(TypeError, match="Found data in value of type ArrayImpl: it is state"):
        nn.static(jnp.array(1))
    with pytest.raises(ValueError, match="Found data in value of type Param"):
        nn.static(nn.Param(jnp.ones(2)))
    with pytest.raises(TypeError, match="field options"):
        nn.data(1, default=2)


def test_data_of_numbers_keeps_the_plain_values_as_leaves():
    class P(nn.Pytree):
        def __init__(self):
            self.a = nn.data(1)
            self.b = nn.static(2)
            self.c = nn.data((2.5, True))

    p = P()
    assert p.a == 1 and type(p.a) is int and p.b == 2
    assert jax.tree.leaves(p) == [1, 2.5, True]
    st = nn.state(p)
    assert st["a"] == 1 and st["c"] == (2.5, True) and "b" not in st
    p.a = "hello"  # an explicit mark stays: still data
    assert jax.tree.leaves(p) == ["hello", 2.5, True]
    p.a = nn.static(3)
    assert jax.tree.leaves(p) == [2.5, True]
