"""Which leaves of a weight argument are weights, and which module each belongs to.

A module library keeps each array in a *variable*: an object with a ``value`` property and
a ``get_value()`` method (cairn.nn's ``Variable``, Flax NNX's ``nnx.Variable``). A variable
is a *parameter* when its class is, or derives from, a class named ``Param``
(``nn.Param``, ``nnx.Param`` and both libraries' ``LoRAParam``). No module library is
imported: the objects are found by walking the tree along each leaf's key path.

By default, as in Qwix, only parameters are weights: a leaf held by any other variable (a
KV cache, BatchNorm statistics, an ``nn.data`` array, Rngs state) is left to the program
as it is. A leaf held by no variable (a plain pytree: dicts, lists, tuples of arrays) is a
weight. A provider's ``weight_filter`` replaces that default: a predicate
``(path, variable) -> bool`` (``variable`` is ``None`` for a plain leaf) or variable classes.

The module a weight belongs to is the path of its variable minus the variable's own name
(``layers/0/mlp`` for ``layers/0/mlp/kernel`` in cairn.nn, whose leaf path is the
variable's, and for ``layers/0/mlp/kernel/value`` in Flax NNX, whose leaf sits under the
variable); for a plain leaf, its path minus the last component.

A weight's *name* is the path of its variable (``layers/0/mlp/kernel`` in cairn.nn and in
Flax NNX alike; for a plain leaf, its path; for a variable holding several leaves, the leaf
path). Everything derived from a weight is keyed by it: the weight plan of
``quantize_params`` and GPTQ, LoRA adapters (``layers/0/mlp/lora/lora_a``) and input
scales (``layers/0/mlp/kernel_awq_scale``), so they are the same whichever library holds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from cairn.core_array import QArray, join_path

__all__ = [
    "WeightFilter", "LeafInfo", "check_weight_filter", "weight_predicate", "classify_leaves", "leaf_names", "weight_leaves",
    "is_param", "is_variable",
]

#: What says which leaves are weights: ``None`` (parameters and plain pytree leaves), a
#: predicate ``(path, variable) -> bool`` (``variable``: the variable holding the leaf at
#: ``path``, or ``None`` for a plain pytree leaf), or a variable class or tuple of classes
#: (the leaves such variables hold).
WeightFilter = Callable[[str, Any], bool] | type | tuple[type, ...]

_UNKNOWN = object()


def is_variable(x: Any) -> bool:
    """Whether ``x`` is a module library's variable: its class has ``value`` and ``get_value``."""
    if x is _UNKNOWN or isinstance(x, Mapping | list | tuple | QArray):
        return False
    cls = type(x)
    return hasattr(cls, "value") and callable(getattr(cls, "get_value", None))


def is_param(variable: Any) -> bool:
    """Whether ``variable``'s class is, or derives from, a class named ``Param``."""
    return any(c.__name__ == "Param" for c in type(variable).__mro__)


def default_weight_filter(path: str, variable: Any) -> bool:
    """Parameters and plain pytree leaves are weights; other variables' leaves are not."""
    del path
    return variable is None or is_param(variable)


def _is_types(x: Any) -> bool:
    return isinstance(x, type) or (isinstance(x, tuple) and bool(x) and all(isinstance(t, type) for t in x))


def check_weight_filter(weight_filter: Any, owner: str) -> WeightFilter | None:
    """``weight_filter`` itself, when it is one of the forms :data:`WeightFilter` allows.

    Raises:
      TypeError: it is none of them.
    """
    if weight_filter is not None and not _is_types(weight_filter) and not callable(weight_filter):
        raise TypeError(
            f"{owner}: weight_filter must be None (parameters and plain pytree leaves are the weights), "
            f"a callable (path, variable) -> bool, or a variable class or tuple of classes; got {weight_filter!r}"
        )
    return weight_filter


def weight_predicate(weight_filter: WeightFilter | None) -> Callable[[str, Any], bool]:
    """``weight_filter`` as a predicate ``(path, variable) -> bool``."""
    if weight_filter is None:
        return default_weight_filter
    if _is_types(weight_filter):
        types = cast(type | tuple[type, ...], weight_filter)

        def is_instance(path: str, variable: Any) -> bool:
            del path
            return isinstance(variable, types)

        return is_instance
    return cast(Callable[[str, Any], bool], weight_filter)


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """One leaf: its ``path``, the ``variable`` holding it (or ``None``), its ``module_path``
    and its ``name`` (the variable's path; the leaf's own path for a plain leaf or a
    variable holding several leaves)."""

    path: str
    variable: Any
    module_path: str
    name: str


def _child(obj: Any, entry: Any) -> Any:
    """The object one ``jax.tree_util`` key entry below ``obj`` (``_UNKNOWN`` if it cannot be reached)."""
    from jax.tree_util import DictKey, GetAttrKey, SequenceKey

    tries: list[Callable[[], Any]]
    if isinstance(entry, GetAttrKey):
        tries = [lambda: getattr(obj, entry.name), lambda: obj[entry.name]]
    elif isinstance(entry, DictKey):
        tries = [lambda: obj[entry.key], lambda: getattr(obj, entry.key)]
    elif isinstance(entry, SequenceKey):
        tries = [lambda: obj[entry.idx]]
    else:  # a FlattenedIndexKey: the node's own flattening, not reachable by name
        return _UNKNOWN
    for get in tries:
        try:
            return get()
        except Exception:  # noqa: BLE001 - any failure means "not reachable this way"
            continue
    return _UNKNOWN


def classify_leaves(root: Any, keypaths: Sequence[tuple]) -> list[LeafInfo]:
    """A :class:`LeafInfo` for each key path of ``root``'s flattening (in order).

    Walks from ``root`` along each key path (shared prefixes once) and keeps the innermost
    variable met on the way; where an object cannot be reached, the variable found so far
    (if any) holds the leaf.
    """
    # prefix -> (object there, its path, innermost variable on the way, that variable's module path, its path)
    memo: dict[tuple, tuple[Any, str, Any, str, str]] = {(): (root, "", root if is_variable(root) else None, "", "")}
    found = []
    for kp in keypaths:
        kp = tuple(kp)
        for depth in range(1, len(kp) + 1):
            prefix = kp[:depth]
            if prefix in memo:
                continue
            parent, parent_path, variable, module, var_path = memo[kp[: depth - 1]]
            # below a variable is its value: nothing more to find (and not read, so no
            # library's accessor runs)
            obj = _UNKNOWN if parent is _UNKNOWN or parent is variable else _child(parent, kp[depth - 1])
            path = join_path(parent_path, kp[depth - 1])
            if is_variable(obj):
                variable, module, var_path = obj, parent_path, path
            memo[prefix] = (obj, path, variable, module, var_path)
        _, path, variable, module, var_path = memo[kp]
        if variable is None:
            module = memo[kp[:-1]][1] if kp else ""
        found.append((path, variable, module, var_path))
    held: dict[int, int] = {}  # id(variable) -> how many leaves it holds
    for _, variable, _, _ in found:
        if variable is not None:
            held[id(variable)] = held.get(id(variable), 0) + 1
    return [
        LeafInfo(path, variable, module, var_path if variable is not None and held[id(variable)] == 1 else path)
        for path, variable, module, var_path in found
    ]


def leaf_names(tree: Any, keypaths: Sequence[tuple]) -> list[str]:
    """The name (see the module docstring) of each leaf of ``tree``, given its key paths."""
    return [info.name for info in classify_leaves(tree, keypaths)]


# (treedef, weight_filter, argnum) -> per leaf (path, module path, name) when the filter chose it, else None.
# What a leaf is (its variable's class and metadata, its keys) is part of the tree's structure,
# so the walk runs once per structure, not on every call.
_CHOSEN: dict[tuple, list[tuple[str, str, str] | None]] = {}
_CHOSEN_MAX = 256


def weight_leaves(
    tree: Any, with_path: Sequence[tuple[tuple, Any]], treedef: Any, weight_filter: WeightFilter | None, argnum: int | None
) -> list[tuple[str, str, str] | None]:
    """Per leaf of ``tree`` (flattened as ``with_path``, structure ``treedef``): its path,
    module path and name when ``weight_filter`` makes it a weight, else ``None`` (whether
    the leaf is an array is the caller's to check). With ``argnum``, all three start with it."""
    try:
        key: tuple | None = (treedef, weight_filter, argnum)
        hit = _CHOSEN.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable filter or static field: classify every time
        key, hit = None, None
    if hit is not None:
        return hit
    keep = weight_predicate(weight_filter)
    chosen: list[tuple[str, str, str] | None] = []
    for info in classify_leaves(tree, [kp for kp, _ in with_path]):
        path, module, name = info.path, info.module_path, info.name
        if argnum is not None:
            path, module, name = f"{argnum}/{path}", f"{argnum}/{module}".rstrip("/"), f"{argnum}/{name}"
        chosen.append((path, module, name) if keep(path, info.variable) else None)
    if key is not None:
        if len(_CHOSEN) >= _CHOSEN_MAX:
            _CHOSEN.clear()
        _CHOSEN[key] = chosen
    return chosen
