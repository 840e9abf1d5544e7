"""LoRA / QLoRA by rules on plain parameter trees, against the closed-form reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import quant


def _mlp(p, x):
    h = jax.nn.relu(x @ p["l1"]["kernel"])
    return jnp.einsum("bh,ho->bo", h, p["l2"]["w_out"])


def _params():
    k = jax.random.split(jax.random.key(0), 2)
    return {"l1": {"kernel": jax.random.normal(k[0], (6, 10)) / 3}, "l2": {"w_out": jax.random.normal(k[1], (10, 4)) / 3}}


X = jax.random.normal(jax.random.key(7), (5, 6))


def test_adapter_paths_follow_nn_lora_linear():
    assert quant.lora_paths("l1/kernel") == ("l1/lora/lora_a", "l1/lora/lora_b")
    assert quant.lora_paths("kernel") == ("lora/lora_a", "lora/lora_b")
    assert quant.lora_paths("l2/w_out") == ("l2/w_out_lora/lora_a", "l2/w_out_lora/lora_b")


def test_fresh_adapters_leave_the_output_unchanged_and_trained_ones_match_reference():
    provider = quant.LoraProvider([quant.LoraRule(rank=2, alpha=6.0)])
    lp = quant.apply_lora_to_params(_params(), provider, _mlp, X, rng=jax.random.key(1))
    assert lp["l1"]["lora"]["lora_a"].shape == (6, 2) and lp["l1"]["lora"]["lora_b"].shape == (2, 10)
    assert lp["l2"]["w_out_lora"]["lora_a"].shape == (10, 2)
    f = quant.quantize(_mlp, provider)
    np.testing.assert_array_equal(np.asarray(f(lp, X)), np.asarray(_mlp(_params(), X)))
    lp["l1"]["lora"]["lora_b"] = jax.random.normal(jax.random.key(3), (2, 10))
    lp["l2"]["w_out_lora"]["lora_b"] = jax.random.normal(jax.random.key(4), (2, 4))
    scale = 6.0 / 2
    p = _params()
    w1 = np.asarray(p["l1"]["kernel"], np.float64) + scale * np.asarray(lp["l1"]["lora"]["lora_a"], np.float64) @ np.asarray(lp["l1"]["lora"]["lora_b"], np.float64)
    w2 = np.asarray(p["l2"]["w_out"], np.float64) + scale * np.asarray(lp["l2"]["w_out_lora"]["lora_a"], np.float64) @ np.asarray(lp["l2"]["w_out_lora"]["lora_b"], np.float64)
    ref = np.maximum(np.asarray(X, np.float64) @ w1, 0) @ w2
    np.testing.assert_allclose(np.asarray(f(lp, X)), ref, rtol=1e-4, atol=1e-4)


def test_weight_on_the_left_and_transposed():
    def fn(p, x):
        return (p["l1"]["kernel"].T @ x.T).T  # W^T x^T: the weight is the left operand

    provider = quant.LoraProvider([quant.LoraRule(rank=3, alpha=3.0)])
    lp = quant.apply_lora_to_params(_params(), provider, fn, X, rng=jax.random.key(1))
    lp["l1"]["lora"]["lora_b"] = jnp.ones_like(lp["l1"]["lora"]["lora_b"])
    # the dot sees W^T [10, 6] contracting its axis 1 (6 = in); A is [6, 3], B [3, 10]
    a, b = np.asarray(lp["l1"]["lora"]["lora_a"]), np.asarray(lp["l1"]["lora"]["lora_b"])
    w_view = np.asarray(_params()["l1"]["kernel"]).T + (a @ b).T
    np.testing.assert_allclose(np.asarray(quant.quantize(fn, provider)(lp, X)), (w_view @ np.asarray(X).T).T, rtol=1e-5, atol=1e-5)


def test_qlora_quantizes_the_base_product():
    provider = quant.LoraProvider([quant.LoraRule(rank=2, alpha=2.0, weight_qtype="int4")])
    lp = quant.apply_lora_to_params(_params(), provider, _mlp, X, rng=jax.random.key(1))
    y = quant.quantize(_mlp, provider)(lp, X)
    ptq = quant.quantize(_mlp, quant.PtqProvider([quant.QuantizationRule(weight_qtype="int4")]))(_params(), X)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ptq), rtol=1e-6, atol=1e-6)  # B = 0: only the base


def test_missing_adapters_and_bad_rules_are_named():
    provider = quant.LoraProvider([quant.LoraRule(module_path="l1", rank=2)], strict=False)
    with pytest.raises(ValueError, match=r"'l1/kernel'.*'l1/lora/lora_a'.*apply_lora"):
        quant.quantize(_mlp, provider)(_params(), X)
    with pytest.raises(ValueError, match="rank must be a positive int"):
        quant.LoraRule(rank=0)
    with pytest.raises(ValueError, match="dropout"):
        quant.LoraRule(dropout=1.0)


def test_dropout_only_with_a_key():
    rule = quant.LoraRule(rank=2, alpha=2.0, dropout=0.5)
    provider = quant.LoraProvider([rule])
    lp = quant.apply_lora_to_params(_params(), provider, _mlp, X, rng=jax.random.key(1))
    lp["l1"]["lora"]["lora_b"] = jnp.ones((2, 10))
    a = quant.quantize(_mlp, provider)(lp, X)
    b = quant.quantize(_mlp, quant.LoraProvider([rule]))(lp, X)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # no key: no dropout
    c = quant.quantize(_mlp, quant.LoraProvider([rule], dropout_rng=jax.random.key(5)))(lp, X)
    assert not np.allclose(np.asarray(a), np.asarray(c))
