"""Every public callable of every package says its arguments in a Google-style ``Args:`` section.

Public here means: each name in a package's ``__all__`` (``cairn.<name>``), and each name in
the ``__all__`` of a submodule that ``__all__`` lists (``cairn.checkpoint.args``,
``cairn.optim.losses``...). A function is checked when its signature has parameters; a class
when its constructor has (``self`` left out), and only where the class itself, or a Cairn class
it derives from, defines ``__init__``/``__new__`` (a dataclass or NamedTuple counts; an
exception that keeps ``Exception``'s constructor does not, nor does a ``typing.Protocol``). The
public methods of an exported class that a Cairn class defines (the class itself or a base;
static and class methods too, properties not) are checked as functions. Parameters whose name starts with an
underscore (not for callers) and ``self``/``cls`` are left out.

A parameter counts as documented when an entry of the ``Args:`` section (in the function's
docstring; for a class, in the class's, or in the docstring of the class defining its constructor
or of that ``__init__``) names it:
``name: text`` or ``name (type): text``; ``*args`` and ``**kwargs`` may be written with or
without their stars. The check imports the packages (``__all__`` is what users see), so run it
where they are installed, as ``nox -s lint`` does.

Callables not yet documented are listed in ``tools/docargs_todo.txt`` (one qualified name a
line). The list may only shrink: a callable missing from it that lacks arguments fails, and so
does a listed one that is now documented or no longer exists, so the list stays exact.

    python tools/docargs.py                    # every package
    python tools/docargs.py checkpoint nn      # some packages (their todo entries only)
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys
import types
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
TODO = ROOT / "tools" / "docargs_todo.txt"
SECTION = re.compile(r"^([ \t]*)(?:Args|Arguments):[ \t]*$", re.M)
ENTRY = re.compile(r"\*{0,2}([A-Za-z_]\w*)\s*(?:\([^)]*\))?\s*:")


def documented_args(doc: str | None) -> set[str]:
    """The parameter names the ``Args:`` section of ``doc`` describes (empty if it has none).

    Args:
      doc: a docstring, as written (indented) or cleaned.
    """
    text = inspect.cleandoc(doc or "")
    names: set[str] = set()
    for m in SECTION.finditer(text):
        base = len(m.group(1))
        entry_indent = None
        for line in text[m.end():].splitlines()[1:]:
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip())
            if indent <= base:
                break
            if entry_indent is None:
                entry_indent = indent
            if indent == entry_indent and (e := ENTRY.match(line.strip())):
                names.add(e.group(1))
    return names


def _constructor_owner(cls: type) -> type | None:
    """The class whose ``__init__``/``__new__`` builds ``cls``, if it is ``cls`` or a Cairn class."""
    if getattr(cls, "_is_protocol", False):
        return None  # a typing.Protocol is not constructed
    for c in cls.__mro__:
        if "__init__" in c.__dict__ or "__new__" in c.__dict__:
            return c if c is cls or c.__module__.startswith("cairn.") else None
    return None


def missing_args(obj: object) -> list[str] | None:
    """The parameters of ``obj`` its docstring's ``Args:`` leaves out; None when not checked.

    Args:
      obj: a function or class (anything else, or a signature Python cannot read, is not checked).
    """
    docs = [obj.__doc__]
    if inspect.isclass(obj):
        owner = _constructor_owner(obj)
        if owner is None:
            return None
        init = owner.__dict__.get("__init__")
        docs += [owner.__doc__, getattr(init, "__doc__", None)]
    elif not callable(obj) or type(obj).__module__ in ("typing", "types"):
        return None  # not a function, or a type alias (``Params = Any``, ``A | B``): nothing to call
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    # a leading underscore marks a parameter as not for callers (``*_args`` kept for Orbax's signatures)
    params = [p.name for p in sig.parameters.values() if p.name not in ("self", "cls") and not p.name.startswith("_")]
    if not params:
        return None
    got: set[str] = set()
    for d in docs:
        got |= documented_args(d)
    return [p for p in params if p not in got]


def public_methods(cls: type) -> Iterator[tuple[str, object]]:
    """``(name, function)`` for each public method ``cls`` has from a Cairn class (itself or a base).

    Methods, static and class methods count; properties and methods inherited from non-Cairn
    classes (``object``, ``Exception``, ``typing.Protocol``...) do not.

    Args:
      cls: an exported class.
    """
    found: dict[str, object] = {}
    for c in cls.__mro__:
        if not c.__module__.startswith("cairn."):
            continue
        for name, member in vars(c).items():
            fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            # a lambda in a class body is a field's default value (a dataclass's), not a method
            if not name.startswith("_") and inspect.isfunction(fn) and fn.__name__ != "<lambda>" and name not in found:
                found[name] = fn
    yield from found.items()


def public_callables(package: str) -> Iterator[tuple[str, object]]:
    """``(qualified name, object)`` for each name in ``cairn.<package>``'s ``__all__`` and in its
    listed submodules', and for each public method of the classes among them.

    A function reached twice (re-exported, or a method two exported classes share) is given
    once, under the first name it is reached by.

    Args:
      package: the folder name under packages/ (``core_array``, ``nn``...).
    """
    seen_modules: set[str] = set()
    seen_objects: set[int] = set()
    todo = [f"cairn.{package}"]
    while todo:
        modname = todo.pop(0)
        if modname in seen_modules:
            continue
        seen_modules.add(modname)
        mod = importlib.import_module(modname)
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if isinstance(obj, types.ModuleType):
                if obj.__name__.startswith(f"cairn.{package}."):
                    todo.append(obj.__name__)
                continue
            if id(obj) in seen_objects:
                continue
            seen_objects.add(id(obj))
            yield f"{modname}.{name}", obj
            if inspect.isclass(obj):
                for method_name, fn in public_methods(obj):
                    if id(fn) not in seen_objects:
                        seen_objects.add(id(fn))
                        yield f"{modname}.{name}.{method_name}", fn


def problems(packages: list[str], todo: set[str]) -> tuple[list[str], set[str]]:
    """The failures, and the todo entries these packages left unused.

    Args:
      packages: the packages to check.
      todo: qualified names allowed to lack ``Args:`` for now.
    """
    out, used = [], set()
    for pkg in packages:
        for qual, obj in public_callables(pkg):
            lacking = missing_args(obj)
            if not lacking:
                if qual in todo:
                    used.add(qual)
                    out.append(f"{qual}: documented now, remove it from {TODO.relative_to(ROOT)}")
                continue
            if qual in todo:
                used.add(qual)
                continue
            out.append(f"{qual}: its docstring's Args: section does not name {', '.join(lacking)}")
    prefixes = tuple(f"cairn.{p}." for p in packages)
    stale = {t for t in todo if t.startswith(prefixes)} - used
    return out, stale


def read_todo(path: pathlib.Path = TODO) -> set[str]:
    """The qualified names listed in ``path`` (``#`` comments and blank lines ignored).

    Args:
      path: the todo file.
    """
    if not path.exists():
        return set()
    lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
    return {ln for ln in lines if ln}


def all_packages() -> list[str]:
    return sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())


def main(argv: list[str]) -> int:
    packages = argv[1:] or all_packages()
    unknown = sorted(set(packages) - set(all_packages()))
    if unknown:
        print(f"docstring Args check: no such package {unknown}")
        return 2
    found, stale = problems(packages, read_todo())
    found += [f"{s}: listed in {TODO.relative_to(ROOT)} but not a public callable any more" for s in sorted(stale)]
    for p in found:
        print(p)
    if found:
        print(f"docstring Args check: {len(found)} problem(s); see tools/docargs.py for the rule")
        return 1
    print("docstring Args check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
