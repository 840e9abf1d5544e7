"""The rewrite finds every dot whose operand is a weight, however the program reaches it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cairn_testlib import record_quant_sites

from cairn import quant

RULE = quant.QuantizationRule(weight_qtype="int8")


def _params(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "enc": {"kernel": jax.random.normal(k[0], (8, 8)) * 0.3},
        "dec": {"kernel": jax.random.normal(k[1], (8, 8)) * 0.3},
        "stack": jax.random.normal(k[2], (3, 8, 8)) * 0.3,
    }


X = jax.random.normal(jax.random.key(9), (2, 8))

FORMS = {
    "matmul_operator": lambda p, x: x @ p["enc"]["kernel"],
    "jnp_matmul": lambda p, x: jnp.matmul(x, p["enc"]["kernel"]),
    "jnp_dot": lambda p, x: jnp.dot(x, p["enc"]["kernel"]),
    "einsum": lambda p, x: jnp.einsum("bd,df->bf", x, p["enc"]["kernel"]),
    "transposed_cast": lambda p, x: x @ p["enc"]["kernel"].T.astype(jnp.float32).T,
    "lax_dot_general": lambda p, x: jax.lax.dot_general(x, p["enc"]["kernel"], (((1,), (0,)), ((), ()))),
    "inside_jit": lambda p, x: jax.jit(lambda a, w: a @ w)(x, p["enc"]["kernel"]),
    "inside_remat": lambda p, x: jax.checkpoint(lambda a: jnp.tanh(a) @ p["enc"]["kernel"])(x),
    "inside_cond": lambda p, x: jax.lax.cond(True, lambda a: a @ p["enc"]["kernel"], lambda a: a, x),
    "inside_while": lambda p, x: jax.lax.while_loop(
        lambda c: c[0] < 1, lambda c: (c[0] + 1, c[1] @ p["enc"]["kernel"]), (0, x)
    )[1],
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_form_of_matmul_is_intercepted(form):
    fn = FORMS[form]
    provider = quant.PtqProvider([quant.QuantizationRule(module_path="enc", weight_qtype="int8")])
    seen = record_quant_sites(provider)
    p = _params()
    y = quant.quantize(fn, provider)(p, X)
    assert seen and all(s[1] == "enc" for s in seen), seen
    ref = fn(p, X)
    rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    assert 0 < rel < 0.02  # int8 per-channel: quantized (not bit-equal to float), and close


def test_scan_over_stacked_weights_and_tied_use():
    def fn(p, x):
        h, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, p["stack"])
        return h @ p["enc"]["kernel"] + h @ p["enc"]["kernel"].T  # the same weight twice

    provider = quant.PtqProvider([RULE], strict=False)
    seen = record_quant_sites(provider)
    y = quant.quantize(fn, provider)(_params(), X)
    assert [s[0] for s in seen] == ["dot_general"] * 3
    assert seen[1][1:] == ("enc", 0) and seen[2][1:] == ("enc", 1)
    ref = fn(_params(), X)
    assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 0.02


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_custom_vjp_and_ragged_and_conv():
    @jax.custom_vjp
    def mm(a, w):
        return a @ w

    mm.defvjp(lambda a, w: (a @ w, (a, w)), lambda r, ct: (ct @ r[1].T, r[0].T @ ct))

    def fn(p, x, img):
        h = mm(x, p["enc"]["kernel"])
        groups = jnp.array([1, 1], jnp.int32)
        r = jax.lax.ragged_dot(h, p["stack"][:2], groups)
        c = jax.lax.conv_general_dilated(img, p["conv"], (1, 1), "SAME")
        return r, c

    p = {**_params(), "conv": jax.random.normal(jax.random.key(3), (4, 3, 3, 3))}
    img = jax.random.normal(jax.random.key(4), (1, 3, 6, 6))
    provider = quant.PtqProvider([RULE])
    seen = record_quant_sites(provider)
    out = quant.quantize(fn, provider)(p, X, img)
    assert sorted(s[0] for s in seen) == ["conv_general_dilated", "dot_general", "ragged_dot"]
    for got, want in zip(out, fn(p, X, img)):
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.02


def test_module_path_and_op_names_select():
    def fn(p, x):
        return (x @ p["enc"]["kernel"]) @ p["dec"]["kernel"] + x @ p["dec"]["kernel"]

    provider = quant.PtqProvider([quant.QuantizationRule(module_path="dec", op_names=("dot_general1",), weight_qtype="int8")])
    seen = record_quant_sites(provider)
    y = quant.quantize(fn, provider)(_params(), X)
    assert [s[1:] for s in seen] == [("enc", 0), ("dec", 0), ("dec", 1)]
    p = _params()
    # only the second dot of 'dec' is quantized: the first two products are exact
    exact = (X @ p["enc"]["kernel"]) @ p["dec"]["kernel"]
    assert not np.allclose(np.asarray(y), np.asarray(fn(p, X)), rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(y - exact), np.asarray(X @ p["dec"]["kernel"]), rtol=0.05, atol=0.05)


def test_unmatched_rule_is_an_error_naming_it_and_the_paths_seen():
    provider = quant.PtqProvider([quant.QuantizationRule(module_path="layers/.*", weight_qtype="int8")])
    with pytest.raises(ValueError, match=r"matched no op.*layers/\.\*.*'enc'"):
        quant.quantize(FORMS["matmul_operator"], provider)(_params(), X)
    lax_provider = quant.PtqProvider([quant.QuantizationRule(module_path="layers/.*", weight_qtype="int8")], strict=False)
    quant.quantize(FORMS["matmul_operator"], lax_provider)(_params(), X)
    assert lax_provider.get_unused_rules() == list(lax_provider.rules)


def test_bad_rules_are_refused():
    with pytest.raises(ValueError, match="module_path='\\('"):
        quant.QuantizationRule(module_path="(", weight_qtype="int8")
    with pytest.raises(ValueError, match="weight_qtype.*unknown qtype"):
        quant.QuantizationRule(weight_qtype="int9")
    with pytest.raises(ValueError, match="op name 'matmul'"):
        quant.QuantizationRule(op_names=("matmul",), weight_qtype="int8")
    with pytest.raises(ValueError, match="tile_size"):
        quant.QuantizationRule(weight_qtype="int8", tile_size=0)
    with pytest.raises(TypeError, match="expected a QtRule"):
        quant.QtProvider([quant.QuantizationRule(weight_qtype="int8")])


def test_works_under_jit_and_vmap_and_keeps_output_structure():
    def fn(p, x):
        return {"y": x @ p["enc"]["kernel"], "n": 3}

    q = quant.quantize(fn, quant.PtqProvider([RULE], strict=False))
    eager = q(_params(), X)
    jitted = jax.jit(q)(_params(), X)
    mapped = jax.vmap(q, in_axes=(None, 0))(_params(), X[:, None, :])
    assert eager["n"] == 3
    np.testing.assert_allclose(np.asarray(eager["y"]), np.asarray(jitted["y"]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(mapped["y"][:, 0]), np.asarray(eager["y"]), rtol=1e-5, atol=1e-5)
