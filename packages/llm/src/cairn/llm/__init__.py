"""cairn.llm: open-weight model families on the Cairn libraries, Hugging Face checkpoints in and out.

The application layer: it composes cairn.nn (modules), cairn.kernels (attention,
mixture-of-experts matmuls), cairn.quant (LoRA), cairn.serving (the Hugging Face
``Tokenizer``, export for serving) and cairn.core_array (sharding rules); no Cairn library
imports it.
"""

from cairn.llm._cache import KVCache
from cairn.llm._config import LlmConfig
from cairn.llm._dpo import DPOConfig, DPOTrainer, preference_dataset
from cairn.llm._errors import CheckpointError, UnsupportedModelError
from cairn.llm._families import supported_model_types
from cairn.llm._generate import GenerationResult, generate
from cairn.llm._grpo import GRPOConfig, GRPOTrainer
from cairn.llm._hf_config import config_from_hf, config_to_hf
from cairn.llm._hf_io import from_pretrained, save_pretrained
from cairn.llm._lora import (
    LoraAdapters,
    apply_lora,
    load_lora,
    lora_adapters,
    lora_target_modules,
    merge_lora,
    save_lora,
)
from cairn.llm._model import CausalLM
from cairn.llm._moe import load_balancing_loss
from cairn.llm._projection import with_params
from cairn.llm._serving import ServingFunctions, as_generator, export_for_serving, serving_functions
from cairn.llm._sft import SFTConfig, SFTTrainer
from cairn.llm._sft_data import sft_dataset, sft_example
from cairn.llm._trainer import LoraSettings, plot_metrics, read_metrics

# the tokenizer lives in cairn.serving (the server needs it and may not import cairn.llm); the same class
from cairn.serving import ChatTemplateError, IncrementalDecoder, Tokenizer

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "CausalLM",
    "ChatTemplateError",
    "GenerationResult",
    "CheckpointError",
    "KVCache",
    "IncrementalDecoder",
    "LlmConfig",
    "LoraSettings",
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "SFTConfig",
    "SFTTrainer",
    "LoraAdapters",
    "Tokenizer",
    "UnsupportedModelError",
    "ServingFunctions",
    "apply_lora",
    "as_generator",
    "config_from_hf",
    "config_to_hf",
    "export_for_serving",
    "from_pretrained",
    "generate",
    "load_balancing_loss",
    "load_lora",
    "lora_adapters",
    "lora_target_modules",
    "merge_lora",
    "save_lora",
    "save_pretrained",
    "serving_functions",
    "sft_dataset",
    "preference_dataset",
    "sft_example",
    "with_params",
    "plot_metrics",
    "read_metrics",
    "supported_model_types",
]
