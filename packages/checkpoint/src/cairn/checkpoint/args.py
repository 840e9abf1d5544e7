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
    get_registered_args_cls,
    get_registered_handler_cls,
    register_with_handler,
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
    "get_registered_args_cls",
    "get_registered_handler_cls",
    "register_with_handler",
]
