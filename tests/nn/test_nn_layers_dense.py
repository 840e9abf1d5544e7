"""Linear, LinearGeneral, Einsum, Embed, LoRA and LoRALinear against float64 NumPy.

Tolerances: float32 within rtol=atol=1e-5 of the float64 reference; bfloat16 (inputs and
parameters in bfloat16, so the computation runs in bfloat16) within rtol=atol=3e-2 of the
reference computed from the same bfloat16-rounded values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import nn
from nn._nn_helpers import DTYPES, f64, randn, tolerances

TOL = tolerances(1e-5, 3e-2)


# --- Linear ---


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_bias", [True, False])
def test_linear_matches_numpy(dtype, use_bias):
    layer = nn.Linear(
        6, 5, use_bias=use_bias, param_dtype=dtype, bias_init=nn.initializers.normal(1.0),
        rngs=nn.Rngs(0),
    )
    x = randn((3, 4, 6), dtype)
    y = layer(x)
    assert y.shape == (3, 4, 5) and y.dtype == dtype
    ref = f64(x) @ f64(layer.kernel[...])
    if use_bias:
        ref = ref + f64(layer.bias[...])
    else:
        assert layer.bias is None
    np.testing.assert_allclose(f64(y), ref, **TOL[dtype])


def test_linear_dtype_and_param_dtype():
    layer = nn.Linear(4, 2, dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    assert layer.kernel[...].dtype == jnp.float32
    assert layer(jnp.ones((1, 4))).dtype == jnp.bfloat16
    # integer input promotes to the parameters' float dtype
    assert nn.Linear(4, 2, rngs=nn.Rngs(0))(jnp.ones((1, 4), jnp.int32)).dtype == jnp.float32


def test_linear_grad_equals_numpy_formula():
    layer = nn.Linear(4, 3, rngs=nn.Rngs(1))
    x = randn((5, 4), seed=2)
    w, b = layer.kernel[...], layer.bias[...]

    def loss(w, b):
        return jnp.sum(jnp.tanh(x @ w + b) ** 2)

    gw, gb = jax.grad(loss, argnums=(0, 1))(w, b)
    # d/dz sum(tanh(z)^2) = 2 tanh(z) (1 - tanh(z)^2)
    z = f64(x) @ f64(w) + f64(b)
    dz = 2 * np.tanh(z) * (1 - np.tanh(z) ** 2)
    np.testing.assert_allclose(f64(gw), f64(x).T @ dz, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(f64(gb), dz.sum(0), rtol=1e-4, atol=1e-5)

    # the same gradient through the module as a pytree (the functional form)
    def mloss(m):
        return jnp.sum(jnp.tanh(m(x)) ** 2)

    g = jax.grad(mloss)(layer)
    np.testing.assert_allclose(f64(g.kernel[...]), f64(gw), rtol=1e-6)
    np.testing.assert_allclose(f64(g.bias[...]), f64(gb), rtol=1e-6)
    # and through nn.grad (a State of Param gradients)
    ng = nn.to_pure_dict(nn.grad(mloss)(layer))
    np.testing.assert_allclose(f64(ng["kernel"]), f64(gw), rtol=1e-6)
    np.testing.assert_allclose(f64(ng["bias"]), f64(gb), rtol=1e-6)


@settings(max_examples=8, deadline=None)
@given(
    batch=st.lists(st.sampled_from([1, 3]), min_size=0, max_size=2),
    fin=st.sampled_from([1, 5]),
    fout=st.sampled_from([2, 5]),
)
def test_linear_shapes_property(batch, fin, fout):
    layer = nn.Linear(fin, fout, rngs=nn.Rngs(0))
    x = jnp.ones((*batch, fin))
    y = layer(x)
    assert y.shape == (*batch, fout)
    np.testing.assert_allclose(
        f64(y), np.ones((*batch, fin)) @ f64(layer.kernel[...]) + f64(layer.bias[...]), rtol=1e-5,
        atol=1e-5,
    )


def test_linear_bad_inputs():
    layer = nn.Linear(16, 4, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match=r"Linear expected last axis 16, got 8 in input of shape \(4, 8\)"):
        layer(jnp.ones((4, 8)))
    with pytest.raises(TypeError, match="numeric"):
        layer(jnp.ones((4, 16), bool))
    with pytest.raises(ValueError, match="at least 1 axes"):
        layer(jnp.ones(()))
    with pytest.raises(ValueError, match="positive"):
        nn.Linear(0, 3, rngs=nn.Rngs(0))


def test_linear_metadata_and_jit():
    layer = nn.Linear(3, 2, kernel_metadata={"note": ("embed", "mlp")}, rngs=nn.Rngs(0))
    assert layer.kernel.note == ("embed", "mlp")
    x = jnp.ones((2, 3))
    y = jax.jit(lambda m, x: m(x))(layer, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(layer(x)), rtol=1e-6)


# --- LinearGeneral ---


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_linear_general_multi_axis(dtype):
    layer = nn.LinearGeneral(
        (3, 4), (2, 5), axis=(-2, -1), param_dtype=dtype,
        bias_init=nn.initializers.normal(1.0), rngs=nn.Rngs(0),
    )
    assert layer.kernel.shape == (3, 4, 2, 5) and layer.bias.shape == (2, 5)
    x = randn((6, 3, 4), dtype)
    ref = np.einsum("bij,ijkl->bkl", f64(x), f64(layer.kernel[...])) + f64(layer.bias[...])
    np.testing.assert_allclose(f64(layer(x)), ref, **TOL[dtype])


def test_linear_general_non_trailing_axis_and_batch_axis():
    layer = nn.LinearGeneral(3, 2, axis=1, rngs=nn.Rngs(0))
    x = randn((4, 3, 5))
    ref = np.einsum("aib,ik->abk", f64(x), f64(layer.kernel[...]))
    np.testing.assert_allclose(f64(layer(x)), ref, rtol=1e-5, atol=1e-5)

    bl = nn.LinearGeneral(
        3, 2, axis=-1, batch_axis={0: 4}, bias_init=nn.initializers.normal(1.0), rngs=nn.Rngs(0)
    )
    assert bl.kernel.shape == (4, 3, 2) and bl.bias.shape == (4, 2)
    x = randn((4, 5, 3))
    ref = np.einsum("hti,hik->htk", f64(x), f64(bl.kernel[...])) + f64(bl.bias[...])[:, None, :]
    np.testing.assert_allclose(f64(bl(x)), ref, rtol=1e-5, atol=1e-5)


def test_linear_general_errors():
    with pytest.raises(ValueError, match="same length"):
        nn.LinearGeneral((3, 4), 2, axis=-1, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="leading dims"):
        nn.LinearGeneral(3, 2, batch_axis={1: 4}, rngs=nn.Rngs(0))
    layer = nn.LinearGeneral((3, 4), 2, axis=(-2, -1), rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match=r"LinearGeneral expected axis 1 of size 3, got 5"):
        layer(jnp.ones((2, 5, 4)))


# --- Einsum ---


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_einsum_matches_numpy(dtype):
    layer = nn.Einsum(
        "btd,dnh->btnh", (8, 2, 4), (2, 4), param_dtype=dtype,
        bias_init=nn.initializers.normal(1.0), rngs=nn.Rngs(0),
    )
    x = randn((3, 5, 8), dtype)
    ref = np.einsum("btd,dnh->btnh", f64(x), f64(layer.kernel[...])) + f64(layer.bias[...])
    np.testing.assert_allclose(f64(layer(x)), ref, **TOL[dtype])


def test_einsum_errors():
    with pytest.raises(ValueError, match="two operands"):
        nn.Einsum("ab->b", (2,), rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="kernel_shape"):
        nn.Einsum("ab,bc->ac", (2, 3, 4), rngs=nn.Rngs(0))
    layer = nn.Einsum("ab,bc->ac", (2, 3), rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="2 axes"):
        layer(jnp.ones((1, 2, 2)))


# --- Embed ---


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_embed_lookup_and_attend(dtype):
    emb = nn.Embed(11, 6, param_dtype=dtype, rngs=nn.Rngs(0))
    ids = jnp.array([[0, 3, 10], [5, 5, 1]])
    h = emb(ids)
    table = f64(emb.embedding[...])
    np.testing.assert_array_equal(f64(h), table[np.asarray(ids)])
    q = randn((2, 3, 6), dtype)
    np.testing.assert_allclose(f64(emb.attend(q)), f64(q) @ table.T, **TOL[dtype])


def test_embed_default_init_has_unit_variance_per_row():
    emb = nn.Embed(4000, 8, rngs=nn.Rngs(0))
    # variance_scaling(1, fan_in, normal, out_axis=0): fan_in = features -> var 1/8
    assert f64(emb.embedding[...]).var() == pytest.approx(1 / 8, rel=0.05)


def test_embed_errors():
    emb = nn.Embed(10, 4, rngs=nn.Rngs(0))
    with pytest.raises(TypeError, match="integer ids"):
        emb(jnp.ones((2,)))
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        emb(jnp.array([3, 10]))
    with pytest.raises(ValueError, match="Embed.attend expected last axis 4"):
        emb.attend(jnp.ones((2, 5)))
    # under jit an out-of-range id cannot raise; it yields NaN
    out = jax.jit(lambda m, i: m(i))(emb, jnp.array([11]))
    assert np.isnan(np.asarray(out)).all()


# --- LoRA ---


def test_lora_matches_numpy_and_starts_as_identity_on_base():
    base = nn.Linear(5, 3, rngs=nn.Rngs(0))
    x = randn((4, 5))
    lora = nn.LoRA(5, 2, 3, base_module=base, rngs=nn.Rngs(1))
    # B = 0 at init: adapter adds nothing
    np.testing.assert_allclose(f64(lora(x)), f64(base(x)), rtol=1e-6)
    lora.lora_b[...] = randn((2, 3), seed=3)
    ref = f64(base(x)) + f64(x) @ f64(lora.lora_a[...]) @ f64(lora.lora_b[...])
    np.testing.assert_allclose(f64(lora(x)), ref, rtol=1e-5, atol=1e-5)
    scaled = nn.LoRA(5, 2, 3, alpha=8.0, rngs=nn.Rngs(1))
    scaled.lora_b[...] = randn((2, 3), seed=3)
    ref = 4.0 * f64(x) @ f64(scaled.lora_a[...]) @ f64(scaled.lora_b[...])
    np.testing.assert_allclose(f64(scaled(x)), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_lora_linear_matches_numpy(dtype):
    layer = nn.LoRALinear(5, 3, lora_rank=2, param_dtype=dtype, lora_param_dtype=dtype, rngs=nn.Rngs(0))
    assert isinstance(layer.lora.lora_a, nn.LoRAParam) and isinstance(layer.lora.lora_a, nn.Param)
    layer.lora.lora_b[...] = randn((2, 3), dtype, seed=4)
    x = randn((4, 5), dtype)
    ref = (
        f64(x) @ f64(layer.kernel[...]) + f64(layer.bias[...])
        + f64(x) @ f64(layer.lora.lora_a[...]) @ f64(layer.lora.lora_b[...])
    )
    np.testing.assert_allclose(f64(layer(x)), ref, **TOL[dtype])


def test_lora_grad_only_adapters():
    layer = nn.LoRALinear(4, 2, lora_rank=2, rngs=nn.Rngs(0))
    x = randn((3, 4))

    def loss(a, b):
        layer.lora.lora_a[...] = a
        layer.lora.lora_b[...] = b
        return jnp.sum(layer(x) ** 2)

    a0, b0 = layer.lora.lora_a[...], layer.lora.lora_b[...] + 0.5
    ga, gb = jax.grad(loss, argnums=(0, 1))(a0, b0)
    layer.lora.lora_a[...], layer.lora.lora_b[...] = a0, b0
    y = f64(layer(x))
    # d/dA sum(y^2) = x^T (2y) B^T ; d/dB = (xA)^T (2y)
    np.testing.assert_allclose(f64(ga), f64(x).T @ (2 * y) @ f64(b0).T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(f64(gb), (f64(x) @ f64(a0)).T @ (2 * y), rtol=1e-4, atol=1e-5)


def test_lora_errors():
    with pytest.raises(ValueError, match="lora_rank"):
        nn.LoRA(3, 0, 2, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="LoRA expected last axis 3"):
        nn.LoRA(3, 1, 2, rngs=nn.Rngs(0))(jnp.ones((1, 4)))


def test_with_partitioning_metadata_reaches_every_layer_kernel():
    init = nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "heads", "kv"))
    mha = nn.MultiHeadAttention(2, 8, kernel_init=init, rngs=nn.Rngs(0))
    assert mha.query.kernel.sharding_names == ("embed", "heads", "kv")
    assert mha.query.kernel.shape == (8, 2, 4)
    lin = nn.Linear(3, 4, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("a", "b")),
                    rngs=nn.Rngs(0))
    assert lin.kernel.sharding_names == ("a", "b")
    cell = nn.LSTMCell(3, 2, recurrent_kernel_init=nn.with_partitioning(nn.initializers.orthogonal(), (None, "h")),
                       rngs=nn.Rngs(0))
    for m in (cell.hi, cell.hf, cell.hg, cell.ho):  # one (H, H) recurrent kernel per gate
        assert m.kernel.sharding_names == (None, "h") and m.kernel.shape == (2, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_on_a_base_module_at_both_dtypes(dtype):
    """y = base(x) + (alpha / rank) x A B, parameters and inputs in ``dtype``."""
    base = nn.Linear(5, 3, param_dtype=dtype, rngs=nn.Rngs(0))
    lora = nn.LoRA(5, 2, 3, base_module=base, alpha=4.0, param_dtype=dtype, rngs=nn.Rngs(1))
    lora.lora_b[...] = randn((2, 3), dtype, seed=3)
    x = randn((4, 5), dtype, seed=5)
    y = lora(x)
    assert y.dtype == dtype
    ref = (
        f64(x) @ f64(base.kernel[...]) + f64(base.bias[...])
        + 2.0 * f64(x) @ f64(lora.lora_a[...]) @ f64(lora.lora_b[...])
    )
    np.testing.assert_allclose(f64(y), ref, **TOL[dtype])


def test_layers_run_on_qarray_weights_in_float_numerics():
    # a QArray weight (e.g. from cairn.quant.quantize_params, put in with nn.update) is
    # dequantized on the fly: the layer equals itself with the dequantized float weight
    from cairn.core_array import QArray, QuantLayout

    layer = nn.Linear(4, 3, rngs=nn.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 4))
    q = QArray(
        jnp.asarray(np.arange(12).reshape(4, 3) - 6, jnp.int8), jnp.full((1, 3), 0.1, jnp.float32),
        qtype="int8", layout=QuantLayout.per_channel(1),
    )
    layer.kernel.value = q
    want = x @ q.dequantize() + layer.bias.value
    np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nn.jit(lambda m, x: m(x))(layer, x)), np.asarray(want), rtol=1e-6)
    emb = nn.Embed(4, 3, rngs=nn.Rngs(0))
    emb.embedding.value = q
    np.testing.assert_allclose(np.asarray(emb(jnp.array([2]))), np.asarray(q.dequantize()[2:3]), rtol=1e-6)


@pytest.mark.parametrize("cls", ["Linear", "LinearGeneral"])
def test_custom_dot_general_receives_the_qarray_kernel_unchanged(cls):
    # a kernel library's quantized dot (cairn.kernels.quantized_dot_general) takes the
    # QArray as it is; the input and bias are promoted to the dequantized kernel's dtype
    from cairn.core_array import QArray, QuantLayout

    seen = []

    def qdot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        seen.append(rhs)
        return jax.lax.dot_general(lhs, rhs.dequantize(), dimension_numbers)

    layer = getattr(nn, cls)(4, 3, dot_general=qdot, rngs=nn.Rngs(0))
    q = QArray(
        jnp.asarray(np.arange(12).reshape(4, 3) - 6, jnp.int8), jnp.full((1, 3), 0.1, jnp.float32),
        qtype="int8", layout=QuantLayout.per_channel(1),
    )
    layer.kernel.value = q
    x = jax.random.normal(jax.random.key(1), (2, 4), jnp.bfloat16)
    y = layer(x)
    assert isinstance(seen[-1], QArray) and seen[-1].qtype == "int8"
    assert y.dtype == jnp.float32  # bf16 input promoted with the float32 dequantized kernel
    want = np.asarray(x, np.float64) @ np.asarray(q.dequantize(), np.float64) + np.asarray(layer.bias.value)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)
