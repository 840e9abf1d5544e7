"""The container kinds of a saved tree, so that a restore without a target rebuilds them.

The structure is stored in ``_METADATA.json`` as JSON next to the leaves: a leaf is
``"L"``, ``None`` is ``null``, and each container names its kind with its children in
order::

    {"dict": [[key, child], ...]}      insertion order; int keys stay int
    {"list": [child, ...]}  {"tuple": [child, ...]}
    {"namedtuple": [[field, child], ...], "name": "Point"}   rebuilt as a dict, as Orbax does
    {"node": "qualname"}                any other pytree node (dataclass, registered class):
                                        rebuilt as nested dicts keyed by path component

Checkpoints written before the structure was stored restore as nested dicts, as they did.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping
from typing import Any

from cairn.core_array import SEPARATOR, join_path, unflatten

LEAF = "L"


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def describe(tree: Any, leaf_paths: Mapping[str, Any]) -> Any:
    """The JSON structure of ``tree`` whose leaves are exactly the keys of ``leaf_paths``
    (as produced by :func:`cairn.core_array.flatten_with_paths`).

    >>> describe({"b": [1, (2, None)], "a": {}}, {"b/0": 1, "b/1/0": 2})
    {'dict': [['b', {'list': ['L', {'tuple': ['L', None]}]}], ['a', {'dict': []}]]}
    """
    return _describe(tree, "", leaf_paths)


def _describe(x: Any, prefix: str, leaves: Mapping[str, Any]) -> Any:
    if prefix in leaves and (prefix or x is leaves[prefix]):
        return LEAF
    if x is None:
        return None
    if type(x) is dict or (isinstance(x, dict) and type(x).__module__ == "collections"):
        return {"dict": [[k, _describe(v, join_path(prefix, k), leaves)] for k, v in x.items()]}
    if _is_namedtuple(x):
        return {
            "namedtuple": [[f, _describe(getattr(x, f), join_path(prefix, f), leaves)] for f in x._fields],
            "name": type(x).__name__,
        }
    if type(x) in (list, tuple):
        kind = type(x).__name__
        return {kind: [_describe(v, join_path(prefix, i), leaves) for i, v in enumerate(x)]}
    name = type(x).__qualname__ if not dataclasses.is_dataclass(x) else f"dataclass {type(x).__qualname__}"
    return {"node": name}


def leaf_paths_of(structure: Any) -> set[str]:
    """Every leaf path a structure holds (its ``"node"`` subtrees are not expanded)."""
    out: set[str] = set()
    _collect(structure, "", out)
    return out


def _collect(s: Any, prefix: str, out: set[str]) -> None:
    if s == LEAF:
        out.add(prefix)
    elif isinstance(s, dict):
        for kind, children in s.items():
            if kind in ("dict", "namedtuple"):
                for k, c in children:
                    _collect(c, join_path(prefix, k), out)
            elif kind in ("list", "tuple"):
                for i, c in enumerate(children):
                    _collect(c, join_path(prefix, i), out)


def rebuild(structure: Any, values: Mapping[str, Any]) -> Any:
    """The tree described by ``structure`` with its leaves taken from ``values`` by path.

    >>> rebuild({"dict": [["z", {"list": ["L", "L"]}], ["a", None]]}, {"z/0": 42, "z/1": 43})
    {'z': [42, 43], 'a': None}
    """
    return _rebuild(structure, "", values, sorted(values))


def _rebuild(s: Any, prefix: str, values: Mapping[str, Any], keys: list[str]) -> Any:
    if s == LEAF:
        return values[prefix]
    if s is None:
        return None
    if "dict" in s:
        return {k: _rebuild(c, join_path(prefix, k), values, keys) for k, c in s["dict"]}
    if "namedtuple" in s:
        return {k: _rebuild(c, join_path(prefix, k), values, keys) for k, c in s["namedtuple"]}
    if "list" in s:
        return [_rebuild(c, join_path(prefix, i), values, keys) for i, c in enumerate(s["list"])]
    if "tuple" in s:
        return tuple(_rebuild(c, join_path(prefix, i), values, keys) for i, c in enumerate(s["tuple"]))
    head = prefix + SEPARATOR if prefix else ""
    sub = {}
    for p in keys[bisect.bisect_left(keys, head):]:  # the paths under ``prefix``, by binary search
        if not p.startswith(head):
            break
        sub[p[len(head):]] = values[p]
    return unflatten(sub) if sub else {}
