"""The dependency-direction contract: a Cairn package imports only cairn.core_array and itself.

Checks every ``packages/<name>/src/cairn/<name>/**.py`` and every
``packages/<name>/pyproject.toml`` dependency list. Exit status 1 with one line per
violation, naming file and line. Imports are found at any depth (inside functions,
``try`` blocks, ``if TYPE_CHECKING``) in every spelling:

- ``import cairn.x``, ``import cairn.x.sub as y``, ``from cairn.x import y``;
- ``from cairn import x`` (``x`` is a subpackage of the namespace);
- relative imports resolved against the file's own module name
  (``from .. import x`` or ``from ..x import y`` inside ``cairn/<name>/``);
- ``importlib.import_module("cairn.x")``, ``import_module(".x", "cairn")`` and
  ``__import__("cairn.x")`` / ``__import__("cairn", fromlist=["x"])`` with literal names.

A name built at run time cannot be seen here; ``nox -s tests_package`` covers that case
by running each package's tests with no sibling installed.

    python tools/depcheck.py packages
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib

ALLOWED_SHARED = "core_array"


def _const_str(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _const_strs(node: ast.AST | None) -> list[str]:
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [s for s in (_const_str(e) for e in node.elts) if s is not None]
    s = _const_str(node)
    return [s] if s is not None else []


def _resolve_relative(module_parts: list[str], is_package: bool, level: int, name: str | None) -> str | None:
    """The absolute module a relative import names, or ``None`` if it climbs past the top."""
    package = module_parts if is_package else module_parts[:-1]
    if level - 1 > len(package) - 1:
        return None
    base = package[: len(package) - (level - 1)]
    return ".".join(base + (name.split(".") if name else []))


def _modules_named(node: ast.AST, module_parts: list[str], is_package: bool) -> list[str] | None:
    """Fully qualified modules an AST node imports (``[]`` if none, ``None`` if unresolvable)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            module = _resolve_relative(module_parts, is_package, node.level, node.module)
            if module is None:
                return None
        else:
            module = node.module or ""
        # ``from pkg import name``: name may be a submodule, so count it as pkg.name too
        return [module] + [f"{module}.{a.name}" for a in node.names if a.name != "*"]
    if isinstance(node, ast.Call):
        func = getattr(node.func, "attr", getattr(node.func, "id", None))
        kwargs = {k.arg: k.value for k in node.keywords if k.arg}
        if func == "import_module" and node.args:
            name = _const_str(node.args[0])
            if name is None:
                return []
            if name.startswith("."):
                anchor = _const_str(node.args[1] if len(node.args) > 1 else kwargs.get("package"))
                if anchor is None:
                    return []
                level = len(name) - len(name.lstrip("."))
                return [_resolve_relative(anchor.split("."), True, level, name[level:] or None) or ""]
            return [name]
        if func == "__import__" and node.args:
            name = _const_str(node.args[0])
            if name is None:
                return []
            fromlist = _const_strs(node.args[3] if len(node.args) > 3 else kwargs.get("fromlist"))
            return [name] + [f"{name}.{f}" for f in fromlist]
    return []


def _imported_cairn_packages(tree: ast.AST, module: str = "cairn._unknown", is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, name)`` for every ``cairn.<name>`` the code in ``tree`` imports.

    ``module`` is the dotted name of the file (``cairn.alpha._x``; for an ``__init__.py``
    the package's name with ``is_package=True``), used to resolve relative imports.
    """
    parts = module.split(".")
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        names = _modules_named(node, parts, is_package)
        if names is None:
            found.append((node.lineno, "<relative import beyond the top-level package>"))
            continue
        seen = set()
        for name in names:
            p = name.split(".")
            if p[0] == "cairn" and len(p) > 1 and p[1] not in seen:
                seen.add(p[1])
                found.append((node.lineno, p[1]))
    return found


def check(packages_dir: str | pathlib.Path) -> list[str]:
    """All violations under ``packages_dir`` as human-readable lines (empty when clean)."""
    root = pathlib.Path(packages_dir)
    violations: list[str] = []
    pkg_dirs = sorted(p for p in root.iterdir() if (p / "pyproject.toml").exists())
    if not pkg_dirs:
        # a contract that checks nothing must not pass
        violations.append(f"{root}: no packages (folders with a pyproject.toml) to check")
    for pkg_dir in pkg_dirs:
        pkg = pkg_dir.name
        src = pkg_dir / "src" / "cairn"
        if (src / "__init__.py").exists():
            violations.append(f"{src / '__init__.py'}: cairn must stay a PEP 420 namespace (no __init__.py)")
        for py in sorted(src.rglob("*.py")):
            rel = py.relative_to(src.parent).with_suffix("").parts
            is_package = rel[-1] == "__init__"
            module = ".".join(rel[:-1] if is_package else rel)
            try:
                tree = ast.parse(py.read_text(), filename=str(py))
            except SyntaxError as e:
                violations.append(f"{py}:{e.lineno}: cannot parse: {e.msg}")
                continue
            for lineno, other in _imported_cairn_packages(tree, module, is_package):
                if other not in (pkg, ALLOWED_SHARED):
                    violations.append(
                        f"{py}:{lineno}: cairn.{pkg} imports sibling cairn.{other}; "
                        f"only cairn.{ALLOWED_SHARED} and cairn.{pkg} are allowed"
                    )
        meta = tomllib.loads((pkg_dir / "pyproject.toml").read_text())
        deps = list(meta.get("project", {}).get("dependencies", []))
        for extra, extra_deps in meta.get("project", {}).get("optional-dependencies", {}).items():
            deps += [f"{d} (extra {extra})" for d in extra_deps]
        for dep in deps:
            m = re.match(r"\s*cairn[-_.]([a-z0-9_.-]+)", dep, re.IGNORECASE)
            if m:
                other = re.split(r"[^a-z0-9_.-]", m.group(1).lower())[0].replace("-", "_").replace(".", "_")
                if other not in (pkg, ALLOWED_SHARED):
                    violations.append(
                        f"{pkg_dir / 'pyproject.toml'}: cairn-{pkg.replace('_', '-')} depends on sibling {dep!r}"
                    )
    return violations


def main(argv: list[str]) -> int:
    root = argv[1] if len(argv) > 1 else "packages"
    if not pathlib.Path(root).is_dir():
        print(f"dependency-direction contract: {root!r} is not a directory")
        return 2
    violations = check(root)
    for v in violations:
        print(v)
    if violations:
        print(f"dependency-direction contract: {len(violations)} violation(s)")
        return 1
    print("dependency-direction contract: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
