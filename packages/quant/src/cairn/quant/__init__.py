"""cairn.quant: quantize any JAX function or model by rules, catching every matmul.

``quantize(fn, provider)`` re-evaluates ``fn``'s traced program and hands each
``dot_general``, ``conv_general_dilated`` and ``ragged_dot`` whose operand flows from a
weight (identified by its core_array path, never guessed from shapes) to the provider's
first applying rule. Names follow Qwix: ``QuantizationRule``, ``QtRule``, ``LoraRule``,
``PtqProvider``, ``QtProvider``, ``quantize_params``, ``calibrate``.
"""

from cairn.quant._api import calibrate, quantize, quantize_params
from cairn.quant._awq import AwqRule, awq_quantize_params
from cairn.quant._calibration import bounds, parse_method
from cairn.quant._gptq import GptqRule, gptq_matrix, gptq_quantize_params
from cairn.quant._lora import (
    LoraProvider,
    LoraRule,
    apply_lora_to_model,
    apply_lora_to_params,
    lora_paths,
)
from cairn.quant._model import QuantizedModel, quantize_model
from cairn.quant._numerics import fake_quant, quantize_array
from cairn.quant._prequantized import process_prequantized_params
from cairn.quant._providers import PtqProvider, QtProvider, QuantizationProvider, input_scale_path
from cairn.quant._qtypes import QTYPES, QTypeInfo, qtype_info
from cairn.quant._rules import QtRule, QuantizationRule
from cairn.quant._smooth_quant import SmoothQuantRule, smooth_quant_params

__version__ = "0.1.0"

__all__ = [
    "quantize",
    "quantize_params",
    "calibrate",
    "process_prequantized_params",
    "quantize_model",
    "QuantizedModel",
    "QuantizationRule",
    "QtRule",
    "LoraRule",
    "GptqRule",
    "gptq_quantize_params",
    "gptq_matrix",
    "AwqRule",
    "awq_quantize_params",
    "SmoothQuantRule",
    "smooth_quant_params",
    "QuantizationProvider",
    "input_scale_path",
    "PtqProvider",
    "QtProvider",
    "LoraProvider",
    "apply_lora_to_model",
    "apply_lora_to_params",
    "lora_paths",
    "QTYPES",
    "QTypeInfo",
    "qtype_info",
    "quantize_array",
    "fake_quant",
    "bounds",
    "parse_method",
]
