"""AWQ on a CausalLM: the forward divides each projection's held input scale out.

References: a float64 NumPy Llama forward in which every projection computes the scaled
product ``(x / s) @ dequantize(Q(diag(s) W))`` (or ``x @ W`` for a float weight), and the
float model itself. Tolerances (float32 model): the quantized model's logits equal the
float64 reference to 1e-4 of the largest |logit| (float32 sums over ``hidden`` <= 64 terms);
a float model rescaled exactly (``diag(s) W`` held with ``s``) equals the float model to 1e-5
relative; AWQ int4 in tiles of 16 (random weights, lm_head included) stays within 0.15 relative
L2 of the float logits (measured 0.096); the stored weights without their scales miss the
scaled reference by over 100x the forward's own error.
"""

from __future__ import annotations

import numpy as np
import pytest

from cairn import llm, nn, quant, serving
from cairn.core_array import QArray, read_checksummed_json

MATRICES = r"layers/\d+/(attn|mlp)/\w+|lm_head"
PROJECTIONS = ["attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down"]


def _config(**kw):
    d = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    return llm.LlmConfig("llama", **{**d, **kw})


def _ids(b=2, t=12, seed=0):
    return np.random.default_rng(seed).integers(0, 64, (b, t)).astype(np.int32)


def _awq(model, batches, pattern=MATRICES):
    provider = quant.PtqProvider([quant.AwqRule(module_path=pattern, weight_qtype="int4", tile_size=16, n_grid=5)])
    return quant.awq_quantize_params(model, provider, lambda m, t: m(t), batches)


def _np(v):
    v = v[...]
    return np.asarray(v.dequantize() if isinstance(v, QArray) else v, np.float64)


def _matrix(module, contracted):
    """``module``'s kernel as float64 ``[inputs, outputs]`` and its input scale (ones if none)."""
    w = _np(module.kernel)
    k = int(np.prod(w.shape[:contracted]))
    held = getattr(module, "kernel_awq_scale", None)
    s = np.ones(k) if held is None else np.asarray(held[...], np.float64)
    return w.reshape(k, -1), s


def _proj(x, module, contracted=1):
    """The scaled computation in float64: ``(x / s) @ W``, ``x [..., inputs]``."""
    w, s = _matrix(module, contracted)
    return (x / s) @ w


def reference_logits(model, ids):
    """Llama (no biases) in float64 NumPy over the model's held arrays."""
    cfg = model.config
    hd, n, kv, eps = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    b, t = ids.shape

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * _np(w)

    inv = 1.0 / (dict(cfg.rope)["rope_theta"] ** (np.arange(0, hd, 2) / hd))
    ang = np.arange(t)[:, None] * inv
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]

    def rope(x):
        return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

    x = _np(model.embed.embedding)[ids]
    for layer in model.layers:
        a = layer.attn
        h = norm(x, layer.input_norm.scale)
        q = rope(_proj(h, a.q).reshape(b, t, n, hd))
        k = np.repeat(rope(_proj(h, a.k).reshape(b, t, kv, hd)), n // kv, axis=2)
        v = np.repeat(_proj(h, a.v).reshape(b, t, kv, hd), n // kv, axis=2)
        s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(hd)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + _proj(np.einsum("bnts,bsnh->btnh", p, v).reshape(b, t, n * hd), a.o, contracted=2)
        h = norm(x, layer.mlp_norm.scale)
        g = _proj(h, layer.mlp.gate)
        x = x + _proj(g / (1 + np.exp(-g)) * _proj(h, layer.mlp.up), layer.mlp.down)
    return _proj(norm(x, model.norm.scale), model.lm_head)


def _rel(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def float_and_awq():
    model = llm.CausalLM(_config(), rngs=nn.Rngs(0))
    return model, _awq(model, [(_ids(4, 16, 1),)])


def test_awq_model_logits_equal_the_scaled_float64_reference_and_stay_close_to_float(float_and_awq):
    model, awq = float_and_awq
    scaled = [p for p in nn.state(awq).flat_state() if str(p[-1]) == "kernel_awq_scale"]
    assert len(scaled) == 6 * 2 + 1  # q k v gate up down per layer, lm_head (attn/o reaches its dot reshaped)
    assert isinstance(awq.layers[0].mlp.up.kernel[...], QArray) and awq.layers[0].mlp.up.kernel[...].qtype == "int4"
    ids = _ids()
    got = np.asarray(nn.jit(lambda m, x: m(x))(awq, ids))
    want = reference_logits(awq, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    float_logits = reference_logits(model, ids)
    np.testing.assert_allclose(np.asarray(model(ids)), float_logits, atol=1e-4 * np.abs(float_logits).max())
    assert _rel(got, float_logits) < 0.15
    # the same stored weights with their scales ignored: what the forward computed before it applied them
    unscaled = llm.CausalLM(model.config, rngs=nn.Rngs(0))
    nn.update(unscaled, nn.state(nn.merge(*nn.split(awq), copy=True), nn.Param).filter(
        lambda p, _: str(p[-1]) != "kernel_awq_scale"))
    assert _rel(unscaled(ids), want) > 100 * _rel(got, want)


@pytest.mark.slow  # CI budget; the float64 reference test above covers the scaled forward by default
def test_an_exactly_rescaled_float_model_equals_the_float_model_at_every_projection():
    """``diag(s) W`` held with ``s`` on all eight projections (o through its heads-flattened
    product, lm_head included) computes ``x W``: the float model's logits, cache path too."""
    model = llm.CausalLM(_config(qkv_bias=True), rngs=nn.Rngs(3))
    params = nn.state(model).to_pure_dict()
    rng = np.random.default_rng(4)
    mods = [(f"layers/{i}/{p}", 2 if p == "attn/o" else 1) for i in range(2) for p in PROJECTIONS] + [("lm_head", 1)]
    for path, contracted in mods:
        node = params
        for key in path.split("/"):
            node = node[int(key)] if key.isdigit() else node[key]
        w = np.asarray(node["kernel"])
        s = rng.uniform(0.25, 4.0, int(np.prod(w.shape[:contracted]))).astype(np.float32)
        node["kernel"] = (w * s.reshape(*w.shape[:contracted], *(1,) * (w.ndim - contracted))).astype(np.float32)
        node["kernel_awq_scale"] = s
    held = llm.with_params(model, params)
    assert held.layers[1].attn.o.kernel_awq_scale[...].shape == (32,)
    assert not hasattr(model.layers[1].attn.o, "kernel_awq_scale"), "the model itself is unchanged"
    ids = _ids()
    want = np.asarray(model(ids))
    np.testing.assert_allclose(np.asarray(held(ids)), want, rtol=0, atol=1e-5 * np.abs(want).max())
    cache = held.init_cache(2, 16)
    logits, _ = held(ids, cache=cache)
    np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(held.output_projection()), np.asarray(model.output_projection()), rtol=1e-6)


def test_dict_params_through_with_params_equal_the_module_route_and_no_provider_divides_twice(float_and_awq):
    model, awq = float_and_awq
    fns = llm.serving_functions(model, 32)
    provider = quant.PtqProvider([quant.AwqRule(module_path=MATRICES, weight_qtype="int4", tile_size=16, n_grid=5)])
    qparams = quant.awq_quantize_params(fns.params, provider, fns.forward, [(_ids(4, 16, 1),)])
    held = llm.with_params(model, qparams)
    ids = _ids()
    want = np.asarray(awq(ids))
    np.testing.assert_allclose(np.asarray(held(ids)), want, rtol=0, atol=1e-6 * np.abs(want).max())
    # a cairn.quant provider around the model (quantize_model, apply_lora's wrapper) divides the input
    # by a scale it finds at a dot's weight operand; the model divides the kernel, so it is applied once
    wrapped = quant.quantize_model(awq, quant.PtqProvider([]))
    np.testing.assert_allclose(np.asarray(wrapped(ids)), want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_with_params_refuses_what_the_model_cannot_hold():
    model = llm.CausalLM(_config(), rngs=nn.Rngs(0))
    params = nn.state(model).to_pure_dict()
    for where, key in ((params["embed"], "embedding_awq_scale"), (params["layers"][0]["mlp"]["up"], "bogus")):
        where[key] = np.ones(32, np.float32)
        with pytest.raises(ValueError, match=key):
            llm.with_params(model, params)
        del where[key]
    params["layers"][0]["mlp"]["down"]["kernel_awq_scale"] = np.ones(32, np.float32)  # down has 64 inputs
    with pytest.raises(ValueError, match=r"layers/0/mlp/down/kernel_awq_scale.*32 values.*64 input channels"):
        llm.with_params(model, params)


@pytest.mark.slow  # a MoE model's first eager forward: ~7 s on a loaded 2-core CPU
def test_scales_on_the_moe_experts_are_refused():
    moe = llm.CausalLM(llm.config_from_hf({
        "model_type": "qwen3_moe", "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 12}), rngs=nn.Rngs(0))
    mp = nn.state(moe).to_pure_dict()
    mp["layers"][0]["mlp"]["experts"]["gate_awq_scale"] = np.ones(16, np.float32)
    with pytest.raises(ValueError, match="experts/gate_awq_scale"):
        llm.with_params(moe, mp)
    vars(moe.layers[0].mlp.experts)["gate_awq_scale"] = nn.Param(np.ones(16, np.float32))  # by hand: the forward refuses
    with pytest.raises(ValueError, match="ragged_dot does not apply"):
        moe(np.zeros((1, 3), np.int32))


@pytest.mark.slow  # generate's compiles and a save/load: ~20 s on a loaded 2-core CPU
def test_awq_model_generates_and_saves_as_the_floats_it_computes_with(float_and_awq, tmp_path):
    _, awq = float_and_awq
    prompts = [[5, 17, 33, 8], [40, 2]]
    out = llm.generate(awq, prompts, max_new_tokens=6, max_length=16)
    assert [len(t) for t in out.tokens] == [6, 6]
    llm.save_pretrained(awq, tmp_path / "hf")  # Hugging Face has no QArray layout: the effective float weights
    back = llm.from_pretrained(tmp_path / "hf")
    assert not back.quantized_paths()
    ids = _ids()
    want = np.asarray(awq(ids))
    np.testing.assert_allclose(np.asarray(back(ids)), want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert llm.generate(back, prompts, max_new_tokens=6, max_length=16).tokens == out.tokens


@pytest.mark.slow  # an export and its load: ~10 s on a loaded 2-core CPU
def test_awq_model_exports_quantized_with_its_scales_and_serves_its_logits(float_and_awq, tmp_path):
    _, awq = float_and_awq
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, 64)}}
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = llm.Tokenizer(backend, {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"})
    path = llm.export_for_serving(awq, tok, tmp_path, "awq", max_length=32, max_batch_size=2)
    manifest = read_checksummed_json(f"{path}/manifest.json")
    assert "layers/0/mlp/up/kernel" in manifest["weights"]["qarrays"]
    loaded = serving.load_generator(path)
    assert "layers/0/mlp/up/kernel_awq_scale" in loaded.weights
    tokens = np.asarray([[5, 17, 33, 8]], np.int32)
    got, _ = loaded.prefill(tokens, np.asarray([4], np.int32))
    want = np.asarray(awq(tokens))[0, -1]
    np.testing.assert_allclose(np.asarray(got)[0], want, rtol=0, atol=2e-5)
