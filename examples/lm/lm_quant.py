"""Post-training quantization of the trained model with cairn.quant, scored by greedy generation.

Variants (``quant.methods``), all weight-only on the attention and MLP matrices of every
block (the embedding, shared with the output head, and the norms stay float32):

- ``w8``: int8, one scale per output channel (``quantize_params``);
- ``w4_gptq``: int4 in tiles of ``quant.tile_size`` inputs, GPTQ over calibration batches;
- ``w4_awq``: int4 in tiles, AWQ's activation-aware scaling over the same batches.

The int4 values are packed two to a byte. Prefill and decode of a variant are
``quant.quantize(fn, provider)`` of the float functions, so the quantized weights are
``QArray`` leaves of ``params`` and the dots run on them (the same functions are exported
for serving, lm_serve).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import lm_generate
import lm_task
import numpy as np

from cairn import quant
from cairn.core_array import QArray

# module paths of the quantized matrices: blocks/<i>/attn/{q,k,v,o} and blocks/<i>/mlp/{gate,up,down}
MATRICES = r"blocks/\d+/(attn|mlp)/\w+"


@dataclasses.dataclass
class Variant:
    """One model variant: its functions, parameters, size and score."""

    name: str
    prefill: lm_generate.PrefillFn
    decode: lm_generate.DecodeFn
    params: Any
    param_bytes: int
    quantize_s: float = 0.0
    exact_match: float = float("nan")
    answers: list[str] = dataclasses.field(default_factory=list)


def param_bytes(params: Any) -> int:
    """Bytes of every array of ``params`` (a QArray counts its values, scales and zero points)."""
    return int(sum(np.asarray(x).nbytes if not hasattr(x, "nbytes") else x.nbytes for x in jax.tree.leaves(params)))


def calibration_batches(cfg: Any, num_batches: int) -> list[tuple[np.ndarray]]:
    """Rows of packed training-split problems (BOS text EOS ...), ``(batch_size, seq_len)`` each."""
    d = cfg.data
    texts = lm_task.make_problems(num_batches * d.batch_size * (d.seq_len // 8), d.max_digits, cfg.run.seed, held_out=False)
    stream = np.concatenate([np.concatenate([[lm_task.BOS], lm_task.encode(t), [lm_task.EOS]]) for t in texts])
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


def quantize_variant(method: str, params: Any, dims: lm_generate.Dims, batches: list[tuple[np.ndarray]],
                     tile: int) -> Variant:
    """The quantized prefill/decode of ``method`` and its ``QArray`` params (int4 packed)."""
    t0 = time.perf_counter()
    provider = quant.PtqProvider([_rule(method, tile)])

    def forward(p: Any, tokens: Any) -> Any:
        return lm_generate.forward_logits(p, tokens, dims)

    if method == "w8":
        qparams = quant.quantize_params(params, provider, forward, batches[0][0])
    elif method == "w4_gptq":
        qparams = quant.gptq_quantize_params(params, provider, forward, batches)
    else:
        qparams = quant.awq_quantize_params(params, provider, forward, batches)
    qparams = _pack(qparams)
    # one provider per function: each traces its own program against the same rule
    prefill = quant.quantize(lm_generate.make_prefill(dims), quant.PtqProvider([_rule(method, tile)]))
    decode = quant.quantize(lm_generate.make_decode(dims), quant.PtqProvider([_rule(method, tile)]))
    return Variant(method, prefill, decode, qparams, param_bytes(qparams), time.perf_counter() - t0)


def float_variant(params: Any, dims: lm_generate.Dims) -> Variant:
    return Variant("float", lm_generate.make_prefill(dims), lm_generate.make_decode(dims), params, param_bytes(params))


def build_variants(cfg: Any, params: Any, dims: lm_generate.Dims) -> dict[str, Variant]:
    """``{"float": ..., method: ...}`` for every configured method (calibrated on training problems)."""
    out = {"float": float_variant(params, dims)}
    if cfg.quant.enabled and cfg.quant.methods:
        batches = calibration_batches(cfg, cfg.quant.calibration_batches)
        for method in cfg.quant.methods:
            out[method] = quantize_variant(method, params, dims, batches, cfg.quant.tile_size)
    return out


def score(variant: Variant, dims: lm_generate.Dims, texts: list[str], max_new_tokens: int, batch: int) -> Variant:
    """Fill in ``exact_match`` and ``answers`` by greedy generation through the KV cache."""
    gen = lm_generate.Generator(variant.prefill, variant.decode, variant.params, dims, batch=batch)
    variant.exact_match, variant.answers = lm_generate.exact_match(gen, texts, max_new_tokens)
    return variant
