"""Flax NNX's ``nnx.filterlib``: the filter classes and ``to_predicate``.

A filter is a Variable type, a path regex string, a ``(path, variable) -> bool``
callable, ``...`` / True (everything), None / False (nothing), a tuple or list (any of
them), or one of these classes.
"""

from cairn.nn._filters import (
    All,
    Any,
    Everything,
    Filter,
    Not,
    Nothing,
    OfType,
    PathContains,
    PathRegex,
    WithTag,
    to_predicate,
)


def filters_to_predicates(filters: tuple) -> tuple:
    """``to_predicate`` of each filter (Flax NNX's helper).

    Args:
      filters: a tuple of filters.
    """
    return tuple(to_predicate(f) for f in filters)


__all__ = [
    "All",
    "Any",
    "Everything",
    "Filter",
    "Not",
    "Nothing",
    "OfType",
    "PathContains",
    "PathRegex",
    "WithTag",
    "filters_to_predicates",
    "to_predicate",
]
