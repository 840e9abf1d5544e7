"""The dependency-direction contract: a Cairn library imports only cairn.core_array and itself.

The one exception is the application layer, cairn.llm (``APPLICATIONS``): it may import
any Cairn library, and no library may import it (DESIGN.md, rule 1).

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

The third contract: every third-party module a package's source imports is declared in its
pyproject. An import that runs when the module is imported (module level, outside a ``try``
that catches ``ImportError``) must name a required dependency; one inside a function or such
a ``try`` (a lazy or optional import) may also name a dependency of one of the package's
extras other than ``test`` and ``bench`` (those are for the tests and benchmarks, never the
library). The standard library and ``cairn.*`` are exempt; an import name maps to its
distribution through the installed packages' metadata (``yaml`` -> ``PyYAML``), else it is
taken as the distribution's name. So ``cairn-nn`` importing ``optax`` without declaring it
fails here, in seconds, where a fresh venv per wheel (``nox -s readme_examples``) takes
minutes.

The second contract: no import cycle INSIDE a package. Every module of
``cairn.<name>`` (each ``.py`` file, an ``__init__.py`` standing for its package) is a
node; every import of another module of the same package is an edge, wherever it sits
(module level, inside a function, in a ``try``), relative imports resolved. Only imports
under ``if TYPE_CHECKING:`` do not count (they never run). ``from cairn.x import name``
points at ``cairn.x.name`` when that is a module and at ``cairn.x`` otherwise; importing
``cairn.x.sub`` does not count as importing ``cairn.x`` (or every module would sit in a
cycle with its package's ``__init__``). Any cycle fails, named ``a -> b -> c -> a`` with the
``file:line`` of each edge, unless EVERY edge of it carries, on the importing line or on
the line just above, the comment ``# import cycle (labelled): <why>``. A label on an edge
that lies on no cycle fails too, so labels cannot go stale.

    python tools/depcheck.py packages              # both contracts
    python tools/depcheck.py --cycles packages/nn  # only the cycle check, for one package
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib
from collections import deque

ALLOWED_SHARED = "core_array"
# application layers: they compose the libraries (any cairn import allowed); no library imports them
APPLICATIONS = ("llm",)
CYCLE_LABEL = "# import cycle (labelled):"


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


def _direction_problem(pkg: str, other: str) -> str | None:
    """Why ``cairn.<pkg>`` may not import ``cairn.<other>``, or None when it may."""
    if other in (pkg, ALLOWED_SHARED):
        return None
    if other in APPLICATIONS:
        return (f"cairn.{pkg} imports the application layer cairn.{other}; no library imports it "
                f"(it composes the libraries, not the other way round)")
    if pkg in APPLICATIONS:
        return None
    return f"cairn.{pkg} imports sibling cairn.{other}; only cairn.{ALLOWED_SHARED} and cairn.{pkg} are allowed"


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
                problem = _direction_problem(pkg, other)
                if problem:
                    violations.append(f"{py}:{lineno}: {problem}")
        meta = tomllib.loads((pkg_dir / "pyproject.toml").read_text())
        deps = list(meta.get("project", {}).get("dependencies", []))
        for extra, extra_deps in meta.get("project", {}).get("optional-dependencies", {}).items():
            deps += [f"{d} (extra {extra})" for d in extra_deps]
        for dep in deps:
            m = re.match(r"\s*cairn[-_.]([a-z0-9_.-]+)", dep, re.IGNORECASE)
            if m:
                other = re.split(r"[^a-z0-9_.-]", m.group(1).lower())[0].replace("-", "_").replace(".", "_")
                if _direction_problem(pkg, other):
                    what = "the application layer" if other in APPLICATIONS else "sibling"
                    violations.append(
                        f"{pkg_dir / 'pyproject.toml'}: cairn-{pkg.replace('_', '-')} depends on {what} {dep!r}"
                    )
    return violations


# --- third-party imports are declared ---

# import names a distribution provides beside its own (jax's C++ half ships as jaxlib)
PROVIDED_BY = {"jaxlib": "jax"}
# extras that serve the tests and the benchmarks, never the library's own code
NON_LIBRARY_EXTRAS = ("test", "bench", "fixtures")


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.split(r"[\s\[<>=!~;(]", req.strip(), maxsplit=1)[0])


def _third_party_imports(tree: ast.AST) -> list[tuple[int, str, bool]]:
    """``(line, top-level name, eager)`` of each absolute import; ``eager`` when it runs at
    module import (not inside a function, not in a ``try`` that catches ImportError)."""
    found: list[tuple[int, str, bool]] = []

    def catches_import_error(node: ast.Try) -> bool:
        names = []
        for h in node.handlers:
            t = h.type
            names += [e for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if e is not None]
        return not node.handlers or any(
            isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception") for n in names
        ) or any(h.type is None for h in node.handlers)

    def visit(node: ast.AST, eager: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name.split(".")[0], eager) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and not child.level and child.module:
                found.append((child.lineno, child.module.split(".")[0], eager))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, False)
            elif isinstance(child, ast.Try):
                guarded = catches_import_error(child)
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), eager and not guarded)
                for rest in (*child.handlers, *child.orelse, *child.finalbody):
                    visit(rest if isinstance(rest, ast.ExceptHandler) else ast.Module(body=[rest], type_ignores=[]), eager)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # never runs
            else:
                visit(child, eager)

    visit(tree, True)
    return [f for f in found if f[1] not in sys.stdlib_module_names and f[1] not in ("cairn", "__future__")]


def _is_type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def check_third_party(packages_dir: str | pathlib.Path) -> list[str]:
    """One line per third-party import a package's source makes without declaring it."""
    import importlib.metadata

    dists_of = importlib.metadata.packages_distributions()
    violations = []
    for pkg_dir in sorted(pathlib.Path(packages_dir).iterdir()):
        if not (pkg_dir / "pyproject.toml").exists():
            continue
        meta = tomllib.loads((pkg_dir / "pyproject.toml").read_text()).get("project", {})
        required = {_requirement_name(d) for d in meta.get("dependencies", [])}
        optional = {_requirement_name(d) for extra, deps in meta.get("optional-dependencies", {}).items()
                    if extra not in NON_LIBRARY_EXTRAS for d in deps}
        dist_name = f"cairn-{pkg_dir.name.replace('_', '-')}"
        for py in sorted((pkg_dir / "src").rglob("*.py")):
            for line, top, eager in _third_party_imports(ast.parse(py.read_text(), filename=str(py))):
                dists = {_norm(d) for d in dists_of.get(top, [top])} | {_norm(PROVIDED_BY.get(top, top))}
                allowed = required if eager else required | optional
                if dists & allowed:
                    continue
                where = "a required dependency" if eager else "a dependency or a library extra"
                hint = " (it is only in an extra: import it inside the function that needs it)" if dists & optional else ""
                violations.append(f"{py}:{line}: imports {top!r}, which is not {where} of {dist_name} "
                                  f"(pyproject.toml){hint}")
    return violations


# --- import cycles inside a package ---


class _Edge:
    """Every import site of module ``target`` in module ``source`` (``(file, line, labelled)``).

    A plain class, not a dataclass: the tests load this file without registering it in
    ``sys.modules``, which ``@dataclass`` needs.
    """

    def __init__(self, source: str, target: str) -> None:
        self.source = source
        self.target = target
        self.sites: list[tuple[pathlib.Path, int, bool]] = []

    @property
    def labelled(self) -> bool:
        return all(lab for _, _, lab in self.sites)

    def where(self, unlabelled_first: bool = True) -> str:
        sites = sorted(self.sites, key=lambda s: (s[2], s[1])) if unlabelled_first else self.sites
        path, line, _ = sites[0]
        return f"{path}:{line}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` except those only under ``if TYPE_CHECKING:`` (its ``else`` counts)."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _package_modules(pkg_src: pathlib.Path) -> dict[str, tuple[pathlib.Path, bool]]:
    """``{dotted module name: (file, is_package)}`` for every ``.py`` under ``cairn/<name>``."""
    modules = {}
    for py in sorted(pkg_src.rglob("*.py")):
        rel = py.relative_to(pkg_src.parent.parent).with_suffix("").parts
        is_package = rel[-1] == "__init__"
        modules[".".join(rel[:-1] if is_package else rel)] = (py, is_package)
    return modules


def _import_targets(node: ast.AST, parts: list[str], is_package: bool, modules: dict) -> list[str]:
    """Modules of ``modules`` that the import statement (or import call) ``node`` runs."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = _resolve_relative(parts, is_package, node.level, node.module)
            if base is None:
                return []
        else:
            base = node.module or ""
        found = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in modules:
                found.append(sub)
            elif base in modules:
                found.append(base)
        return found
    if isinstance(node, ast.Call):
        names = _modules_named(node, parts, is_package) or []
        return [n for n in names if n in modules]
    return []


def _is_labelled(lines: list[str], node: ast.AST) -> bool:
    first = node.lineno
    last = getattr(node, "end_lineno", None) or first
    candidates = lines[max(first - 2, 0) : last]  # the line above, then every line of the statement
    return any(CYCLE_LABEL in line for line in candidates)


def import_graph(pkg_src: str | pathlib.Path) -> dict[str, dict[str, _Edge]]:
    """``{module: {imported module: edge}}`` inside one package (``.../src/cairn/<name>``)."""
    pkg_src = pathlib.Path(pkg_src)
    modules = _package_modules(pkg_src)
    graph: dict[str, dict[str, _Edge]] = {m: {} for m in modules}
    for module, (py, is_package) in modules.items():
        text = py.read_text()
        lines = text.splitlines()
        try:
            tree = ast.parse(text, filename=str(py))
        except SyntaxError:
            continue  # check() reports it
        for node in _runtime_nodes(tree):
            for target in _import_targets(node, module.split("."), is_package, modules):
                if target == module:
                    continue
                edge = graph[module].setdefault(target, _Edge(module, target))
                edge.sites.append((py, node.lineno, _is_labelled(lines, node)))
    for edges in graph.values():
        for edge in edges.values():
            edge.sites.sort(key=lambda s: s[1])
    return graph


def _strongly_connected(graph: dict[str, dict[str, _Edge]]) -> list[set[str]]:
    """Tarjan's components with more than one module (self-imports are dropped earlier)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.add(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    comps.append(comp)
    return comps


def _path_back(graph: dict[str, dict[str, _Edge]], comp: set[str], start: str, goal: str) -> list[str]:
    """Shortest module path ``start -> ... -> goal`` inside ``comp`` (exists: it is a component)."""
    prev: dict[str, str | None] = {start: None}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        if node == goal:
            break
        for nxt in sorted(graph[node]):
            if nxt in comp and nxt not in prev:
                prev[nxt] = node
                todo.append(nxt)
    path = [goal]
    while prev[path[-1]] is not None:
        path.append(prev[path[-1]])  # type: ignore[arg-type]
    return path[::-1]


def check_cycles(pkg_src: str | pathlib.Path) -> list[str]:
    """Every import cycle inside one package that is not labelled on all its edges.

    One line per cycle (``cycle: a -> b -> a`` then the ``file:line`` of each edge), chosen
    so that every unlabelled edge of every cycle appears in at least one reported cycle;
    plus one line per label on an edge that lies on no cycle.
    """
    graph = import_graph(pkg_src)
    problems: list[str] = []
    on_cycle: set[tuple[str, str]] = set()
    for comp in sorted(_strongly_connected(graph), key=min):
        inner = [e for m in sorted(comp) for t, e in sorted(graph[m].items()) if t in comp]
        on_cycle.update((e.source, e.target) for e in inner)
        covered: set[tuple[str, str]] = set()
        for edge in inner:
            if edge.labelled or (edge.source, edge.target) in covered:
                continue
            cycle = [edge.source] + _path_back(graph, comp, edge.target, edge.source)
            steps = [graph[a][b] for a, b in zip(cycle, cycle[1:])]
            covered.update((e.source, e.target) for e in steps)
            short = [m.rsplit(".", 1)[-1] if m.count(".") > 1 else m for m in cycle]
            detail = "; ".join(
                f"{s.source.rsplit('.', 1)[-1]} -> {s.target.rsplit('.', 1)[-1]} at {s.where()}"
                + (" (labelled)" if s.labelled else "")
                for s in steps
            )
            problems.append(f"import cycle in {cycle[0].rsplit('.', 1)[0] if '.' in cycle[0] else cycle[0]}: "
                            f"{' -> '.join(short)}  [{detail}]")
    for module in sorted(graph):
        for target, edge in sorted(graph[module].items()):
            for path, line, labelled in edge.sites:
                if labelled and (module, target) not in on_cycle:
                    problems.append(f"{path}:{line}: labelled import cycle edge {module} -> {target} "
                                    f"lies on no cycle; remove the label")
    return problems


def check_all_cycles(packages_dir: str | pathlib.Path) -> list[str]:
    """``check_cycles`` for every package under ``packages_dir`` (or one package folder)."""
    root = pathlib.Path(packages_dir)
    pkg_dirs = [root] if (root / "pyproject.toml").exists() else sorted(
        p for p in root.iterdir() if (p / "pyproject.toml").exists()
    )
    problems: list[str] = []
    for pkg_dir in pkg_dirs:
        src = pkg_dir / "src" / "cairn" / pkg_dir.name
        if src.is_dir():
            problems += check_cycles(src)
    return problems


def main(argv: list[str]) -> int:
    args = argv[1:]
    cycles_only = "--cycles" in args
    args = [a for a in args if a != "--cycles"]
    root = args[0] if args else "packages"
    if not pathlib.Path(root).is_dir():
        print(f"dependency-direction contract: {root!r} is not a directory")
        return 2
    results = [] if cycles_only else [
        ("dependency-direction contract", check(root), "violation(s)"),
        ("declared-dependency contract", check_third_party(root), "undeclared import(s)"),
    ]
    results.append(("import-cycle contract", check_all_cycles(root), "problem(s)"))
    failed = False
    for name, problems, what in results:
        for line in problems:
            print(line)
        print(f"{name}: {len(problems)} {what}" if problems else f"{name}: ok")
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
