"""cairn.serving: StableHLO export of JAX functions, hermetic load, and an inference server.

``export(fn, params, input_specs, path)`` writes a model directory (manifest with
sha256 of every file, one serialized StableHLO per signature taking the weights as
arguments, weights in TensorStore zarr3); ``load(path)`` reads it back with nothing but
JAX, TensorStore and ``cairn.core_array``. Loaded models and :class:`PythonModel`
satisfy :class:`ServableModel`, the protocol the server runs.
"""

from cairn.serving._batcher import BatchingConfig
from cairn.serving._export import Signature, export
from cairn.serving._hashing import ModelFormatError, ModelIntegrityError
from cairn.serving._http import HttpLimits
from cairn.serving._load import LoadedModel, LoadedSignature, enable_compilation_cache, load
from cairn.serving._model import PythonModel, ServableModel
from cairn.serving._repository import ModelRepository, VersionPolicy
from cairn.serving._server import Server, serve

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
]
