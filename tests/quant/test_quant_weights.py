"""Stored QArray weights staying QArrays, against float64 NumPy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


@pytest.mark.parametrize("mode", ["eager", "nn.jit"])
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
