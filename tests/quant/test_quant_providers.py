"""PTQ, QAT and calibration numerics against independent float64 references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import quant
from cairn.core_array import QArray

jax.config.update("jax_enable_x64", False)


def _ref_fake_quant(x: np.ndarray, bits: int, axes: tuple[int, ...]) -> np.ndarray:
    qmax = 2 ** (bits - 1) - 1
    x = np.asarray(x, np.float64)
    hi = np.max(np.abs(x), axis=axes, keepdims=True)
    s = np.where(hi > 0, hi / (qmax + 0.5), 1.0)
    return np.clip(np.round(x / s), -qmax, qmax) * s


def _mlp(p, x):
    h = jax.nn.relu(x @ p["l1"]["kernel"] + p["l1"]["bias"])
    return h @ p["l2"]["kernel"]


def _params():
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "l1": {"kernel": jax.random.normal(k[0], (16, 32)) / 4, "bias": jnp.zeros(32)},
        "l2": {"kernel": jax.random.normal(k[1], (32, 8)) / 6},
    }


X = np.asarray(jax.random.normal(jax.random.key(5), (4, 16)))


@pytest.mark.parametrize("bits,qtype", [(8, "int8"), (4, "int4")])
def test_weight_only_equals_float64_reference(bits, qtype):
    p = _params()
    y = quant.quantize(_mlp, quant.PtqProvider([quant.QuantizationRule(weight_qtype=qtype)]))(p, X)
    w1 = _ref_fake_quant(np.asarray(p["l1"]["kernel"]), bits, (0,))
    w2 = _ref_fake_quant(np.asarray(p["l2"]["kernel"]), bits, (0,))
    ref = np.maximum(X.astype(np.float64) @ w1, 0) @ w2
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5)  # float32 dot vs float64


def test_w8a8_uses_integer_dots_and_equals_reference():
    p = _params()
    f = quant.quantize(_mlp, quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8", act_qtype="int8")]))
    jaxpr = str(jax.make_jaxpr(f)(p, X))
    assert "preferred_element_type=int32" in jaxpr
    w1 = _ref_fake_quant(np.asarray(p["l1"]["kernel"]), 8, (0,))
    w2 = _ref_fake_quant(np.asarray(p["l2"]["kernel"]), 8, (0,))
    h = np.maximum(_ref_fake_quant(X, 8, (1,)) @ w1, 0)
    ref = _ref_fake_quant(h, 8, (1,)) @ w2
    np.testing.assert_allclose(np.asarray(f(p, X)), ref, rtol=1e-4, atol=1e-4)


def test_quantize_params_gives_the_same_outputs():
    p = _params()
    provider = quant.PtqProvider([quant.QuantizationRule(module_path="l.", weight_qtype="int8")])
    qp = quant.quantize_params(p, provider, _mlp, X)
    assert isinstance(qp["l1"]["kernel"], QArray) and isinstance(qp["l2"]["kernel"], QArray)
    assert not isinstance(qp["l1"]["bias"], QArray)  # added, not a dot operand
    assert qp["l1"]["kernel"].qvalue.dtype == jnp.int8
    f = quant.quantize(_mlp, provider)
    np.testing.assert_array_equal(np.asarray(f(qp, X)), np.asarray(f(p, X)))
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(qp, X)), np.asarray(f(p, X)))


def test_quantize_params_needs_a_plan():
    with pytest.raises(ValueError, match="no weight plan"):
        quant.quantize_params(_params(), quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")]))


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_qat_gradients_are_straight_through():
    p = _params()
    provider = quant.QtProvider([quant.QtRule(weight_qtype="int8", act_qtype="int8")])
    f = quant.quantize(_mlp, provider)

    def ste(x, axes):
        return x + jax.lax.stop_gradient(quant.fake_quant(x, "int8", reduce_axes=axes) - x)

    def reference(p, x):
        h = jax.nn.relu(ste(x, (1,)) @ ste(p["l1"]["kernel"], (0,)) + p["l1"]["bias"])
        return ste(h, (1,)) @ ste(p["l2"]["kernel"], (0,))

    g = jax.grad(lambda p: f(p, X).sum())(p)
    gr = jax.grad(lambda p: reference(p, X).sum())(p)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gr)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(f(p, X)), np.asarray(reference(p, X)), rtol=1e-5, atol=1e-6)


def test_static_activation_scale_from_calibrate():
    p = _params()
    rule = quant.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)
    provider = quant.PtqProvider([rule])
    f = quant.quantize(_mlp, provider)
    with pytest.raises(ValueError, match="run calibrate"):
        f(p, X)
    batches = [(p, X), (p, 0.5 * X)]
    ranges = quant.calibrate(_mlp, provider, batches)
    key = ("l1", "dot_general", 0, 0)
    lo, hi = ranges[key]
    expect = (np.abs(X).max() + 0.5 * np.abs(X).max()) / 2  # mean over batches of the per-batch absmax
    np.testing.assert_allclose(float(hi), expect, rtol=1e-6)
    np.testing.assert_allclose(float(lo), -expect, rtol=1e-6)
    # applied as a fixed symmetric per-tensor scale hi / 127.5: an integer dot, values beyond hi clipped
    y = f(p, X)
    assert "preferred_element_type=int32" in str(jax.make_jaxpr(f)(p, X))
    w1 = _ref_fake_quant(np.asarray(p["l1"]["kernel"]), 8, (0,))
    s = expect / 127.5
    x_q = np.clip(np.round(X / s), -127, 127) * s
    h = np.maximum(x_q @ w1 + np.asarray(p["l1"]["bias"]), 0)
    _, hi2 = ranges[("l2", "dot_general", 0, 0)]
    s2 = float(hi2) / 127.5
    ref = (np.clip(np.round(h / s2), -127, 127) * s2) @ _ref_fake_quant(np.asarray(p["l2"]["kernel"]), 8, (0,))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-3, atol=2e-3)


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("qtype", ["nf4", "mxfp4", "nvfp4", "mxfp8"])
def test_lookup_and_block_qtypes_through_the_program(qtype):
    p = _params()
    # l1 contracts 16 inputs: too few for the 32-blocks of the mx formats, so they take l2 only
    module = "l2" if qtype.startswith("mx") else "l."
    provider = quant.PtqProvider([quant.QuantizationRule(module_path=module, weight_qtype=qtype)])
    qp = quant.quantize_params(p, provider, _mlp, X)
    assert qp["l2"]["kernel"].qtype == qtype
    f = quant.quantize(_mlp, provider)
    ref = np.asarray(_mlp(p, X))
    # the quantized program equals the float program on the dequantized weights
    deq = jax.tree.map(lambda v: v.dequantize() if isinstance(v, QArray) else v, qp, is_leaf=lambda v: isinstance(v, QArray))
    np.testing.assert_allclose(np.asarray(f(qp, X)), np.asarray(_mlp(deq, X)), rtol=1e-5, atol=1e-5)
    assert np.linalg.norm(np.asarray(f(qp, X)) - ref) / np.linalg.norm(ref) < 0.25
    if qtype != "nf4":  # the block formats fix their tile
        with pytest.raises(ValueError, match="tile_size must be None"):
            quant.QuantizationRule(weight_qtype=qtype, tile_size=4)


def _grads(rule, **provider_kwargs):
    p = _params()
    f = quant.quantize(_mlp, quant.QtProvider([rule], **provider_kwargs))
    return jax.grad(lambda p: (f(p, X) ** 2).sum())(p)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_quantized_backward_per_tensor_matches_the_reference():
    rule = quant.QtRule(weight_qtype="int8", bwd_qtype="int8")
    g = _grads(rule)
    p = _params()

    # reference: forward with STE fake-quantized weights; each dot's cotangent fake-quantized per tensor
    def dot(a, w):
        @jax.custom_vjp
        def f(a, w):
            return a @ w

        def bwd(res, ct):
            ctq = quant.fake_quant(ct, "int8")
            return ctq @ res[1].T, res[0].T @ ctq

        f.defvjp(lambda a, w: (a @ w, (a, w)), bwd)
        return f(a, w)

    def ste(w):
        return w + jax.lax.stop_gradient(quant.fake_quant(w, "int8", reduce_axes=(0,)) - w)

    def reference(p):
        h = jax.nn.relu(dot(X, ste(p["l1"]["kernel"])) + p["l1"]["bias"])
        return (dot(h, ste(p["l2"]["kernel"])) ** 2).sum()

    gr = jax.grad(reference)(p)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gr)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_weight_grad_tiles_and_stochastic_rounding():
    exact = _grads(quant.QtRule(weight_qtype="int8"))
    tiled = _grads(quant.QtRule(weight_qtype="int8", bwd_qtype="int4", bwd_weight_grad_tile_size=2))
    per_tensor = _grads(quant.QtRule(weight_qtype="int8", bwd_qtype="int4"))
    err = lambda g: float(jnp.linalg.norm(g["l2"]["kernel"] - exact["l2"]["kernel"]))  # noqa: E731
    assert err(tiled) < err(per_tensor)  # finer cotangent scales: a closer weight gradient
    with pytest.raises(ValueError, match="bwd_rng"):
        _grads(quant.QtRule(weight_qtype="int8", bwd_qtype="int4", bwd_stochastic_rounding="uniform"))
    a = _grads(quant.QtRule(weight_qtype="int8", bwd_qtype="int4", bwd_stochastic_rounding="uniform"), bwd_rng=jax.random.key(0))
    b = _grads(quant.QtRule(weight_qtype="int8", bwd_qtype="int4", bwd_stochastic_rounding="uniform"), bwd_rng=jax.random.key(1))
    assert not np.allclose(np.asarray(a["l1"]["kernel"]), np.asarray(b["l1"]["kernel"]))
    # unbiased on average: the mean over keys approaches the unquantized-cotangent gradient
    keys = [jax.random.key(i) for i in range(24)]
    mean = sum(np.asarray(_grads(quant.QtRule(weight_qtype="int8", bwd_qtype="int4", bwd_stochastic_rounding="low_bit_uniform"), bwd_rng=k)["l2"]["kernel"]) for k in keys) / len(keys)
    assert np.linalg.norm(mean - np.asarray(exact["l2"]["kernel"])) < 0.5 * err(per_tensor)
    with pytest.raises(ValueError, match="bwd_weight_grad_tile_size"):
        quant.QtRule(weight_qtype="int8", bwd_qtype="int8", bwd_weight_grad_tile_size=0)


@pytest.mark.parametrize("qtype", ["int4", "nf4"])
def test_packed_weights_give_the_same_outputs(qtype):
    p = _params()
    provider = quant.PtqProvider([quant.QuantizationRule(weight_qtype=qtype)])
    qp = quant.quantize_params(p, provider, _mlp, X)
    packed = quant.quantize_params(p, provider, _mlp, X, pack=True)
    k = packed["l1"]["kernel"]
    assert k.qvalue.dtype == jnp.uint8 and k.packed_length == 32 and k.qvalue.shape == (16, 16)
    assert k.nbytes == qp["l1"]["kernel"].nbytes
    f = jax.jit(quant.quantize(_mlp, provider))
    np.testing.assert_array_equal(np.asarray(f(packed, X)), np.asarray(f(qp, X)))


def _ref_block_fake_quant(w: np.ndarray, t0: int, t1: int, qmax: int) -> np.ndarray:
    w = np.asarray(w, np.float64)
    out = np.empty_like(w)
    for i in range(0, w.shape[0], t0):
        for j in range(0, w.shape[1], t1):
            blk = w[i : i + t0, j : j + t1]
            s = np.abs(blk).max() / (qmax + 0.5)
            out[i : i + t0, j : j + t1] = np.clip(np.round(blk / s), -qmax, qmax) * s
    return out


def test_two_axis_tile_size_quantizes_weights_in_2d_blocks():
    # tile_size=(contracting, output): one scale per (8, 4) block of each kernel
    p = _params()
    provider = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int4", tile_size=(8, 4))])
    y = quant.quantize(_mlp, provider)(p, X)
    w1 = _ref_block_fake_quant(np.asarray(p["l1"]["kernel"]), 8, 4, 7)
    w2 = _ref_block_fake_quant(np.asarray(p["l2"]["kernel"]), 8, 4, 7)
    ref = np.maximum(X.astype(np.float64) @ w1, 0) @ w2
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5)
    qp = quant.quantize_params(p, provider, _mlp, X)  # the offline tree has the same layout
    k = qp["l1"]["kernel"]
    assert isinstance(k, QArray) and k.layout.axes == (0, 1) and k.scale.shape == (2, 8)
    np.testing.assert_allclose(np.asarray(k.dequantize()), w1, rtol=1e-6, atol=1e-7)
    # a prequantized tree with those blocks runs through the same program unchanged
    np.testing.assert_allclose(np.asarray(quant.quantize(_mlp, provider)(qp, X)), np.asarray(y), rtol=1e-6, atol=1e-6)


def test_two_axis_tiles_follow_transposed_and_scanned_weights():
    k = jax.random.normal(jax.random.key(3), (3, 16, 16)) / 4  # three stacked [out, in] kernels

    def f(p, x):
        def body(h, w):
            return jnp.tanh(h @ w.T), None
        return jax.lax.scan(body, x, p["w"])[0]

    x = np.asarray(jax.random.normal(jax.random.key(4), (2, 16)))
    y = quant.quantize(f, quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8", tile_size=(4, 2))]))({"w": k}, x)
    h = x.astype(np.float64)
    for w in np.asarray(k):  # the weight's contracting axis is its axis 1 (in), output axis 0
        h = np.tanh(h @ _ref_block_fake_quant(w.T, 4, 2, 127))
    np.testing.assert_allclose(np.asarray(y), h, rtol=1e-5, atol=1e-5)


def test_two_axis_tile_size_errors_name_the_rule():
    with pytest.raises(ValueError, match="pair of them"):
        quant.QuantizationRule(weight_qtype="int8", tile_size=(4, 0))
    with pytest.raises(ValueError, match="pair of them"):
        quant.QuantizationRule(weight_qtype="int8", tile_size=(4, 4, 4))
    with pytest.raises(ValueError, match="tiles two axes"):
        quant.gptq_quantize_params(
            _params(), quant.PtqProvider([quant.GptqRule(module_path="l1", weight_qtype="int4", tile_size=(8, 4))]), _mlp, [(X,)]
        )
    with pytest.raises(ValueError, match="do not divide"):
        quant.quantize(_mlp, quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8", tile_size=(8, 5))]))(_params(), X)
