"""cairn.checkpoint: async, atomic, sharded checkpoints of JAX pytrees on TensorStore."""

from cairn.checkpoint._checkpointer import AsyncCheckpointer, metadata, restore, save
from cairn.checkpoint._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriteError,
    ChecksumError,
    TargetMismatchError,
)
from cairn.checkpoint._manager import CheckpointManager, CheckpointManagerOptions
from cairn.checkpoint._restore import LeafMetadata
from cairn.checkpoint._safetensors import load_safetensors, save_safetensors

__version__ = "0.1.0"

__all__ = [
    "AsyncCheckpointer",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointManagerOptions",
    "CheckpointWriteError",
    "ChecksumError",
    "LeafMetadata",
    "TargetMismatchError",
    "load_safetensors",
    "metadata",
    "restore",
    "save",
    "save_safetensors",
]
