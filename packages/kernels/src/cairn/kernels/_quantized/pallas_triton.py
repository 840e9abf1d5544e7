"""Quantized matmul, the Pallas Triton kernel (``x[m, k] @ q[k, n]``, the ``Linear`` case).

The weight stays int8 (int4 values are widened to int8 once) in memory and is converted
block by block inside the kernel, so a weight-only quantized layer reads a quarter of a
float32 weight's bytes. With a float ``x`` each ``q`` block is cast to ``x``'s dtype and
accumulated in float32; with an int8 ``QArray`` ``x`` the blocks multiply as integers into
an int32 accumulator. The epilogue multiplies by the row scale of ``x`` (per token or per
tensor) and the column scale of ``q`` (per channel or per tensor) before the one store.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cairn.core_array import QArray
from cairn.kernels._quantized.common import values_of
from cairn.kernels._quantized.xla import INT_QTYPES, result_dtype
from cairn.kernels._registry import Implementation
from cairn.kernels._tiling import checked_config, pad_to_multiple

DEFAULT_CONFIG = {"block_m": 64, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 2}


def check_config(config: Mapping[str, Any]) -> dict[str, int]:
    """The config with defaults filled in; raises ``ValueError`` naming a bad key."""
    return checked_config(config, DEFAULT_CONFIG, blocks=("block_m", "block_n", "block_k"))


def _scale_vector(q: QArray, axis: int, size: int) -> jax.Array | None:
    """``q``'s scale as a vector along ``axis`` (size 1 elsewhere), or ``None``."""
    s = jnp.asarray(q.scale, jnp.float32)
    if s.ndim == 0 or s.size == 1:
        return jnp.full((size,), s.reshape(()), jnp.float32)
    other = [d for i, d in enumerate(s.shape) if i != axis]
    if q.layout.kind == "per_tile" or any(d != 1 for d in other):
        return None
    return jnp.broadcast_to(s.reshape(-1), (size,))


def supports(lhs: Any, rhs: Any, dimension_numbers: Any, **_: Any) -> str | None:
    """``None`` for the kernel's case: 2-d int QArray ``rhs`` contracted on axis 0 with
    ``lhs``'s last axis, no batch axes, scales per channel or per tensor, no zero point."""
    (lc, rc), (lb, rb) = dimension_numbers
    if not isinstance(rhs, QArray) or rhs.ndim != 2 or tuple(rc) != (0,) or lb or rb:
        return "the Triton kernel takes a 2-d QArray rhs contracted on axis 0 without batch axes"
    if tuple(lc) != (len(lhs.shape) - 1,):
        return "the Triton kernel contracts lhs's last axis"
    for name, q, axis in (("rhs", rhs, 1), ("lhs", lhs, 0)):
        if not isinstance(q, QArray):
            continue
        if q.qtype not in INT_QTYPES or q.zero_point is not None:
            return f"{name} qtype {q.qtype} (zero point {q.zero_point is not None}): the kernel takes integer qtypes without zero point"
        if name == "lhs" and q.ndim != 2:
            return "a QArray lhs must be 2-d"
        if _scale_vector(q, axis, q.shape[axis]) is None:
            return f"{name} scale layout {q.layout.kind}: the kernel takes per-channel or per-tensor scales"
    return None


def _kernel(x_ref, w_ref, ls_ref, rs_ref, o_ref, *, bk, nk, int_dot, precision):
    bm, bn = o_ref.shape
    acc_dtype = jnp.int32 if int_dot else jnp.float32

    def body(kb, acc):
        x = x_ref[:, pl.ds(kb * bk, bk)]
        w = w_ref[pl.ds(kb * bk, bk), :]
        if not int_dot:
            w = w.astype(x.dtype)
        return acc + jnp.dot(x, w, precision=precision, preferred_element_type=acc_dtype)

    acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), acc_dtype))
    out = acc.astype(jnp.float32) * ls_ref[...][:, None] * rs_ref[...][None, :]
    o_ref[...] = out.astype(o_ref.dtype)


def matmul_triton(x2: Any, ls: Any, w: Any, rs: Any, out_dtype: Any, *, cfg: Any, interpret: Any, precision: Any=None) -> Any:
    m = x2.shape[0]
    n = w.shape[1]
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    xp = pad_to_multiple(pad_to_multiple(x2, 0, bm), 1, bk)
    wp = pad_to_multiple(pad_to_multiple(w, 0, bk), 1, bn)
    mp, kp = xp.shape
    np_ = wp.shape[1]
    int_dot = jnp.issubdtype(x2.dtype, jnp.integer)
    out = pl.pallas_call(
        functools.partial(_kernel, bk=bk, nk=kp // bk, int_dot=int_dot, precision=precision),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // bm, np_ // bn),
        in_specs=[
            pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((kp, bn), lambda i, j: (0, j)),
            pl.BlockSpec((bm,), lambda i, j: (i,)),
            pl.BlockSpec((bn,), lambda i, j: (j,)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        name="cairn_quantized_matmul",
    )(xp, wp, pad_to_multiple(ls, 0, bm), pad_to_multiple(rs, 0, bn))
    return out[:m, :n]


def quantized_dot_general_triton(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    *,
    config: Mapping[str, Any],
    interpret: bool = False,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """The Pallas Triton implementation (see :func:`supports` for the shapes it takes)."""
    cfg = check_config(config)
    out_dtype = result_dtype(lhs, rhs, preferred_element_type)
    k, n = rhs.shape
    w = values_of(rhs).astype(jnp.int8)
    rs = _scale_vector(rhs, 1, n)
    if isinstance(lhs, QArray):
        x2 = values_of(lhs).astype(jnp.int8)
        ls = _scale_vector(lhs, 0, lhs.shape[0])
        lead: tuple[int, ...] = (lhs.shape[0],)
    else:
        lead = tuple(lhs.shape[:-1])
        x2 = jnp.asarray(lhs).reshape(-1, k)
        return _float_lhs(x2, w, rs, out_dtype, cfg, interpret, precision).reshape(*lead, n)
    out = matmul_triton(x2, ls, w, rs, out_dtype, cfg=cfg, interpret=interpret, precision=precision)
    return out.reshape(*lead, n)


def _float_lhs(x2, w, rs, out_dtype, cfg, interpret, precision):
    """The weight-only product, differentiable in ``x2`` (the quantized weight is frozen)."""

    @jax.custom_vjp
    def mm(x2):
        ls = jnp.ones((x2.shape[0],), jnp.float32)
        return matmul_triton(x2, ls, w, rs, out_dtype, cfg=cfg, interpret=interpret, precision=precision)

    def fwd(x2):
        return mm(x2), None

    def bwd(_, g):
        gs = g.astype(jnp.float32) * rs[None, :]
        dx = jnp.dot(gs, w.astype(jnp.float32).T, precision=precision, preferred_element_type=jnp.float32)
        return (dx.astype(x2.dtype),)

    mm.defvjp(fwd, bwd)
    return mm(x2)


IMPLEMENTATION = Implementation(
    "quantized_dot_general", "pallas_triton", quantized_dot_general_triton, frozenset({"gpu"}),
    configs=lambda *a, **k: [
        {**DEFAULT_CONFIG, "block_m": bm, "block_n": bn, "block_k": bk}
        for bm in (16, 64, 128) for bn in (64, 128) for bk in (32, 64)
    ],
    default_config=lambda *a, **k: dict(DEFAULT_CONFIG),
    supports=supports,
)
