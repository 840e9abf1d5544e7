"""cairn.quant on cairn.nn models: the rewrite finds the same weights however the model is
written, quantize_model keeps the call's mutations, and works under nn.jit and nn.grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cairn_testlib import record_quant_sites

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


TOKENS = jnp.array([1, 4, 7, 2, 9, 3], jnp.int32)


@pytest.mark.parametrize("style", ["matmul", "jnp_matmul", "einsum"])
def test_same_weights_found_whatever_the_spelling(style):
    provider = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")])
    sites = record_quant_sites(provider)
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


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
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
        return nn.scan(lambda h, layer: (nn.remat(lambda lyr, h: lyr(h))(layer, h), None))(x, layers)[0]

    provider = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")])
    sites = record_quant_sites(provider)
    y = quant.quantize(run, provider)(stacked, x)
    assert sites and all(s[1] == "" for s in sites)  # the stacked leaf 'kernel' itself
    want = run(stacked, x)
    assert 0 < float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want)) < 0.02


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_lora_on_an_nn_model_trains_only_the_adapters_and_loads_into_lora_linear():
    class Two(nn.Module):
        def __init__(self, rngs):
            self.l1 = nn.Linear(6, 10, rngs=rngs)
            self.l2 = nn.Linear(10, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    x = jax.random.normal(jax.random.key(2), (5, 6))
    model = Two(nn.Rngs(0))
    provider = quant.LoraProvider([quant.LoraRule(rank=2, alpha=2.0, weight_qtype="int8")])
    quant.apply_lora_to_model(model, provider, x, rng=jax.random.key(3))
    assert sorted(nn.state(model, nn.LoRAParam).flat_paths()) == [
        "l1/lora/lora_a", "l1/lora/lora_b", "l2/lora/lora_a", "l2/lora/lora_b",
    ]
    kernel = np.asarray(model.l1.kernel.value).copy()
    opt = nn.Optimizer(model, optim.adam(1e-2), wrt=nn.LoRAParam)
    target = jnp.ones((5, 4))

    def loss(m):
        return ((quant.quantize_model(m, provider)(x) - target) ** 2).mean()

    before = float(loss(model))
    for _ in range(20):
        opt.update(model, nn.grad(loss, wrt=nn.LoRAParam)(model))
    assert float(loss(model)) < 0.5 * before
    np.testing.assert_array_equal(np.asarray(model.l1.kernel.value), kernel)  # the base stays frozen

    # the adapters load into nn.LoRALinear (same paths, same alpha / rank scale)
    layer = nn.LoRALinear(6, 10, lora_rank=2, alpha=2.0, rngs=nn.Rngs(9))
    nn.update(layer, nn.state(model.l1))
    float_provider = quant.LoraProvider([quant.LoraRule(module_path="l1", rank=2, alpha=2.0)], strict=False)
    via_rules = quant.quantize(lambda m, x: m.l1(x), float_provider)(model, x)
    np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(via_rules), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_quantized_params_round_trip_through_cairn_checkpoint(tmp_path):
    from cairn import checkpoint
    from cairn.core_array import QArray

    def mlp(p, x):
        return jax.nn.relu(x @ p["l1"]["kernel"]) @ p["l2"]["kernel"]

    k = jax.random.split(jax.random.key(0), 3)
    params = {"l1": {"kernel": jax.random.normal(k[0], (64, 32))}, "l2": {"kernel": jax.random.normal(k[1], (32, 8))}}
    x = jax.random.normal(k[2], (4, 64))
    provider = quant.PtqProvider([
        quant.QuantizationRule(module_path="l1", weight_qtype="nf4"),
        quant.QuantizationRule(module_path="l2", weight_qtype="int4", tile_size=16),
    ])
    qp = quant.quantize_params(params, provider, mlp, x)
    checkpoint.save(tmp_path / "q", qp)
    # QArray leaves are stored as <path>/qvalue and <path>/scale, dtypes kept (uint4, int4)
    meta = checkpoint.metadata(tmp_path / "q")
    assert {"l1/kernel/qvalue", "l1/kernel/scale", "l2/kernel/qvalue", "l2/kernel/scale"} <= set(meta)
    back = checkpoint.restore(tmp_path / "q", target=qp)
    assert isinstance(back["l1"]["kernel"], QArray) and back["l1"]["kernel"].qtype == "nf4"
    assert back["l2"]["kernel"].layout == qp["l2"]["kernel"].layout
    f = quant.quantize(mlp, provider)
    np.testing.assert_array_equal(np.asarray(f(back, x)), np.asarray(f(qp, x)))


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_kv_cache_decode_through_quantize_model_equals_the_quantized_full_pass():
    # the cache the decode calls write must persist between calls of the quantized model
    mha = nn.MultiHeadAttention(4, 16, num_kv_heads=2, rngs=nn.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    provider = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")])
    full = quant.quantize_model(mha, provider)(x, is_causal=True)
    mha.init_cache((2, 8, 16))
    q = quant.quantize_model(mha, provider)
    prompt = q(x[:, :3], decode=True)
    steps = [q(x[:, t : t + 1], decode=True) for t in (3, 4)]
    np.testing.assert_allclose(np.asarray(jnp.concatenate([prompt, *steps], axis=1)), np.asarray(full), atol=2e-5)
    float_full = nn.MultiHeadAttention(4, 16, num_kv_heads=2, rngs=nn.Rngs(0))(x, is_causal=True)
    assert 0 < float(jnp.abs(full - float_full).max()) < 0.05  # quantized, and close


def test_rules_on_dots_between_activations_name_the_module_by_scope():
    # attention logits have no weight: nn's named scopes give them a module path
    class Attn(nn.Module):
        def __init__(self, rngs):
            self.q = nn.Linear(8, 8, rngs=rngs)
            self.k = nn.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return jax.nn.softmax(jnp.einsum("bd,cd->bc", self.q(x), self.k(x)))

    class Net(nn.Module):
        def __init__(self, rngs):
            self.layers = [Attn(rngs), Attn(rngs)]

        def __call__(self, x):
            return [layer(x) for layer in self.layers]

    model = Net(nn.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (5, 8))
    provider = quant.PtqProvider([quant.QuantizationRule(module_path="layers/1", op_names=("einsum",), act_qtype="int8")])
    sites = record_quant_sites(provider)
    out = quant.quantize_model(model, provider)(x)
    ref = model(x)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))  # layers/0 untouched
    assert not np.array_equal(np.asarray(out[1]), np.asarray(ref[1]))  # layers/1's logits quantized
    assert ("einsum", "layers/1", 0) in sites
    assert float(jnp.abs(out[1] - ref[1]).max()) < 0.05


def test_nn_update_with_quantize_params_runs_the_model_on_qarrays():
    class Net(nn.Module):
        def __init__(self, rngs):
            self.emb = nn.Embed(10, 8, rngs=rngs)
            self.l1 = nn.Linear(8, 16, rngs=rngs)
            self.conv = nn.Conv(16, 4, (3,), rngs=rngs)

        def __call__(self, t):
            return self.conv(jax.nn.relu(self.l1(self.emb(t))))

    model, tokens = Net(nn.Rngs(0)), jnp.array([[1, 2, 3, 4, 5]])
    ref = model(tokens)
    provider = quant.PtqProvider([quant.QuantizationRule(module_path="l1|conv", weight_qtype="int8")])
    nn.update(model, nn.state(quant.quantize_params(model, provider, lambda m, t: m(t), tokens)))
    assert type(model.l1.kernel.value).__name__ == "QArray"
    eager = model(tokens)  # layers dequantize on the fly
    assert float(jnp.linalg.norm(eager - ref) / jnp.linalg.norm(ref)) < 0.02
    np.testing.assert_allclose(np.asarray(nn.jit(lambda m, t: m(t))(model, tokens)), np.asarray(eager), atol=1e-6)
    np.testing.assert_allclose(np.asarray(quant.quantize_model(model, provider)(tokens)), np.asarray(eager), atol=1e-5)


@pytest.mark.parametrize("method", ["awq", "smooth_quant"])
def test_awq_and_smooth_quant_on_an_nn_model(method):
    from cairn.core_array import QArray

    class Net(nn.Module):
        def __init__(self, rngs):
            self.l1 = nn.Linear(32, 64, rngs=rngs)
            self.l2 = nn.Linear(64, 8, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    model = Net(nn.Rngs(0))
    x = np.array(jax.random.normal(jax.random.key(1), (256, 32)))
    x[:, :3] *= 20.0  # salient input channels
    call = lambda m, x: m(x)  # noqa: E731
    if method == "awq":
        provider = quant.PtqProvider([quant.AwqRule(weight_qtype="int4", n_grid=8)])
        qmodel = quant.awq_quantize_params(model, provider, call, [(x,)])
        plain = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int4")])
    else:
        provider = quant.PtqProvider([quant.SmoothQuantRule(weight_qtype="int8", act_qtype="int8")])
        qmodel = quant.smooth_quant_params(model, provider, call, [(x,)])
        plain = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8", act_qtype="int8")])
    assert not isinstance(model.l1.kernel.value, QArray)  # the input model is not changed
    assert isinstance(qmodel.l1.kernel.value, QArray)
    assert isinstance(qmodel.l1.kernel_awq_scale, nn.Param) and qmodel.l1.kernel_awq_scale.value.shape == (32,)
    ref = np.asarray(model(x), np.float64)
    err = np.linalg.norm(np.asarray(quant.quantize_model(qmodel, provider)(x)) - ref)
    base = np.linalg.norm(np.asarray(quant.quantize_model(model, plain)(x)) - ref)
    assert err < base
