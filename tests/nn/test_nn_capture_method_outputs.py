"""``nn.capture(method_outputs=...)``, ``var_defaults`` as a mapping and a Variable that
proxies a call to its value (Flax NNX's module_test, mutable_array_test and
variable_test, issue 30)."""

import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn


class Inner(nn.Module):
    def __init__(self, key):
        self.w = nn.Param(jax.random.normal(key, (3, 3)))

    def __call__(self, x):
        return x @ self.w[...]

    def helper(self, x):
        return jnp.sin(x)


class Outer(nn.Module):
    def __init__(self):
        self.block = Inner(jax.random.key(0))

    def __call__(self, x):
        y = self.block(x)
        return self.block.helper(y) * 2


def test_method_outputs_are_sown_per_module_and_method():
    model = Outer()
    x = jnp.ones((2, 3))
    out, inter = nn.capture(model, nn.Intermediate, method_outputs=nn.Intermediate)(x)
    w = np.asarray(model.block.w[...], np.float64)
    y = np.ones((2, 3)) @ w
    np.testing.assert_allclose(np.asarray(inter["block"]["__call__"][0]), y, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(inter["block"]["helper"][0]), np.sin(y), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(inter["__call__"][0]), 2 * np.sin(y), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out), 2 * np.sin(y), rtol=1e-5)
    # the model and its classes are left as they were
    assert set(nn.state(model).flat_paths()) == {"block/w"}
    assert Inner.__call__.__qualname__ == "Inner.__call__"
    with pytest.raises(TypeError, match="method_outputs must be a Variable type"):
        nn.capture(model, nn.Intermediate, method_outputs="x")


def test_var_defaults_is_a_mapping():
    d = nn.var_defaults()
    assert dict(d) == {"hijax": False, "ref": False}
    assert "ref" in d and len(d) == 2 and list(d) == ["hijax", "ref"] and d["hijax"] is d.hijax
    with pytest.raises(KeyError):
        d["other"]


def test_variable_proxies_a_call():
    class Scale(typing.NamedTuple):
        k: int

        def __call__(self, x):
            return self.k * x

    assert nn.Param(Scale(2))(3) == 6
    with pytest.raises(TypeError, match="Param is not callable: its value is a"):
        nn.Param(jnp.ones(2))(1)


def test_recursive_map_over_a_list_of_modules():
    class Foo(nn.Pytree):
        def __init__(self, d):
            self.d = d
            self.w = nn.Param(jnp.full((2,), float(d)))

    bar = [Foo(10), {"b": Foo(20)}]
    seen = []

    def visit(path, node):
        seen.append((path, type(node).__name__))
        if isinstance(node, Foo):
            node.d += 1
        return node

    out = nn.recursive_map(visit, bar, graph=False)
    assert out[0].d == 11 and out[1]["b"].d == 21 and bar[0].d == 10  # a new tree
    assert out[0].w is bar[0].w  # sharing the Variables
    assert ((0, "w"), "Param") in seen and ((1,), "dict") in seen and ((), "list") in seen
    swapped = nn.recursive_map(lambda p, x: Foo(-x.d) if isinstance(x, Foo) else x, bar)
    assert swapped[0].d == -10 and swapped[1]["b"].d == -20
    v = nn.Param(jnp.array(1))
    with pytest.raises(ValueError, match="found at paths '0' and '1'"):
        nn.recursive_map(lambda p, x: x, [v, v], graph=False)
    calls = []
    a, b = nn.recursive_map(lambda p, x: calls.append(p) or x, [v, v])  # graph mode
    assert a is b is v and calls == [(0,), ()]  # the shared Variable mapped once


def test_sow_refuses_a_field_of_another_kind():
    class Foo(nn.Module):
        def __init__(self):
            self.y = 10
            self.p = nn.Param(jnp.ones(()))

    m = Foo()
    with pytest.raises(ValueError, match="'y' of Foo to be a Variable, got int"):
        m.sow(nn.Intermediate, "y", 1.0)
    with pytest.raises(TypeError, match="'p' of Foo to be of type Intermediate, got Param"):
        m.sow(nn.Intermediate, "p", 1.0)
    m.sow(nn.Intermediate, "z", 1.0)
    m.sow(nn.Intermediate, "z", 2.0)
    assert m.z.value == (1.0, 2.0)
