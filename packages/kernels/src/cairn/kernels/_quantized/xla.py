"""Quantized ``dot_general``, the XLA implementation.

Operands are :class:`cairn.core_array.QArray` s or plain arrays. The plan:

- Both integer QArrays: an ``int8 x int8 -> int32`` dot (int4 values widen to int8 first),
  then one float32 multiply by the product of the scales.
- One QArray (weight-only): its values, cast to the other operand's dtype (exact for int8,
  int4 and fp8 in bfloat16 or wider), go into the dot; the scale multiplies the output
  (against float32 activations it is folded into the float32 conversion instead).
- fp8 QArrays: the dot runs on the fp8 values with float32 accumulation.
- Scales with size 1 on every contracting axis (per-tensor, per-channel on output axes)
  are applied after the dot. A per-tile scale along one contracting axis splits that axis
  into ``(tiles, tile)``, makes ``tiles`` a batch axis of the dot, scales each tile's
  partial product and sums the tiles.
- Anything else (zero points, nf4, other scale layouts): dequantize, then a float dot.

The scale of the output is itself a ``dot_general`` of the two scale arrays (broadcast to
full size on batch axes; contracting axes have size 1), so it lands in the dot's output
layout for any dimension numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import lax

from cairn.core_array import QArray, dtype_info
from cairn.kernels._quantized.common import full_scale, values_of

INT_QTYPES = ("int8", "int4", "int2", "uint8", "uint4")


class Operand(NamedTuple):
    values: Any  # what enters the dot
    scale: Any  # broadcastable to the operand's shape, or None (plain array)
    tiled: int | None  # the contracting axis cut into tiles, or None
    tile: int | None


def _is_int(q: Any) -> bool:
    return isinstance(q, QArray) and q.qtype in INT_QTYPES


def _operand(q: Any, contracting: tuple[int, ...]) -> Operand | None:
    """How ``q`` enters the fast path, or ``None`` when it must be dequantized."""
    if not isinstance(q, QArray):
        return Operand(jnp.asarray(q), None, None, None)
    if q.zero_point is not None or q.qtype == "nf4" or q.qtype in ("mxfp8", "mxfp4", "nvfp4"):
        return None
    if dtype_info(q.qtype).kind not in ("int", "uint", "float"):
        return None
    s = jnp.asarray(q.scale, jnp.float32)
    s = s.reshape((1,) * q.ndim) if s.ndim == 0 else s
    nd = q.ndim
    tiled = tile = None
    if q.layout.kind == "per_tile" and s.ndim:
        ax = q.layout.axes[0] % nd
        if ax in contracting:
            tiled, tile = ax, int(cast(Any, q.layout.tile_size) or 1)
        else:
            s = full_scale(q)
    if any(s.shape[a] != 1 for a in contracting if a != tiled):
        return None
    return Operand(values_of(q), s, tiled, tile)


def _dot_values(a: Operand, b: Operand, both_int: bool) -> tuple[Any, Any, Any]:
    """The two dot operands and the accumulation dtype."""
    x, y = a.values, b.values
    if both_int:
        return x.astype(jnp.int8), y.astype(jnp.int8), jnp.int32
    float_dtype = next((v.dtype for v in (x, y) if jnp.issubdtype(v.dtype, jnp.floating)
                        and jnp.dtype(v.dtype).itemsize > 1), jnp.float32)
    fp8 = all(jnp.dtype(v.dtype).itemsize == 1 and jnp.issubdtype(v.dtype, jnp.floating) for v in (x, y))
    if fp8:
        return x, y, jnp.float32
    return x.astype(float_dtype), y.astype(float_dtype), jnp.float32


def _split(v: Any, axis: int, tile: int) -> Any:
    shape = v.shape
    return v.reshape(shape[:axis] + (shape[axis] // tile, tile) + shape[axis + 1 :])


def _tiled_numbers(dn, la: int, ra: int):
    """Dimension numbers after splitting lhs axis ``la`` and rhs axis ``ra`` into
    ``(tiles, tile)``: tiles become the first batch axis, ``tile`` is contracted."""
    (lc, rc), (lb, rb) = dn

    def shift(axes, at):
        return tuple(a + 1 if a > at else a for a in axes)

    lc2 = tuple(la + 1 if a == la else a for a in shift(lc, la))
    rc2 = tuple(ra + 1 if a == ra else a for a in shift(rc, ra))
    return ((lc2, rc2), ((la,) + shift(lb, la), (ra,) + shift(rb, ra)))


def _scale_operand(op: Operand, shape: tuple[int, ...], batch: tuple[int, ...], contracting: tuple[int, ...]):
    s = op.scale if op.scale is not None else jnp.ones((1,) * len(shape), jnp.float32)
    target = tuple(shape[i] if i in batch else (1 if i in contracting else s.shape[i]) for i in range(len(shape)))
    return jnp.broadcast_to(s, target)


def fast_dot(lhs: Any, rhs: Any, dn: Any, precision: Any, out_dtype: Any) -> Any | None:
    """The scaled-after-the-dot product, or ``None`` when a layout needs dequantization."""
    (lc, rc), (lb, rb) = dn
    a, b = _operand(lhs, tuple(lc)), _operand(rhs, tuple(rc))
    if a is None or b is None:
        return None
    la = lc[rc.index(b.tiled)] if b.tiled is not None else None
    ra = rc[lc.index(a.tiled)] if a.tiled is not None else None
    if a.tiled is not None and b.tiled is not None and (ra != b.tiled or a.tile != b.tile):
        return None
    tile = a.tile or b.tile
    if tile is not None:
        la = cast(int, a.tiled if a.tiled is not None else la)
        ra = cast(int, b.tiled if b.tiled is not None else ra)
        a = Operand(_split(a.values, la, tile), _split_scale(a.scale, la), la, tile)
        b = Operand(_split(b.values, ra, tile), _split_scale(b.scale, ra), ra, tile)
        dn = _tiled_numbers(dn, la, ra)
        (lc, rc), (lb, rb) = dn
    x, y, acc = _dot_values(a, b, _is_int(lhs) and _is_int(rhs))
    folded = _fold_f32(a, b, x, y)
    if folded is not None:
        return lax.dot_general(*folded, dn, precision=precision, preferred_element_type=jnp.float32).astype(out_dtype)
    out = lax.dot_general(x, y, dn, precision=precision, preferred_element_type=acc)
    ls = _scale_operand(a, x.shape, tuple(lb), tuple(lc))
    rs = _scale_operand(b, y.shape, tuple(rb), tuple(rc))
    scale = lax.dot_general(ls, rs, dn, preferred_element_type=jnp.float32)
    out = out.astype(jnp.float32) * scale
    if tile is not None:
        out = out.sum(axis=0)
    return out.astype(out_dtype)


def _fold_f32(a: Operand, b: Operand, x: Any, y: Any) -> tuple[Any, Any] | None:
    """Weight-only against a float32 operand, untiled: the scale folded into the float32
    conversion of the values (free in the convert's fusion, exact in float32), not a
    separate pass over the output; ``None`` otherwise (16-bit activations keep the scale
    after the dot: folding would round the scaled weights to 16 bits)."""
    if a.tile is not None or b.tile is not None or (a.scale is None) == (b.scale is None):
        return None
    plain, quant = (x, (y, b.scale)) if a.scale is None else (y, (x, a.scale))
    if jnp.dtype(plain.dtype) != jnp.dtype(jnp.float32):
        return None
    scaled = quant[0].astype(jnp.float32) * quant[1]
    return (x, scaled) if a.scale is None else (scaled, y)


def _split_scale(s: Any, axis: int) -> Any:
    """A scale for values split at ``axis``: ``[.., tiles or 1, ..] -> [.., tiles or 1, 1, ..]``."""
    return None if s is None else jnp.expand_dims(s, axis + 1)


def result_dtype(lhs: Any, rhs: Any, preferred_element_type: Any) -> Any:
    """The output dtype: ``preferred_element_type``, else the float operand's (or the
    QArray's original) dtype."""
    if preferred_element_type is not None:
        return jnp.dtype(preferred_element_type)
    dts = [jnp.dtype(q.dtype) for q in (lhs, rhs)]
    return jnp.result_type(*dts)


def dequantized(x: Any) -> Any:
    return jnp.asarray(x.dequantize()) if isinstance(x, QArray) else x


def quantized_dot_general_xla(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    *,
    config: Mapping[str, Any],
    interpret: bool = False,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """The XLA implementation (no config keys)."""
    del config, interpret
    dn: Any = tuple(tuple(tuple(int(a) for a in axes) for axes in pair) for pair in dimension_numbers)
    out_dtype = result_dtype(lhs, rhs, preferred_element_type)
    out = fast_dot(lhs, rhs, dn, precision, out_dtype)
    if out is not None:
        return out
    return lax.dot_general(
        dequantized(lhs), dequantized(rhs), dn, precision=precision, preferred_element_type=jnp.float32
    ).astype(out_dtype)
