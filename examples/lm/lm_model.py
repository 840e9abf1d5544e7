"""A small decoder-only transformer written with cairn.nn.

Token embedding, rotary positions, pre-RMSNorm blocks of grouped-query causal attention
and a gated (SwiGLU) MLP, tied or untied output. Packed rows are supported: attention
stays within a segment (``segment_ids``) and rotary positions restart per segment.

Every parameter carries logical axis names (``with_partitioning``), so the
`mesh.rules` of the config place it on the device mesh: ``vocab`` and ``embed`` for the
embedding, ``embed -> heads/kv_heads`` for the attention projections, ``embed -> mlp``
for the MLP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from cairn import nn

if TYPE_CHECKING:
    import lm_config

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _init(axes: tuple[str, ...], scale: float = 1.0) -> Callable[..., jax.Array]:
    return nn.with_partitioning(nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal"), axes)


class Attention(nn.Module):
    def __init__(self, cfg: lm_config.Config, *, rngs: nn.Rngs) -> None:
        m = cfg.model
        self.num_heads, self.num_kv_heads = m.num_heads, m.num_kv_heads
        self.head_dim = m.d_model // m.num_heads
        self.rope_base = m.rope_base
        dt, pdt = _DTYPES[m.dtype], _DTYPES[m.param_dtype]
        d, hd = m.d_model, self.head_dim
        self.q = nn.Linear(d, m.num_heads * hd, use_bias=False, dtype=dt, param_dtype=pdt,
                           kernel_init=_init(("embed", "heads")), rngs=rngs)
        self.k = nn.Linear(d, m.num_kv_heads * hd, use_bias=False, dtype=dt, param_dtype=pdt,
                           kernel_init=_init(("embed", "kv_heads")), rngs=rngs)
        self.v = nn.Linear(d, m.num_kv_heads * hd, use_bias=False, dtype=dt, param_dtype=pdt,
                           kernel_init=_init(("embed", "kv_heads")), rngs=rngs)
        self.o = nn.Linear(m.num_heads * hd, d, use_bias=False, dtype=dt, param_dtype=pdt,
                           kernel_init=_init(("heads", "embed"), 1.0 / (2 * m.num_layers)), rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        q = self.q(x).reshape(b, s, self.num_heads, self.head_dim)
        k = self.k(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.v(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        q = nn.apply_rotary_embedding(q, positions, base=self.rope_base)
        k = nn.apply_rotary_embedding(k, positions, base=self.rope_base)
        out = nn.dot_product_attention(q, k, v, mask=mask)
        return self.o(out.reshape(b, s, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: lm_config.Config, *, rngs: nn.Rngs) -> None:
        m = cfg.model
        dt, pdt = _DTYPES[m.dtype], _DTYPES[m.param_dtype]
        self.gate = nn.Linear(m.d_model, m.mlp_dim, use_bias=False, dtype=dt, param_dtype=pdt,
                              kernel_init=_init(("embed", "mlp")), rngs=rngs)
        self.up = nn.Linear(m.d_model, m.mlp_dim, use_bias=False, dtype=dt, param_dtype=pdt,
                            kernel_init=_init(("embed", "mlp")), rngs=rngs)
        self.down = nn.Linear(m.mlp_dim, m.d_model, use_bias=False, dtype=dt, param_dtype=pdt,
                              kernel_init=_init(("mlp", "embed"), 1.0 / (2 * m.num_layers)), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: lm_config.Config, *, rngs: nn.Rngs) -> None:
        d = cfg.model.d_model
        pdt = _DTYPES[cfg.model.param_dtype]
        self.attn_norm = nn.RMSNorm(d, param_dtype=pdt, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = nn.RMSNorm(d, param_dtype=pdt, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, mask)
        return x + self.mlp(self.mlp_norm(x))


class TransformerLM(nn.Module):
    """``logits = TransformerLM(cfg, vocab_size, rngs=...)(tokens, segment_ids, positions)``."""

    def __init__(self, cfg: lm_config.Config, vocab_size: int, *, rngs: nn.Rngs) -> None:
        m = cfg.model
        dt, pdt = _DTYPES[m.dtype], _DTYPES[m.param_dtype]
        self.tie_embeddings = m.tie_embeddings
        self.embed = nn.Embed(vocab_size, m.d_model, dtype=dt, param_dtype=pdt,
                              embedding_init=nn.with_partitioning(nn.initializers.normal(m.d_model**-0.5), ("vocab", "embed")),
                              rngs=rngs)
        self.blocks = nn.List([Block(cfg, rngs=rngs) for _ in range(m.num_layers)])
        self.final_norm = nn.RMSNorm(m.d_model, param_dtype=pdt, rngs=rngs)
        if not m.tie_embeddings:
            self.head = nn.Linear(m.d_model, vocab_size, use_bias=False, dtype=dt, param_dtype=pdt,
                                  kernel_init=_init(("embed", "vocab")), rngs=rngs)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        causal = jnp.tril(jnp.ones((tokens.shape[1], tokens.shape[1]), bool))
        mask = (same & causal[None] & (segment_ids[:, :, None] > 0))[:, None]  # (b, 1, q, k)
        for block in self.blocks:
            x = block(x, positions, mask)
        x = self.final_norm(x)
        logits = self.embed.attend(x) if self.tie_embeddings else self.head(x)
        return logits.astype(jnp.float32)


def loss_and_metrics(model: TransformerLM, batch: dict) -> tuple[jax.Array, dict]:
    """Weighted next-token cross-entropy and the per-row exact match on weighted tokens."""
    logits = model(batch["inputs"], batch["segment_ids"], batch["positions"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    w = batch["weights"]
    denom = jnp.maximum(w.sum(), 1.0)
    loss = (nll * w).sum() / denom
    correct = (jnp.argmax(logits, -1) == batch["targets"]) | (w == 0)
    return loss, {"loss": loss, "token_accuracy": ((jnp.argmax(logits, -1) == batch["targets"]) * w).sum() / denom,
                  "row_exact": jnp.all(correct, axis=-1)}
