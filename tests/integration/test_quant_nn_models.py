"""cairn.quant on cairn.nn models: the rewrite finds the same weights however the model is
written, quantize_model keeps the call's mutations, and works under nn.jit and nn.grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn, optim, quant


class _Block(nn.Module):
    def __init__(self, d: int, rngs: nn.Rngs, style: str) -> None:
        self.up = nn.Linear(d, 2 * d, rngs=rngs)
        self.down = nn.Param(jax.random.normal(rngs.params(), (2 * d, d)) / d)
        self.style = style

    def __call__(self, x):
        h = jax.nn.relu(self.up(x))
        w = self.down.value
        if self.style == "matmul":
            return x + h @ w
        if self.style == "jnp_matmul":
            return x + jnp.matmul(h, w)
        return x + jnp.einsum("bh,hd->bd", h, w)


class _Model(nn.Module):
    def __init__(self, rngs: nn.Rngs, style: str = "matmul", vocab: int = 11, d: int = 8) -> None:
        self.embed = nn.Embed(vocab, d, rngs=rngs)
        self.blocks = [_Block(d, rngs, style), _Block(d, rngs, style)]
        self.norm = nn.BatchNorm(d, use_running_average=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        x = self.norm(x)
        return self.embed.attend(x)  # tied output projection: the embedding used as a weight


def _seen(provider):
    sites = []
    inner = provider._handle

    def handle(site, invals):
        sites.append((site.kind, site.module_path, site.index))
        return inner(site, invals)

    provider._handle = handle
    return sites


TOKENS = jnp.array([1, 4, 7, 2, 9, 3], jnp.int32)


@pytest.mark.parametrize("style", ["matmul", "jnp_matmul", "einsum"])
def test_same_weights_found_whatever_the_spelling(style):
    provider = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")])
    sites = _seen(provider)
    model = _Model(nn.Rngs(0), style)
    quant.quantize_model(model, provider)(TOKENS)
    modules = sorted({s[1] for s in sites})
    assert modules == ["blocks/0", "blocks/0/up", "blocks/1", "blocks/1/up", "embed"], sites


def test_quantize_model_keeps_mutations_and_identity():
    model, reference = _Model(nn.Rngs(0)), _Model(nn.Rngs(0))
    norm = model.norm
    q = quant.quantize_model(model, quant.PtqProvider([quant.QuantizationRule(module_path="blocks/.*", weight_qtype="int8")]), TOKENS)
    y = q(TOKENS)
    want = reference(TOKENS)
    assert float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want)) < 0.03
    assert model.norm is norm  # the same objects, updated in place
    stats, ref_stats = np.asarray(model.norm.mean.value), np.asarray(reference.norm.mean.value)
    assert np.abs(stats).max() > 0
    np.testing.assert_allclose(stats, ref_stats, rtol=0.05, atol=0.02)  # quantized activations, same update


def test_under_nn_jit_the_mutation_reaches_the_caller():
    model = _Model(nn.Rngs(0))
    q = quant.quantize_model(model, quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")]))
    eager = _Model(nn.Rngs(0))
    qe = quant.quantize_model(eager, quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")]))
    y = nn.jit(lambda m, t: m(t))(q, TOKENS)
    np.testing.assert_allclose(np.asarray(y), np.asarray(qe(TOKENS)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(model.norm.mean.value), np.asarray(eager.norm.mean.value), rtol=1e-5, atol=1e-6)


def test_qat_trains_with_nn_optimizer_and_straight_through_gradients():
    model = _Model(nn.Rngs(0))
    rules = [quant.QtRule(module_path="blocks/.*", weight_qtype="int8", act_qtype="int8")]
    opt = nn.Optimizer(model, optim.adam(1e-2), wrt=nn.Param)
    targets = jnp.array([2, 3, 4, 5, 6, 7])

    def loss(m):
        logits = quant.quantize_model(m, quant.QtProvider(rules))(TOKENS)
        return optim.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    first = float(loss(model))
    for _ in range(30):
        grads = nn.grad(loss)(model)
        opt.update(model, grads)
    assert float(loss(model)) < 0.5 * first


def test_scan_and_remat_over_stacked_layers():
    class Layer(nn.Module):
        def __init__(self, rngs):
            self.kernel = nn.Param(jax.random.normal(rngs.params(), (6, 6)) / 3)

        def __call__(self, h):
            return jnp.tanh(h @ self.kernel.value)

    stacked = nn.vmap(lambda r: Layer(r))(nn.Rngs(0).split(3))
    x = jax.random.normal(jax.random.key(1), (2, 6))

    def run(layers, x):
        return nn.scan(lambda h, layer: (nn.remat(lambda l, h: l(h))(layer, h), None))(x, layers)[0]

    provider = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")])
    sites = _seen(provider)
    y = quant.quantize(run, provider)(stacked, x)
    assert sites and all(s[1] == "" for s in sites)  # the stacked leaf 'kernel' itself
    want = run(stacked, x)
    assert 0 < float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want)) < 0.02
