"""cairn.serving: StableHLO export of JAX functions, hermetic load, and an inference server.

``export(fn, params, input_specs, path)`` writes a model directory (manifest with
sha256 of every file, one serialized StableHLO per signature taking the weights as
arguments, weights in TensorStore zarr3); ``load(path)`` reads it back with nothing but
JAX, TensorStore and ``cairn.core_array``. Loaded models and :class:`PythonModel`
satisfy :class:`ServableModel`, the protocol the server runs.

Generation: ``export_generator(prefill, decode, params, path, ...)`` exports a language
model's prefill and decode-step functions over a KV cache; :class:`GenerationEngine`
runs any :class:`GenerativeModel` (loaded or :class:`PythonGenerator`) with continuous
batching over a fixed number of cache slots. :class:`Tokenizer` reads a Hugging Face
tokenizer folder (``tokenizer.json`` through the ``tokenizers`` library, chat templates
rendered with jinja2 as transformers does).
"""

from cairn.serving._batcher import BatchingConfig, QueueFull, Unavailable
from cairn.serving._chat_template import ChatTemplateError
from cairn.serving._export import Signature, export
from cairn.serving._generate import (
    GenerationConfig,
    GenerationEngine,
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
)
from cairn.serving._genexport import (
    GenerativeModel,
    PythonGenerator,
    detokenize,
    export_generator,
    tokenize,
)
from cairn.serving._hashing import ModelFormatError, ModelIntegrityError
from cairn.serving._http import HttpLimits
from cairn.serving._load import (
    LoadedGenerator,
    LoadedModel,
    LoadedSignature,
    enable_compilation_cache,
    load,
    load_generator,
)
from cairn.serving._model import PythonModel, ServableModel
from cairn.serving._paged import OutOfBlocks, PagedCache, PrefixCacheStats, block_hash
from cairn.serving._paged_engine import PagedGenerationEngine
from cairn.serving._repository import ModelRepository, VersionPolicy
from cairn.serving._sampling import SamplingParams
from cairn.serving._server import Server, serve
from cairn.serving._tokenizer import IncrementalDecoder, Tokenizer

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "ServableModel",
    "PythonModel",
    "export",
    "Signature",
    "load",
    "LoadedModel",
    "LoadedSignature",
    "enable_compilation_cache",
    "ModelFormatError",
    "ModelIntegrityError",
    "serve",
    "Server",
    "ModelRepository",
    "VersionPolicy",
    "BatchingConfig",
    "HttpLimits",
    "QueueFull",
    "Unavailable",
    "GenerativeModel",
    "PythonGenerator",
    "LoadedGenerator",
    "export_generator",
    "load_generator",
    "tokenize",
    "detokenize",
    "SamplingParams",
    "GenerationConfig",
    "GenerationEngine",
    "GenerationRequest",
    "GenerationEvent",
    "GenerationResult",
    "Tokenizer",
    "IncrementalDecoder",
    "ChatTemplateError",
    "PagedCache",
    "PagedGenerationEngine",
    "PrefixCacheStats",
    "OutOfBlocks",
    "block_hash",
]
