"""A small decoder-only LM with a KV cache, for the generation benchmark (benchmarks/serving.py).

Pure JAX, random weights (the benchmark controls output lengths with ``ignore_eos``, so
what the model says does not matter, only what it costs). Pre-norm transformer: learned
token and position embeddings, ``layers`` blocks of grouped-query causal self-attention
(``heads`` query heads sharing ``kv_heads`` K/V heads, as Llama does) and a GELU MLP,
RMSNorm, tied output embedding; float32.

The two functions follow the generation contract (cairn.serving ``export_generator``):

* ``prefill(params, tokens (b, p) int32, lengths (b,) int32) -> (logits (b, vocab), cache)``:
  logits at position ``lengths - 1``; the cache holds every layer's K and V
  (``k{i}``/``v{i}``, each ``(b, max_length, kv_heads, head_dim)``), rows at positions
  ``>= p`` zero;
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
import math
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


def init_params(cfg: LMConfig, seed: int = 0) -> dict[str, Any]:
    """Random float32 weights (scaled so activations and logits stay O(1))."""
    rng = np.random.default_rng(seed)
    d, hd = cfg.d_model, cfg.head_dim

    def w(*shape: int) -> np.ndarray:
        return (rng.normal(size=shape) / math.sqrt(shape[0])).astype(np.float32)

    params: dict[str, Any] = {
        "embed": (rng.normal(size=(cfg.vocab_size, d)) * 0.5).astype(np.float32),
        "pos": (rng.normal(size=(cfg.max_length, d)) * 0.1).astype(np.float32),
        "norm": np.ones(d, np.float32),
    }
    for i in range(cfg.layers):
        params[f"block{i}"] = {
            "norm1": np.ones(d, np.float32),
            "wq": w(d, cfg.heads * hd),
            "wkv": w(d, 2 * cfg.kv_heads * hd),
            "wo": w(cfg.heads * hd, d),
            "norm2": np.ones(d, np.float32),
            "w1": w(d, cfg.mlp),
            "w2": w(cfg.mlp, d),
        }
    return params


def cache_shapes(cfg: LMConfig) -> dict[str, tuple[int, ...]]:
    """Per-row shape of every cache entry (``k{i}``, ``v{i}``)."""
    row = (cfg.max_length, cfg.kv_heads, cfg.head_dim)
    return {f"{kv}{i}": row for i in range(cfg.layers) for kv in ("k", "v")}


def _rms(x: Any, g: Any) -> Any:
    import jax.numpy as jnp

    return x * jnp.reciprocal(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)) * g


def _qkv(cfg: LMConfig, p: dict, x: Any) -> tuple[Any, Any, Any]:
    """x (..., d) -> q (..., heads, hd), k and v (..., kv_heads, hd)."""
    h = _rms(x, p["norm1"])
    q = (h @ p["wq"]).reshape(*x.shape[:-1], cfg.heads, cfg.head_dim)
    kv = (h @ p["wkv"]).reshape(*x.shape[:-1], 2, cfg.kv_heads, cfg.head_dim)
    return q, kv[..., 0, :, :], kv[..., 1, :, :]


def _mlp(p: dict, x: Any) -> Any:
    import jax

    return x + jax.nn.gelu(_rms(x, p["norm2"]) @ p["w1"]) @ p["w2"]


def _logits(params: dict, x: Any) -> Any:
    return _rms(x, params["norm"]) @ params["embed"].T


def prefill_fn(cfg: LMConfig) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """``prefill(params, tokens, lengths) -> (logits, cache)`` for ``cfg``."""
    import jax
    import jax.numpy as jnp

    group = cfg.heads // cfg.kv_heads

    def prefill(params: dict, tokens: Any, lengths: Any) -> tuple[Any, dict[str, Any]]:
        b, p = tokens.shape
        x = params["embed"][tokens] + params["pos"][:p]
        causal = jnp.tril(jnp.ones((p, p), bool))
        cache = {}
        for i in range(cfg.layers):
            blk = params[f"block{i}"]
            q, k, v = _qkv(cfg, blk, x)  # (b, p, h, hd), (b, p, kvh, hd)
            q = q.reshape(b, p, cfg.kv_heads, group, cfg.head_dim)
            s = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / math.sqrt(cfg.head_dim)
            s = jnp.where(causal, s, -1e30)
            o = jnp.einsum("bkgqs,bskd->bqkgd", jax.nn.softmax(s, axis=-1), v).reshape(b, p, cfg.d_model)
            x = _mlp(blk, x + o @ blk["wo"])
            pad = ((0, 0), (0, cfg.max_length - p), (0, 0), (0, 0))
            cache[f"k{i}"], cache[f"v{i}"] = jnp.pad(k, pad), jnp.pad(v, pad)
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return _logits(params, last), cache

    return prefill


def decode_fn(cfg: LMConfig) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """``decode(params, tokens, positions, cache) -> (logits, cache)`` for ``cfg``."""
    import jax
    import jax.numpy as jnp

    group = cfg.heads // cfg.kv_heads

    def decode(params: dict, tokens: Any, positions: Any, cache: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        b = tokens.shape[0]
        x = params["embed"][tokens] + params["pos"][positions]
        rows = jnp.arange(b)
        seen = jnp.arange(cfg.max_length)[None, :] <= positions[:, None]  # (b, L)
        new = {}
        for i in range(cfg.layers):
            blk = params[f"block{i}"]
            q, k, v = _qkv(cfg, blk, x)  # (b, h, hd), (b, kvh, hd)
            kc = cache[f"k{i}"].at[rows, positions].set(k)
            vc = cache[f"v{i}"].at[rows, positions].set(v)
            q = q.reshape(b, cfg.kv_heads, group, cfg.head_dim)
            s = jnp.einsum("bkgd,bskd->bkgs", q, kc) / math.sqrt(cfg.head_dim)
            s = jnp.where(seen[:, None, None, :], s, -1e30)
            o = jnp.einsum("bkgs,bskd->bkgd", jax.nn.softmax(s, axis=-1), vc).reshape(b, cfg.d_model)
            x = _mlp(blk, x + o @ blk["wo"])
            new[f"k{i}"], new[f"v{i}"] = kc, vc
        return _logits(params, x), new

    return decode


def build(cfg: LMConfig = LMConfig(), seed: int = 0) -> tuple[Callable, Callable, dict[str, Any]]:
    """``(prefill, decode, params)`` for ``cfg``."""
    return prefill_fn(cfg), decode_fn(cfg), init_params(cfg, seed)


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
