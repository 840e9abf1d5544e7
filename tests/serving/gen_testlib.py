"""A tiny decoder-only language model for the generation tests: a cairn.llm ``CausalLM``
served through ``cairn.llm.serving_functions`` (pure ``prefill``/``decode`` over a flat
KV-cache dict, the contract of ``cairn.serving`` generation).

Llama-shaped: two layers of grouped-query attention (4 query heads over 2 key/value heads),
rotary positions, RMS norms, a SwiGLU MLP and a head tied to the embedding; vocabulary 40,
width 32, ``MAX_LENGTH`` 64. ``reference_logits`` is the model's full forward pass (no
cache), which tests/llm checks against transformers; the cached functions are checked
against it. Weights may be ``QArray`` leaves (dequantized inside).
"""

from __future__ import annotations

import functools
import pathlib

import numpy as np
import tokenizers

from cairn import llm, nn
from cairn.core_array import ArraySpec, QuantLayout, flatten_with_paths, quantize
from cairn.serving import Tokenizer

VOCAB_SIZE = 40
D_MODEL = 32
N_HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
N_LAYERS = 2
D_FF = 64
MAX_LENGTH = 64
BOS_ID, EOS_ID = 1, 2  # 0 is padding
# token id -> text: 0..2 are specials (no text), then single characters and two multi-char tokens
VOCAB: list[str | None] = [None, None, None, *"abcdefghijklmnopqrstuvwxyz", *"012345", " ", ".", ",", "ab", "the"]
assert len(VOCAB) == VOCAB_SIZE

CONFIG = llm.LlmConfig("llama", vocab_size=VOCAB_SIZE, hidden_size=D_MODEL, intermediate_size=D_FF,
                       num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS, num_key_value_heads=KV_HEADS,
                       head_dim=HEAD_DIM, max_position_embeddings=MAX_LENGTH, tie_word_embeddings=True)
_FNS = llm.serving_functions(llm.CausalLM(CONFIG, rngs=nn.Rngs(0)), MAX_LENGTH)
# the weight matrices of every layer (what the quantized tests quantize), by path under layers/<i>/
MATRICES = ("attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down")


def init_params(seed: int = 0, scale: float = 1.0) -> dict:
    """Random float32 weights as nested dicts (``layers/0/attn/q/kernel``): matrices
    ``N(0, scale^2 / fan_in)``, the embedding ``N(0, scale^2)``, norm scales ``1 + N(0, 0.01)``;
    ``scale`` > 1 makes the logits peakier (greedy margins larger)."""
    rng = np.random.default_rng(seed)
    flat = {}
    for path, x in flatten_with_paths(_FNS.params).items():
        shape = tuple(x.shape)
        if path.endswith("/scale"):
            flat[path] = 1 + 0.1 * rng.normal(size=shape)
        elif path == "embed/embedding":
            flat[path] = rng.normal(size=shape) * scale
        else:  # [in..., out] kernels; o is [heads, head_dim, hidden]
            fan_in = int(np.prod(shape[:-1])) if path.endswith("attn/o/kernel") else shape[0]
            flat[path] = rng.normal(size=shape) * scale / np.sqrt(fan_in)
    out: dict = {}
    for path, x in flat.items():
        node = out
        *heads, last = [int(k) if k.isdigit() else k for k in path.split("/")]
        for k in heads:
            node = node.setdefault(k, {})
        node[last] = x.astype(np.float32)
    return out


def quantized_params(params: dict, kind: str, layout: QuantLayout | None = None) -> dict:
    """``params`` with every matrix of :data:`MATRICES` a ``QArray`` of ``kind`` (int4 packed),
    one scale per output channel (per head for ``attn/q|k|v``) unless ``layout`` says otherwise."""
    out = {**params, "layers": {i: {k: dict(v) for k, v in layer.items()} for i, layer in params["layers"].items()}}
    for layer in out["layers"].values():
        for m in MATRICES:
            group, name = m.split("/")
            kernel = layer[group][name]["kernel"]
            axis = 1 if m in ("attn/q", "attn/k", "attn/v") else kernel.ndim - 1  # heads / output channels
            q = quantize(kernel, kind, layout or QuantLayout.per_channel(axis))
            layer[group][name] = {"kernel": q.pack() if kind == "int4" else q}
    return out


def cache_specs(max_length: int = MAX_LENGTH) -> dict[str, ArraySpec]:
    """Per-row specs of the cache entries ``k0, v0, k1, v1``: ``(max_length, KV_HEADS, HEAD_DIM)``."""
    return {f"{kv}{i}": ArraySpec((max_length, KV_HEADS, HEAD_DIM), "float32") for i in range(N_LAYERS) for kv in "kv"}


def prefill(params, tokens, lengths):
    """tokens int32 (b, p) right-padded, lengths int32 (b,) -> (logits (b, V) at lengths-1, cache)."""
    return _FNS.prefill(params, tokens, lengths)


def decode(params, tokens, positions, cache):
    """tokens/positions int32 (b,) -> (logits (b, V) for positions+1, updated cache)."""
    return _FNS.decode(params, tokens, positions, cache)


BLOCK_SIZE = 4  # tokens per KV block of the paged layout in the tests


def paged(params, tokens, positions, lengths, block_tables, pool):
    """The paged step (``cairn.llm.serving_functions``' ``paged``): a chunk of ``lengths`` tokens
    per row at ``positions ..`` over a pool ``{name: (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)}``."""
    return _FNS.paged(params, tokens, positions, lengths, block_tables, pool)


def reference_logits(params, tokens) -> np.ndarray:
    """The model's full causal forward pass (no cache): tokens (n,) -> logits (n, V) float64."""
    tokens = np.asarray(tokens, np.int32)
    n = len(tokens)
    # padded to one length and jitted once: a causal model's logits at i see tokens <= i only
    padded = np.zeros((1, MAX_LENGTH), np.int32)
    padded[0, :n] = tokens
    return np.asarray(_jit_forward()(params, padded), np.float64)[0, :n]


@functools.cache
def _jit_forward():
    import jax

    return jax.jit(_FNS.forward)


CHAT_TEMPLATE = ("{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}<eos>{% endfor %}"
                 "{% if add_generation_prompt %}<bos>assistant: {% endif %}")


def char_tokenizer(folder: pathlib.Path) -> pathlib.Path:
    """A Hugging Face tokenizer folder over the model's 40 ids, written under ``folder/tok``:
    specials 0..2 (``<pad>``, ``<bos>``, ``<eos>``), then its characters and the merge "ab",
    with :data:`CHAT_TEMPLATE`."""
    pieces = ["<pad>", "<bos>", "<eos>", *VOCAB[3:]]
    vocab = {p: i for i, p in enumerate(pieces)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [("a", "b")]))
    backend.decoder = tokenizers.decoders.Fuse()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in pieces[:3]])
    tok = Tokenizer(backend, {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}, chat_template=CHAT_TEMPLATE)
    tok.save_pretrained(folder / "tok")
    return folder / "tok"
