"""A small decoder-only LM with a KV cache, for the generation benchmark (benchmarks/serving.py).

A Llama-shaped ``cairn.llm.CausalLM`` with random weights (the benchmark controls output
lengths with ``ignore_eos``, so what the model says does not matter, only what it costs):
``layers`` blocks of grouped-query causal self-attention (``heads`` query heads sharing
``kv_heads`` K/V heads), rotary positions, a SwiGLU MLP, RMSNorm, tied output embedding;
float32. Its prefill and decode are ``cairn.llm.serving_functions``: the model's own
modules over a flat cache, the generation contract of cairn.serving's
``export_generator``:

* ``prefill(params, tokens (b, p) int32, lengths (b,) int32) -> (logits (b, vocab), cache)``:
  logits at position ``lengths - 1``; the cache holds every layer's K and V
  (``k{i}``/``v{i}``, each ``(b, max_length, kv_heads, head_dim)``);
* ``decode(params, tokens (b,), positions (b,), cache) -> (logits (b, vocab), cache)``:
  writes the token's K/V at ``positions`` and attends to cache positions ``<= positions``.
  Rows are independent.

``python benchmarks/_serving_generate_model.py`` checks decode against prefill (the
logits of a prompt's last token through the cache equal prefill's over the whole prompt)
and prints the jitted step times at a few batch sizes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab_size: int = 512
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    mlp: int = 1024
    max_length: int = 256

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def model(cfg: LMConfig, seed: int = 0) -> Any:
    """The ``cairn.llm.CausalLM`` of ``cfg``, randomly initialised."""
    from cairn import llm, nn

    c = llm.LlmConfig("llama", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp,
                      num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                      head_dim=cfg.head_dim, max_position_embeddings=cfg.max_length, tie_word_embeddings=True)
    return llm.CausalLM(c, rngs=nn.Rngs(seed))


def cache_shapes(cfg: LMConfig) -> dict[str, tuple[int, ...]]:
    """Per-row shape of every cache entry (``k{i}``, ``v{i}``)."""
    row = (cfg.max_length, cfg.kv_heads, cfg.head_dim)
    return {f"{kv}{i}": row for i in range(cfg.layers) for kv in ("k", "v")}


def build(cfg: LMConfig = LMConfig(), seed: int = 0) -> tuple[Callable, Callable, dict[str, Any]]:
    """``(prefill, decode, params)`` for ``cfg``."""
    from cairn import llm

    fns = llm.serving_functions(model(cfg, seed), cfg.max_length)
    return fns.prefill, fns.decode, fns.params


def step_times(cfg: LMConfig, batches: tuple[int, ...] = (1, 16, 64), repeat: int = 20) -> dict[int, float]:
    """Median seconds of one jitted decode step (cache donated) at each batch size."""
    import time

    import jax
    import jax.numpy as jnp

    _, decode, params = build(cfg)
    step = jax.jit(functools.partial(decode, jax.device_put(params)), donate_argnums=(2,))
    out = {}
    for b in batches:
        cache = {n: jnp.zeros((b, *s), jnp.float32) for n, s in cache_shapes(cfg).items()}
        tok, pos = jnp.zeros(b, jnp.int32), jnp.full(b, cfg.max_length // 2, jnp.int32)
        logits, cache = step(tok, pos, cache)
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            logits, cache = step(tok, pos, cache)
            np.asarray(logits)
            times.append(time.perf_counter() - t)
        out[b] = float(np.median(times))
    return out


def _check(cfg: LMConfig) -> None:
    import jax
    import jax.numpy as jnp

    prefill, decode, params = build(cfg)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (3, 12)).astype(np.int32)
    lengths = np.array([12, 5, 9], np.int32)
    want, _ = jax.jit(prefill)(params, tokens, lengths)
    # prefill all but the last prompt token, then decode it through the cache
    _, cache = jax.jit(prefill)(params, tokens[:, :11], lengths - 1)
    got, _ = jax.jit(decode)(params, jnp.asarray(tokens[np.arange(3), lengths - 1]), jnp.asarray(lengths - 1), cache)
    err = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    print(f"decode vs prefill max |diff| {err:.2e}; logits std {float(np.asarray(want).std()):.2f}")
    assert err < 1e-3, err


if __name__ == "__main__":
    c = LMConfig()
    _check(c)
    t = step_times(c)
    print({b: f"{s * 1e3:.2f} ms" for b, s in t.items()}, f"ideal batching gain at 64: {64 * t[1] / t[64]:.1f}x")
