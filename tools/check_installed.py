"""Import one installed Cairn package and check it stands alone.

    python tools/check_installed.py <package> [--wheel]

Fails when the import fails; when ``cairn`` is not a PEP 420 namespace; when a sibling
cairn package is importable in this environment that the distribution does not declare
as a dependency (a library declares only core_array; the application layer, cairn-llm,
declares the libraries it composes); when ``__all__`` is empty or names something missing; when ``__version__``
differs from the installed distribution's version; and, for core_array and data, when
importing the package imports JAX. With ``--wheel`` (the fresh venvs of ``nox -s build``)
also when the module does not come from site-packages, or when JAX is installed next to
core_array or data at all.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pkgutil
import re
import sys

JAX_FREE = {"core_array", "data"}


def declared_cairn_dependencies(dist: str) -> set[str]:
    """The cairn packages (``core_array``, ``nn``...) that ``dist`` requires, extras excluded."""
    out = set()
    for req in importlib.metadata.requires(dist) or []:
        if "extra ==" in req.replace('"', "").replace("'", ""):
            continue
        m = re.match(r"\s*cairn[-_.]([a-z0-9_.-]+?)\s*(?:[<>=!~;\[(]|$)", req, re.IGNORECASE)
        if m:
            out.add(m.group(1).lower().replace("-", "_").replace(".", "_"))
    return out


def main() -> int:
    pkg = sys.argv[1]
    mod = importlib.import_module(f"cairn.{pkg}")
    problems = []
    if not getattr(mod, "__all__", None):
        problems.append(f"cairn.{pkg} has no __all__")
    for name in getattr(mod, "__all__", []):
        if not hasattr(mod, name):
            problems.append(f"cairn.{pkg}.__all__ names {name!r}, which does not exist")
    dist = "cairn-" + pkg.replace("_", "-")
    installed = importlib.metadata.version(dist)
    if getattr(mod, "__version__", None) != installed:
        problems.append(
            f"cairn.{pkg}.__version__ is {getattr(mod, '__version__', None)!r}, but the installed "
            f"distribution {dist} is {installed!r}: bump both together"
        )
    cairn = sys.modules["cairn"]
    if getattr(cairn, "__file__", None) is not None:
        problems.append(f"cairn is a regular package ({cairn.__file__}); it must be a PEP 420 namespace")
    allowed = {pkg, "core_array"} | declared_cairn_dependencies(dist)
    siblings = sorted({m.name for m in pkgutil.iter_modules(cairn.__path__)} - allowed)
    if siblings:
        problems.append(
            f"sibling packages are importable next to cairn.{pkg}: "
            + ", ".join(f"cairn.{s}" for s in siblings)
            + f"; install cairn-{pkg.replace('_', '-')} alone (with only its declared dependencies) "
            f"to prove it does not need them"
        )
    if "--wheel" in sys.argv and "site-packages" not in (mod.__file__ or ""):
        problems.append(f"cairn.{pkg} imported from {mod.__file__}, not from the installed wheel")
    if pkg in JAX_FREE:
        if "--wheel" in sys.argv and importlib.util.find_spec("jax") is not None:
            problems.append(f"JAX is installed alongside {dist}, which must not need it")
        if "jax" in sys.modules:
            problems.append(f"importing cairn.{pkg} imported jax")
    if problems:
        print("\n".join(problems))
        return 1
    print(f"cairn.{pkg} {installed} imports alone: ok ({len(mod.__all__)} public names)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
