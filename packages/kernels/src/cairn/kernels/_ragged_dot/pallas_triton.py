"""Ragged dot, the Pallas Triton implementation (GPU; ``interpret=True`` runs it on the CPU).

Mode ``"m"``: one program per (work item, column block); it accumulates
``lhs[tile] @ rhs[group]`` over ``k`` blocks in float32 (int32 for integer operands) and
stores only the rows of its group (masked store), so tiles on a group boundary are shared
by two programs without overlap; the output starts as zeros (aliased input), which is what
the rows after ``sum(group_sizes)`` keep. Mode ``"k"``: one program per (group, k block,
n block) looping over the row tiles of its group only (a dynamic trip count).

Operands whose sizes are not multiples of the blocks are zero-padded once in the wrapper
(aligned shapes, the usual case, are not copied).
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

from cairn.kernels._ragged_dot.xla import _acc_dtype, make_ragged, out_dtype, schedule
from cairn.kernels._registry import Implementation
from cairn.kernels._tiling import checked_config, pad_to_multiple

DEFAULT_CONFIG = {"block_m": 64, "block_k": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}


def check_config(config: Mapping[str, Any]) -> dict[str, int]:
    """The config with defaults filled in; raises ``ValueError`` naming a bad key."""
    return checked_config(config, DEFAULT_CONFIG, blocks=("block_m", "block_k", "block_n"), strict=True)


def _params(cfg):
    return pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _kernel_m(tile_ref, grp_ref, lo_ref, hi_ref, x_ref, w_ref, _z_ref, o_ref, *, bm, bk, bn, nk, acc, precision):
    i = pl.program_id(0)
    j = pl.program_id(1)
    t = tile_ref[i]
    g = grp_ref[i]
    lo = lo_ref[i]
    hi = hi_ref[i]

    def body(kb, a):
        x = x_ref[pl.ds(t * bm, bm), pl.ds(kb * bk, bk)]
        w = w_ref[g, pl.ds(kb * bk, bk), pl.ds(j * bn, bn)]
        return a + jnp.dot(x, w, precision=precision, preferred_element_type=acc)

    a = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), acc))
    rows = t * bm + lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
    mask = (rows >= lo) & (rows < hi)
    pltriton.store(o_ref.at[pl.ds(t * bm, bm), pl.ds(j * bn, bn)], a.astype(o_ref.dtype), mask=mask)


def forward_m(lhs: Any, rhs: Any, gs: Any, dtype: Any, *, cfg: Any, interpret: Any, precision: Any=None) -> Any:
    """Mode m on the Triton kernel: ``[m, k] x [g, k, n] -> [m, n]``."""
    m = lhs.shape[0]
    n = rhs.shape[2]
    bm, bk, bn = cfg["block_m"], cfg["block_k"], cfg["block_n"]
    x = pad_to_multiple(pad_to_multiple(lhs, 0, bm), 1, bk)
    w = pad_to_multiple(pad_to_multiple(rhs, 1, bk), 2, bn)
    mp, kp = x.shape
    np_ = w.shape[2]
    sch = schedule(gs, m, bm)
    acc = _acc_dtype(dtype)
    kernel = functools.partial(_kernel_m, bm=bm, bk=bk, bn=bn, nk=kp // bk, acc=acc, precision=precision)
    zeros = jnp.zeros((mp, np_), dtype)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), dtype),
        grid=(sch.tile.shape[0], np_ // bn),
        input_output_aliases={6: 0},
        interpret=interpret,
        compiler_params=_params(cfg),
        name="cairn_ragged_dot_m",
    )(sch.tile, sch.group, sch.lo, sch.hi, x, w, zeros)
    return out[:m, :n]


def _kernel_k(start_ref, end_ref, x_ref, y_ref, o_ref, *, bm, bk, bn, acc, precision):
    g = pl.program_id(0)
    a_blk = pl.program_id(1)
    b_blk = pl.program_id(2)
    start = start_ref[g]
    end = end_ref[g]

    def body(t, a):
        rows = t * bm + lax.broadcasted_iota(jnp.int32, (bm, bk), 0)
        x = x_ref[pl.ds(t * bm, bm), pl.ds(a_blk * bk, bk)]
        x = jnp.where((rows >= start) & (rows < end), x, jnp.zeros_like(x))
        y = y_ref[pl.ds(t * bm, bm), pl.ds(b_blk * bn, bn)]
        return a + jnp.dot(x.T, y, precision=precision, preferred_element_type=acc)

    first = start // bm
    last = jnp.where(end > start, (end + bm - 1) // bm, first)
    a = lax.fori_loop(first, last, body, jnp.zeros((bk, bn), acc))
    o_ref[...] = a.astype(o_ref.dtype)


def forward_k(lhs: Any, rhs: Any, gs: Any, dtype: Any, *, cfg: Any, interpret: Any, precision: Any=None) -> Any:
    """Mode k on the Triton kernel: ``[m, k] x [m, n] -> [g, k, n]``."""
    m, k = lhs.shape
    n = rhs.shape[1]
    groups = gs.shape[0]
    bm, bk, bn = cfg["block_m"], cfg["block_k"], cfg["block_n"]
    x = pad_to_multiple(pad_to_multiple(lhs, 0, bm), 1, bk)
    y = pad_to_multiple(pad_to_multiple(rhs, 0, bm), 1, bn)
    ends = jnp.minimum(jnp.cumsum(gs.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    kp, np_ = x.shape[1], y.shape[1]
    acc = _acc_dtype(dtype)
    kernel = functools.partial(_kernel_k, bm=bm, bk=bk, bn=bn, acc=acc, precision=precision)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((groups, kp, np_), dtype),
        grid=(groups, kp // bk, np_ // bn),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=pl.BlockSpec((None, bk, bn), lambda g, a, b: (g, a, b)),
        interpret=interpret,
        compiler_params=_params(cfg),
        name="cairn_ragged_dot_k",
    )(starts, ends, x, y)
    return out[:, :k, :n]


def ragged_dot_triton(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    config: Mapping[str, Any],
    interpret: bool = False,
    ragged: str = "m",
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """The Pallas Triton implementation (forward and backward are Triton kernels)."""
    cfg = check_config(config)
    dtype = out_dtype(lhs, rhs, preferred_element_type)
    fm = functools.partial(forward_m, cfg=cfg, interpret=interpret, precision=precision)
    fk = functools.partial(forward_k, cfg=cfg, interpret=interpret, precision=precision)
    return make_ragged(fm, fk)(ragged, lhs, rhs, group_sizes, dtype)


def _configs(*_: Any, **__: Any) -> list[dict[str, Any]]:
    out = []
    for bm in (64, 128):
        for bn in (64, 128):
            for bk in (32, 64):
                out.append({**DEFAULT_CONFIG, "block_m": bm, "block_n": bn, "block_k": bk})
    return out


def _supports(lhs: Any, rhs: Any, *_: Any, **__: Any) -> str | None:
    if jnp.dtype(lhs.dtype) != jnp.dtype(rhs.dtype):
        return f"lhs and rhs dtypes differ ({jnp.dtype(lhs.dtype).name}, {jnp.dtype(rhs.dtype).name})"
    return None


IMPLEMENTATION = Implementation(
    "ragged_dot", "pallas_triton", ragged_dot_triton, frozenset({"gpu"}), configs=_configs,
    default_config=lambda *a, **k: dict(DEFAULT_CONFIG), supports=_supports,
)
