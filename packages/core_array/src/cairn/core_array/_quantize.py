"""The one basic ``quantize`` / ``dequantize`` every package may call without cairn.quant.

``cairn.kernels`` quantizes activations for its quantized dot with it, and serving tests
build QArrays with it. It works on NumPy arrays without JAX and on JAX arrays (traced
too). cairn.quant's ``quantize_array`` adds calibration methods, stochastic rounding and
the rule machinery on top; both use the same grid, so results agree bit for bit:

- signed integer qtypes, ``method="absmax"``: ``s = absmax / (qmax + 0.5)``,
  ``q = clip(round(x / s), -qmax, qmax)`` (the top bucket used fully, no zero point);
- ``method="minmax"`` and every unsigned integer qtype: the range ``[lo, hi]`` widened to
  hold 0, ``s = (hi - lo) / (qmax - qmin)``,
  ``z = clip(round(qmin - lo / s), qmin, qmax)``, ``q = clip(round(x / s) + z, qmin, qmax)``;
- float qtypes (fp8, fp4): ``s = absmax / fmax``, ``q = cast(clip(x / s, -fmax, fmax))``;
- ``nf4``: ``s = absmax``, ``q`` the index of the nearest of :data:`NF4_LEVELS`;
- ``mxfp8`` / ``mxfp4``: power-of-two scales ``2**ceil(log2(absmax / fmax))`` (stored as
  float32), per tile of 32 along the layout's tile axis; ``nvfp4`` the same with fp8 scales
  ``absmax / 6`` and tiles of 16.

A scale is computed per group of the layout: one for ``per_tensor``; one per index of the
kept axes for ``per_channel``; for ``per_tile``, one per tile of each tiled axis and per
index of every other axis. An all-zero group gets scale 1.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from cairn.core_array._dtypes import as_numpy_dtype, canonical_dtype, dtype_info
from cairn.core_array._qarray import (
    LOGICAL_QTYPES,
    NF4_LEVELS,
    QArray,
    QuantLayout,
    _tile_split,
    _xp,
    storage_dtype,
)

__all__ = ["quantize", "dequantize"]

_BLOCKS = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}
_METHODS = ("absmax", "minmax")


def _grid(qtype: str) -> tuple[str, float, float]:
    """``(kind, qmin, qmax)`` of a qtype's value grid (floats: ``-fmax``, ``fmax``)."""
    if qtype == "nf4":
        return "nf4", -1.0, 1.0
    info = dtype_info(storage_dtype(qtype))
    if info.kind == "float":
        fmax = float(ml_dtypes.finfo(info.dtype).max)
        return "float", -fmax, fmax
    if info.kind in ("int", "uint"):
        lo, hi = -(2 ** (info.bits - 1)), 2 ** (info.bits - 1) - 1
        if info.kind == "uint":
            lo, hi = 0, 2**info.bits - 1
        return info.kind, float(lo), float(hi)
    raise ValueError(f"quantize: qtype {qtype!r} is not a quantized type (an int, uint, float or nf4 type)")


def _group_bounds(x: Any, layout: QuantLayout, xp: Any) -> tuple[Any, Any]:
    """Per-group ``(min, max)`` of ``x`` in the layout's full scale shape."""
    nd = x.ndim
    target = layout.expected_scale_shape(tuple(x.shape))
    if layout.kind == "per_tile":
        split, inner = _tile_split(tuple(x.shape), layout)
        xs = x.reshape(split)
        lo, hi = xs.min(axis=inner), xs.max(axis=inner)
    else:
        red = tuple(i for i in range(nd) if target[i] == 1 and x.shape[i] != 1) if nd else ()
        lo = x.min(axis=red, keepdims=True) if nd else x
        hi = x.max(axis=red, keepdims=True) if nd else x
    return lo.reshape(target), hi.reshape(target)


def _scale(kind: str, qtype: str, lo: Any, hi: Any, qmin: float, qmax: float, symmetric: bool, xp: Any):
    bound = xp.maximum(xp.abs(lo), xp.abs(hi))
    if qtype in ("mxfp8", "mxfp4"):
        return xp.exp2(xp.ceil(xp.log2(xp.where(bound > 0, bound / qmax, 1.0)))).astype(np.float32), None
    if qtype == "nvfp4":
        fp8max = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
        s = xp.clip(xp.where(bound > 0, bound / qmax, 1.0), 2.0**-9, fp8max)
        return s.astype(as_numpy_dtype("float8_e4m3fn")), None
    if kind == "nf4":
        return xp.where(bound > 0, bound, 1.0).astype(np.float32), None
    if kind == "float" or (symmetric and kind == "int"):
        top = qmax if kind == "float" else qmax + 0.5
        return xp.where(bound > 0, bound / top, 1.0).astype(np.float32), None
    lo, hi = xp.minimum(lo, 0.0), xp.maximum(hi, 0.0)  # an exact 0 on the grid (integer zero point)
    span = hi - lo
    scale = xp.where(span > 0, span / (qmax - qmin), 1.0).astype(np.float32)
    zero = xp.clip(xp.round(qmin - lo / scale), qmin, qmax).astype(np.float32)
    return scale, zero


def quantize(
    x: Any,
    qtype: str = "int8",
    layout: QuantLayout | None = None,
    *,
    method: str = "absmax",
) -> QArray:
    """Quantize ``x`` to ``qtype`` with one scale per group of ``layout``.

    Args:
      x: float array (NumPy or JAX) of any shape.
      qtype: ``int8``, ``int4``, ``uint4``, ``int2``, ``uint8``, ``float8_e4m3fn``,
        ``float8_e5m2``, ``float4_e2m1fn``, ``nf4``, ``mxfp8``, ``mxfp4`` or ``nvfp4``.
      layout: how scales cover the values (default: one per tensor). The block formats
        need a ``per_tile`` layout with tiles of their block length.
      method: ``"absmax"`` (symmetric for signed types) or ``"minmax"`` (with a zero
        point; integer qtypes only).

    Returns:
      A :class:`QArray` (unpacked; call ``.pack()`` for sub-byte storage) whose
      ``dequantize()`` is within half a step of ``x`` per element.

    Raises:
      ValueError: unknown qtype or method, a layout that does not fit ``x``'s shape, or a
        block format without tiles of its block length.

    >>> q = quantize(np.array([[1.0, -2.0], [0.5, 0.25]], np.float32), "int8",
    ...              QuantLayout.per_channel(0))
    >>> q.qvalue.tolist(), q.scale.ravel().tolist()
    ([[64, -127], [127, 64]], [0.01568627543747425, 0.003921568859368563])
    """
    layout = QuantLayout.per_tensor() if layout is None else layout
    if method not in _METHODS:
        raise ValueError(f"quantize: method {method!r} unknown; expected one of {_METHODS}")
    if qtype not in LOGICAL_QTYPES:
        qtype = canonical_dtype(qtype)
    kind, qmin, qmax = _grid(qtype)
    if method == "minmax" and kind not in ("int", "uint"):
        raise ValueError(f"quantize: method 'minmax' needs an integer qtype, got {qtype!r}")
    block = _BLOCKS.get(qtype)
    if block is not None and (layout.kind != "per_tile" or set(layout.tile_sizes) != {block}):
        raise ValueError(f"quantize: {qtype} has one scale per block of {block}: pass QuantLayout.per_tile(axis, {block})")
    xp = _xp(x)
    xf = xp.asarray(x).astype(np.float32)
    lo, hi = _group_bounds(xf, layout, xp)
    scale, zero = _scale(kind, qtype, lo, hi, qmin, qmax, method == "absmax" and kind == "int", xp)
    scaled = xf / layout.repeat_tiles(scale.astype(np.float32), tuple(xf.shape))
    store = as_numpy_dtype(storage_dtype(qtype))
    if kind == "nf4":
        levels = np.asarray(NF4_LEVELS, np.float32)
        mids = xp.asarray((levels[1:] + levels[:-1]) / 2)
        q = xp.searchsorted(mids, xp.clip(scaled, -1.0, 1.0)).astype(store)
    elif kind == "float":
        q = xp.clip(scaled, qmin, qmax).astype(store)
    else:
        ze = 0.0 if zero is None else layout.repeat_tiles(zero, tuple(xf.shape))
        q = xp.clip(xp.round(scaled) + ze, -qmax if zero is None else qmin, qmax).astype(store)
    dtype = canonical_dtype(getattr(x, "dtype", np.float32))
    return QArray(q, scale, zero, qtype=qtype, layout=layout, dtype=dtype)


def dequantize(q: QArray) -> Any:
    """``q``'s values in its original dtype: ``(qvalue - zero_point) * scale`` (see
    :meth:`QArray.dequantize`); plain arrays pass through unchanged.

    Args:
      q: a :class:`QArray` (or a plain array, returned as is).
    """
    return q.dequantize() if isinstance(q, QArray) else q
