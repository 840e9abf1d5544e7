"""The dependency-direction contract: a Cairn package imports only cairn.core_array and itself.

Checks every ``packages/<name>/src/cairn/<name>/**.py`` (imports at any depth, including
``importlib.import_module("cairn.x")`` with a literal name) and every
``packages/<name>/pyproject.toml`` dependency list. Exit status 1 with one line per
violation, naming file and line.

    python tools/depcheck.py packages
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib

ALLOWED_SHARED = "core_array"


def _imported_cairn_packages(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "cairn":
                names = [f"cairn.{a.name}" for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for name in names:
            parts = name.split(".")
            if parts[0] == "cairn" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def check(packages_dir: str | pathlib.Path) -> list[str]:
    """All violations under ``packages_dir`` as human-readable lines (empty when clean)."""
    root = pathlib.Path(packages_dir)
    violations: list[str] = []
    for pkg_dir in sorted(p for p in root.iterdir() if (p / "pyproject.toml").exists()):
        pkg = pkg_dir.name
        src = pkg_dir / "src" / "cairn"
        if (src / "__init__.py").exists():
            violations.append(f"{src / '__init__.py'}: cairn must stay a PEP 420 namespace (no __init__.py)")
        for py in sorted(src.rglob("*.py")):
            try:
                tree = ast.parse(py.read_text(), filename=str(py))
            except SyntaxError as e:
                violations.append(f"{py}:{e.lineno}: cannot parse: {e.msg}")
                continue
            for lineno, other in _imported_cairn_packages(tree):
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
            m = re.match(r"\s*cairn[-_]([a-z_-]+)", dep)
            if m:
                other = m.group(1).replace("-", "_")
                if other not in (pkg, ALLOWED_SHARED):
                    violations.append(
                        f"{pkg_dir / 'pyproject.toml'}: cairn-{pkg.replace('_', '-')} depends on sibling {dep!r}"
                    )
    return violations


def main(argv: list[str]) -> int:
    root = argv[1] if len(argv) > 1 else "packages"
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
