"""Argument checks and names shared by the dataset classes and their transformations.

Nothing here imports another ``cairn.data`` module, so every module may use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

__all__ = [
    "FilterFn",
    "MapFn",
    "RandomMapFn",
    "as_callable",
    "check_seed",
    "fn_name",
    "int_at_least",
]


class _HasMap(Protocol):
    def map(self, element: Any) -> Any: ...


class _HasRandomMap(Protocol):
    def random_map(self, element: Any, rng: np.random.Generator) -> Any: ...


class _HasFilter(Protocol):
    def filter(self, element: Any) -> bool: ...


# What map / random_map / filter accept: a function, or a Grain-style transform object
# whose .map / .random_map / .filter method is used (see as_callable).
MapFn = Callable[[Any], Any] | _HasMap
RandomMapFn = Callable[[Any, np.random.Generator], Any] | _HasRandomMap
FilterFn = Callable[[Any], bool] | _HasFilter


def int_at_least(v: Any, lo: int) -> bool:
    """Whether ``v`` is a Python int (not a bool) and ``>= lo``."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def check_seed(seed: Any, what: str) -> int:
    """``seed`` as an int; ``TypeError`` naming ``what`` for a bool or a non-integer."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"{what}: seed must be an int, got {type(seed).__name__} {seed!r}")
    return int(seed)


def fn_name(fn: Any) -> str:
    """The name a stage shows for a user function (qualname, or the owner's class)."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name
    owner = getattr(fn, "__self__", None)  # a bound method of a transform object
    return type(owner).__name__ if owner is not None else type(fn).__name__


def as_callable(fn: Any, what: str, method: str = "map") -> Callable:
    """Accept a plain callable or a Grain-style transform object (``.map`` / ``.filter`` ...)."""
    if hasattr(fn, method) and not isinstance(fn, type) and callable(getattr(fn, method)):
        return getattr(fn, method)
    if callable(fn):
        return fn
    raise TypeError(f"{what}() expects a callable, got {type(fn).__name__}")
