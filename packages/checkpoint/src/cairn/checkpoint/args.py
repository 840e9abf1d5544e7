"""``ocp.args``: typed descriptions of what to save and how to restore it (Orbax's names)."""

from cairn.checkpoint._args import (
    ArrayRestore,
    ArraySave,
    CheckpointArgs,
    Composite,
    JsonRestore,
    JsonSave,
    PyTreeRestore,
    PyTreeSave,
    StandardRestore,
    StandardSave,
)

__all__ = [
    "ArrayRestore",
    "ArraySave",
    "CheckpointArgs",
    "Composite",
    "JsonRestore",
    "JsonSave",
    "PyTreeRestore",
    "PyTreeSave",
    "StandardRestore",
    "StandardSave",
]
