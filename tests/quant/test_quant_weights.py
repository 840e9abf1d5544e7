"""What a weight is, which module it belongs to, and stored QArray weights staying QArrays:
cairn.nn, Flax NNX and plain pytrees, against float64 NumPy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from quant_testlib import B1 as _B1
from quant_testlib import K1 as _K1
from quant_testlib import K2 as _K2
from quant_testlib import plain_forward, two_layer

from cairn import nn, optim, quant
from cairn.core_array import QArray


def _ref_fake_quant(x, bits: int, axes: tuple[int, ...]) -> np.ndarray:
    """Symmetric absmax quantize-dequantize, one scale per group reduced over ``axes``."""
    qmax = 2 ** (bits - 1) - 1
    x = np.asarray(x, np.float64)
    hi = np.max(np.abs(x), axis=axes, keepdims=True)
    s = np.where(hi > 0, hi / (qmax + 0.5), 1.0)
    return np.clip(np.round(x / s), -qmax, qmax) * s


def _spy(provider: quant.QuantizationProvider, sides: bool = False) -> list:
    """The module path of every dot the provider is handed (with ``sides``: and its weight operands)."""
    seen = []
    inner = provider._handle

    def handle(site, invals):
        seen.append((site.module_path, site.weight_sides) if sides else site.module_path)
        return inner(site, invals)

    provider._handle = handle
    return seen


def _snapshot(q: QArray) -> dict:
    return {
        "qvalue": np.asarray(q.qvalue).copy(),
        "scale": np.asarray(q.scale).copy(),
        "qtype": q.qtype,
        "dtype": q.qvalue.dtype,
        "layout": q.layout,
        "nbytes": q.nbytes,
        "packed_length": q.packed_length,
        "codes": np.asarray(q.unpack().qvalue).astype(np.int64),
    }


def _assert_same_qarray(leaf, snap: dict) -> None:
    assert isinstance(leaf, QArray), f"the stored QArray came back as a {type(leaf).__name__}"
    got = (leaf.qtype, leaf.qvalue.dtype, leaf.layout, leaf.nbytes, leaf.packed_length)
    assert got == (snap["qtype"], snap["dtype"], snap["layout"], snap["nbytes"], snap["packed_length"])
    np.testing.assert_array_equal(np.asarray(leaf.qvalue), snap["qvalue"])
    np.testing.assert_array_equal(np.asarray(leaf.scale), snap["scale"])


# --- item 1: stored QArray weights stay QArrays, bit for bit ---


def _state_nbytes(model) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(nn.state(model)))


@pytest.mark.parametrize("mode", ["eager", "nn.jit"])
def test_stored_int8_weight_stays_the_same_qarray_after_calls(mode):
    model = nn.Linear(256, 256, rngs=nn.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 256))
    provider = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")])
    nn.update(model, nn.state(quant.quantize_params(model, provider, lambda m, x: m(x), x)))
    snap, size = _snapshot(model.kernel.value), _state_nbytes(model)
    assert size == 256 * 256 + 256 * 4 + 256 * 4  # int8 values, float32 scales, float32 bias
    if mode == "eager":
        run = lambda m, x: quant.quantize_model(m, provider)(x)  # noqa: E731
    else:
        run = nn.jit(lambda m, x: quant.quantize_model(m, provider)(x))
    for _ in range(3):
        y = run(model, x)
        _assert_same_qarray(model.kernel.value, snap)
    assert _state_nbytes(model) == size
    w = snap["codes"].astype(np.float64) * snap["scale"].astype(np.float64)
    ref = np.asarray(x, np.float64) @ w + np.asarray(model.bias.value, np.float64)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)


def _nf4_dequantized(snap: dict) -> np.ndarray:
    from cairn.core_array import NF4_LEVELS

    return np.asarray(NF4_LEVELS, np.float64)[snap["codes"]] * snap["scale"].astype(np.float64)


# eager, the first step compiles every op of the rewritten forward and backward one by one
@pytest.mark.parametrize("mode", [pytest.param("eager", marks=pytest.mark.slow), "nn.jit"])
def test_qlora_nf4_base_stays_the_same_qarray_through_training(mode):
    class Two(nn.Module):
        def __init__(self, rngs):
            self.l1 = nn.Linear(16, 32, rngs=rngs)
            self.l2 = nn.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    x = jax.random.normal(jax.random.key(2), (8, 16))
    target = jnp.ones((8, 4))
    model = Two(nn.Rngs(0))
    provider = quant.LoraProvider([quant.LoraRule(rank=2, alpha=2.0, weight_qtype="nf4")])
    quant.apply_lora_to_model(model, provider, x, rng=jax.random.key(3))
    nn.update(model, nn.state(quant.quantize_params(model, provider, lambda m, x: m(x), x, pack=True)))
    snaps = {name: _snapshot(getattr(model, name).kernel.value) for name in ("l1", "l2")}
    assert snaps["l1"]["qtype"] == "nf4" and snaps["l1"]["nbytes"] == 16 * 32 // 2 + 32 * 4  # packed 4-bit + scales
    opt = nn.Optimizer(model, optim.adam(1e-2), wrt=nn.LoRAParam)

    def loss(m):
        return ((quant.quantize_model(m, provider)(x) - target) ** 2).mean()

    def step(m, o):
        o.update(m, nn.grad(loss, wrt=nn.LoRAParam)(m))

    step = nn.jit(step) if mode == "nn.jit" else step
    lora_b = np.asarray(model.l2.lora["lora_b"].value).copy()
    for _ in range(3):
        step(model, opt)
        for name, snap in snaps.items():
            _assert_same_qarray(getattr(model, name).kernel.value, snap)
    assert not np.array_equal(np.asarray(model.l2.lora["lora_b"].value), lora_b)  # the adapters trained
    # the base the loss sees is the stored nf4 one: float64 forward through it plus the adapters
    def ref_layer(name, h):
        layer = getattr(model, name)
        a, b = (np.asarray(layer.lora[k].value, np.float64) for k in ("lora_a", "lora_b"))
        return h @ _nf4_dequantized(snaps[name]) + np.asarray(layer.bias.value, np.float64) + (h @ a) @ b * (2.0 / 2)

    ref = ref_layer("l2", np.maximum(ref_layer("l1", np.asarray(x, np.float64)), 0))
    np.testing.assert_allclose(np.asarray(quant.quantize_model(model, provider)(x)), ref, rtol=1e-4, atol=1e-4)


def test_plain_function_returning_its_stored_weight_returns_the_qarray():
    params = {"l": {"kernel": jax.random.normal(jax.random.key(0), (8, 4))}}
    x = jnp.ones((2, 8))
    provider = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")])
    fn = lambda p, x: (x @ p["l"]["kernel"], p)  # noqa: E731
    qp = quant.quantize_params(params, provider, fn, x)
    _, back = quant.quantize(fn, provider)(qp, x)
    assert back["l"]["kernel"] is qp["l"]["kernel"]


# --- item 2: only parameters are weights by default; buffers are left alone ---


class _CacheDot(nn.Module):
    """A parameter and a non-parameter buffer that both reach a dot."""

    def __init__(self, w, c):
        self.w = nn.Param(w)
        self.cache = nn.Cache(c)

    def __call__(self, x):
        return (x @ self.w.value) @ self.cache.value.T


_W = np.asarray(jax.random.normal(jax.random.key(4), (16, 8)))
_C = np.asarray(jax.random.normal(jax.random.key(5), (6, 8)))
_X = np.asarray(jax.random.normal(jax.random.key(6), (3, 16)))


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def test_a_buffer_reaching_a_dot_is_not_a_weight_by_default():
    model = _CacheDot(jnp.asarray(_W), jnp.asarray(_C))
    provider = quant.PtqProvider([quant.QuantizationRule(module_path=".*", weight_qtype="int4")])
    seen = _spy(provider, sides=True)
    y = quant.quantize_model(model, provider)(_X)
    ref = (_X.astype(np.float64) @ _ref_fake_quant(_W, 4, (0,))) @ _C.astype(np.float64).T
    assert _rel(y, ref) < 1e-5  # the cache stays float
    assert seen == [("", (1,)), ("", ())]  # x @ w has a weight operand, h @ cache.T none
    qmodel = quant.quantize_params(model, provider, lambda m, x: m(x), _X)
    assert isinstance(qmodel.w.value, QArray)
    assert not isinstance(qmodel.cache.value, QArray)
    np.testing.assert_array_equal(np.asarray(qmodel.cache.value), _C)


def test_the_weight_filter_widens_what_a_weight_is():
    model = _CacheDot(jnp.asarray(_W), jnp.asarray(_C))
    everything = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int4")], weight_filter=lambda path, variable: True)
    y = quant.quantize_model(model, everything)(_X)
    ref = (_X.astype(np.float64) @ _ref_fake_quant(_W, 4, (0,))) @ _ref_fake_quant(_C, 4, (1,)).T
    assert _rel(y, ref) < 1e-5  # the cache quantized too, one scale per row
    qmodel = quant.quantize_params(model, everything, lambda m, x: m(x), _X)
    assert isinstance(qmodel.cache.value, QArray) and isinstance(qmodel.w.value, QArray)
    # a variable type (or a tuple of them) selects the leaves those variables hold
    only_cache = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int4")], weight_filter=nn.Cache)
    y = quant.quantize_model(model, only_cache)(_X)
    ref = (_X.astype(np.float64) @ _W.astype(np.float64)) @ _ref_fake_quant(_C, 4, (1,)).T
    assert _rel(y, ref) < 1e-5


def test_flax_nnx_cache_is_not_a_weight_and_plain_trees_are_weights():
    nnx = pytest.importorskip("flax.nnx")

    class CacheDot(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.asarray(_W))
            self.cache = nnx.Cache(jnp.asarray(_C))

        def __call__(self, x):
            return (x @ self.w[...]) @ self.cache[...].T

    provider = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int4")])
    y = quant.quantize_model(CacheDot(), provider)(_X)
    ref_w = _X.astype(np.float64) @ _ref_fake_quant(_W, 4, (0,))
    assert _rel(y, ref_w @ _C.astype(np.float64).T) < 1e-5
    qmodel = quant.quantize_params(CacheDot(), provider, lambda m, x: m(x), _X)
    assert isinstance(qmodel.w.get_value(), QArray) and not isinstance(qmodel.cache.get_value(), QArray)
    # a plain pytree has no variables: every array leaf of the weight argument is a weight
    fn = lambda p, x: (x @ p["w"]) @ p["cache"].T  # noqa: E731
    y = quant.quantize(fn, provider)({"w": jnp.asarray(_W), "cache": jnp.asarray(_C)}, _X)
    assert _rel(y, ref_w @ _ref_fake_quant(_C, 4, (1,)).T) < 1e-5


def test_a_bad_weight_filter_is_refused():
    with pytest.raises(TypeError, match="weight_filter must be"):
        quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")], weight_filter="kernel")


# --- item 4: a rule's module_path names the module, for cairn.nn, Flax NNX and plain pytrees ---

_B2 = np.zeros(4, np.float32)
_XM = np.asarray(jax.random.normal(jax.random.key(10), (5, 8)))


def _nnx_model():
    pytest.importorskip("flax.nnx")
    return two_layer("flax.nnx", _B2)


def _nn_model():
    return two_layer("cairn.nn", _B2)


def _plain_params():
    return two_layer("plain", _B2)


_plain = plain_forward


@pytest.mark.parametrize("kind", ["flax.nnx", "cairn.nn", "plain"])
def test_module_path_names_the_module(kind):
    provider = quant.PtqProvider([quant.QuantizationRule(module_path="a", weight_qtype="int8")])  # strict
    seen = _spy(provider)
    if kind == "plain":
        params, fn = _plain_params(), _plain
        y = quant.quantize(fn, provider)(params, _XM)
    else:
        params = _nnx_model() if kind == "flax.nnx" else _nn_model()
        fn = lambda m, x: m(x)  # noqa: E731
        y = quant.quantize_model(params, provider)(_XM)
    assert sorted(set(seen)) == ["a", "b"]
    h = np.maximum(_XM.astype(np.float64) @ _ref_fake_quant(_K1, 8, (0,)) + _B1, 0)
    ref = h @ _K2.astype(np.float64) + _B2  # only module 'a' quantized
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5)
    q = quant.quantize_params(params, provider, fn, _XM)
    if kind == "plain":
        a, b = q["a"]["kernel"], q["b"]["kernel"]
    else:
        a, b = q.a.kernel.get_value(), q.b.kernel.get_value()
    assert isinstance(a, QArray) and not isinstance(b, QArray)


@pytest.mark.parametrize("kind", ["flax.nnx", "cairn.nn", "plain"])
def test_a_variable_name_is_not_a_module_path(kind):
    provider = quant.PtqProvider([quant.QuantizationRule(module_path="a/kernel", weight_qtype="int8")])
    with pytest.raises(ValueError, match=r"matched no op.*\['a', 'b'\]"):
        if kind == "plain":
            quant.quantize(_plain, provider)(_plain_params(), _XM)
        else:
            quant.quantize_model(_nnx_model() if kind == "flax.nnx" else _nn_model(), provider)(_XM)
