"""cairn.checkpoint: async, atomic, sharded checkpoints of JAX pytrees on TensorStore."""

from ._checkpointer import AsyncCheckpointer, metadata, restore, save
from ._errors import CheckpointError, ChecksumError, TargetMismatchError
from ._restore import LeafMetadata

__all__ = [
    "AsyncCheckpointer",
    "CheckpointError",
    "ChecksumError",
    "LeafMetadata",
    "TargetMismatchError",
    "metadata",
    "restore",
    "save",
]
