"""A tiny decoder-only language model for the generation tests, written to the contract of
``cairn.serving`` generation (pure ``prefill``/``decode`` over a flat KV-cache dict).

Two layers of causal self-attention with grouped-query attention (4 query heads over 2
key/value heads), learned positions, an RMS norm, a tanh-GELU MLP and a head tied to the
embedding; vocabulary 40, width 32, ``MAX_LENGTH`` 64. ``reference_logits`` is an
independent float64 NumPy full forward (no cache) the cached functions are checked against.
Weights may be ``QArray`` leaves (dequantized inside).
"""

from __future__ import annotations

import math
import pathlib

import numpy as np
import tokenizers

from cairn.core_array import ArraySpec, QArray
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


def init_params(seed: int = 0, scale: float = 1.0) -> dict:
    """Random float32 weights; ``scale`` > 1 makes the logits peakier (greedy margins larger)."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.normal(size=shape) * scale / math.sqrt(shape[0])).astype(np.float32)

    layers = [
        {
            "wq": w(D_MODEL, N_HEADS * HEAD_DIM), "wk": w(D_MODEL, KV_HEADS * HEAD_DIM),
            "wv": w(D_MODEL, KV_HEADS * HEAD_DIM), "wo": w(N_HEADS * HEAD_DIM, D_MODEL),
            "w1": w(D_MODEL, D_FF), "w2": w(D_FF, D_MODEL),
            "n1": (1 + 0.1 * rng.normal(size=D_MODEL)).astype(np.float32),
            "n2": (1 + 0.1 * rng.normal(size=D_MODEL)).astype(np.float32),
        }
        for _ in range(N_LAYERS)
    ]
    return {
        "emb": (rng.normal(size=(VOCAB_SIZE, D_MODEL)) * scale).astype(np.float32),
        "pos": (rng.normal(size=(MAX_LENGTH, D_MODEL)) * 0.5).astype(np.float32),
        "layers": layers,
        "nf": np.ones(D_MODEL, np.float32),
    }


def cache_specs(max_length: int = MAX_LENGTH) -> dict[str, ArraySpec]:
    """Per-row specs of the cache entries ``k0, v0, k1, v1``: ``(max_length, KV_HEADS, HEAD_DIM)``."""
    return {f"{kv}{i}": ArraySpec((max_length, KV_HEADS, HEAD_DIM), "float32") for i in range(N_LAYERS) for kv in "kv"}


# --- the JAX model ---


def _w(x):
    return x.dequantize() if isinstance(x, QArray) else x


def _rms(x, g):
    import jax.numpy as jnp

    return x * (1.0 / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)) * _w(g)


def _gelu(x):
    import jax.numpy as jnp

    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def _attend(q, k, v, mask):
    """q (b, s, H, hd), k/v (b, t, KV, hd), mask (b, s, t) -> (b, s, H*hd)."""
    import jax.numpy as jnp

    b, s = q.shape[0], q.shape[1]
    qg = q.reshape(b, s, KV_HEADS, N_HEADS // KV_HEADS, HEAD_DIM)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k) / math.sqrt(HEAD_DIM)
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    p = jnp.exp(scores - scores.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    out = jnp.einsum("bkgst,btkd->bskgd", p, v)
    return out.reshape(b, s, N_HEADS * HEAD_DIM)


def _block(layer, x, k_all, v_all, mask):
    """One layer given the keys/values to attend to; returns the new residual stream."""
    h = _rms(x, layer["n1"])
    q = (h @ _w(layer["wq"])).reshape(*x.shape[:2], N_HEADS, HEAD_DIM)
    x = x + _attend(q, k_all, v_all, mask) @ _w(layer["wo"])
    return x + _gelu(_rms(x, layer["n2"]) @ _w(layer["w1"])) @ _w(layer["w2"])


def _kv(layer, x):
    h = _rms(x, layer["n1"])
    k = (h @ _w(layer["wk"])).reshape(*x.shape[:2], KV_HEADS, HEAD_DIM)
    v = (h @ _w(layer["wv"])).reshape(*x.shape[:2], KV_HEADS, HEAD_DIM)
    return k, v


def prefill(params, tokens, lengths):
    """tokens int32 (b, p) right-padded, lengths int32 (b,) -> (logits (b, V) at lengths-1, cache)."""
    import jax
    import jax.numpy as jnp

    b, p = tokens.shape
    idx = jax.lax.broadcasted_iota(jnp.int32, (p,), 0)
    x = jnp.take(_w(params["emb"]), tokens, axis=0) + jnp.take(_w(params["pos"]), idx, axis=0)[None]
    row = jax.lax.broadcasted_iota(jnp.int32, (p, p), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (p, p), 1)
    mask = jnp.broadcast_to((col <= row)[None], (b, p, p))
    cache = {}
    for i, layer in enumerate(params["layers"]):
        k, v = _kv(layer, x)
        zeros = jnp.zeros((b, MAX_LENGTH, KV_HEADS, HEAD_DIM), jnp.float32)
        cache[f"k{i}"] = jax.lax.dynamic_update_slice(zeros, k, (0, 0, 0, 0))
        cache[f"v{i}"] = jax.lax.dynamic_update_slice(zeros, v, (0, 0, 0, 0))
        x = _block(layer, x, k, v, mask)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
    logits = _rms(last, params["nf"]) @ _w(params["emb"]).T
    return logits.astype(jnp.float32), cache


def decode(params, tokens, positions, cache):
    """tokens/positions int32 (b,) -> (logits (b, V) for positions+1, updated cache)."""
    import jax
    import jax.numpy as jnp

    x = (jnp.take(_w(params["emb"]), tokens, axis=0) + jnp.take(_w(params["pos"]), positions, axis=0))[:, None]
    b = x.shape[0]
    t = jax.lax.broadcasted_iota(jnp.int32, (b, MAX_LENGTH), 1)
    at = (t == positions[:, None])[:, :, None, None]
    mask = (t <= positions[:, None])[:, None, :]
    new = {}
    for i, layer in enumerate(params["layers"]):
        k, v = _kv(layer, x)
        new[f"k{i}"] = jnp.where(at, k, cache[f"k{i}"])
        new[f"v{i}"] = jnp.where(at, v, cache[f"v{i}"])
        x = _block(layer, x, new[f"k{i}"], new[f"v{i}"], mask)
    logits = _rms(x[:, 0], params["nf"]) @ _w(params["emb"]).T
    return logits.astype(jnp.float32), new


# --- the float64 NumPy reference ---


def _np(x) -> np.ndarray:
    return np.asarray(x.dequantize() if isinstance(x, QArray) else x, np.float64)


def reference_logits(params, tokens) -> np.ndarray:
    """Full causal forward in float64 NumPy: tokens (n,) -> logits (n, V) at every position."""
    tokens = np.asarray(tokens, np.int64)
    n = len(tokens)

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * _np(g)

    x = _np(params["emb"])[tokens] + _np(params["pos"])[:n]
    causal = np.tril(np.ones((n, n), bool))
    for layer in params["layers"]:
        h = rms(x, layer["n1"])
        q = (h @ _np(layer["wq"])).reshape(n, N_HEADS, HEAD_DIM)
        k = (h @ _np(layer["wk"])).reshape(n, KV_HEADS, HEAD_DIM)
        v = (h @ _np(layer["wv"])).reshape(n, KV_HEADS, HEAD_DIM)
        rep = N_HEADS // KV_HEADS
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)  # query head j uses kv head j // rep
        s = np.einsum("shd,thd->hst", q, k) / math.sqrt(HEAD_DIM)
        s = np.where(causal[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hst,thd->shd", p, v).reshape(n, -1) @ _np(layer["wo"])
        f = rms(x, layer["n2"]) @ _np(layer["w1"])
        f = 0.5 * f * (1.0 + np.tanh(0.7978845608028654 * (f + 0.044715 * f**3)))
        x = x + f @ _np(layer["w2"])
    return rms(x, params["nf"]) @ _np(params["emb"]).T


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
