"""Resolve masks and labels (pytrees, callables or path-regex rules) to one value per leaf.

Path rules use the ``cairn.core_array`` path convention (``"layers/0/mlp/kernel"``)
and ``re.fullmatch``. Rules are ordered; the **first matching rule wins**.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from cairn.core_array import path_matches, tree_paths

__all__ = ["resolve_per_leaf", "is_rules"]


def is_rules(spec: Any, params: Any) -> bool:
    """Whether ``spec`` is a set of path-regex rules rather than a label/mask pytree."""
    if isinstance(spec, str):
        return True
    if isinstance(spec, Sequence) and not isinstance(spec, str) and spec and all(
            isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str) for r in spec):
        return True
    if isinstance(spec, Mapping) and spec and all(isinstance(k, str) for k in spec):
        if isinstance(params, Mapping) and set(spec.keys()) == set(params.keys()):
            return False
        return True
    return False


def _rules_list(spec) -> list[tuple[str, Any]]:
    if isinstance(spec, str):
        return [(spec, True), (".*", False)]
    if isinstance(spec, Mapping):
        return list(spec.items())
    return list(spec)


def _apply_rules(spec, paths: list[str], *, what: str, mask_mode: bool) -> list[Any]:
    rules = _rules_list(spec)
    for pat, _ in rules:
        try:
            re.compile(pat)
        except re.error as e:
            raise ValueError(f"{what} rule {pat!r} is not a valid regular expression: {e}") from None
    out = []
    used = [False] * len(rules)
    for p in paths:
        for ri, (pat, label) in enumerate(rules):
            if path_matches(pat, p):
                out.append(label)
                used[ri] = True
                break
        else:
            if mask_mode:
                out.append(False)
                continue
            raise ValueError(f"{what}: parameter at path {p!r} matches none of the rules "
                             f"{[r for r, _ in rules]}; add a catch-all rule such as '.*'")
    implicit_default = isinstance(spec, str)
    for ri, (pat, _) in enumerate(rules):
        if used[ri] or (implicit_default and ri == len(rules) - 1):
            continue
        anywhere = [p for p in paths if path_matches(pat, p)]
        if anywhere:
            earlier = [r for r, _ in rules[:ri] if any(path_matches(r, q) for q in anywhere)]
            raise ValueError(f"{what} rule {pat!r} only matches parameters already claimed by "
                             f"earlier rules {earlier} (first matching rule wins), e.g. path "
                             f"{anywhere[0]!r}")
        raise ValueError(f"{what} rule {pat!r} matches no parameter; paths look like "
                         f"{paths[:5]}")
    return out


def _broadcast_prefix(prefix, full, *, what: str) -> list[Any]:
    """Expand a pytree prefix (e.g. a mask) to one value per leaf of ``full``."""
    try:
        nested = jax.tree_util.tree_map(
            lambda m, sub: _Rep([m] * len(jax.tree_util.tree_leaves(sub))), prefix, full,
            is_leaf=lambda x: x is None)
    except (ValueError, TypeError) as e:
        pp = set(tree_paths(prefix, is_leaf=lambda x: x is None)) if prefix is not None else set()
        fp = tree_paths(full)
        bad = [p for p in fp if not any(p == q or p.startswith(q + "/") for q in pp)][:5]
        raise ValueError(f"{what} tree does not match the params tree (it must have the same "
                         f"structure or be a prefix of it); params paths not covered: {bad}. "
                         f"({e})") from None
    return [x for rep in jax.tree_util.tree_leaves(nested, is_leaf=lambda x: isinstance(x, _Rep))
            for x in rep.items]


class _Rep:
    """Opaque holder (a pytree leaf) for the values a prefix entry expands to."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = items


def _is_pytree_leaf(x: Any) -> bool:
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))


def resolve_per_leaf(spec: Any, params: Any, *, what: str, mask_mode: bool) -> list[Any]:
    """One label (or bool when ``mask_mode``) per leaf of ``params`` in flatten order."""
    paths = list(tree_paths(params))
    if callable(spec) and not isinstance(spec, Mapping) and _is_pytree_leaf(spec):
        spec = spec(params)   # a callable pytree node with leaves (an Equinox module) is a tree
    if isinstance(spec, bool):
        return [spec] * len(paths)
    if is_rules(spec, params):
        return _apply_rules(spec, paths, what=what, mask_mode=mask_mode)
    vals = _broadcast_prefix(spec, params, what=what)
    if mask_mode:
        return [bool(v) for v in vals]
    return vals
