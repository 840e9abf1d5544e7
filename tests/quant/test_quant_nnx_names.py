"""Names derived from a weight (LoRA adapters, AWQ / SmoothQuant input scales, the weight
plan of quantize_params and GPTQ, calibration keys) are the same for a Flax NNX model, the
equivalent cairn.nn model and a plain pytree: built from the variable's path (``a/kernel``),
never from NNX's leaf path (``a/kernel/value``), and placed where each library keeps them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from quant_testlib import B1 as _B1
from quant_testlib import K1 as _K1
from quant_testlib import K2 as _K2
from quant_testlib import plain_forward, two_layer

from cairn import nn, quant
from cairn.core_array import QArray, path_of

nnx = pytest.importorskip("flax.nnx")

_B2 = np.asarray(jax.random.normal(jax.random.key(11), (4,))) / 10
_X = np.asarray(jax.random.normal(jax.random.key(10), (6, 8)), np.float32)
_T = np.asarray(jax.random.normal(jax.random.key(12), (6, 4)), np.float32)


def _model(kind):
    return two_layer(kind, _B2)


def _plain_params():
    return two_layer("plain", _B2)


_plain = plain_forward


def _call(m, x):
    return m(x)


def _names(tree):
    """Leaf paths with Flax NNX's trailing ``/value`` (the leaf below each variable) removed."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda v: isinstance(v, QArray))
    return sorted(path_of(kp).removesuffix("/value") for kp, _ in flat)


def _value(x):
    return x.get_value() if hasattr(x, "get_value") else x


def _lora_reference(a, b, scale):
    """float64: relu(x K1 + b1 + (x A) B * scale) K2 + b2, and d mean((y - t)^2) / d(A, B)."""
    x = _X.astype(np.float64)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    pre = x @ _K1 + _B1 + (x @ a) @ b * scale
    h = np.maximum(pre, 0)
    y = h @ _K2 + _B2
    dy = 2 * (y - _T) / y.size
    dpre = (dy @ _K2.T) * (pre > 0)
    return y, scale * x.T @ (dpre @ b.T), scale * (x @ a).T @ dpre


# --- LoRA ---


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("kind", ["flax.nnx", "cairn.nn"])
def test_lora_adapters_land_in_the_module_as_lora_params_and_train(kind):
    model = _model(kind)
    provider = quant.LoraProvider([quant.LoraRule(module_path="a", rank=2, alpha=4.0)])
    quant.apply_lora_to_model(model, provider, _X, rng=jax.random.key(3))
    lib = nnx if kind == "flax.nnx" else nn
    # the adapters are attributes of the weight's module, as in the library's LoRALinear
    assert isinstance(model.a.lora["lora_a"], lib.LoRAParam) and isinstance(model.a.lora["lora_b"], lib.LoRAParam)
    assert [n for n in _names(model) if "lora" in n] == ["a/lora/lora_a", "a/lora/lora_b"]
    assert not hasattr(model.b, "lora")
    a0 = np.asarray(_value(model.a.lora["lora_a"]))
    # the same initial A for every library: the adapter's name and key do not depend on the leaf path
    ref_a0 = np.asarray(jax.random.uniform(jax.random.split(jax.random.fold_in(jax.random.key(3), 0))[0], (8, 2), jnp.float32, -(6 / 8) ** 0.5, (6 / 8) ** 0.5))
    np.testing.assert_array_equal(a0, ref_a0)
    b0 = np.asarray(jax.random.normal(jax.random.key(5), (2, 16)), np.float32) / 3
    model.a.lora["lora_b"].set_value(jnp.asarray(b0))

    def loss(m):
        return jnp.mean((quant.quantize_model(m, provider)(_X) - _T) ** 2)

    y_ref, da_ref, db_ref = _lora_reference(a0, b0, 2.0)
    np.testing.assert_allclose(np.asarray(quant.quantize_model(model, provider)(_X)), y_ref, rtol=1e-5, atol=1e-5)
    if kind == "flax.nnx":
        grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        ga, gb = grads["a"]["lora"]["lora_a"], grads["a"]["lora"]["lora_b"]
        assert _names(grads) == ["a/lora/lora_a", "a/lora/lora_b"]  # only the adapters are trained
    else:
        grads = nn.grad(loss, wrt=nn.LoRAParam)(model)
        ga, gb = grads.a.lora["lora_a"], grads.a.lora["lora_b"]
    np.testing.assert_allclose(np.asarray(_value(ga)), da_ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(_value(gb)), db_ref, rtol=1e-4, atol=1e-6)


def test_nnx_lora_adapters_train_under_an_nnx_optimizer_and_jit():
    optax = pytest.importorskip("optax")
    model = _model("flax.nnx")
    provider = quant.LoraProvider([quant.LoraRule(module_path="a", rank=2, alpha=4.0)])
    quant.apply_lora_to_model(model, provider, _X, rng=jax.random.key(3))
    opt = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(m, opt):
        def loss(m):
            return jnp.mean((quant.quantize_model(m, provider)(_X) - _T) ** 2)

        value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
        opt.update(m, grads)
        return value

    a0, b0 = np.asarray(model.a.lora["lora_a"][...]), np.asarray(model.a.lora["lora_b"][...])
    first = float(step(model, opt))
    _, da, db = _lora_reference(a0, b0, 2.0)
    np.testing.assert_allclose(np.asarray(model.a.lora["lora_a"][...]), a0 - 0.5 * da, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.a.lora["lora_b"][...]), b0 - 0.5 * db, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(model.a.kernel[...]), _K1.astype(np.float32))  # the base is frozen
    for _ in range(10):
        last = float(step(model, opt))
    assert last < first


def test_lora_on_plain_params_uses_the_same_names():
    provider = quant.LoraProvider([quant.LoraRule(module_path="a", rank=2, alpha=4.0)])
    params = quant.apply_lora_to_params(_plain_params(), provider, _plain, _X, rng=jax.random.key(3))
    assert [n for n in _names(params) if "lora" in n] == ["a/lora/lora_a", "a/lora/lora_b"]
    nnx_model = _model("flax.nnx")
    quant.apply_lora_to_model(nnx_model, quant.LoraProvider(provider.rules), _X, rng=jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(params["a"]["lora"]["lora_a"]), np.asarray(nnx_model.a.lora["lora_a"][...]))


# --- AWQ and SmoothQuant ---


def _calibration_x():
    x = np.array(jax.random.normal(jax.random.key(1), (64, 8)), np.float32)
    x[:, :2] *= 20.0  # salient input channels
    return x


@pytest.mark.parametrize("method", ["awq", "smooth_quant"])
def test_input_scales_are_named_after_the_variable_on_nnx_nn_and_plain(method):
    x = _calibration_x()
    if method == "awq":
        provider = quant.PtqProvider([quant.AwqRule(module_path="a", weight_qtype="int4", n_grid=8)])
        run = quant.awq_quantize_params
    else:
        provider = quant.PtqProvider([quant.SmoothQuantRule(module_path="a", weight_qtype="int8")])
        run = quant.smooth_quant_params
    out = {
        "flax.nnx": run(_model("flax.nnx"), provider, _call, [(x,)]),
        "cairn.nn": run(_model("cairn.nn"), provider, _call, [(x,)]),
        "plain": run(_plain_params(), provider, _plain, [(x,)]),
    }
    for kind, q in out.items():
        assert _names(q) == ["a/bias", "a/kernel", "a/kernel_awq_scale", "b/bias", "b/kernel"], kind
    assert isinstance(out["flax.nnx"].a.kernel_awq_scale, nnx.Param)
    assert isinstance(out["cairn.nn"].a.kernel_awq_scale, nn.Param)
    s = np.asarray(out["plain"]["a"]["kernel_awq_scale"], np.float64)
    w = out["plain"]["a"]["kernel"]
    assert isinstance(w, QArray)
    # the stored weight is diag(s) K1, quantized; inference divides the inputs by s
    y_ref = np.maximum((_X / s) @ np.asarray(w.dequantize(), np.float64) + _B1, 0) @ _K2 + _B2
    for kind, q in out.items():
        scale = q["a"]["kernel_awq_scale"] if kind == "plain" else q.a.kernel_awq_scale[...]
        kernel = q["a"]["kernel"] if kind == "plain" else q.a.kernel.get_value()
        np.testing.assert_allclose(np.asarray(scale), s, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(kernel.qvalue), np.asarray(w.qvalue))
        y = quant.quantize(_plain, provider)(q, _X) if kind == "plain" else quant.quantize_model(q, provider)(_X)
        np.testing.assert_allclose(np.asarray(y), y_ref, rtol=2e-5, atol=2e-5)


# --- the weight plan: quantize_params and GPTQ ---


def test_quantize_params_plan_is_keyed_by_variable_path():
    provider = quant.PtqProvider([quant.QuantizationRule(module_path="a", weight_qtype="int8")])
    model = _model("flax.nnx")
    q_model = quant.quantize_params(model, provider, _call, _X)
    assert isinstance(q_model.a.kernel.get_value(), QArray) and not isinstance(q_model.b.kernel.get_value(), QArray)
    assert sorted(provider._plan) == ["a/kernel"]  # the same name as for cairn.nn and plain trees
    # the plan made on the NNX model applies to its state and to its pure dict alike
    state = quant.quantize_params(nnx.state(model), provider)
    pure = quant.quantize_params(nnx.to_pure_dict(nnx.state(model)), provider)
    for k in (state["a"]["kernel"].get_value(), pure["a"]["kernel"]):
        assert isinstance(k, QArray)
        np.testing.assert_array_equal(np.asarray(k.qvalue), np.asarray(q_model.a.kernel.get_value().qvalue))
    assert not isinstance(pure["b"]["kernel"], QArray)


def test_gptq_quantizes_the_same_weights_identically_on_nnx_nn_and_plain():
    x = _calibration_x()
    provider = quant.PtqProvider([quant.GptqRule(module_path="a", weight_qtype="int4")])
    got = {
        "flax.nnx": quant.gptq_quantize_params(_model("flax.nnx"), provider, _call, [(x,)]).a,
        "cairn.nn": quant.gptq_quantize_params(_model("cairn.nn"), provider, _call, [(x,)]).a,
    }
    plain = quant.gptq_quantize_params(_plain_params(), provider, _plain, [(x,)])["a"]["kernel"]
    hessian = 2.0 * x.astype(np.float64).T @ x.astype(np.float64) / x.shape[0]
    q_ref, s_ref = quant.gptq_matrix(_K1, hessian, "int4")
    for kind, layer in got.items():
        k = layer.kernel.get_value()
        assert isinstance(k, QArray), kind
        np.testing.assert_array_equal(np.asarray(k.qvalue), np.asarray(plain.qvalue))
    np.testing.assert_array_equal(np.asarray(plain.qvalue), q_ref)
    np.testing.assert_allclose(np.asarray(plain.scale), s_ref, rtol=1e-6)


# --- module paths through nested calls (jit) and calibration keys ---


@pytest.mark.parametrize("kind", ["flax.nnx", "cairn.nn", "plain"])
def test_module_path_survives_a_nested_jit_and_keys_calibration(kind):
    rule = quant.QuantizationRule(module_path="a", weight_qtype="int8", act_qtype="int8", act_static_scale=True)
    provider = quant.PtqProvider([rule])  # strict: the rule must match inside the jit
    if kind == "plain":
        params, fn = _plain_params(), _plain
    else:
        params, fn = _model(kind), _call

    def nested(p, x):
        return jax.jit(fn)(p, x)

    static = quant.calibrate(nested, provider, [(params, _X)])
    assert list(static) == [("a", "dot_general", 0, 0)]
    lo, hi = static[("a", "dot_general", 0, 0)]
    assert float(lo) == -float(hi)
    np.testing.assert_allclose(float(hi), np.abs(_X).max(), rtol=1e-6)


def _int8_reference():
    """float64: only module ``a``'s weight fake-quantized, int8 per output channel."""
    scale = np.abs(_K1).max(axis=0, keepdims=True) / 127.5
    k1 = np.clip(np.round(_K1 / scale), -127, 127) * scale
    return np.maximum(_X.astype(np.float64) @ k1 + _B1, 0) @ _K2 + _B2


def _custom_vjp(fn):
    f = jax.custom_vjp(fn)
    f.defvjp(lambda p, x: (fn(p, x), (p, x)), lambda res, g: jax.vjp(fn, *res)[1](g))
    return f


def _shard_map(fn):
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    return jax.shard_map(fn, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec("d")), out_specs=PartitionSpec("d"))


@pytest.mark.parametrize("wrap", [_custom_vjp, _shard_map])
@pytest.mark.parametrize("kind", ["flax.nnx", "cairn.nn", "plain"])
def test_module_path_survives_custom_vjp_and_shard_map(kind, wrap):
    provider = quant.PtqProvider([quant.QuantizationRule(module_path="a", weight_qtype="int8")])  # strict
    params, fn = (_plain_params(), _plain) if kind == "plain" else (_model(kind), _call)
    y = quant.quantize(wrap(fn), provider)(params, _X)
    np.testing.assert_allclose(np.asarray(y), _int8_reference(), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind", ["flax.nnx", "cairn.nn", "plain"])
def test_prequantized_checkpoint_is_found_by_weight_name(kind):
    provider = quant.PtqProvider([quant.QuantizationRule(module_path="a", weight_qtype="int8")])
    params, fn = (_plain_params(), _plain) if kind == "plain" else (_model(kind), _call)
    template = quant.quantize_params(params, provider, fn, _X)
    scale = np.abs(_K1).max(axis=0, keepdims=True) / 127.5
    qvalue = np.clip(np.round(_K1 / scale), -127, 127).astype(np.int8)
    # nested dicts named as nnx.to_pure_dict names them: the same for every library
    ckpt = {"a": {"kernel": {"qvalue": qvalue, "scale": scale.astype(np.float32)}, "bias": _B1}, "b": {"kernel": _K2, "bias": _B2}}
    loaded = quant.process_prequantized_params(ckpt, template)
    kernel = loaded["a"]["kernel"] if kind == "plain" else loaded.a.kernel.get_value()
    assert isinstance(kernel, QArray)
    np.testing.assert_array_equal(np.asarray(kernel.qvalue), qvalue)
    y = quant.quantize(fn, provider)(loaded, _X)
    np.testing.assert_allclose(np.asarray(y), _int8_reference(), rtol=2e-5, atol=2e-5)
    if kind == "flax.nnx":  # a checkpoint of the NNX state's leaves (``a/kernel/value``) loads as well
        by_leaf = {m: {k: {"value": v} for k, v in layer.items()} for m, layer in ckpt.items()}
        loaded = quant.process_prequantized_params(by_leaf, template)
        np.testing.assert_array_equal(np.asarray(loaded.a.kernel.get_value().qvalue), qvalue)
        with pytest.raises(ValueError, match=r"no entry for 'b/kernel' \(nor for its leaf path 'b/kernel/value'\)"):
            quant.process_prequantized_params({"a": ckpt["a"], "b": {"bias": _B2}}, template)


def test_a_weight_name_is_its_variable_path_unless_the_variable_holds_several_leaves():
    from cairn.quant._weights import classify_leaves

    class Held(nnx.Module):
        def __init__(self):
            self.pair = nnx.Param({"x": jnp.ones(2), "y": jnp.ones(3)})
            self.one = nnx.Param(jnp.ones(2))

    m = Held()
    flat, _ = jax.tree_util.tree_flatten_with_path(m)
    got = [(i.path, i.name, i.module_path) for i in classify_leaves(m, [kp for kp, _ in flat])]
    assert got == [("one/value", "one", ""), ("pair/value/x", "pair/value/x", ""), ("pair/value/y", "pair/value/y", "")]
