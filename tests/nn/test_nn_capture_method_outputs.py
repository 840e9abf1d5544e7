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
