"""Ragged dot, the XLA implementation, and the work-item schedule every implementation shares.

Two modes cover ``jax.lax.ragged_dot_general`` without batch dims:

- ``"m"`` (ragged rows, the MoE forward): ``lhs[m, k]`` rows are cut into consecutive groups
  of ``group_sizes``; rows of group ``g`` are multiplied by ``rhs[g, k, n]``; rows after
  ``sum(group_sizes)`` give zeros. Output ``[m, n]``.
- ``"k"`` (ragged contraction, the weight gradient): ``lhs[m, k]`` and ``rhs[m, n]`` share
  the ragged row axis; ``out[g] = lhs[rows of g].T @ rhs[rows of g]``. Output ``[g, k, n]``.

The schedule: rows are cut into tiles of ``block_m``; a *work item* is a (tile, group)
pair whose rows overlap, so a tile on a group boundary is visited once per group it holds
and the number of items is at most ``cdiv(m, block_m) + groups - 1``. The XLA
implementation loops over the items with one ``[block_m, k] @ [k, n]`` each (instead of
``jax.lax.ragged_dot``'s dense form on the CPU, one full ``[m, k] @ [k, n]`` per group).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Schedule(NamedTuple):
    """Work items: ``tile[i]``, ``group[i]`` and the row range ``[lo[i], hi[i])`` (empty for
    the padding items after the real ones)."""

    tile: jax.Array
    group: jax.Array
    lo: jax.Array
    hi: jax.Array


def num_items(m: int, groups: int, block_m: int) -> int:
    """The static upper bound on the number of work items."""
    return max(1, -(-m // block_m) + groups - 1)


def schedule(group_sizes: jax.Array, m: int, block_m: int) -> Schedule:
    """The work items for rows of ``m`` cut into ``group_sizes`` and tiles of ``block_m``."""
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(gs), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    nonempty = ends > starts
    first = starts // block_m
    last = jnp.maximum(ends - 1, 0) // block_m
    counts = jnp.where(nonempty, last - first + 1, 0)
    off_end = jnp.cumsum(counts)
    off_start = off_end - counts
    n = num_items(m, gs.shape[0], block_m)
    i = jnp.arange(n, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(off_end, i, side="right"), gs.shape[0] - 1).astype(jnp.int32)
    valid = i < off_end[-1]
    tile = jnp.where(valid, first[g] + i - off_start[g], 0).astype(jnp.int32)
    lo = jnp.maximum(starts[g], tile * block_m)
    hi = jnp.minimum(ends[g], tile * block_m + block_m)
    lo = jnp.where(valid, lo, 0)
    hi = jnp.where(valid, hi, 0)
    return Schedule(tile, g, lo.astype(jnp.int32), hi.astype(jnp.int32))


def row_groups(group_sizes: jax.Array, m: int) -> jax.Array:
    """The group of each row (``groups`` for the rows after the last group)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def out_dtype(lhs: Any, rhs: Any, preferred_element_type: Any) -> Any:
    return jnp.dtype(preferred_element_type) if preferred_element_type is not None else jnp.result_type(lhs, rhs)


def _pad_rows(x: jax.Array, block_m: int) -> jax.Array:
    pad = -x.shape[0] % block_m
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _fwd_m(lhs, rhs, group_sizes, block_m, precision, acc_dtype):
    m = lhs.shape[0]
    n = rhs.shape[2]
    sch = schedule(group_sizes, m, block_m)
    x = _pad_rows(lhs, block_m)
    out = jnp.zeros((x.shape[0], n), acc_dtype)
    rows = jnp.arange(block_m, dtype=jnp.int32)

    def body(i, out):
        t, g, lo, hi = sch.tile[i], sch.group[i], sch.lo[i], sch.hi[i]
        xt = lax.dynamic_slice_in_dim(x, t * block_m, block_m, 0)
        y = jnp.dot(xt, rhs[g], precision=precision, preferred_element_type=acc_dtype)
        r = t * block_m + rows
        keep = ((r >= lo) & (r < hi))[:, None]
        cur = lax.dynamic_slice_in_dim(out, t * block_m, block_m, 0)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y, cur), t * block_m, 0)

    out = lax.fori_loop(0, sch.tile.shape[0], body, out)
    return out[:m]


def _fwd_k(lhs, rhs, group_sizes, block_m, precision, acc_dtype):
    m, k = lhs.shape
    n = rhs.shape[1]
    groups = group_sizes.shape[0]
    sch = schedule(group_sizes, m, block_m)
    x = _pad_rows(lhs, block_m)
    y = _pad_rows(rhs, block_m)
    out = jnp.zeros((groups, k, n), acc_dtype)
    rows = jnp.arange(block_m, dtype=jnp.int32)

    def body(i, out):
        t, g, lo, hi = sch.tile[i], sch.group[i], sch.lo[i], sch.hi[i]
        r = t * block_m + rows
        keep = ((r >= lo) & (r < hi))[:, None]
        xt = jnp.where(keep, lax.dynamic_slice_in_dim(x, t * block_m, block_m, 0), 0)
        yt = lax.dynamic_slice_in_dim(y, t * block_m, block_m, 0)
        part = lax.dot_general(xt, yt, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=acc_dtype)
        return out.at[g].add(part)

    return lax.fori_loop(0, sch.tile.shape[0], body, out)


def _acc_dtype(dtype: Any) -> Any:
    return jnp.int32 if jnp.issubdtype(dtype, jnp.integer) else jnp.float32


def _compute(mode, lhs, rhs, group_sizes, block_m, precision, dtype):
    acc = _acc_dtype(dtype)
    if mode == "m":
        return _fwd_m(lhs, rhs, group_sizes, block_m, precision, acc).astype(dtype)
    return _fwd_k(lhs, rhs, group_sizes, block_m, precision, acc).astype(dtype)


def make_ragged(forward_m: Any, forward_k: Any) -> Any:
    """A differentiable ragged dot from the two forward passes.

    ``forward_m(lhs, rhs, gs, dtype)`` and ``forward_k(lhs, rhs, gs, dtype)`` compute the
    two modes; the backward of each mode is the other mode (and itself transposed):
    mode m: ``dlhs = m(g, rhs^T)``, ``drhs = k(lhs, g)``;
    mode k: ``dlhs = m(rhs, g^T)`` and ``drhs = m(lhs, g)`` per group.
    """

    def run(mode, lhs, rhs, gs, dtype):
        return (forward_m if mode == "m" else forward_k)(lhs, rhs, gs, dtype)

    def grads(mode, lhs, rhs, gs, g):
        if mode == "m":
            dl = forward_m(g, jnp.swapaxes(rhs, 1, 2), gs, lhs.dtype)
            dr = forward_k(lhs, g, gs, rhs.dtype)
        else:
            # out[g] = lhs_g^T rhs_g: dlhs_g = rhs_g @ g[g]^T, drhs_g = lhs_g @ g[g]
            dl = forward_m(rhs, jnp.swapaxes(g, 1, 2), gs, lhs.dtype)
            dr = forward_m(lhs, g, gs, rhs.dtype)
        return dl, dr

    import functools

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
    def ragged(mode, lhs, rhs, gs, dtype):
        return run(mode, lhs, rhs, gs, dtype)

    def fwd(mode, lhs, rhs, gs, dtype):
        return run(mode, lhs, rhs, gs, dtype), (lhs, rhs, gs)

    def bwd(mode, dtype, res, g):
        lhs, rhs, gs = res
        dl, dr = grads(mode, lhs, rhs, gs, g)
        return dl, dr, None

    ragged.defvjp(fwd, bwd)
    return ragged


def _xla_m(block_m, precision):
    return lambda lhs, rhs, gs, dtype: _compute("m", lhs, rhs, gs, block_m, precision, dtype)


def _xla_k(block_m, precision):
    return lambda lhs, rhs, gs, dtype: _compute("k", lhs, rhs, gs, block_m, precision, dtype)


def ragged_dot_xla(
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
    """The XLA implementation: ``config["method"]`` is ``"tiled"`` (the work-item loop with
    ``config["block_m"]``) or ``"dense"`` (``jax.lax.ragged_dot_general`` itself);
    ``ragged`` is the mode, ``"m"`` or ``"k"`` (see the module docstring)."""
    del interpret
    dtype = out_dtype(lhs, rhs, preferred_element_type)
    if config.get("method", "tiled") == "dense":
        fn = make_ragged(
            lambda a, b, gs, dt: _dense("m", a, b, gs, precision, dt),
            lambda a, b, gs, dt: _dense("k", a, b, gs, precision, dt),
        )
    else:
        block_m = int(config.get("block_m", 128))
        fn = make_ragged(_xla_m(block_m, precision), _xla_k(block_m, precision))
    return fn(ragged, lhs, rhs, group_sizes, dtype)


def dimension_numbers(mode: str) -> lax.RaggedDotDimensionNumbers:
    """The ``ragged_dot_general`` dimension numbers of a mode on 2-d ``lhs``."""
    if mode == "m":
        return lax.RaggedDotDimensionNumbers(((([1], [1]), ([], []))), [0], [0])
    return lax.RaggedDotDimensionNumbers(((([0], [0]), ([], []))), [0], [])


def _dense(mode, lhs, rhs, group_sizes, precision, dtype):
    return lax.ragged_dot_general(
        lhs, rhs, group_sizes.astype(jnp.int32), dimension_numbers(mode), precision=precision,
        preferred_element_type=dtype,
    )
