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

import cairn.kernels as ck
from cairn import nn

if TYPE_CHECKING:
    import lm_config

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
IMPLEMENTATIONS = ("xla", "kernels")  # plain XLA (cairn.nn / jax.nn ops) or cairn.kernels

# What attention needs to know about a batch's rows: the boolean mask (b, 1, q, k) for plain
# XLA, or cairn.kernels' (query, key) segment ids, where padding (segment 0) never matches.
AttentionMask = jax.Array | tuple[jax.Array, jax.Array]


def _check_impl(what: str, impl: str) -> str:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"{what} implementation must be one of {IMPLEMENTATIONS}, got {impl!r}")
    return impl


def attention_mask(segment_ids: jax.Array, implementation: str = "xla") -> AttentionMask:
    """Causal attention within each packed segment; segment 0 (padding) sees and is seen by nothing.

    Args:
      segment_ids: int ``(b, s)``; 0 marks padding.
      implementation: ``"xla"``: a boolean mask ``(b, 1, s, s)`` for ``nn.dot_product_attention``;
        ``"kernels"``: a ``(query, key)`` pair of segment ids for
        ``cairn.kernels.dot_product_attention(..., is_causal=True)`` (padding becomes -1 in
        the queries and -2 in the keys, so it matches nothing: the same mask, never formed).

    Raises:
      ValueError: an unknown implementation.
    """
    if _check_impl("attention", implementation) == "kernels":
        pad = segment_ids > 0
        return jnp.where(pad, segment_ids, -1), jnp.where(pad, segment_ids, -2)
    s = segment_ids.shape[1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = jnp.tril(jnp.ones((s, s), bool))
    return (same & causal[None] & (segment_ids[:, :, None] > 0))[:, None]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask) -> jax.Array:
    """Grouped-query attention ``(b, s, heads, d)`` through whichever implementation ``mask`` is for."""
    if isinstance(mask, tuple):
        return ck.dot_product_attention(q, k, v, is_causal=True, segment_ids=mask)
    return nn.dot_product_attention(q, k, v, mask=mask)


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

    def __call__(self, x: jax.Array, positions: jax.Array, mask: AttentionMask) -> jax.Array:
        b, s, _ = x.shape
        q = self.q(x).reshape(b, s, self.num_heads, self.head_dim)
        k = self.k(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.v(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        q = nn.apply_rotary_embedding(q, positions, base=self.rope_base)
        k = nn.apply_rotary_embedding(k, positions, base=self.rope_base)
        out = attend(q, k, v, mask)
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

    def __call__(self, x: jax.Array, positions: jax.Array, mask: AttentionMask) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, mask)
        return x + self.mlp(self.mlp_norm(x))


class TransformerLM(nn.Module):
    """``logits = TransformerLM(cfg, vocab_size, rngs=...)(tokens, segment_ids, positions)``.

    ``attention`` and ``loss`` pick the implementation of the attention and of the training
    loss (`loss_and_metrics`): ``"xla"`` (cairn.nn's ops) or ``"kernels"`` (cairn.kernels'
    ``dot_product_attention`` and ``linear_softmax_cross_entropy_loss``). They are static
    attributes, not parameters: the same checkpoint loads under either.
    """

    def __init__(self, cfg: lm_config.Config, vocab_size: int, *, rngs: nn.Rngs,
                 attention: str = "xla", loss: str = "xla") -> None:
        m = cfg.model
        dt, pdt = _DTYPES[m.dtype], _DTYPES[m.param_dtype]
        self.tie_embeddings = m.tie_embeddings
        self.attention_impl = _check_impl("attention", attention)
        self.loss_impl = _check_impl("loss", loss)
        self.embed = nn.Embed(vocab_size, m.d_model, dtype=dt, param_dtype=pdt,
                              embedding_init=nn.with_partitioning(nn.initializers.normal(m.d_model**-0.5), ("vocab", "embed")),
                              rngs=rngs)
        self.blocks = nn.List([Block(cfg, rngs=rngs) for _ in range(m.num_layers)])
        self.final_norm = nn.RMSNorm(m.d_model, param_dtype=pdt, rngs=rngs)
        if not m.tie_embeddings:
            self.head = nn.Linear(m.d_model, vocab_size, use_bias=False, dtype=dt, param_dtype=pdt,
                                  kernel_init=_init(("embed", "vocab")), rngs=rngs)

    def hidden(self, tokens: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """The final-normed hidden states ``(b, s, d_model)``, before the output projection."""
        x = self.embed(tokens)
        mask = attention_mask(segment_ids, self.attention_impl)
        for block in self.blocks:
            x = block(x, positions, mask)
        return self.final_norm(x)

    def output_projection(self) -> jax.Array:
        """The ``(d_model, vocab)`` output matrix: the tied embedding transposed, or the head's kernel."""
        return self.embed.embedding[...].T if self.tie_embeddings else self.head.kernel[...]

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        x = self.hidden(tokens, segment_ids, positions)
        logits = self.embed.attend(x) if self.tie_embeddings else self.head(x)
        return logits.astype(jnp.float32)


def fused_loss(x: jax.Array, targets: jax.Array, weights: jax.Array, projection: jax.Array) -> jax.Array:
    """``sum(nll * weights) / max(sum(weights), 1)`` through ``linear_softmax_cross_entropy_loss``.

    The fused op has no per-token weights, so a token of weight 0 enters with its hidden
    state zeroed: its logits are all 0, its loss exactly ``log(vocab)`` (subtracted again)
    and its gradient 0. Exact for 0/1 weights, which are the only ones the recipe makes.

    Args:
      x: ``(b, s, d)`` hidden states; targets: int ``(b, s)``; weights: 0/1 ``(b, s)``;
      projection: ``(d, vocab)``.
    """
    d, vocab = projection.shape
    w = weights.reshape(-1).astype(jnp.float32)
    xs = x.reshape(-1, d) * w[:, None].astype(x.dtype)
    total = ck.linear_softmax_cross_entropy_loss(xs, targets.reshape(-1), projection.astype(x.dtype))
    masked = w.size - w.sum()
    return (total - masked * jnp.log(jnp.float32(vocab))) / jnp.maximum(w.sum(), 1.0)


def logits_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum(nll * weights) / max(sum(weights), 1)`` from float32 logits ``(b, s, vocab)``."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return (nll * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def logit_metrics(model: TransformerLM, batch: dict) -> tuple[jax.Array, dict]:
    """Weighted next-token cross-entropy from the full logits, token accuracy and per-row exact match."""
    logits = model(batch["inputs"], batch["segment_ids"], batch["positions"])
    loss = logits_loss(logits, batch["targets"], batch["weights"])
    w = batch["weights"]
    denom = jnp.maximum(w.sum(), 1.0)
    right = jnp.argmax(logits, -1) == batch["targets"]
    return loss, {"loss": loss, "token_accuracy": (right * w).sum() / denom,
                  "row_exact": jnp.all(right | (w == 0), axis=-1)}


def loss_and_metrics(model: TransformerLM, batch: dict) -> tuple[jax.Array, dict]:
    """The training loss: weighted next-token cross-entropy, by ``model.loss_impl``.

    ``"xla"``: from the logits, with the token accuracy and per-row exact match
    (`logit_metrics`). ``"kernels"``: the fused loss that never forms the logits
    (`fused_loss`), so the metrics that need them are left to `logit_metrics` (evaluation).
    """
    if model.loss_impl == "xla":
        return logit_metrics(model, batch)
    x = model.hidden(batch["inputs"], batch["segment_ids"], batch["positions"])
    loss = fused_loss(x, batch["targets"], batch["weights"], model.output_projection())
    return loss, {"loss": loss}
