"""Optional JAX: imported lazily, so ``cairn.core_array`` works without it."""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


@functools.cache
def jax_available() -> bool:
    """Whether JAX can be imported in this environment."""
    try:
        return importlib.util.find_spec("jax") is not None
    except (ImportError, ValueError):  # a broken or blocked installation counts as absent
        return False


_on_jax_import: list[Callable[[], object]] = []


def on_jax_import(fn: Callable[[], object]) -> None:
    """Run ``fn()`` once JAX is in use (now, if it already is): used to register pytrees."""
    _on_jax_import.append(fn)
    if sys.modules.get("jax") is not None:
        jax_tree_util()


def jax_tree_util() -> ModuleType | None:
    """``jax.tree_util`` once the program has imported JAX, else ``None``.

    Never imports JAX itself: a tree can only hold a JAX-registered node after JAX was
    imported, so there is nothing to walk before that, and a JAX-free process (a data
    worker, say) stays JAX-free. A ``None`` entry (``sys.modules["jax"] = None``, how
    tests block an import) counts as absent.
    """
    if sys.modules.get("jax") is None:
        return None
    tu = sys.modules.get("jax.tree_util")
    if tu is None:
        import jax.tree_util as tu
    while _on_jax_import:
        _on_jax_import.pop(0)()
    return tu


def require_jax(what: str) -> ModuleType:
    """Import JAX or raise a clear error naming the feature that needs it."""
    if not jax_available():
        raise ImportError(f"{what} needs JAX; install it with `pip install cairn-core-array[jax]`")
    import jax

    return jax
