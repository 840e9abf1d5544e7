"""The recipe's model: a Llama-shaped ``cairn.llm.CausalLM`` built from the config, and its losses.

The model is cairn.llm's one decoder (token embedding, rotary positions, pre-RMSNorm blocks
of grouped-query causal attention and a SwiGLU MLP, tied or untied output): the same
object trains here, generates in process (``cairn.llm.generate``) and is exported for
serving (``cairn.llm.export_for_serving``). Packed rows keep attention within a segment
(``segment_ids``) and rotary positions restart per segment.

Every parameter carries logical axis names, so the ``mesh.rules`` of the config place it on
the device mesh: ``vocab``/``embed`` for the embedding, ``embed -> heads/kv_heads`` (and
``head_dim``) for the attention projections, ``embed -> mlp`` for the MLP.

Two ops have two implementations, picked per run (``lm_train.choose_kernels``): the
attention (``"xla"``: cairn.kernels' XLA implementation; ``"kernels"``: whatever
cairn.kernels' registry picks for the shapes, e.g. a Pallas kernel on a GPU) and the
training loss (``"xla"``: cross-entropy of the logits; ``"kernels"``: cairn.kernels' fused
linear + softmax cross-entropy, which never forms the logits). :class:`Impl` carries the
choice into the jitted steps as a static argument; the checkpoint is the same under either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import lm_config

import cairn.kernels as ck
from cairn import llm, nn
from cairn.core_array import flatten_with_paths, unflatten

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
IMPLEMENTATIONS = ("xla", "kernels")  # cairn.kernels' XLA implementation, or the registry's choice


def _check_impl(what: str, impl: str) -> str:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"{what} implementation must be one of {IMPLEMENTATIONS}, got {impl!r}")
    return impl


@dataclasses.dataclass(frozen=True)
class Impl:
    """Which implementation runs the attention and the training loss (hashable: a static argument)."""

    attention: str = "xla"
    loss: str = "xla"

    def __post_init__(self) -> None:
        _check_impl("attention", self.attention)
        _check_impl("loss", self.loss)

    def attention_scope(self) -> contextlib.AbstractContextManager:
        """The block the model runs in: cairn.kernels' attention forced to XLA, or left to its registry."""
        if self.attention == "xla":
            return ck.override("xla", op="dot_product_attention")
        return contextlib.nullcontext()


def llm_config(cfg: lm_config.Config) -> llm.LlmConfig:
    """The recipe's ``model`` section as a Llama-shaped :class:`cairn.llm.LlmConfig`; its context
    (``max_position_embeddings``) is the trained row length ``data.seq_len``."""
    m = cfg.model
    return llm.LlmConfig(
        "llama", vocab_size=lm_config.vocab_size(cfg), hidden_size=m.d_model, intermediate_size=m.mlp_dim,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        head_dim=m.d_model // m.num_heads, rms_norm_eps=1e-6, max_position_embeddings=cfg.data.seq_len,
        tie_word_embeddings=m.tie_embeddings, rope=(("rope_theta", float(m.rope_base)), ("rope_type", "default")),
        dtype=m.dtype)


def build(cfg: lm_config.Config, seed: int) -> llm.CausalLM:
    """A freshly initialised model (``model.dtype``: parameters and computation), with the
    recipe's initialisation (`reinitialize`)."""
    model = llm.CausalLM(llm_config(cfg), dtype=_DTYPES[cfg.model.dtype], rngs=nn.Rngs(params=seed))
    reinitialize(model, seed)
    return model


def _fan_in(path: str, shape: tuple[int, ...]) -> int:
    """Inputs summed by a kernel: all axes but the last for ``attn/o`` (``[heads, head_dim, hidden]``),
    else the first (``[hidden, heads, head_dim]``, ``[in, out]``)."""
    return math.prod(shape[:-1]) if path.endswith("attn/o/kernel") else shape[0]


def reinitialize(model: llm.CausalLM, seed: int) -> None:
    """The recipe's initialisation, in place (cairn.llm's default, N(0, 0.02) everywhere, suits
    loading checkpoints rather than training a small model from scratch): every kernel
    truncated-normal with variance ``1 / fan_in``, divided by ``2 * num_layers`` for the
    projections that write into the residual stream (``attn/o``, ``mlp/down``); the embedding
    ``N(0, 1 / hidden)``; norm scales 1 (the scheme of the recipe's earlier hand-written model).
    The default config at 800 steps reached 99.6% held-out exact match with it, 78.2% with
    cairn.llm's default."""
    params = nn.state(model, nn.Param)
    flat = flatten_with_paths(params.to_pure_dict())
    keys = dict(zip(flat, jax.random.split(jax.random.key(seed), len(flat))))
    layers = model.config.num_hidden_layers
    new = {}
    for path, x in flat.items():
        if path.endswith("/scale"):
            new[path] = x
        elif path == "embed/embedding":
            new[path] = jax.random.normal(keys[path], x.shape, x.dtype) * x.shape[1] ** -0.5
        else:
            var = 1.0 / _fan_in(path, x.shape) / (2 * layers if path.endswith(("attn/o/kernel", "mlp/down/kernel")) else 1)
            # a truncated normal on [-2, 2] has standard deviation 0.8796; divide it out
            z = jax.random.truncated_normal(keys[path], -2.0, 2.0, x.shape, x.dtype) / 0.87962566103423978
            new[path] = z * math.sqrt(var)
    params.replace_by_pure_dict(unflatten(new, params.to_pure_dict()))


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """Causal attention within each packed segment, boolean ``(b, 1, s, s)``; segment 0 (padding)
    sees and is seen by nothing (the explicit-mask reference of the packed attention)."""
    s = segment_ids.shape[1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = jnp.tril(jnp.ones((s, s), bool))
    return (same & causal[None] & (segment_ids[:, :, None] > 0))[:, None]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, implementation: str) -> jax.Array:
    """The packed attention the model runs, ``(b, s, heads, d)``: cairn.kernels' causal
    attention with segment ids (padding -1 in the queries, -2 in the keys: it matches
    nothing), under ``implementation``."""
    pad = segment_ids > 0
    seg = (jnp.where(pad, segment_ids, -1), jnp.where(pad, segment_ids, -2))
    with Impl(attention=implementation).attention_scope():
        return ck.dot_product_attention(q, k, v, is_causal=True, segment_ids=seg)


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


def logits(model: llm.CausalLM, batch: dict, impl: Impl = Impl()) -> jax.Array:
    """Float32 logits ``(b, s, vocab)`` of packed rows (``inputs``, ``positions``, ``segment_ids``)."""
    with impl.attention_scope():
        return model(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])


def logit_metrics(model: llm.CausalLM, batch: dict, impl: Impl = Impl()) -> tuple[jax.Array, dict]:
    """Weighted next-token cross-entropy from the full logits, token accuracy and per-row exact match."""
    out = logits(model, batch, impl)
    loss = logits_loss(out, batch["targets"], batch["weights"])
    w = batch["weights"]
    denom = jnp.maximum(w.sum(), 1.0)
    right = jnp.argmax(out, -1) == batch["targets"]
    return loss, {"loss": loss, "token_accuracy": (right * w).sum() / denom,
                  "row_exact": jnp.all(right | (w == 0), axis=-1)}


def loss_and_metrics(model: llm.CausalLM, batch: dict, impl: Impl = Impl()) -> tuple[jax.Array, dict]:
    """The training loss: weighted next-token cross-entropy, by ``impl.loss``.

    ``"xla"``: from the logits, with the token accuracy and per-row exact match
    (`logit_metrics`). ``"kernels"``: the fused loss that never forms the logits
    (`fused_loss` of ``model.hidden_states`` and ``model.output_projection()``), so the
    metrics that need them are left to `logit_metrics` (evaluation).
    """
    if impl.loss == "xla":
        return logit_metrics(model, batch, impl)
    with impl.attention_scope():
        x = model.hidden_states(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    loss = fused_loss(x, batch["targets"], batch["weights"], model.output_projection())
    return loss, {"loss": loss}
