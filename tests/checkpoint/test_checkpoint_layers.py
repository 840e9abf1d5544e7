"""The Orbax-compatibility layer sits at the edge: it imports the core, never the reverse."""

from __future__ import annotations

import ast
import pathlib

import cairn.checkpoint as cc

SRC = pathlib.Path(cc.__file__).parent
# Orbax's calling conventions (ocp.args, handlers, checkpointers, per-leaf args, the manager's
# args= / checkpointers forms, handler registries) and the public modules that only re-export them
COMPAT = {"_args", "_handlers", "_checkpointers", "_items", "_leaf_args", "_orbax_manager", "_registry", "args"}
EDGE = COMPAT | {"__init__", "utils", "test_utils", "checkpoint_utils", "type_handlers"}


def _imported_modules(path: pathlib.Path) -> set[str]:
    """The cairn.checkpoint submodules that ``path`` imports (at any depth of the file)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "cairn.checkpoint":
                out.update(a.name for a in node.names)
            elif node.module.startswith("cairn.checkpoint."):
                out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[2] for a in node.names if a.name.startswith("cairn.checkpoint."))
    return out


def test_core_modules_import_nothing_from_the_compat_layer():
    core = sorted(p for p in SRC.glob("*.py") if p.stem not in EDGE)
    assert {p.stem for p in core} >= {"_manager", "_checkpointer", "_restore", "_tree", "_json_item"}
    bad = {p.stem: sorted(_imported_modules(p) & COMPAT) for p in core}
    assert not {k: v for k, v in bad.items() if v}, f"core modules importing the Orbax layer: {bad}"


def test_the_public_manager_is_the_compat_subclass_of_the_core_one():
    from cairn.checkpoint import _manager, _orbax_manager

    assert cc.CheckpointManager is _orbax_manager.CheckpointManager
    assert issubclass(cc.CheckpointManager, _manager.CheckpointManager)
    assert cc.CheckpointManagerOptions is _manager.CheckpointManagerOptions
