"""Every public signature in ``packages/*/src`` is fully annotated.

Public here means: a function whose name has no leading underscore, defined at module
level (also inside a module-level ``if``/``try``) or as a method of a class whose name,
and every enclosing class's name, has no leading underscore. The module's own name does
not matter: Cairn's API lives in private ``_topic.py`` modules re-exported by
``__init__.py``. Of the dunder methods, ``__init__`` and ``__call__`` are public (they
are the constructor's and the call's signatures); other dunders and functions nested in
functions are not checked.

For each public function: every parameter (positional-only, ordinary, ``*args``,
keyword-only, ``**kwargs``) except the first parameter of a method (``self``/``cls``;
not skipped for ``@staticmethod``) has an annotation, and so has the return
(``-> None`` included, for ``__init__`` too).

    python tools/typehints.py packages            # every packages/*/src
    python tools/typehints.py packages/nn/src     # one package (any folder or file)
"""

from __future__ import annotations

import ast
import pathlib
import sys

PUBLIC_DUNDERS = {"__init__", "__call__"}


def _is_public_name(name: str) -> bool:
    return not name.startswith("_") or name in PUBLIC_DUNDERS


def _decorator_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Attribute):
            names.add(target.attr)
    return names


def _missing(fn: ast.FunctionDef | ast.AsyncFunctionDef, is_method: bool) -> list[str]:
    """What ``fn`` lacks: parameter names (``*args`` spelled with its star) and ``return``."""
    a = fn.args
    positional = a.posonlyargs + a.args
    if is_method and positional and "staticmethod" not in _decorator_names(fn):
        positional = positional[1:]
    params: list[tuple[str, ast.arg]] = [(p.arg, p) for p in positional]
    if a.vararg:
        params.append((f"*{a.vararg.arg}", a.vararg))
    params += [(p.arg, p) for p in a.kwonlyargs]
    if a.kwarg:
        params.append((f"**{a.kwarg.arg}", a.kwarg))
    missing = [name for name, p in params if p.annotation is None]
    if fn.returns is None:
        missing.append("return")
    return missing


def public_functions(tree: ast.Module) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str, bool]]:
    """``(def node, qualified name, is_method)`` for every public function of a module."""
    found: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str, bool]] = []

    def visit(body: list[ast.stmt], prefix: str, in_class: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _is_public_name(node.name) and (in_class or node.name not in PUBLIC_DUNDERS):
                    found.append((node, prefix + node.name, in_class))
            elif isinstance(node, ast.ClassDef):
                if not node.name.startswith("_"):
                    visit(node.body, f"{prefix}{node.name}.", True)
            elif isinstance(node, ast.If):
                visit(node.body, prefix, in_class)
                visit(node.orelse, prefix, in_class)
            elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
                visit(node.body, prefix, in_class)  # type: ignore[attr-defined]
                for h in node.handlers:  # type: ignore[attr-defined]
                    visit(h.body, prefix, in_class)
                visit(node.orelse, prefix, in_class)  # type: ignore[attr-defined]
                visit(node.finalbody, prefix, in_class)  # type: ignore[attr-defined]

    visit(tree.body, "", False)
    return found


def check_source(text: str, filename: str = "<string>") -> list[str]:
    """One ``file:line: name lacks annotations for a, b, return`` line per unannotated signature."""
    tree = ast.parse(text, filename=filename)
    problems = []
    for fn, name, is_method in public_functions(tree):
        missing = _missing(fn, is_method)
        if missing:
            problems.append(f"{filename}:{fn.lineno}: {name} lacks annotations for {', '.join(missing)}")
    return problems


def source_files(paths: list[str]) -> list[pathlib.Path]:
    """The ``.py`` files to check: ``packages`` means every ``packages/*/src``."""
    files: list[pathlib.Path] = []
    for p in map(pathlib.Path, paths):
        if p.is_file():
            files.append(p)
            continue
        srcs = sorted(d / "src" for d in p.iterdir() if (d / "src").is_dir()) if not (p / "src").is_dir() else [p / "src"]
        roots = srcs or [p]
        for root in roots:
            files += [f for f in sorted(root.rglob("*.py")) if "__pycache__" not in f.parts]
    return files


def main(argv: list[str]) -> int:
    paths = argv[1:] or ["packages"]
    missing = [a for a in paths if not pathlib.Path(a).exists()]
    if missing:
        print(f"type-hint check: no such path {missing}")
        return 2
    problems: list[str] = []
    for py in source_files(paths):
        try:
            problems += check_source(py.read_text(), str(py))
        except SyntaxError as e:
            problems.append(f"{py}:{e.lineno}: cannot parse: {e.msg}")
    for p in problems:
        print(p)
    if problems:
        print(f"type-hint check: {len(problems)} public signature(s) not fully annotated")
        return 1
    print("type-hint check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
