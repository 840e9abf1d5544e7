"""``LlmConfig``: one frozen description of a decoder, every family's differences as fields.

A Hugging Face ``config.json`` is parsed into it by :func:`cairn.llm.config_from_hf`
(the family tables say which keys mean what); the model reads nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["FULL", "SLIDING", "LlmConfig", "freeze"]

FULL = "full_attention"
SLIDING = "sliding_attention"


def freeze(value: Any) -> Any:
    """A hashable copy of a JSON value: dicts become sorted ``(key, value)`` tuples, lists tuples."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class LlmConfig:
    """The shape and numerics of a decoder-only transformer (hashable: a model's static field).

    Names follow Hugging Face's ``config.json`` where one exists.

    Args:
      model_type: the Hugging Face family (``"llama"``, ``"qwen2"``, ``"gemma2"``...).
      vocab_size: tokens in the vocabulary (rows of the embedding).
      hidden_size: the residual stream's width.
      intermediate_size: the width of the dense (SwiGLU/GeGLU) MLPs.
      num_hidden_layers: decoder layers.
      num_attention_heads: query heads.
      num_key_value_heads: key/value heads (a divisor of ``num_attention_heads``: GQA).
      head_dim: the width of one head.
      rms_norm_eps: the epsilon of every RMSNorm.
      hidden_act: the MLP's gate activation (``"silu"``, ``"gelu_pytorch_tanh"``...).
      max_position_embeddings: the longest sequence the model was trained for.
      tie_word_embeddings: the output projection reuses the embedding (no ``lm_head``).
      rope: the rotary parameters of full-attention layers (``rope_type``, ``rope_theta`` and
        the scaling parameters of that type), frozen ``(key, value)`` tuples.
      local_rope: the same for sliding layers; None means the same as ``rope``.
      qkv_bias: biases on the q, k, v projections (Qwen2; Llama's ``attention_bias``).
      o_bias: a bias on the attention output projection (Llama's ``attention_bias``).
      mlp_bias: biases on the MLP projections.
      qk_norm: RMSNorm over ``head_dim`` on queries and keys before the rotation (Qwen3,
        Gemma 3).
      norm_offset: every RMSNorm multiplies by ``norm_offset + weight`` (Gemma: 1).
      sandwich_norms: extra norms on the attention and MLP outputs before the residual add
        (Gemma 2 and 3).
      embed_scale: multiply embeddings by ``sqrt(hidden_size)`` (Gemma).
      query_pre_attn_scalar: attention scale ``query_pre_attn_scalar ** -0.5`` instead of
        ``head_dim ** -0.5`` (Gemma); None for the latter.
      attn_logit_softcapping: ``cap * tanh(x / cap)`` on the attention logits (Gemma 2);
        None for none.
      final_logit_softcapping: the same on the output logits; None for none.
      sliding_window: a sliding layer attends to the last this many positions, itself
        included (Mistral, Gemma 2 and 3); None without sliding layers.
      layer_types: ``"full_attention"`` or ``"sliding_attention"`` per layer; empty means all
        full.
      num_experts: > 0 makes mixture-of-experts MLPs (Qwen3-MoE): each token's router
        softmax over ``num_experts`` picks its top ``num_experts_per_tok`` experts, weighted
        by their probabilities; 0 for dense MLPs only.
      num_experts_per_tok: experts per token, in ``1..num_experts``.
      moe_intermediate_size: the width of each expert's SwiGLU MLP.
      norm_topk_prob: renormalize the chosen experts' weights to sum to 1.
      decoder_sparse_step: layer ``i`` is a MoE layer when ``(i + 1) % decoder_sparse_step ==
        0`` and ``i`` is not in ``mlp_only_layers`` (:meth:`is_moe_layer`); the others keep a
        dense MLP of width ``intermediate_size``.
      mlp_only_layers: layers that keep a dense MLP.
      dtype: the parameters' dtype name (``"bfloat16"``...).
      hf: the ``config.json`` it came from (JSON text), so saving writes back every key this
        class does not model (token ids, ``architectures``, ...); ``""`` for a hand-built
        config.

    Raises:
      ValueError: a size that is not a positive int, heads that do not divide, layer types
        of the wrong count or kind, sliding layers without a window, or inconsistent experts.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope: tuple = (("rope_theta", 10000.0), ("rope_type", "default"))
    local_rope: tuple | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    dtype: str = "float32"
    hf: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlmConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlmConfig: num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_hidden_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"LlmConfig.layer_types has {len(self.layer_types)} entries for "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in (FULL, SLIDING)})
        if bad:
            raise ValueError(f"LlmConfig.layer_types: unknown {bad}; expected {FULL!r} or {SLIDING!r}")
        if SLIDING in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(
                f"LlmConfig: sliding layers need a positive sliding_window, got {self.sliding_window!r}"
            )
        self._check_experts()
        object.__setattr__(self, "rope", freeze(dict(self.rope)))
        if self.local_rope is not None:
            object.__setattr__(self, "local_rope", freeze(dict(self.local_rope)))

    def _check_experts(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers or ()))
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"LlmConfig.num_experts must be an int >= 0, got {self.num_experts!r}")
        if not self.num_experts:
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"LlmConfig.num_experts_per_tok must be in 1..num_experts={self.num_experts}, "
                f"got {self.num_experts_per_tok!r}"
            )
        if not (isinstance(self.moe_intermediate_size, int) and self.moe_intermediate_size > 0):
            raise ValueError(f"LlmConfig.moe_intermediate_size must be a positive int, got {self.moe_intermediate_size!r}")
        if not (isinstance(self.decoder_sparse_step, int) and self.decoder_sparse_step > 0):
            raise ValueError(f"LlmConfig.decoder_sparse_step must be a positive int, got {self.decoder_sparse_step!r}")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts (else a dense MLP).

        Args:
          layer: a layer index.
        """
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def attention_scale(self) -> float:
        """The factor on ``q . k``: ``query_pre_attn_scalar ** -0.5`` or ``head_dim ** -0.5``."""
        d = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return 1.0 / math.sqrt(d)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: it attends to every earlier position).

        Args:
          layer: a layer index.
        """
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def rope_parameters(self, layer: int) -> dict[str, Any]:
        """The rotary parameters of ``layer`` as a dict (``rope_type``, ``rope_theta``, ...).

        Args:
          layer: a layer index.
        """
        if self.layer_types[layer] == SLIDING and self.local_rope is not None:
            return dict(self.local_rope)
        return dict(self.rope)
