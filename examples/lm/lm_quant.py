"""Post-training quantization of the trained model with cairn.quant, scored by greedy generation.

Variants (``quant.methods``), all weight-only on the attention and MLP matrices of every
layer (the embedding, shared with the output head, and the norms stay float32):

- ``w8``: int8, one scale per output channel (``quantize_params``);
- ``w4_gptq``: int4 in tiles of ``quant.tile_size`` inputs, GPTQ over calibration batches;
- ``w4_awq``: int4 in tiles, AWQ's activation-aware scaling over the same batches (each
  matrix's per-input-channel scale is held beside it; the model's forward divides it out).

The int4 values are packed two to a byte. A variant is the same ``cairn.llm.CausalLM`` with
its selected weights replaced by ``QArray`` leaves: it generates with ``cairn.llm.generate``
(the layers dequantize them) and is exported with them quantized (lm_serve). The output
projection of the attention reaches its dot through a reshape (heads and head_dim as one
axis), so ``quantize_params`` keeps it float; the other six matrices of every layer are
quantized.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import lm_generate
import lm_task
import numpy as np

from cairn import llm, nn, quant
from cairn.core_array import QArray

# module paths of the quantized matrices: layers/<i>/attn/{q,k,v,o} and layers/<i>/mlp/{gate,up,down}
MATRICES = r"layers/\d+/(attn|mlp)/\w+"


@dataclasses.dataclass
class Variant:
    """One model variant: the model (``QArray`` weights for a quantized one), its size and score."""

    name: str
    model: llm.CausalLM
    param_bytes: int
    quantize_s: float = 0.0
    exact_match: float = float("nan")
    answers: list[str] = dataclasses.field(default_factory=list)


def param_bytes(params: Any) -> int:
    """Bytes of every array of ``params`` (a QArray counts its values, scales and zero points)."""
    return int(sum(np.asarray(x).nbytes if not hasattr(x, "nbytes") else x.nbytes for x in jax.tree.leaves(params)))


def calibration_batches(cfg: Any, num_batches: int, tok: Any = None) -> list[tuple[np.ndarray]]:
    """Rows of packed training-split problems, ``(batch_size, seq_len)`` each: BOS text EOS ...
    (bytes), or with ``tok`` (the run's tokenizer, with post-training) their chat form."""
    d = cfg.data
    texts = lm_task.make_problems(num_batches * d.batch_size * (d.seq_len // 8), d.max_digits, cfg.run.seed, held_out=False)
    if tok is not None and cfg.posttrain.enabled:
        rows = [tok.apply_chat_template(lm_task.chat_messages(t), add_generation_prompt=False, tokenize=True) for t in texts]
    elif tok is not None:
        rows = [tok.encode(t) + [lm_task.EOS] for t in texts]
    else:
        rows = [np.concatenate([[lm_task.BOS], lm_task.encode(t), [lm_task.EOS]]) for t in texts]
    stream = np.concatenate([np.asarray(r, np.int64) for r in rows])
    per = d.batch_size * d.seq_len
    return [(stream[i * per : (i + 1) * per].reshape(d.batch_size, d.seq_len).astype(np.int32),) for i in range(num_batches)]


def _pack(params: Any) -> Any:
    return jax.tree.map(lambda x: x.pack() if isinstance(x, QArray) else x, params, is_leaf=lambda x: isinstance(x, QArray))


def _rule(method: str, tile: int) -> quant.QuantizationRule:
    if method == "w8":
        return quant.QuantizationRule(module_path=MATRICES, weight_qtype="int8")
    if method == "w4_gptq":
        return quant.GptqRule(module_path=MATRICES, weight_qtype="int4", tile_size=tile)
    if method == "w4_awq":
        return quant.AwqRule(module_path=MATRICES, weight_qtype="int4", tile_size=tile)
    raise ValueError(f"unknown quantization method {method!r}; expected w8, w4_gptq or w4_awq")


def _with_params(model: llm.CausalLM, params: Any) -> llm.CausalLM:
    """A copy of ``model`` holding ``params`` (nested dicts as ``serving_functions`` gives them,
    with AWQ's ``kernel_awq_scale`` entries, which the copy's forward applies); anything else
    the model cannot hold raises ``ValueError`` (never dropped)."""
    return llm.with_params(model, params)


def quantize_variant(method: str, model: llm.CausalLM, batches: list[tuple[np.ndarray]], tile: int) -> Variant:
    """The model of ``method`` with ``QArray`` weights (int4 packed); ``model`` is unchanged."""
    t0 = time.perf_counter()
    provider = quant.PtqProvider([_rule(method, tile)])
    fns = llm.serving_functions(model, model.config.max_position_embeddings)
    if method == "w8":
        qparams = quant.quantize_params(fns.params, provider, fns.forward, batches[0][0])
    elif method == "w4_gptq":
        qparams = quant.gptq_quantize_params(fns.params, provider, fns.forward, batches)
    else:
        qparams = quant.awq_quantize_params(fns.params, provider, fns.forward, batches)
    qparams = _pack(qparams)
    return Variant(method, _with_params(model, qparams), param_bytes(qparams), time.perf_counter() - t0)


def float_variant(model: llm.CausalLM) -> Variant:
    return Variant("float", model, param_bytes(nn.state(model, nn.Param)))


def build_variants(cfg: Any, model: llm.CausalLM, tok: Any = None) -> dict[str, Variant]:
    """``{"float": ..., method: ...}`` for every configured method (calibrated on training
    problems, tokenized by ``tok``: the run's tokenizer; default bytes)."""
    out = {"float": float_variant(model)}
    if cfg.quant.enabled and cfg.quant.methods:
        batches = calibration_batches(cfg, cfg.quant.calibration_batches, tok)
        for method in cfg.quant.methods:
            out[method] = quantize_variant(method, model, batches, cfg.quant.tile_size)
    return out


def score(variant: Variant, texts: list[str], max_new_tokens: int, length: int, batch: int, codec: Any = None,
          chat: Any = None) -> Variant:
    """Fill in ``exact_match`` and ``answers`` by greedy generation (``cairn.llm.generate``;
    ``codec`` / ``chat`` as `lm_generate.exact_match` takes them)."""
    variant.exact_match, variant.answers = lm_generate.exact_match(variant.model, texts, max_new_tokens, length, batch,
                                                                   codec=codec, chat=chat)
    return variant
