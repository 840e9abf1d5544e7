"""Dots on quantized operands, and where each operand's scales sit.

``dot_general`` with both operands quantized symmetrically per channel (scales constant
along the contracted axes) runs on the integer values (``int8 x int8 -> int32``; fp8
values are multiplied in float32) and applies both scales to the output:
``sum_k (s_l q_l)(s_r q_r) = s_l s_r sum_k q_l q_r``. With one operand quantized that way
the other stays float and the one scale is applied to the output. Any other case
(zero points, tiles along a contracted axis, convolutions, ragged dots) dequantizes the
quantized operands and runs the op as traced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cairn.core_array import NF4_LEVELS, QArray
from cairn.quant._rewrite import bind_as_traced

__all__ = ["operand_axes", "quantized_dot", "bind_dequantized"]


def operand_axes(eqn: Any, side: int, ndim: int) -> tuple[tuple[int, ...], int | None]:
    """(axes reduced for one scale, the axis tiles run along) of operand ``side`` (0 or 1).

    For a dot: the contracted axes, tiled along the last of them. For a convolution's
    kernel: every axis but the output features; for its input: every axis but the batch.
    """
    name = eqn.primitive.name
    if name == "dot_general":
        contracting = eqn.params["dimension_numbers"][0][side]
        return tuple(contracting), (contracting[-1] if contracting else None)
    if name in ("ragged_dot_general", "ragged_dot"):
        rdn = eqn.params.get("ragged_dot_dimension_numbers")
        if rdn is None:  # ragged_dot: lhs [m, k], rhs [g, k, n]
            return ((1,), 1) if side == 0 else ((1,), 1)
        contracting = rdn.dot_dimension_numbers[0][side]
        return tuple(contracting), (contracting[-1] if contracting else None)
    dn = eqn.params["dimension_numbers"]  # conv_general_dilated
    keep = dn.lhs_spec[0] if side == 0 else dn.rhs_spec[0]
    return tuple(a for a in range(ndim) if a != keep), None


def _channelwise(q: QArray, reduced: Sequence[int]) -> bool:
    """Symmetric, and one scale along every reduced axis (so scales factor out of the sum)."""
    if q.zero_point is not None or q.layout.kind == "per_tile":
        return False
    s = q.scale
    return getattr(s, "ndim", 0) == 0 or all(s.shape[a] == 1 for a in reduced)


def _output_scale(q: QArray, contracting: Sequence[int], batch: Sequence[int], other_free: int, side: int) -> Any:
    """``q``'s scale laid out like the dot's output: batch, lhs free axes, rhs free axes."""
    import jax.numpy as jnp

    s = jnp.asarray(q.scale, jnp.float32)
    if s.ndim == 0:
        return s
    free = [a for a in range(q.ndim) if a not in contracting and a not in batch]
    s = jnp.transpose(s, (*batch, *free, *contracting))
    s = s.reshape(s.shape[: len(batch) + len(free)])
    nb = len(batch)
    ones = (1,) * other_free
    return s.reshape(s.shape + ones) if side == 0 else s.reshape(s.shape[:nb] + ones + s.shape[nb:])


def _values(q: QArray, dtype: Any) -> Any:
    """``q``'s integer or fp8 values in ``dtype``; sub-byte integers widen through int8
    (XLA's CPU convert from int4 straight to float is several times slower)."""
    import jax.numpy as jnp

    v = q.unpack().qvalue
    if q.qtype == "nf4":
        return jnp.asarray(NF4_LEVELS, jnp.float32)[v.astype(jnp.int32)].astype(dtype)
    if jnp.issubdtype(v.dtype, jnp.integer) and jnp.dtype(v.dtype).itemsize == 1 and jnp.iinfo(v.dtype).bits < 8:
        v = v.astype(jnp.int8 if jnp.issubdtype(v.dtype, jnp.signedinteger) else jnp.uint8)
    return v.astype(dtype)


def quantized_dot(eqn: Any, lhs: Any, rhs: Any) -> list:
    """The traced ``dot_general`` equation ``eqn`` on operands that may be ``QArray``s."""
    import jax.numpy as jnp
    from jax import lax

    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    out_dtype = eqn.outvars[0].aval.dtype
    lq, rq = isinstance(lhs, QArray), isinstance(rhs, QArray)
    lok = lq and _channelwise(lhs, lc)
    rok = rq and _channelwise(rhs, rc)
    if (lq and not lok) or (rq and not rok) or not (lq or rq):
        return bind_dequantized(eqn, [lhs, rhs])
    lfree = (lhs.ndim if lq else jnp.ndim(lhs)) - len(lc) - len(lb)
    rfree = (rhs.ndim if rq else jnp.ndim(rhs)) - len(rc) - len(rb)
    dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    if lq and rq:
        both_int = all(jnp.issubdtype(q.qvalue.dtype, jnp.integer) and q.qtype != "nf4" for q in (lhs, rhs))
        acc = jnp.int32 if both_int else jnp.float32
        a = _values(lhs, jnp.int8 if both_int else jnp.float32)
        b = _values(rhs, jnp.int8 if both_int else jnp.float32)
    else:
        float_side = rhs if lq else lhs
        acc = eqn.params.get("preferred_element_type") or float_side.dtype
        a = _values(lhs, float_side.dtype) if lq else lhs
        b = _values(rhs, float_side.dtype) if rq else rhs
    out = lax.dot_general(a, b, dims, precision=eqn.params.get("precision"), preferred_element_type=acc)
    out = out.astype(jnp.float32)
    if lq:
        out = out * _output_scale(lhs, lc, lb, rfree, 0)
    if rq:
        out = out * _output_scale(rhs, rc, rb, lfree, 1)
    return [out.astype(out_dtype)]


def bind_dequantized(eqn: Any, operands: Sequence[Any], rest: Sequence[Any] = ()) -> list:
    """Run ``eqn`` as traced, with ``QArray`` operands dequantized to the traced dtypes."""
    vals = []
    for x, var in zip([*operands, *rest], eqn.invars):
        if isinstance(x, QArray):
            x = x.dequantize().astype(var.aval.dtype)
        vals.append(x)
    return bind_as_traced(eqn, vals)
