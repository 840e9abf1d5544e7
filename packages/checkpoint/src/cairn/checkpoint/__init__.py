"""cairn.checkpoint: async, atomic, sharded checkpoints of JAX pytrees on TensorStore.

Orbax's v0 surface is here too (``import cairn.checkpoint as ocp``): ``ocp.args``,
``Checkpointer`` and its handlers, ``CheckpointManager(directory, options=...,
item_names=...)``, ``SaveArgs``/``RestoreArgs``/``ArrayRestoreArgs``, ``PLACEHOLDER``, ``Transform``,
``ocp.utils.to_shape_dtype_struct`` and ``ocp.test_utils.erase_and_create_empty``.
"""

from cairn.checkpoint import (
    args,
    checkpoint_managers,
    checkpoint_utils,
    logging,
    metadata,
    step,
    test_utils,
    type_handlers,
    utils,
)
from cairn.checkpoint._checkpointer import restore, save
from cairn.checkpoint._checkpointers import (
    AsyncCheckpointer,
    Checkpointer,
    PyTreeCheckpointer,
    StandardCheckpointer,
)
from cairn.checkpoint._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointWriteError,
    ChecksumError,
    StepAlreadyExistsError,
    SyncTimeoutError,
    TargetMismatchError,
)
from cairn.checkpoint._goodput import GOODPUT_FILE, GoodputRecorder
from cairn.checkpoint._handlers import (
    ArrayCheckpointHandler,
    AsyncCheckpointHandler,
    CheckpointHandler,
    CompositeCheckpointHandler,
    JsonCheckpointHandler,
    PyTreeCheckpointHandler,
    StandardCheckpointHandler,
)
from cairn.checkpoint._items import CheckpointMetadata
from cairn.checkpoint._leaf_args import (
    PLACEHOLDER,
    ArrayRestoreArgs,
    RestoreArgs,
    SaveArgs,
    Transform,
    apply_transformations,
)
from cairn.checkpoint._manager import (
    AsyncOptions,
    CheckpointManagerOptions,
    FileOptions,
    MultiprocessingOptions,
)
from cairn.checkpoint._orbax_manager import (
    DEFAULT_ITEM_NAME,
    METADATA_ITEM_NAME,
    CheckpointManager,
    RootMetadata,
    StepMetadata,
)
from cairn.checkpoint._preemption import PREEMPTION_EXIT_CODE
from cairn.checkpoint._registry import CheckpointHandlerRegistry, DefaultCheckpointHandlerRegistry
from cairn.checkpoint._restore import LeafMetadata
from cairn.checkpoint._safetensors import load_safetensors, save_safetensors
from cairn.checkpoint._utils import intersect_trees, merge_trees

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ITEM_NAME",
    "METADATA_ITEM_NAME",
    "MultiprocessingOptions",
    "PLACEHOLDER",
    "PREEMPTION_EXIT_CODE",
    "ArrayCheckpointHandler",
    "ArrayRestoreArgs",
    "AsyncOptions",
    "AsyncCheckpointHandler",
    "AsyncCheckpointer",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointHandler",
    "CheckpointManager",
    "CheckpointHandlerRegistry",
    "CheckpointManagerOptions",
    "CheckpointMetadata",
    "CheckpointWriteError",
    "Checkpointer",
    "ChecksumError",
    "CompositeCheckpointHandler",
    "DefaultCheckpointHandlerRegistry",
    "FileOptions",
    "GOODPUT_FILE",
    "GoodputRecorder",
    "JsonCheckpointHandler",
    "LeafMetadata",
    "PyTreeCheckpointHandler",
    "PyTreeCheckpointer",
    "RestoreArgs",
    "RootMetadata",
    "SaveArgs",
    "StandardCheckpointHandler",
    "StandardCheckpointer",
    "StepAlreadyExistsError",
    "StepMetadata",
    "SyncTimeoutError",
    "TargetMismatchError",
    "Transform",
    "apply_transformations",
    "args",
    "intersect_trees",
    "merge_trees",
    "checkpoint_managers",
    "checkpoint_utils",
    "load_safetensors",
    "logging",
    "metadata",
    "restore",
    "save",
    "save_safetensors",
    "step",
    "test_utils",
    "type_handlers",
    "utils",
]
