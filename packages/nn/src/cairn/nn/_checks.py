"""Constructor argument checks shared by the layers.

A bad size, kernel size, stride or rate raises when the layer is built, with the layer
and the argument named, instead of later inside ``lax.dot_general`` or
``lax.conv_general_dilated`` with no name at all. Each helper returns the value in its
canonical Python type (``int``, ``tuple[int, ...]``, ``float``), so the layer stores
exactly what it checked.

>>> positive_int("Linear", "in_features", 3)
3
>>> positive_int("Linear", "in_features", 16.5)
Traceback (most recent call last):
  ...
TypeError: Linear: in_features must be an int, got 16.5 (float)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

__all__ = [
    "finite_float", "nonnegative_float", "nonnegative_int", "optional_positive_int", "positive_float",
    "positive_int", "positive_ints", "rate",
]


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _int(layer: str, name: str, value: Any, minimum: int) -> int:
    if not _is_int(value):
        raise TypeError(f"{layer}: {name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        what = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{layer}: {name} must be {what}, got {value}")
    return int(value)


def positive_int(layer: str, name: str, value: Any) -> int:
    """``value`` as an ``int >= 1``; ``TypeError`` for a float, bool or str, ``ValueError``
    for zero or a negative number."""
    return _int(layer, name, value, 1)


def nonnegative_int(layer: str, name: str, value: Any) -> int:
    """``value`` as an ``int >= 0``."""
    return _int(layer, name, value, 0)


def optional_positive_int(layer: str, name: str, value: Any) -> int | None:
    """``None`` or a positive int."""
    return None if value is None else positive_int(layer, name, value)


def positive_ints(
    layer: str, name: str, value: Any, rank: int | None = None, minimum: int = 1,
    allow_empty: bool = False,
) -> tuple[int, ...]:
    """An int (broadcast to ``rank`` entries when ``rank`` is given) or a sequence of ints,
    each ``>= minimum``, as a tuple; with ``rank`` the sequence needs ``rank`` entries."""
    if _is_int(value):
        items = (value,) * (1 if rank is None else rank)
    elif isinstance(value, Sequence) and not isinstance(value, str):
        items = tuple(value)
    else:
        raise TypeError(
            f"{layer}: {name} must be an int or a sequence of ints, got {value!r} "
            f"({type(value).__name__})"
        )
    if not items and not allow_empty:
        raise ValueError(f"{layer}: {name} must have at least one entry, got {value!r}")
    if rank is not None and len(items) != rank:
        raise ValueError(
            f"{layer}: {name} {tuple(items)} needs one entry per spatial dim ({rank})"
        )
    for i, v in enumerate(items):
        _int(layer, f"{name}[{i}]", v, minimum)
    return tuple(int(v) for v in items)


def finite_float(layer: str, name: str, value: Any) -> float:
    """A finite real number (not a bool or str) as a ``float``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{layer}: {name} must be a real number, got {value!r} ({type(value).__name__})"
        )
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{layer}: {name} must be finite, got {value}")
    return value


def rate(layer: str, name: str, value: Any) -> float:
    """A probability in ``[0, 1]`` (a dropout rate) as a ``float``."""
    value = finite_float(layer, name, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{layer}: {name} must be in [0, 1], got {value}")
    return value


def nonnegative_float(layer: str, name: str, value: Any) -> float:
    """A finite real ``>= 0`` (an epsilon) as a ``float``."""
    value = finite_float(layer, name, value)
    if value < 0:
        raise ValueError(f"{layer}: {name} must be >= 0, got {value}")
    return value


def positive_float(layer: str, name: str, value: Any) -> float:
    """A finite real ``> 0`` (a base, a scale factor) as a ``float``."""
    value = finite_float(layer, name, value)
    if value <= 0:
        raise ValueError(f"{layer}: {name} must be > 0, got {value}")
    return value
