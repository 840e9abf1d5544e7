"""The family tables: how each Hugging Face ``model_type`` maps onto ``LlmConfig`` and ``CausalLM``.

Data, not code paths. A :class:`Family` lists

- ``fixed``: ``LlmConfig`` fields the architecture sets (Qwen2 always has qkv biases);
- ``keys``: ``LlmConfig`` field -> ``(config.json key, default)`` for fields read from the
  file (defaults are the reference implementation's);
- ``layers``: how layer types default when ``config.json`` has no ``layer_types``;
- ``weights``: one :class:`WeightRule` per tensor: its Hugging Face name, its path in the
  model (``{i}`` is the layer), its Hugging Face shape as products of config fields,
  whether the ``[out, in]`` matrix is transposed to the model's ``[in, out]``, and the
  config flag that makes it exist, and which layers have it (``layers``: every layer, only
  the mixture-of-experts ones, only the dense ones). Head splits need no entry: the model's kernels are
  ``[hidden, heads, head_dim]`` / ``[heads, head_dim, hidden]``, so a transposed matrix is
  reshaped to the model's shape (and back when saving).

Mixture-of-experts checkpoints store one matrix per expert (``...experts.{e}.gate_proj``);
the model holds them stacked, ``[num_experts, in, out]``, the layout ``ragged_dot``
takes. A rule whose Hugging Face name has ``{e}`` is that mechanism: expert ``e``'s
matrix (transposed as the row says) is slice ``[e]`` of the model parameter on load, and
slice ``[e]`` is written back under the expert's name on save.

A ``keys`` entry may name alternatives, ``"num_experts|num_local_experts"``: the first
one present in ``config.json`` is read, and the same one written back (the first when
none was present). transformers writes ``num_local_experts`` for Qwen3-MoE's
``num_experts`` (an attribute alias), the published checkpoints ``num_experts``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from cairn.llm._errors import UnsupportedModelError

__all__ = ["FAMILIES", "Family", "WeightRule", "family_of", "supported_model_types"]


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One tensor: ``hf`` name, model ``path``, ``hf_shape`` (each entry a config field or
    ``a*b`` product), ``transpose`` (``[out, in]`` on disk), ``when`` (an ``LlmConfig``
    boolean field, ``not <field>`` negated; empty: always present), ``layers`` (for a
    per-layer ``{i}`` name: ``"all"``, ``"moe"`` or ``"dense"``, by
    ``LlmConfig.is_moe_layer``). An ``{e}`` in ``hf`` makes one tensor per expert, each
    slice ``[e]`` of the stacked model parameter; ``hf_shape`` is one expert's."""

    hf: str
    path: str
    hf_shape: tuple[str, ...]
    transpose: bool = False
    when: str = ""
    layers: str = "all"


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture: see the module docstring for the fields."""

    model_types: tuple[str, ...]
    architecture: str
    fixed: Mapping[str, Any]
    keys: Mapping[str, tuple[str, Any]]
    layers: str  # "all_full" | "mistral" | "qwen2" | "every_layer" | "alternate" | "every_nth"
    weights: tuple[WeightRule, ...]
    rope_theta: float = 10000.0


W = WeightRule
_L = "model.layers.{i}."
_P = "layers/{i}/"

# --- tensor tables ---

_OUTER = (
    W("model.embed_tokens.weight", "embed/embedding", ("vocab_size", "hidden_size")),
    W("model.norm.weight", "norm/scale", ("hidden_size",)),
    W("lm_head.weight", "lm_head/kernel", ("vocab_size", "hidden_size"), True, "not tie_word_embeddings"),
)
_ATTENTION = (
    W(_L + "self_attn.q_proj.weight", _P + "attn/q/kernel", ("num_attention_heads*head_dim", "hidden_size"), True),
    W(_L + "self_attn.k_proj.weight", _P + "attn/k/kernel", ("num_key_value_heads*head_dim", "hidden_size"), True),
    W(_L + "self_attn.v_proj.weight", _P + "attn/v/kernel", ("num_key_value_heads*head_dim", "hidden_size"), True),
    W(_L + "self_attn.o_proj.weight", _P + "attn/o/kernel", ("hidden_size", "num_attention_heads*head_dim"), True),
    W(_L + "self_attn.q_proj.bias", _P + "attn/q/bias", ("num_attention_heads*head_dim",), when="qkv_bias"),
    W(_L + "self_attn.k_proj.bias", _P + "attn/k/bias", ("num_key_value_heads*head_dim",), when="qkv_bias"),
    W(_L + "self_attn.v_proj.bias", _P + "attn/v/bias", ("num_key_value_heads*head_dim",), when="qkv_bias"),
    W(_L + "self_attn.o_proj.bias", _P + "attn/o/bias", ("hidden_size",), when="o_bias"),
    W(_L + "self_attn.q_norm.weight", _P + "attn/q_norm/scale", ("head_dim",), when="qk_norm"),
    W(_L + "self_attn.k_norm.weight", _P + "attn/k_norm/scale", ("head_dim",), when="qk_norm"),
)
# dense MLP: every layer of a dense family, the non-MoE layers of a MoE family
_MLP = (
    W(_L + "mlp.gate_proj.weight", _P + "mlp/gate/kernel", ("intermediate_size", "hidden_size"), True, layers="dense"),
    W(_L + "mlp.up_proj.weight", _P + "mlp/up/kernel", ("intermediate_size", "hidden_size"), True, layers="dense"),
    W(_L + "mlp.down_proj.weight", _P + "mlp/down/kernel", ("hidden_size", "intermediate_size"), True, layers="dense"),
    W(_L + "mlp.gate_proj.bias", _P + "mlp/gate/bias", ("intermediate_size",), when="mlp_bias", layers="dense"),
    W(_L + "mlp.up_proj.bias", _P + "mlp/up/bias", ("intermediate_size",), when="mlp_bias", layers="dense"),
    W(_L + "mlp.down_proj.bias", _P + "mlp/down/bias", ("hidden_size",), when="mlp_bias", layers="dense"),
)
# Qwen3-MoE's sparse block: the router (``gate``) and one SwiGLU MLP per expert, stacked
_E = _L + "mlp.experts.{e}."
_QWEN_MOE = (
    W(_L + "mlp.gate.weight", _P + "mlp/router/kernel", ("num_experts", "hidden_size"), True, layers="moe"),
    W(_E + "gate_proj.weight", _P + "mlp/experts/gate", ("moe_intermediate_size", "hidden_size"), True, layers="moe"),
    W(_E + "up_proj.weight", _P + "mlp/experts/up", ("moe_intermediate_size", "hidden_size"), True, layers="moe"),
    W(_E + "down_proj.weight", _P + "mlp/experts/down", ("hidden_size", "moe_intermediate_size"), True, layers="moe"),
)
# Llama's naming: post_attention_layernorm is the norm *before* the MLP
_LLAMA_NORMS = (
    W(_L + "input_layernorm.weight", _P + "input_norm/scale", ("hidden_size",)),
    W(_L + "post_attention_layernorm.weight", _P + "mlp_norm/scale", ("hidden_size",)),
)
# Gemma 2/3: four norms a layer; post_attention_layernorm is on the attention output
_GEMMA_NORMS = (
    W(_L + "input_layernorm.weight", _P + "input_norm/scale", ("hidden_size",)),
    W(_L + "post_attention_layernorm.weight", _P + "post_attn_norm/scale", ("hidden_size",)),
    W(_L + "pre_feedforward_layernorm.weight", _P + "mlp_norm/scale", ("hidden_size",)),
    W(_L + "post_feedforward_layernorm.weight", _P + "post_mlp_norm/scale", ("hidden_size",)),
)
LLAMA_WEIGHTS = _OUTER + _LLAMA_NORMS + _ATTENTION + _MLP
GEMMA_WEIGHTS = _OUTER + _GEMMA_NORMS + _ATTENTION + _MLP
QWEN_MOE_WEIGHTS = LLAMA_WEIGHTS + _QWEN_MOE

# --- config tables ---

_COMMON_KEYS: dict[str, tuple[str, Any]] = {
    "vocab_size": ("vocab_size", None),
    "hidden_size": ("hidden_size", None),
    "intermediate_size": ("intermediate_size", None),
    "num_hidden_layers": ("num_hidden_layers", None),
    "num_attention_heads": ("num_attention_heads", None),
    "rms_norm_eps": ("rms_norm_eps", 1e-6),
    "hidden_act": ("hidden_act", "silu"),
    "tie_word_embeddings": ("tie_word_embeddings", False),
}
_GEMMA_KEYS = {
    **_COMMON_KEYS,
    "hidden_act": ("hidden_activation", "gelu_pytorch_tanh"),
    "tie_word_embeddings": ("tie_word_embeddings", True),
    "qkv_bias": ("attention_bias", False),
    "o_bias": ("attention_bias", False),
    "query_pre_attn_scalar": ("query_pre_attn_scalar", 256),
    "sliding_window": ("sliding_window", 4096),
}
_GEMMA_FIXED = {"norm_offset": 1.0, "sandwich_norms": True, "embed_scale": True}

FAMILIES: tuple[Family, ...] = (
    Family(("llama",), "LlamaForCausalLM", {},
           {**_COMMON_KEYS, "qkv_bias": ("attention_bias", False), "o_bias": ("attention_bias", False),
            "mlp_bias": ("mlp_bias", False), "max_position_embeddings": ("max_position_embeddings", 2048)},
           "all_full", LLAMA_WEIGHTS),
    Family(("mistral",), "MistralForCausalLM", {},
           {**_COMMON_KEYS, "max_position_embeddings": ("max_position_embeddings", 131072),
            "sliding_window": ("sliding_window", 4096)},
           "mistral", LLAMA_WEIGHTS),
    Family(("qwen2",), "Qwen2ForCausalLM", {"qkv_bias": True},
           {**_COMMON_KEYS, "max_position_embeddings": ("max_position_embeddings", 32768),
            "sliding_window": ("sliding_window", None)},
           "qwen2", LLAMA_WEIGHTS),
    Family(("qwen3",), "Qwen3ForCausalLM", {"qk_norm": True},
           {**_COMMON_KEYS, "qkv_bias": ("attention_bias", False), "o_bias": ("attention_bias", False),
            "max_position_embeddings": ("max_position_embeddings", 32768), "sliding_window": ("sliding_window", None)},
           "qwen2", LLAMA_WEIGHTS),
    Family(("qwen3_moe",), "Qwen3MoeForCausalLM", {"qk_norm": True},
           {**_COMMON_KEYS, "qkv_bias": ("attention_bias", False), "o_bias": ("attention_bias", False),
            "max_position_embeddings": ("max_position_embeddings", 32768), "sliding_window": ("sliding_window", 4096),
            "num_experts": ("num_experts|num_local_experts", 128), "num_experts_per_tok": ("num_experts_per_tok", 8),
            "moe_intermediate_size": ("moe_intermediate_size", 768), "norm_topk_prob": ("norm_topk_prob", False),
            "decoder_sparse_step": ("decoder_sparse_step", 1), "mlp_only_layers": ("mlp_only_layers", None)},
           "every_layer", QWEN_MOE_WEIGHTS),
    Family(("gemma2",), "Gemma2ForCausalLM", _GEMMA_FIXED,
           {**_GEMMA_KEYS, "max_position_embeddings": ("max_position_embeddings", 8192),
            "attn_logit_softcapping": ("attn_logit_softcapping", 50.0),
            "final_logit_softcapping": ("final_logit_softcapping", 30.0)},
           "alternate", GEMMA_WEIGHTS),
    Family(("gemma3_text",), "Gemma3ForCausalLM", {**_GEMMA_FIXED, "qk_norm": True},
           {**_GEMMA_KEYS, "max_position_embeddings": ("max_position_embeddings", 131072),
            "attn_logit_softcapping": ("attn_logit_softcapping", None),
            "final_logit_softcapping": ("final_logit_softcapping", None)},
           "every_nth", GEMMA_WEIGHTS, rope_theta=1_000_000.0),
)


def supported_model_types() -> list[str]:
    """Every ``model_type`` a family here reads."""
    return sorted(t for f in FAMILIES for t in f.model_types)


def family_of(model_type: Any) -> Family:
    """The family of ``model_type``; ``UnsupportedModelError`` listing the supported ones."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not supported; supported model types: {supported_model_types()}"
    )
