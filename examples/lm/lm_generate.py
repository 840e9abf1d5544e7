"""Generation with the trained transformer: prefill and decode-step functions over a KV cache.

The two functions follow cairn.serving's generative-model contract (``docs/serving.md``):
pure functions of a plain ``params`` dict (the model's parameters; ``QArray`` leaves are
fine, see lm_quant) and a flat cache ``{"k0": (b, max_length, kv_heads, head_dim), "v0":
..., ...}`` batched along axis 0:

- ``prefill(params, tokens, lengths) -> (logits, cache)``: right-padded prompts ``(b, p)``;
  the logits of the next token after each prompt, the cache of the prompt's keys/values;
- ``decode(params, tokens, positions, cache) -> (logits, cache)``: one token per row at
  its own position; writes its key/value there, attends to positions ``<= positions``.

Their math is lm_model.TransformerLM's (RMSNorm, rotary positions, grouped-query causal
attention, SwiGLU, tied or untied head), so decoding token by token through the cache gives
the same logits as the full forward pass (tested). ``greedy_generate`` runs batched greedy
decoding in-process; ``exact_match`` scores held-out addition problems by generating the
answer (not by teacher forcing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import lm_task
import numpy as np

from cairn import nn
from cairn.core_array import ArraySpec, flatten_with_paths

Params = dict[str, Any]
Cache = dict[str, jax.Array]
PrefillFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Cache]]
DecodeFn = Callable[[Any, jax.Array, jax.Array, Cache], tuple[jax.Array, Cache]]


def params_of(model: nn.Module) -> Params:
    """The model's parameters as plain nested dicts (``blocks`` keyed ``"0"``, ``"1"``, ...).

    Paths are the module's (``blocks/0/attn/q/kernel``), so quantization rules written for
    the model select the same weights here.
    """
    out: Params = {}
    for path, x in flatten_with_paths(nn.state(model, nn.Param)).items():
        node: Any = out
        parts = path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = jnp.asarray(np.asarray(jax.device_get(x)))
    return out


@dataclasses.dataclass(frozen=True)
class Dims:
    """The static sizes the functions need (from the config)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_base: float
    max_length: int
    vocab_size: int

    @classmethod
    def from_config(cls, cfg: Any, max_length: int | None = None) -> Dims:
        """Sizes from the config; ``max_length`` (the KV cache's) defaults to the longest
        addition prompt plus ``serve.max_new_tokens``, rounded up to a power of two, at most
        ``data.seq_len`` (the trained context)."""
        m = cfg.model
        if max_length is None:
            longest = 1 + 2 * cfg.data.max_digits + 2 + cfg.serve.max_new_tokens  # BOS a + b = answer
            max_length = min(cfg.data.seq_len, bucket(longest, 1 << 30))
        return cls(m.num_layers, m.num_heads, m.num_kv_heads, m.d_model // m.num_heads, m.rope_base,
                   max_length, lm_task.VOCAB_SIZE)

    def cache_specs(self) -> dict[str, ArraySpec]:
        """Per-row spec of each cache entry (``(max_length, kv_heads, head_dim)`` float32)."""
        shape = (self.max_length, self.num_kv_heads, self.head_dim)
        return {f"{kv}{i}": ArraySpec(shape, "float32") for i in range(self.num_layers) for kv in ("k", "v")}


def _rms(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dims: Dims) -> jax.Array:
    """Grouped-query attention: q ``(b, s, h, d)``, k/v ``(b, t, kvh, d)``, mask ``(b, s, t)``."""
    b, s = q.shape[0], q.shape[1]
    return nn.dot_product_attention(q, k, v, mask=mask[:, None]).reshape(b, s, dims.num_heads * dims.head_dim)


def _mlp(p: Params, x: jax.Array) -> jax.Array:
    h = _rms(x, p["mlp_norm"]["scale"])
    m = p["mlp"]
    return (jax.nn.silu(h @ m["gate"]["kernel"]) * (h @ m["up"]["kernel"])) @ m["down"]["kernel"]


def _qkv(p: Params, x: jax.Array, positions: jax.Array, dims: Dims) -> tuple[jax.Array, jax.Array, jax.Array]:
    b, s = x.shape[0], x.shape[1]
    h = _rms(x, p["attn_norm"]["scale"])
    a = p["attn"]
    q = (h @ a["q"]["kernel"]).reshape(b, s, dims.num_heads, dims.head_dim)
    k = (h @ a["k"]["kernel"]).reshape(b, s, dims.num_kv_heads, dims.head_dim)
    v = (h @ a["v"]["kernel"]).reshape(b, s, dims.num_kv_heads, dims.head_dim)
    q = nn.apply_rotary_embedding(q, positions, base=dims.rope_base)
    k = nn.apply_rotary_embedding(k, positions, base=dims.rope_base)
    return q, k, v


def _head(params: Params, x: jax.Array) -> jax.Array:
    x = _rms(x, params["final_norm"]["scale"])
    if "head" in params:
        return (x @ params["head"]["kernel"]).astype(jnp.float32)
    return jnp.einsum("...f,vf->...v", x, params["embed"]["embedding"]).astype(jnp.float32)


def _causal_forward(params: Params, tokens: jax.Array, dims: Dims) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
    """Hidden states ``(b, s, d)`` of a causal pass over ``tokens (b, s)`` and each layer's (k, v)."""
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    mask = jnp.broadcast_to(jnp.arange(s)[:, None] >= jnp.arange(s)[None, :], (b, s, s))
    x = params["embed"]["embedding"][tokens].astype(jnp.float32)
    kvs = []
    for i in range(dims.num_layers):
        blk = params["blocks"][str(i)]
        q, k, v = _qkv(blk, x, positions, dims)
        x = x + _attend(q, k, v, mask, dims) @ blk["attn"]["o"]["kernel"]
        x = x + _mlp(blk, x)
        kvs.append((k, v))
    return x, kvs


def make_prefill(dims: Dims) -> PrefillFn:
    """``prefill(params, tokens (b, p), lengths (b,)) -> (logits (b, vocab), cache)``; ``p <= max_length``."""

    def prefill(params: Params, tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, Cache]:
        b = tokens.shape[0]
        x, kvs = _causal_forward(params, tokens, dims)
        empty = jnp.zeros((b, dims.max_length, dims.num_kv_heads, dims.head_dim), jnp.float32)
        cache: Cache = {}
        for i, (k, v) in enumerate(kvs):
            for name, t in ((f"k{i}", k), (f"v{i}", v)):
                cache[name] = jax.lax.dynamic_update_slice(empty, t.astype(jnp.float32), (0, 0, 0, 0))
        last = jnp.take_along_axis(x, (lengths.astype(jnp.int32) - 1)[:, None, None], axis=1)[:, 0]
        return _head(params, last), cache

    return prefill


def make_decode(dims: Dims) -> DecodeFn:
    """``decode(params, tokens (b,), positions (b,), cache) -> (logits (b, vocab), cache)``."""

    def decode(params: Params, tokens: jax.Array, positions: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        positions = positions.astype(jnp.int32)
        slots = jnp.arange(dims.max_length, dtype=jnp.int32)
        here = (slots[None, :] == positions[:, None])[:, :, None, None]  # (b, t, 1, 1): this row's position
        mask = (slots[None, :] <= positions[:, None])[:, None, :]  # (b, 1, t)
        x = params["embed"]["embedding"][tokens][:, None].astype(jnp.float32)
        new: Cache = {}
        for i in range(dims.num_layers):
            blk = params["blocks"][str(i)]
            q, k, v = _qkv(blk, x, positions[:, None], dims)
            new[f"k{i}"] = jnp.where(here, k.astype(jnp.float32), cache[f"k{i}"])
            new[f"v{i}"] = jnp.where(here, v.astype(jnp.float32), cache[f"v{i}"])
            x = x + _attend(q, new[f"k{i}"], new[f"v{i}"], mask, dims) @ blk["attn"]["o"]["kernel"]
            x = x + _mlp(blk, x)
        return _head(params, x[:, 0]), new

    return decode


def forward_logits(params: Params, tokens: jax.Array, dims: Dims) -> jax.Array:
    """Causal logits at every position ``(b, s, vocab)`` (the reference decode is checked against)."""
    return _head(params, _causal_forward(params, tokens, dims)[0])


# --- greedy generation in-process ---


def bucket(n: int, cap: int) -> int:
    """The next power of two >= n, at most ``cap`` (the prompt-length buckets the server uses too)."""
    return min(cap, 1 << max(0, (n - 1).bit_length()))


@dataclasses.dataclass
class Generator:
    """Jitted prefill/decode over fixed ``params`` for batched greedy decoding."""

    prefill: PrefillFn
    decode: DecodeFn
    params: Any
    dims: Dims
    batch: int = 16

    def __post_init__(self) -> None:
        self._prefill = jax.jit(self.prefill)
        self._decode = jax.jit(self.decode, donate_argnums=(3,))

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 eos: Sequence[int] = (lm_task.EOS,)) -> list[list[int]]:
        """Greedy continuations (token ids, the stop token excluded) of each prompt."""
        out: list[list[int]] = []
        for start in range(0, len(prompts), self.batch):
            out.extend(self._chunk(prompts[start : start + self.batch], max_new_tokens, set(eos)))
        return out

    def _chunk(self, prompts: Sequence[Sequence[int]], max_new: int, eos: set[int]) -> list[list[int]]:
        n = len(prompts)
        lengths = np.array([len(p) for p in prompts] + [1] * (self.batch - n), np.int32)
        if lengths.max() + max_new > self.dims.max_length:
            raise ValueError(f"prompt of {lengths.max()} tokens + {max_new} new tokens exceeds max_length {self.dims.max_length}")
        width = bucket(int(lengths.max()), self.dims.max_length)
        tokens = np.zeros((self.batch, width), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        logits, cache = self._prefill(self.params, tokens, lengths)
        outs: list[list[int]] = [[] for _ in range(n)]
        done = np.zeros(self.batch, bool)
        done[n:] = True
        positions = lengths.copy()
        for step in range(max_new):
            nxt = np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int32)
            for i in np.flatnonzero(~done):
                if int(nxt[i]) in eos:
                    done[i] = True
                else:
                    outs[i].append(int(nxt[i]))
            if done.all() or step == max_new - 1:
                break
            logits, cache = self._decode(self.params, nxt, positions, cache)
            positions = positions + 1
        return outs


def problem_prompt(text: str) -> tuple[list[int], str]:
    """``"372+59=134"`` -> (BOS + tokens of ``"372+59="``, ``"134"``)."""
    head, answer = text.split("=", 1)
    return [lm_task.BOS, *lm_task.encode(head + "=").tolist()], answer


def answers_text(token_lists: Sequence[Sequence[int]]) -> list[str]:
    return [lm_task.decode(np.asarray(t, np.int32)) for t in token_lists]


def exact_match(gen: Generator, texts: Sequence[str], max_new_tokens: int) -> tuple[float, list[str]]:
    """Held-out exact match by greedy generation: (fraction right, the generated answers)."""
    prompts, expected = zip(*(problem_prompt(t) for t in texts)) if texts else ((), ())
    got = answers_text(gen.generate(list(prompts), max_new_tokens))
    right = sum(g == e for g, e in zip(got, expected))
    return (right / len(texts) if texts else float("nan")), got


def vocabulary() -> list[str | None]:
    """Token id -> text for the byte tokenizer: printable ASCII bytes; None for specials and other bytes."""
    return [chr(i - 3) if 3 + 32 <= i < 3 + 127 else None for i in range(lm_task.VOCAB_SIZE)]
