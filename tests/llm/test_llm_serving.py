"""cairn.llm models served by cairn.serving: the exported prefill/decode are the model's own.

References: ``cairn.llm.generate`` (itself checked against one prompt at a time and against
transformers' logits through the full forward pass) and the model's full forward pass, with a
float64 NumPy ``log_softmax`` for the prompt scores. Tolerances: float32 logits to 2e-5
absolute on logits of magnitude ~1 (the cached and full passes sum in different orders).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from llm_testlib import extend, forward, load

from cairn import llm, nn, quant, serving
from cairn.core_array import QArray, read_checksummed_json

# llama (full attention), qwen2 (qkv biases, tied embeddings), gemma2 (soft-capping, sliding window 4)
# llama in the default suite; the others (compiles of ~20-30 s each on a loaded 2-core CPU) in tests_slow
FAMILY_PARAMS = ["llama", pytest.param("qwen2", marks=pytest.mark.slow), pytest.param("gemma2", marks=pytest.mark.slow)]
PROMPTS = [[5, 17, 33, 8, 61, 2, 9], [40], [11, 12, 13, 70, 3]]
MAX_LENGTH = 64  # generate's cache bucket: both paths attend over the same number of slots
NEW = 10


def _tokenizer(n: int) -> llm.Tokenizer:
    """A word-level tokenizer of ``n`` ids: ``<pad> <bos> <eos>`` then ``w3 .. w{n-1}``."""
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, n)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in ("<pad>", "<bos>", "<eos>")])
    return llm.Tokenizer(backend, {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"},
                         chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")


def _engine_tokens(model, prompts, new):
    cfg = serving.GenerationConfig(num_slots=4, prefill_batch=2)
    with serving.GenerationEngine(model, cfg).start(precompile=False) as engine:
        reqs = [engine.submit(p, serving.SamplingParams(max_new_tokens=new)) for p in prompts]
        return [r.result(120).token_ids for r in reqs]


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_exported_greedy_generation_equals_generate(family, tmp_path):
    model = load(family)
    want = llm.generate(model, PROMPTS, NEW, max_length=MAX_LENGTH).tokens
    path = llm.export_for_serving(model, None, tmp_path, family, max_length=MAX_LENGTH, max_batch_size=4,
                                  eos_token_ids=())
    assert path == os.path.join(str(tmp_path), family, "1")
    loaded = serving.load_generator(path)
    assert (loaded.vocab_size, loaded.max_length) == (model.config.vocab_size, MAX_LENGTH)
    assert _engine_tokens(loaded, PROMPTS, NEW) == want
    # the in-process generator gives the same tokens
    inproc = llm.as_generator(model, max_length=MAX_LENGTH, eos_token_ids=())
    assert isinstance(inproc, serving.PythonGenerator)
    assert _engine_tokens(inproc, PROMPTS, NEW) == want


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_prefill_and_decode_logits_equal_the_full_forward(family):
    model = load(family)
    fns = llm.serving_functions(model, 24)
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(3, 96, n)) for n in (9, 3, 6)]
    lengths = np.array([6, 2, 5], np.int32)  # prefill the first `lengths` tokens, decode the rest
    tokens = np.zeros((3, 8), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : lengths[i]] = s[: lengths[i]]
    logits, cache = jax.jit(fns.prefill)(fns.params, jnp.asarray(tokens), jnp.asarray(lengths))
    assert sorted(cache) == sorted(fns.cache_specs) and cache["k0"].shape == (3, 24, *fns.cache_specs["k0"].shape[1:])
    full = [np.asarray(forward(model, jnp.asarray([s], jnp.int32)))[0] for s in seqs]
    for i in range(3):
        np.testing.assert_allclose(np.asarray(logits[i]), full[i][lengths[i] - 1], atol=2e-5, rtol=0)
    decode, pos = jax.jit(fns.decode), lengths.copy()
    for _ in range(3):  # rows at different positions advance together
        nxt = np.array([seqs[i][min(pos[i], len(seqs[i]) - 1)] for i in range(3)], np.int32)
        logits, cache = decode(fns.params, jnp.asarray(nxt), jnp.asarray(pos), cache)
        for i in range(3):
            if pos[i] < len(seqs[i]):
                np.testing.assert_allclose(np.asarray(logits[i]), full[i][pos[i]], atol=2e-5, rtol=0)
        pos = pos + 1


def test_prefill_attends_over_the_prompt_only_and_equals_the_full_forward():
    # prefill runs the full causal pass over the p prompt positions (not a cached pass over
    # max_length slots): its logits are the full forward's at lengths - 1, its cache holds what
    # the model's own cached prefill (queries over every max_length slot) writes at slots <
    # length, and zeros from slot p on; the padding after a prompt (random ids here) changes
    # nothing before it
    model = load("llama")
    fns = llm.serving_functions(model, 24)
    rng = np.random.default_rng(3)
    lengths = np.array([8, 2, 5], np.int32)
    tokens = rng.integers(3, 96, (3, 8)).astype(np.int32)  # past each length: padding, not zeros
    logits, cache = jax.jit(fns.prefill)(fns.params, jnp.asarray(tokens), jnp.asarray(lengths))
    assert logits.shape == (3, model.config.vocab_size) and logits.dtype == jnp.float32
    full = np.asarray(forward(model, jnp.asarray(tokens)))  # causal: position n - 1 sees tokens < n only
    np.testing.assert_allclose(np.asarray(logits), full[np.arange(3), lengths - 1], atol=2e-5, rtol=0)
    _, cached = extend(model, jnp.asarray(tokens), model.init_cache(3, 24), jnp.asarray(lengths))
    for i in range(model.config.num_hidden_layers):
        for name, want in ((f"k{i}", cached.keys[i]), (f"v{i}", cached.values[i])):
            got, want = np.asarray(cache[name]), np.asarray(want)
            for b, n in enumerate(lengths):
                np.testing.assert_allclose(got[b, :n], want[b, :n], atol=2e-5, rtol=0)
            assert not got[:, tokens.shape[1]:].any(), name  # nothing written past the prompt's p slots


def test_score_is_the_log_probability_of_each_prompt_token():
    model = load("llama")
    fns = llm.serving_functions(model, 16)
    tokens = np.array([[5, 17, 33, 8, 61], [40, 7, 0, 0, 0]], np.int32)
    lengths = np.array([5, 2], np.int32)
    got = np.asarray(jax.jit(fns.score)(fns.params, jnp.asarray(tokens), jnp.asarray(lengths)))
    assert got.dtype == np.float32 and got.shape == (2, 5)
    for b in range(2):
        n = lengths[b]
        logits = np.asarray(forward(model, jnp.asarray(tokens[b : b + 1, :n])), np.float64)[0]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        want = np.zeros(5)
        want[1:n] = logp[np.arange(n - 1), tokens[b, 1:n]]
        np.testing.assert_allclose(got[b], want, atol=2e-5, rtol=0)


def _int8(model):
    provider = quant.PtqProvider([quant.QuantizationRule(module_path=r"layers/\d+/(attn|mlp)/\w+", weight_qtype="int8")])
    ids = jnp.zeros((1, 4), jnp.int32)
    nn.update(model, nn.state(quant.quantize_params(model, provider, lambda m, t: m(t), ids)))
    return model


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_an_int8_model_exports_int8_weights_and_serves_its_own_logits(tmp_path):
    model = _int8(llm.from_pretrained(os.path.join(os.path.dirname(__file__), "fixtures", "llama")))
    assert isinstance(model.layers[0].attn.q.kernel[...], QArray)
    path = llm.export_for_serving(model, _tokenizer(40), tmp_path, "q8", max_length=32, max_batch_size=4)
    manifest = read_checksummed_json(os.path.join(path, "manifest.json"))
    qarrays = manifest["weights"]["qarrays"]
    # attn/o reaches its dot through a reshape (heads*head_dim as one axis), so quantize_params keeps it float
    assert {f"layers/{i}/{m}/kernel" for i in range(3) for m in ("attn/q", "attn/k", "attn/v", "mlp/gate", "mlp/up",
                                                                   "mlp/down")} <= set(qarrays)
    loaded = serving.load_generator(path)
    assert loaded.weights["layers/0/attn/q/kernel/qvalue"].dtype == np.int8
    assert loaded.tokenizer is not None and loaded.eos_token_ids == (2,)
    tokens, lengths = jnp.asarray([[5, 17, 33, 8]], jnp.int32), jnp.asarray([4], jnp.int32)
    got, _ = loaded.prefill(tokens, lengths)
    want = np.asarray(forward(model, tokens))[0, -1]  # the model with its QArray weights
    np.testing.assert_allclose(np.asarray(got)[0], want, atol=2e-5, rtol=0)
    float_logits = np.asarray(forward(load("llama"), tokens))[0, -1]
    assert np.abs(want - float_logits).max() > 1e-5  # the weights really are quantized


def test_the_tokenizer_travels_in_the_artifact(tmp_path):
    tok = _tokenizer(50)
    path = llm.export_for_serving(load("llama"), tok, tmp_path, "m", version=3, max_length=16, max_batch_size=2)
    assert path.endswith(os.path.join("m", "3")) and os.path.isfile(os.path.join(path, "tokenizer", "tokenizer.json"))
    loaded = serving.load_generator(path)
    assert loaded.tokenize("w5 w7") == tok.encode("w5 w7") and loaded.eos_token_ids == (2,)
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "w9"}]) == "w9 "


def test_errors_are_clear(tmp_path):
    model = load("llama")
    with pytest.raises(ValueError, match="max_length=4096 exceeds the model's max_position_embeddings=2048"):
        llm.export_for_serving(model, None, tmp_path, "m", max_length=4096)
    with pytest.raises(ValueError, match="the tokenizer has 100 ids but the model's vocab_size is 96"):
        llm.export_for_serving(model, _tokenizer(100), tmp_path, "m", max_length=16)
    with pytest.raises(ValueError, match="max_length .* must be an int >= 2, got 1"):
        llm.as_generator(model, max_length=1)
    with pytest.raises(ValueError, match="version must be an int >= 1"):
        llm.export_for_serving(model, None, tmp_path, "m", max_length=16, version=0)
    with pytest.raises(ValueError, match="name must be a model name"):
        llm.export_for_serving(model, None, tmp_path, "a/b", max_length=16)
    lora = llm.apply_lora(llm.from_pretrained(os.path.join(os.path.dirname(__file__), "fixtures", "llama")), 2, 4.0)
    with pytest.raises(TypeError, match="merge_lora"):
        llm.export_for_serving(lora, None, tmp_path, "m", max_length=16)
    with pytest.raises(TypeError, match="model must be a cairn.llm.CausalLM"):
        llm.serving_functions({"w": np.zeros(3)}, 16)
    llm.export_for_serving(model, None, tmp_path, "m", max_length=16, max_batch_size=2)
    with pytest.raises(FileExistsError):
        llm.export_for_serving(model, None, tmp_path, "m", max_length=16, max_batch_size=2)


@pytest.mark.slow  # over 7 s (a compile per family); the tiny llama's paged path runs in tests/serving
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_paged_chunks_and_decode_steps_equal_the_full_forward(family):
    # the paged program over scattered blocks: a prompt in chunks (the last one padded, a
    # padding row beside it), then decode steps, against the full forward pass
    model = load(family)
    fns = llm.serving_functions(model, 24)
    bs, nb = 4, 16
    kv = fns.cache_specs["k0"].shape[1:]
    pool = {n: jnp.zeros((nb, bs, *kv), fns.cache_specs[n].dtype) for n in fns.cache_specs}
    seq = [int(t) for t in np.random.default_rng(1).integers(3, 96, 14)]
    full = np.asarray(forward(model, jnp.asarray([seq], jnp.int32)))[0]
    tables = np.array([[9, 2, 14, 5, 0, 0], [0] * 6], np.int32)  # 6 blocks of 4 cover max_length 24
    step = jax.jit(fns.paged)
    for start, n in ((0, 5), (5, 5), (10, 1)):  # chunks of 5 (the last holds 1 token), then decode
        tokens = np.zeros((2, 5), np.int32)
        tokens[0, :n] = seq[start : start + n]
        logits, pool = step(fns.params, tokens, np.array([start, 0]), np.array([n, 0]), tables, pool)
        np.testing.assert_allclose(np.asarray(logits[0]), full[start + n - 1], atol=3e-5, rtol=0)
    for pos in range(11, 14):
        logits, pool = step(fns.params, np.array([[seq[pos]], [0]]), np.array([pos, 0]), np.array([1, 0]), tables, pool)
        np.testing.assert_allclose(np.asarray(logits[0]), full[pos], atol=3e-5, rtol=0)
    # the padding row wrote nothing: blocks outside row 0's table are still zero
    unused = [b for b in range(nb) if b not in (9, 2, 14, 5)]
    assert not np.asarray(pool["k0"])[unused].any()


@pytest.mark.slow  # an export and two engines' compiles
def test_exported_paged_generation_equals_generate(tmp_path):
    model = load("llama")
    want = llm.generate(model, PROMPTS, NEW, max_length=MAX_LENGTH).tokens
    path = llm.export_for_serving(model, None, tmp_path, "p", max_length=MAX_LENGTH, max_batch_size=4,
                                  eos_token_ids=(), block_size=8)
    loaded = serving.load_generator(path)
    assert loaded.has_paged and loaded.block_size == 8
    cfg = serving.GenerationConfig(num_slots=4, prefill_batch=2, kv_layout="paged", prefill_chunk=4)
    with serving.GenerationEngine(loaded, cfg) as engine:
        reqs = [engine.submit(p, serving.SamplingParams(max_new_tokens=NEW)) for p in PROMPTS]
        assert [r.result(120).token_ids for r in reqs] == want
    with pytest.raises(ValueError, match="block_size .* must be an int in 1..max_length=16"):
        llm.export_for_serving(model, None, tmp_path, "q", max_length=16, block_size=0)


def test_prefill_exports_with_a_symbolic_prompt_longer_than_the_cpu_attention_chunk():
    # the xla attention's CPU default compared the symbolic query length with 64 once the keys
    # outnumbered its 128-key chunk: any max_length above 128 failed to export
    model = load("llama")
    fns = llm.serving_functions(model, 160)
    b, p = jax.export.symbolic_shape("b, p", constraints=("p <= 160",))
    exp = jax.export.export(jax.jit(fns.prefill))(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), fns.params),
        jax.ShapeDtypeStruct((b, p), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
    assert exp.out_avals[0].shape[0] == b
