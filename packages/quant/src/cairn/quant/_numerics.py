"""Quantize a float array into a ``QArray`` with per-tensor, per-channel or per-tile scales.

Scales are shared over ``reduce_axes`` (for a weight: its contracting axes, so each
output channel has its own scale) and, with a tile ``(axis, size)``, over each run of
``size`` elements along ``axis``. Symmetric methods give ``q = clip(round(x / s), -qmax,
qmax)`` with ``s = hi / (qmax + 0.5)`` (so the top bucket is used fully, as in Qwix);
asymmetric ones (``minmax``, ``fixed``, and every unsigned qtype) add a zero point
``z = clip(round(qmin - lo / s), qmin, qmax)`` with
``s = (hi - lo) / (qmax - qmin)``, the range first widened to hold 0 (``lo <= 0 <= hi``) so
the integer zero point stays on the grid. Float qtypes use ``s = max(|lo|, |hi|) / fmax`` and
round by the cast. ``QArray.dequantize`` inverts all of them: ``(q - z) * s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from cairn.core_array import NF4_LEVELS, QArray, QuantLayout, canonical_dtype
from cairn.quant._calibration import Method, bounds, parse_method
from cairn.quant._qtypes import QTypeInfo, qtype_info

__all__ = ["quantize_array", "quantize_with_bounds", "fake_quant", "tile_length", "tile_pairs"]


def tile_length(tile_size: int | float | tuple, axis_size: int, where: str) -> int:
    """The tile length for ``tile_size`` (an ``int`` length or a ``float`` ``1/count``).

    Raises:
      ValueError: the tile does not divide the axis (``where`` names the weight or op).
    """
    if isinstance(tile_size, tuple | list):
        raise ValueError(
            f"{where}: tile_size {tuple(tile_size)} tiles two axes, but this method tiles only the "
            f"weight's contracting axis: give one length"
        )
    size = int(tile_size) if isinstance(tile_size, int) else round(axis_size * float(tile_size))
    if size < 1 or axis_size % size:
        raise ValueError(
            f"{where}: tile_size {tile_size!r} gives tiles of {size} along an axis of size "
            f"{axis_size}, which they do not divide"
        )
    return size


def _scale_zero_point(lo: Any, hi: Any, info: QTypeInfo, symmetric: bool) -> tuple[Any, Any]:
    import jax.numpy as jnp

    if info.is_float:
        bound = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
        return jnp.where(bound > 0, bound / info.qmax, 1.0).astype(jnp.float32), None
    if symmetric and info.kind == "int":
        # the top bucket covers [qmax - 0.5, qmax + 0.5): dividing by qmax + 0.5 uses it fully
        return jnp.where(hi > 0, hi / (info.qmax + 0.5), 1.0).astype(jnp.float32), None
    # the grid must hold an exact 0 (the zero point is an integer on it): widen to include it
    lo, hi = jnp.minimum(lo, 0.0), jnp.maximum(hi, 0.0)
    span = hi - lo
    scale = jnp.where(span > 0, span / (info.qmax - info.qmin), 1.0).astype(jnp.float32)
    zero = jnp.clip(jnp.round(info.qmin - lo / scale), info.qmin, info.qmax).astype(jnp.float32)
    return scale, zero


Tile = tuple[int, int] | tuple[tuple[int, int], ...]


def tile_pairs(tile: Tile | None) -> tuple[tuple[int, int], ...]:
    """``tile`` as ``((axis, size), ...)``: one ``(axis, size)`` pair or several (``()``: none)."""
    if tile is None:
        return ()
    if len(tile) == 2 and all(isinstance(t, int) for t in tile):
        return (cast(tuple[int, int], tile),)
    return tuple((int(a), int(t)) for a, t in cast(tuple[tuple[int, int], ...], tile))


def _grouped_bounds(x: Any, method: Method, reduce_axes: list[int], tiles: tuple[tuple[int, int], ...]) -> tuple[Any, Any]:
    if not tiles:
        return bounds(x, method, reduce_axes)
    sizes = dict(tiles)
    split: list[int] = []
    red: list[int] = []
    for i, d in enumerate(x.shape):
        if i in sizes:  # (tiles, tile): the scale is shared within the inner axis
            split += [d // sizes[i], sizes[i]]
            red.append(len(split) - 1)
        else:
            split.append(d)
            if i in reduce_axes:
                red.append(len(split) - 1)
    lo, hi = bounds(x.reshape(split), method, red)
    target = tuple(d // sizes[i] if i in sizes else (1 if i in reduce_axes else d) for i, d in enumerate(x.shape))
    return lo.reshape(target), hi.reshape(target)


def quantize_array(
    x: Any,
    qtype: str,
    *,
    reduce_axes: Sequence[int] | None = None,
    tile: Tile | None = None,
    method: str | Method = "absmax",
    where: str = "array",
    noise: Any = None,
) -> QArray:
    """Quantize ``x`` to ``qtype``, one scale per group (see the module docstring).

    Args:
      x: float array of any shape.
      qtype: a name from :data:`~cairn.quant.QTYPES`.
      reduce_axes: axes that share a scale; ``None`` (the default) is every axis, one
        per-tensor scale; ``()`` gives every element its own scale.
      tile: ``(axis, size)``: additionally one scale per ``size`` elements along ``axis``;
        ``((axis0, size0), (axis1, size1))`` tiles two axes (2-d blocks of scales).
      method: calibration method (see :mod:`cairn.quant._calibration`).
      where: names ``x`` in error messages (a weight path).
      noise: for stochastic rounding of integer qtypes, an array of ``x``'s shape with
        values in ``[-0.5, 0.5)`` added before rounding (``None``: round to nearest).

    Returns:
      A ``QArray`` whose ``dequantize()`` approximates ``x`` within half a step per element
      (for values inside the calibrated range).

    >>> import numpy as np
    >>> q = quantize_array(np.array([[1.0, -2.0], [0.5, 0.25]]), "int8", reduce_axes=(1,))
    >>> q.qvalue.tolist(), q.scale.ravel().tolist()
    ([[64, -127], [127, 64]], [0.01568627543747425, 0.003921568859368563])

    Raises:
      ValueError: unknown qtype or method, or a tile that does not divide its axis.
    """
    import jax.numpy as jnp

    info = qtype_info(qtype)
    m = method if isinstance(method, Method) else parse_method(method)
    x = jnp.asarray(x)
    nd = x.ndim
    reduce_axes = range(nd) if reduce_axes is None else reduce_axes
    red = sorted({a % nd for a in reduce_axes}) if nd else []
    tiles = tile_pairs(tile) if nd else ()
    if info.block is not None and not tiles:
        raise ValueError(f"{where}: {info.name} has scales per block of {info.block} and needs a tile axis")
    tiles = tuple((a % nd, tile_length(t, x.shape[a % nd], where)) for a, t in tiles)
    if info.block is not None and any(t != info.block for _, t in tiles):
        raise ValueError(f"{where}: {info.name} uses blocks of {info.block}, not tiles of {[t for _, t in tiles]}")
    lo, hi = _grouped_bounds(x.astype(jnp.float32), m, red, tiles)
    if tiles:
        layout = QuantLayout.per_tile(tuple(a for a, _ in tiles), tuple(t for _, t in tiles))
    else:
        kept = [i for i in range(nd) if i not in red]
        layout = QuantLayout.per_channel(*kept) if kept else QuantLayout.per_tensor()
    return quantize_with_bounds(x, info.name, lo, hi, layout, symmetric=m.symmetric, noise=noise)


def quantize_with_bounds(
    x: Any, qtype: str, lo: Any, hi: Any, layout: QuantLayout, *, symmetric: bool, noise: Any = None
) -> QArray:
    """Quantize ``x`` over given per-group bounds (the shape of the scale for ``layout``).

    ``symmetric`` uses ``hi`` alone (no zero point) for signed integer qtypes; this is how
    static (calibrated) activation scales are applied.
    """
    import jax.numpy as jnp

    info = qtype_info(qtype)
    x = jnp.asarray(x)
    lo, hi = jnp.asarray(lo, jnp.float32), jnp.asarray(hi, jnp.float32)
    if info.kind in ("nf4", "mx", "nv"):
        scale, zero = _block_or_table_scale(lo, hi, info), None
    else:
        scale, zero = _scale_zero_point(lo, hi, info, symmetric)
    se = layout.repeat_tiles(scale.astype(jnp.float32), x.shape)
    scaled = x.astype(jnp.float32) / se
    if noise is not None:
        if info.kind not in ("int", "uint"):
            raise ValueError(f"stochastic rounding needs an integer qtype, got {info.name}")
        scaled = scaled + noise
    if info.kind == "nf4":
        mids = jnp.asarray(NF4_LEVELS[1:], jnp.float32) / 2 + jnp.asarray(NF4_LEVELS[:-1], jnp.float32) / 2
        q = jnp.searchsorted(mids, jnp.clip(scaled, -1.0, 1.0)).astype(info.storage)
    elif info.is_float:
        q = jnp.clip(scaled, info.qmin, info.qmax).astype(info.storage)
    else:
        ze = 0.0 if zero is None else layout.repeat_tiles(zero, x.shape)
        # symmetric grids stop at -qmax: the absmax element sits at exactly +-(qmax + 0.5),
        # where float rounding would otherwise pick -qmax or -qmax - 1 by chance
        qmin = -info.qmax if zero is None else info.qmin
        q = jnp.clip(jnp.round(scaled) + ze, qmin, info.qmax).astype(info.storage)
    return QArray(q, scale, zero, qtype=info.name if info.kind in ("nf4", "mx", "nv") else info.storage, layout=layout, dtype=canonical_dtype(x.dtype))


def _block_or_table_scale(lo: Any, hi: Any, info: QTypeInfo) -> Any:
    """nf4: the group's absmax; mx: the power of two that brings it within the element
    range; nv: absmax / 6 rounded to fp8 (each stored in ``info.scale_dtype``)."""
    import jax.numpy as jnp

    bound = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    if info.kind == "nf4":
        return jnp.where(bound > 0, bound, 1.0).astype(jnp.float32)
    if info.kind == "mx":
        exp = jnp.ceil(jnp.log2(jnp.where(bound > 0, bound / info.qmax, 1.0)))
        return jnp.exp2(exp).astype(info.scale_dtype)
    fmax = float(jnp.finfo(jnp.float8_e4m3fn).max)
    return jnp.clip(jnp.where(bound > 0, bound / info.qmax, 1.0), 2.0**-9, fmax).astype(info.scale_dtype)


def fake_quant(
    x: Any,
    qtype: str,
    *,
    reduce_axes: Sequence[int] | None = None,
    tile: Tile | None = None,
    method: str | Method = "absmax",
    where: str = "array",
    noise: Any = None,
) -> Any:
    """``x`` quantized and dequantized again, in ``x``'s dtype (same arguments as :func:`quantize_array`).

    Args:
      x: float array of any shape.
      qtype: a name from :data:`~cairn.quant.QTYPES`.
      reduce_axes: axes that share a scale; None is one per-tensor scale, ``()`` one per element.
      tile: ``(axis, size)``: one scale per ``size`` elements along ``axis`` (or two such pairs).
      method: the calibration method.
      where: names ``x`` in error messages.
      noise: for stochastic rounding, an array of ``x``'s shape with values in ``[-0.5, 0.5)``; None
        rounds to nearest.
    """
    return quantize_array(x, qtype, reduce_axes=reduce_axes, tile=tile, method=method, where=where, noise=noise).dequantize()
