"""cairn.nn's modules import each other one way: no import cycle.

Every ``import`` statement of a module counts as an edge, at the top or inside a
function (a function-local import that dodges a cycle at import time is still a
cycle in the design). Parsed with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import cairn.nn

PKG = "cairn.nn"
ROOT = Path(cairn.nn.__file__).parent


def _module_name(path: Path) -> str:
    return PKG if path.name == "__init__.py" else f"{PKG}.{path.stem}"


def _targets(node: ast.AST, modules: set[str]) -> set[str]:
    """The nn modules an import statement reaches (``from cairn.nn import x`` reaches
    ``cairn.nn.x`` when that is a module, else the package)."""
    out = set()
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
    else:
        return out
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    if isinstance(node, ast.ImportFrom) and any(
        f"{node.module}.{a.name}" in modules for a in node.names
    ):
        out.discard(node.module)  # `from pkg import submodule` does not need pkg's body
    return out


def import_graph() -> dict[str, set[str]]:
    files = sorted(ROOT.glob("*.py"))
    modules = {_module_name(f) for f in files}
    graph: dict[str, set[str]] = {}
    for f in files:
        name = _module_name(f)
        tree = ast.parse(f.read_text(), filename=str(f))
        edges = set()
        for node in ast.walk(tree):
            edges |= _targets(node, modules)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_nn_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle in cairn.nn: " + " -> ".join(cycle)


def test_the_checker_sees_function_local_imports():
    graph = {"a": {"b"}, "b": {"a"}}
    assert find_cycle(graph) == ["a", "b", "a"]
    src = "def f():\n    from cairn.nn._graph import clone\n"
    edges = set()
    for node in ast.walk(ast.parse(src)):
        edges |= _targets(node, {"cairn.nn", "cairn.nn._graph"})
    assert edges == {"cairn.nn._graph"}


def test_core_modules_are_layered():
    """The layering the package is built on (each module imports only lower ones)."""
    graph = import_graph()
    order = [
        "cairn.nn._graph_mode",
        "cairn.nn._sharding_rules",
        "cairn.nn._variables",
        "cairn.nn._data",
        "cairn.nn._filters",
        "cairn.nn._state",
        "cairn.nn._nodes",
        "cairn.nn._tree_root",
        "cairn.nn._graph",
        "cairn.nn._module",
        "cairn.nn._transform_plan",
    ]
    for i, m in enumerate(order):
        assert graph[m] <= set(order[:i]), (m, graph[m] - set(order[:i]))
