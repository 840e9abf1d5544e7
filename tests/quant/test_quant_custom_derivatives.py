"""A custom derivative rule that receives a weight keeps its meaning once the function is quantized.

The user's rules below say: no gradient flows to ``x``; the weight's gradient is ``x^T ct``
(the ordinary one). The quantized function's value is the int8 weight-only forward; its
gradients are the rule's answers on that forward, checked against float64 NumPy formulas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import quant
from cairn.core_array import QArray


@jax.custom_vjp
def _vjp_matmul(a, w):
    return a @ w


_vjp_matmul.defvjp(lambda a, w: (_vjp_matmul(a, w), (a, w)), lambda res, ct: (jnp.zeros_like(res[0]), res[0].T @ ct))


@jax.custom_jvp
def _jvp_matmul(a, w):
    return a @ w


def _jvp_matmul_rule(primals, tangents):
    (a, w), (_, tw) = primals, tangents
    return _jvp_matmul(a, w), a @ tw  # no tangent from `a`


_jvp_matmul.defjvp(_jvp_matmul_rule)


RULES = {"custom_vjp": _vjp_matmul, "custom_jvp": _jvp_matmul}
VIEWS = {"plain": lambda w: w, "transposed": lambda w: w.T.astype(jnp.float32)}  # the weight through views

W = np.asarray(jax.random.normal(jax.random.key(0), (8, 6)), np.float32)
X = np.asarray(jax.random.normal(jax.random.key(1), (5, 8)), np.float32)


def _int8_weight(w: np.ndarray) -> np.ndarray:
    """Symmetric int8, one scale per output channel (column), dequantized, in float64."""
    w = w.astype(np.float64)
    scale = np.max(np.abs(w), axis=0, keepdims=True) / 127.5
    return np.clip(np.round(w / scale), -127, 127) * scale


def _reference() -> tuple[float, np.ndarray, np.ndarray]:
    """Value of sum(tanh(x @ Q(w))), and the rule's gradients: 0 for x, x^T (1 - tanh^2) for w."""
    y = X.astype(np.float64) @ _int8_weight(W)
    ct = 1.0 - np.tanh(y) ** 2
    return float(np.sum(np.tanh(y))), np.zeros_like(X, np.float64), X.astype(np.float64).T @ ct


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("kind", sorted(RULES))
def test_custom_rule_survives_quantization(kind, view):
    rule, as_seen = RULES[kind], VIEWS[view]
    stored = W if view == "plain" else np.ascontiguousarray(W.T)

    def fn(p, x):
        return jnp.sum(jnp.tanh(rule(x, as_seen(p["w"]))))

    float_gx = jax.grad(fn, 1)({"w": stored}, X)
    assert float(jnp.max(jnp.abs(float_gx))) == 0.0  # the rule's answer, in float
    q = quant.quantize(fn, quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")]))
    value, gx, gw = _reference()
    if view == "transposed":
        gw = gw.T
    grad = jax.grad(q, (0, 1))
    for how, run in {"eager": grad, "jit(grad)": jax.jit(grad), "grad(jit)": jax.grad(jax.jit(q), (0, 1))}.items():
        got_p, got_x = run({"w": stored}, X)
        np.testing.assert_array_equal(np.asarray(got_x), gx, err_msg=how)  # exactly zero, as the rule says
        np.testing.assert_allclose(np.asarray(got_p["w"], np.float64), gw, rtol=2e-4, atol=2e-5, err_msg=how)
    np.testing.assert_allclose(float(q({"w": stored}, X)), value, rtol=1e-5)


@pytest.mark.parametrize("kind", sorted(RULES))
def test_custom_rule_with_a_stored_qarray_weight(kind):
    rule = RULES[kind]

    def fn(p, x):
        return rule(x, p["w"])

    provider = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")])
    q = quant.quantize(fn, provider)
    stored = quant.quantize_params({"w": W}, provider, fn, X)
    assert isinstance(stored["w"], QArray)
    want = X.astype(np.float64) @ _int8_weight(W)
    np.testing.assert_allclose(np.asarray(q(stored, X), np.float64), want, rtol=1e-4, atol=1e-4)
    gx = jax.grad(lambda x: jnp.sum(q(stored, x)))(X)
    np.testing.assert_array_equal(np.asarray(gx), np.zeros_like(X))


def test_custom_jvp_rule_in_forward_mode():
    def fn(p, x):
        return _jvp_matmul(x, p["w"])

    q = quant.quantize(fn, quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")]))
    out, tx = jax.jvp(lambda x: q({"w": W}, x), (X,), (np.ones_like(X),))
    np.testing.assert_allclose(np.asarray(out, np.float64), X.astype(np.float64) @ _int8_weight(W), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(tx), np.zeros((5, 6)))  # the rule: no tangent from x
    tw = np.ones_like(W)
    _, tw_out = jax.jit(lambda w, t: jax.jvp(lambda w: q({"w": w}, X), (w,), (t,)))(W, tw)
    np.testing.assert_allclose(np.asarray(tw_out, np.float64), X.astype(np.float64) @ tw, rtol=1e-5, atol=1e-5)


def test_a_rule_that_closes_over_the_weight_is_refused_by_name():
    def fn(p, x):
        @jax.custom_vjp
        def closing(a):
            return a @ p["w"]

        closing.defvjp(lambda a: (closing(a), a), lambda a, ct: (ct @ jnp.zeros((6, 8)),))
        return jnp.sum(closing(x))

    q = quant.quantize(fn, quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")]))
    np.testing.assert_allclose(float(q({"w": W}, X)), float(np.sum(X.astype(np.float64) @ _int8_weight(W))), rtol=1e-4)
    with pytest.raises(ValueError, match=r"custom_vjp function '.*closing' closes over a traced array"):
        jax.grad(q, 1)({"w": W}, X)
