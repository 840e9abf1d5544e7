"""cairn.kernels.quantized_dot_general as the dot_general of cairn.nn layers, on QArray
kernels made by cairn.quant."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import kernels, nn, quant
from cairn.core_array import QArray


class Mlp(nn.Module):
    def __init__(self, rngs, dot_general):
        self.l1 = nn.Linear(32, 64, dot_general=dot_general, rngs=rngs)
        self.l2 = nn.Linear(64, 8, dot_general=dot_general, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _quantize_kernels(model, qtype):
    for layer in (model.l1, model.l2):
        w = np.asarray(layer.kernel.value)
        layer.kernel.value = quant.quantize_array(w, qtype, reduce_axes=(0,))  # one scale per output column


@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_linear_with_quantized_dot_general_matches_dequantized(qtype):
    x = jax.random.normal(jax.random.key(1), (4, 5, 32))
    model = Mlp(nn.Rngs(0), kernels.quantized_dot_general)
    ref_model = Mlp(nn.Rngs(0), jax.lax.dot_general)
    _quantize_kernels(model, qtype)
    _quantize_kernels(ref_model, qtype)
    assert isinstance(model.l1.kernel.value, QArray)
    out = model(x)
    ref = ref_model(x)  # the default dot dequantizes the kernel
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # the kernel's integer values, not a dequantized copy, reach the dot
    jaxpr = str(jax.make_jaxpr(lambda a: model(a))(x))
    assert "i8[32,64]" in jaxpr or "i4[32,64]" in jaxpr


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_linear_quantized_under_jit_and_grad_of_input():
    x = jax.random.normal(jax.random.key(2), (3, 32))
    model = Mlp(nn.Rngs(0), kernels.quantized_dot_general)
    _quantize_kernels(model, "int8")
    out = nn.jit(lambda m, a: m(a))(model, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(model(x)), rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda a: model(a).sum())(x)
    assert g.shape == x.shape and bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.parametrize("impl", ["xla", "pallas_triton"])
def test_override_picks_the_implementation_inside_the_model(impl):
    x = jax.random.normal(jax.random.key(3), (6, 32))
    model = Mlp(nn.Rngs(0), kernels.quantized_dot_general)
    _quantize_kernels(model, "int8")
    with kernels.recording() as calls, kernels.override(impl, op="quantized_dot_general"):
        out = model(x)
    assert [c.implementation for c in calls if c.op == "quantized_dot_general"] == [impl, impl]
    ref = x @ model.l1.kernel.value.dequantize()
    ref = jax.nn.relu(ref + model.l1.bias.value) @ model.l2.kernel.value.dequantize() + model.l2.bias.value
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-4)
