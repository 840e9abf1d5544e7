"""Calibration: the range ``[lo, hi]`` a tensor is quantized over, per scale group.

Grammar of a method string (Qwix's):

* ``absmax`` or ``absmax,s``: ``hi = s * max|x|``, ``lo = -hi`` (``s`` defaults to 1);
* ``minmax`` or ``minmax,s``: ``lo = s * min(x)``, ``hi = s * max(x)`` (asymmetric);
* ``rms,k``: ``hi = k * sqrt(mean(x**2))``, ``lo = -hi``;
* ``percentile,p``: ``hi`` = the ``p``-th percentile of ``|x|`` (``0 < p <= 100``), ``lo = -hi``;
* ``fixed,min,max``: ``lo = min``, ``hi = max`` for the whole tensor.

Each statistic is taken over ``reduce_axes`` (kept as size-1 axes), so the bounds have
the shape of one scale per group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["Method", "parse_method", "bounds"]

_ARITY = {"absmax": (0, 1), "minmax": (0, 1), "rms": (1, 1), "percentile": (1, 1), "fixed": (2, 2)}


@dataclasses.dataclass(frozen=True)
class Method:
    """A parsed calibration method: ``name`` and its numeric ``args``."""

    name: str
    args: tuple[float, ...]

    @property
    def symmetric(self) -> bool:
        """Whether ``lo == -hi`` by construction (``minmax`` and ``fixed`` are not)."""
        return self.name not in ("minmax", "fixed")


def parse_method(method: str) -> Method:
    """Parse ``"name[,arg...]"``.

    Args:
      method: ``"name[,arg...]"``: ``absmax[,s]``, ``minmax[,s]``, ``rms,k``, ``percentile,p`` or
        ``fixed,min,max``.

    >>> parse_method("absmax"), parse_method("rms,7")
    (Method(name='absmax', args=()), Method(name='rms', args=(7.0,)))

    Raises:
      ValueError: unknown name, wrong number of arguments, or an argument out of range.
    """
    if not isinstance(method, str):
        raise ValueError(f"a calibration method is a string like 'absmax' or 'rms,7', got {method!r}")
    name, *raw = [p.strip() for p in method.split(",")]
    if name not in _ARITY:
        raise ValueError(f"unknown calibration method {method!r}; expected one of {sorted(_ARITY)}")
    low, high = _ARITY[name]
    if not low <= len(raw) <= high:
        want = f"{low}" if low == high else f"{low} to {high}"
        raise ValueError(f"calibration method {method!r} takes {want} numeric argument(s), got {len(raw)}")
    try:
        args = tuple(float(a) for a in raw)
    except ValueError:
        raise ValueError(f"calibration method {method!r}: arguments must be numbers") from None
    if name in ("absmax", "minmax", "rms") and args and not args[0] > 0:
        raise ValueError(f"calibration method {method!r}: the scale factor must be > 0")
    if name == "percentile" and not 0 < args[0] <= 100:
        raise ValueError(f"calibration method {method!r}: the percentile must be in (0, 100]")
    if name == "fixed" and not args[0] < args[1]:
        raise ValueError(f"calibration method {method!r}: min must be below max")
    return Method(name, args)


def bounds(x: Any, method: str | Method, reduce_axes: Sequence[int]) -> tuple[Any, Any]:
    """``(lo, hi)`` of ``x`` per group, reducing ``reduce_axes`` (kept with size 1).

    Computed in float32 (float64 inputs stay float64).

    Args:
      x: the values to calibrate (any shape).
      method: a calibration method, as a string (``"absmax"``, ``"rms,7"``...) or a parsed
        ``Method``.
      reduce_axes: the axes each group spans (reduced, kept with size 1).

    >>> import numpy as np
    >>> lo, hi = bounds(np.array([[1.0, -3.0], [2.0, 0.5]]), "absmax", (1,))
    >>> hi.tolist(), lo.tolist()
    ([[3.0], [2.0]], [[-3.0], [-2.0]])

    Returns:
      ``(lo, hi)``, each ``x``'s shape with ``reduce_axes`` of size 1.
    """
    import jax.numpy as jnp

    m = method if isinstance(method, Method) else parse_method(method)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize < 4:
        x = x.astype(jnp.float32)
    axes = tuple(sorted({a % x.ndim for a in reduce_axes})) if x.ndim else ()
    if m.name == "fixed":
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
        return jnp.full(shape, m.args[0], x.dtype), jnp.full(shape, m.args[1], x.dtype)
    if m.name == "minmax":
        s = m.args[0] if m.args else 1.0
        return s * jnp.min(x, axis=axes, keepdims=True), s * jnp.max(x, axis=axes, keepdims=True)
    if m.name == "absmax":
        hi = (m.args[0] if m.args else 1.0) * jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    elif m.name == "rms":
        hi = m.args[0] * jnp.sqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True))
    else:  # percentile
        hi = jnp.percentile(jnp.abs(x), m.args[0], axis=axes, keepdims=True)
    return -hi, hi
