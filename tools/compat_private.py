"""Static detection of a peer's tests that reach into the peer's private internals.

``tools/compat_suites.py`` counts a test as private when, at run time on the peer, it touches
a name of the peer's private modules that has no public counterpart. Some tests reach into
the peer's internals without such a name: they read or set a private attribute of a peer
object (``manager._checkpointer``, ``handler._items_exist``) or replace the peer's private
code with a mock (``mock.patch.object(atomicity.AtomicRenameTemporaryPath, 'finalize')``,
``mock.patch('orbax.checkpoint._src.path.gcs_utils.is_gcs_path')``), often in a decorator,
which runs while the module is imported and so escapes the run-time trace. This module
finds them in the source of the test file and of the peer's test helpers it loads.

What counts as private, for a test function (its decorators, its body, and the helpers it
calls, transitively: methods of its class and of the classes that class derives from, found
by name in the test file or a helper file, plus the class's ``setUp`` / ``setUpClass``, and
module-level functions of those files):

- ``<expr>._name`` (read, write or delete) or ``getattr / setattr / hasattr / delattr(<expr>,
  "_name")``, where ``_name`` has one leading underscore (a namedtuple's ``_replace``,
  ``_asdict``, ``_fields``, ``_make``, ``_field_defaults`` are public), the peer's own (non-test) source
  defines ``_name`` (an attribute set on ``self``, a method, a class or module attribute),
  the test's file and helpers define no ``_name`` of their own (a test class's ``self._x``
  is never counted), ``<expr>`` is not bare ``self`` / ``cls``, and ``<expr>`` is not rooted
  in a name imported from outside the peer (``jax._src``, ``np._NoValue``);
- in the test's own code (the test file, and the methods of its test classes wherever
  they are defined, e.g. a test base in ``*_test_utils.py``; not the module-level
  functions of the peer's test utilities, which set up the environment), a name of a
  private peer module that is the same object as no public name (``atomicity.
  COMMIT_SUCCESS_FILE``), as the run-time trace counts it in the test file; names of the
  peer's ``environment`` table (``compat_suites.PEERS``) do not count;
- ``mock.patch("<peer>.<path>")`` / ``mock.patch.object(<target>, "<attr>")`` (any callable
  named ``patch``, ``patch.object`` or ``patch.multiple``) that replaces a name of a
  private peer module (that module's binding, which only the peer's own code reads, even
  when the object is also public: ``mock.patch.object(gcs_utils, "is_gcs_path")``), or
  whose dotted target names a private-only object of a private peer module (the
  ``private`` table of ``compat_suites.public_map``: no public name is the same object)
  or has a private component where no such module is known, or whose attribute is
  ``_name`` as above.

Mocks of a peer's public objects, even reached through a private module
(``mock.patch.object(ocp.CheckpointManager, "save")``), and of third-party code
(``jax.monitoring``, ``datetime``) are public use.
"""

from __future__ import annotations

import ast
import pathlib
import re

_PATCHES = ("patch", "patch.object", "patch.multiple")
_ATTR_CALLS = ("getattr", "setattr", "hasattr", "delattr")


# underscore names that are public API by Python's own convention (a namedtuple's methods)
_PUBLIC_UNDERSCORE = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})


def _is_private_name(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in _PUBLIC_UNDERSCORE


def defined_private_names(files: list[pathlib.Path], own: bool = False) -> set[str]:
    """Every ``_name`` the given sources define: ``<x>._name = ...``, ``def _name``, a class
    or module attribute ``_name``; with ``own``, an attribute set only on ``self`` / ``cls``
    counts (a test setting ``manager._x`` does not make ``_x`` its own)."""
    names: set[str] = set()
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if not own or isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if _is_private_name(n)}


def peer_source_files(pkg_dir: pathlib.Path, skip: set[pathlib.Path]) -> list[pathlib.Path]:
    """The peer's library sources: every ``.py`` under its package but its tests and ``skip``
    (the test helpers loaded as test code)."""
    skip = {p.resolve() for p in skip}
    return [p for p in sorted(pkg_dir.rglob("*.py"))
            if not p.name.endswith("_test.py") and p.name != "conftest.py" and p.resolve() not in skip]


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name / Attribute chain, ``None`` for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> the full dotted path it was imported as (module-level imports)."""
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


class FileIndex:
    """One source file's classes, module-level functions and imports."""

    def __init__(self, path: pathlib.Path, module: str | None = None) -> None:
        self.path = path
        self.module = module
        self.tree = ast.parse(path.read_text(encoding="utf-8"))
        self.imports = _imports(self.tree)
        self.functions = {n.name: n for n in self.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.classes: dict[str, ast.ClassDef] = {}

        def add(node: ast.AST, prefix: str) -> None:
            for child in getattr(node, "body", []):
                if isinstance(child, ast.ClassDef):
                    self.classes[prefix + child.name] = child
                    add(child, prefix + child.name + ".")

        add(self.tree, "")


class Analyzer:
    """Finds, per test, the private uses listed in the module docstring."""

    def __init__(self, package: str, private_map: dict[str, dict[str, list[str]]],
                 peer_names: set[str], files: list[FileIndex],
                 environment: dict[str, dict[str, str]] | None = None) -> None:
        self.package = package
        self.environment = environment or {}
        self.private_map = private_map
        self.files = files
        owned = defined_private_names([f.path for f in files], own=True)
        self.peer_names = peer_names - owned

    # --- one function's direct findings ---

    def _outside_peer(self, node: ast.AST, index: FileIndex) -> bool:
        """``node`` is rooted in a name imported from a module outside the peer."""
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            node = node.func if isinstance(node, ast.Call) else node.value
        if not isinstance(node, ast.Name):
            return False
        full = index.imports.get(node.id)
        return full is not None and full.split(".")[0] != self.package.split(".")[0]

    def _private_target(self, path: str) -> bool:
        """A dotted path into the peer that is private: a private component, or a private-only
        name of a private module."""
        parts = path.split(".")
        if parts[0] != self.package.split(".")[0]:
            return False
        for cut in range(len(parts) - 1, 0, -1):
            table = self.private_map.get(".".join(parts[:cut]))
            if table is not None:  # a public object reached through a private module is public
                name = parts[cut]
                return table.get(name, [] if _is_private_name(name) else None) == [] \
                    or any(_is_private_name(p) for p in parts[cut + 1:])
        return any(_is_private_name(p) for p in parts)

    def _resolve(self, node: ast.AST, index: FileIndex) -> str | None:
        dotted = _dotted(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        full = index.imports.get(head)
        return (f"{full}.{rest}" if rest else full) if full else None

    def _patch_finding(self, call: ast.Call, index: FileIndex) -> str | None:
        func = _dotted(call.func) or ""
        if not any(func == p or func.endswith("." + p) for p in _PATCHES) or not call.args:
            return None
        first = call.args[0]
        if func.endswith("patch") and isinstance(first, ast.Constant) and isinstance(first.value, str):
            owner = first.value.rpartition(".")[0]
            private = owner in self.private_map or self._private_target(first.value)
            return f"mock.patch({first.value!r})" if private else None
        attr = call.args[1] if len(call.args) > 1 else None
        name = attr.value if isinstance(attr, ast.Constant) and isinstance(attr.value, str) else None
        target = self._resolve(first, index)
        if name and name in self.peer_names and not self._outside_peer(first, index):
            return f"mock.patch.object(<{_dotted(first) or 'object'}>, {name!r})"
        if target and (target in self.private_map or self._private_target(target)):
            return f"mock.patch.object({target}, {name!r})"
        return None

    def _module_name(self, node: ast.Attribute, index: FileIndex) -> str | None:
        """``node`` names a private-only object of a private peer module (``atomicity.X``)."""
        module = self._resolve(node.value, index)
        table = self.private_map.get(module) if module else None
        if table is None or table.get(node.attr) != [] or node.attr in self.environment.get(module, {}):
            return None
        return f"{module}.{node.attr}"

    def direct(self, func: ast.AST, index: FileIndex, own: bool = True) -> set[str]:
        """The private uses written in ``func`` itself (decorators included); private module
        names only where ``own`` (the test's own code, not a test-utility function)."""
        found = set()
        for node in ast.walk(func):
            if own and isinstance(node, ast.Attribute) and (name := self._module_name(node, index)):
                found.add(name)
            elif isinstance(node, ast.Attribute) and node.attr in self.peer_names:
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    continue
                if not self._outside_peer(base, index):
                    found.add(f"attribute .{node.attr}")
            elif isinstance(node, ast.Call):
                patch = self._patch_finding(node, index)
                if patch:
                    found.add(patch)
                elif isinstance(node.func, ast.Name) and node.func.id in _ATTR_CALLS and len(node.args) > 1:
                    arg = node.args[1]
                    if isinstance(arg, ast.Constant) and arg.value in self.peer_names \
                            and not self._outside_peer(node.args[0], index):
                        found.add(f"{node.func.id}(..., {arg.value!r})")
        return found

    # --- the helpers a test calls ---

    def _find_class(self, dotted: str, index: FileIndex) -> tuple[FileIndex, ast.ClassDef] | None:
        parts = dotted.split(".")
        order = [index, *(f for f in self.files if f is not index)]
        for cut in range(len(parts)):
            name = ".".join(parts[cut:])
            for f in order:
                if name in f.classes:
                    return f, f.classes[name]
        return None

    def mro(self, index: FileIndex, cls: ast.ClassDef) -> list[tuple[FileIndex, ast.ClassDef]]:
        """``cls`` and the classes it derives from that the analysed files define (depth first)."""
        out: list[tuple[FileIndex, ast.ClassDef]] = []
        stack = [(index, cls)]
        while stack:
            f, c = stack.pop(0)
            if any(c is seen for _, seen in out):
                continue
            out.append((f, c))
            for base in c.bases:
                dotted = _dotted(base)
                found = self._find_class(dotted, f) if dotted else None
                if found:
                    stack.append(found)
        return out

    @staticmethod
    def _method(mro: list[tuple[FileIndex, ast.ClassDef]], name: str) -> tuple[FileIndex, ast.AST] | None:
        for f, c in mro:
            for node in c.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return f, node
        return None

    def _callees(self, func: ast.AST, index: FileIndex,
                 mro: list[tuple[FileIndex, ast.ClassDef]]) -> list[tuple[FileIndex, ast.AST]]:
        """Methods (through ``self`` / ``cls`` / ``super()``) and module-level functions (of this
        file or an analysed helper module) that ``func`` names."""
        out = []
        for node in ast.walk(func):
            if isinstance(node, ast.Attribute):
                base = node.value
                on_self = isinstance(base, ast.Name) and base.id in ("self", "cls") or (
                    isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super")
                if on_self and mro:
                    found = self._method(mro, node.attr)
                    if found:
                        out.append(found)
                    continue
                module = self._resolve(base, index)
                for f in self.files:
                    if module and f.module == module and node.attr in f.functions:
                        out.append((f, f.functions[node.attr]))
            elif isinstance(node, ast.Name) and node.id in index.functions:
                out.append((index, index.functions[node.id]))
        return out

    def test_roots(self, index: FileIndex, nodeid: str) -> tuple[list[tuple[FileIndex, ast.AST]], list]:
        """The functions a test runs first (its own, its class's set-up) and its class's mro."""
        parts = re.sub(r"\[.*\]$", "", nodeid).split("::")[1:]
        if len(parts) == 1:
            func = index.functions.get(parts[0])
            return ([(index, func)] if func else []), []
        found = self._find_class(".".join(parts[:-1]), index)
        if not found:
            return [], []
        mro = self.mro(*found)
        name = parts[-1]
        method = self._method(mro, name)
        if method is None:  # a parameterized test: the longest method name it extends
            names = sorted({n.name for _, c in mro for n in c.body
                            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and name.startswith(n.name)},
                           key=len, reverse=True)
            method = self._method(mro, names[0]) if names else None
        roots = [method] if method else []
        roots += [m for m in (self._method(mro, s) for s in ("setUp", "setUpClass")) if m]
        return roots, mro

    def test(self, index: FileIndex, nodeid: str) -> list[str]:
        """The private uses of one test (``file::Class::test`` or ``file::test``), each with the
        function it is written in."""
        roots, mro = self.test_roots(index, nodeid)
        seen: set[int] = set()
        found: set[str] = set()
        stack = list(roots)
        while stack:
            f, func = stack.pop()
            if id(func) in seen:
                continue
            seen.add(id(func))
            # the test's own code: the test file and the test classes' methods (a test base
            # in a helper file holds tests too), not the module-level test utilities
            own = f is index or func not in f.functions.values()
            found |= {f"{use} in {func.name}" for use in self.direct(func, f, own)}
            stack.extend(self._callees(func, f, mro))
        return sorted(found)


def analyze(package: str, private_map: dict[str, dict[str, list[str]]], pkg_dir: pathlib.Path,
            test_files: dict[str, pathlib.Path], helper_files: dict[str, pathlib.Path],
            nodeids: list[str], environment: dict[str, dict[str, str]] | None = None) -> dict[str, list[str]]:
    """{nodeid: private uses} for the tests among ``nodeids`` that have any.

    Args:
        package: the peer's top-level package (``orbax``, ``grain``...).
        private_map: ``public_map(...)["private"]``: private module -> name -> public paths.
        pkg_dir: the installed peer package's folder (its library sources).
        test_files: the test file names as in the nodeids -> their paths.
        helper_files: the peer's test helpers loaded as test code, module name -> path.
        nodeids: the tests to analyse.
        environment: private names that only ask about the test environment (not counted),
            module -> name -> stand-in, as in ``compat_suites.PEERS``.
    """
    peer_names = defined_private_names(peer_source_files(pkg_dir, set(helper_files.values())))
    helpers = [FileIndex(p, m) for m, p in helper_files.items() if p.exists()]
    out: dict[str, list[str]] = {}
    for name, path in test_files.items():
        index = FileIndex(path)
        analyzer = Analyzer(package, private_map, peer_names, [index, *helpers], environment)
        for nodeid in nodeids:
            if nodeid.split("::")[0] == name:
                uses = analyzer.test(index, nodeid)
                if uses:
                    out[nodeid] = uses
    return out
