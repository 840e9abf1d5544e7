"""Layer norm and RMS norm, the Pallas Triton kernels (forward and backward).

One program per block of ``block_rows`` rows holds whole rows (the feature axis padded to
a power of two, padded columns masked out of every statistic). The forward writes ``y``,
``mean`` and ``rstd``; the backward writes ``dx`` and one row of partial ``dscale`` /
``doffset`` sums per program, summed by XLA afterwards.
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

from cairn.kernels._norms.xla import make_norm
from cairn.kernels._registry import Implementation
from cairn.kernels._tiling import checked_config, pad_to_multiple

DEFAULT_CONFIG = {"block_rows": 16, "num_warps": 4}


def check_config(config: Mapping[str, Any]) -> dict[str, int]:
    """The config with defaults filled in; raises ``ValueError`` naming a bad key."""
    return checked_config(config, DEFAULT_CONFIG, blocks=("block_rows",), lo=1)


def _fwd_kernel(x_ref, s_ref, o_ref, y_ref, mean_ref, rstd_ref, *, d, eps, subtract_mean):
    x = x_ref[...].astype(jnp.float32)
    br, dp = x.shape
    valid = lax.broadcasted_iota(jnp.int32, (br, dp), 1) < d
    x = jnp.where(valid, x, 0.0)
    mean = jnp.sum(x, axis=1) / d if subtract_mean else jnp.zeros((br,), jnp.float32)
    xc = jnp.where(valid, x - mean[:, None], 0.0)
    rstd = lax.rsqrt(jnp.sum(xc * xc, axis=1) / d + eps)
    y = xc * rstd[:, None] * s_ref[...].astype(jnp.float32)[None, :] + o_ref[...].astype(jnp.float32)[None, :]
    y_ref[...] = y.astype(y_ref.dtype)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def _bwd_kernel(x_ref, s_ref, mean_ref, rstd_ref, dy_ref, dx_ref, ds_ref, do_ref, *, d, subtract_mean):
    x = x_ref[...].astype(jnp.float32)
    br, dp = x.shape
    valid = lax.broadcasted_iota(jnp.int32, (br, dp), 1) < d
    rstd = rstd_ref[...]
    xhat = jnp.where(valid, (x - mean_ref[...][:, None]) * rstd[:, None], 0.0)
    dy = jnp.where(valid, dy_ref[...].astype(jnp.float32), 0.0)
    g = dy * s_ref[...].astype(jnp.float32)[None, :]
    inner = g - xhat * (jnp.sum(g * xhat, axis=1) / d)[:, None]
    if subtract_mean:
        inner = inner - (jnp.sum(g, axis=1) / d)[:, None]
    dx_ref[...] = (inner * rstd[:, None]).astype(dx_ref.dtype)
    ds_ref[...] = jnp.sum(dy * xhat, axis=0)
    do_ref[...] = jnp.sum(dy, axis=0)


def _layout(x, cfg):
    rows, d = x.shape
    br = cfg["block_rows"]
    dp = pl.next_power_of_2(d)
    return rows, d, br, dp, pad_to_multiple(pad_to_multiple(x, 0, br), 1, dp)


def _vec(v, d, dp, fill):
    v = jnp.full((d,), fill, jnp.float32) if v is None else v.astype(jnp.float32)
    return pad_to_multiple(v, 0, dp)


def forward_triton(x: Any, scale: Any, offset: Any, epsilon: Any, subtract_mean: Any, *, cfg: Any, interpret: Any) -> Any:
    rows, d, br, dp, xp = _layout(x, cfg)
    rp = xp.shape[0]
    row = pl.BlockSpec((br, dp), lambda i: (i, 0))
    vec = pl.BlockSpec((dp,), lambda i: (0,))
    stat = pl.BlockSpec((br,), lambda i: (i,))
    y, mean, rstd = pl.pallas_call(
        functools.partial(_fwd_kernel, d=d, eps=epsilon, subtract_mean=subtract_mean),
        out_shape=(
            jax.ShapeDtypeStruct((rp, dp), x.dtype),
            jax.ShapeDtypeStruct((rp,), jnp.float32),
            jax.ShapeDtypeStruct((rp,), jnp.float32),
        ),
        grid=(rp // br,),
        in_specs=[row, vec, vec],
        out_specs=(row, stat, stat),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=1),
        name="cairn_norm_fwd",
    )(xp, _vec(scale, d, dp, 1.0), _vec(offset, d, dp, 0.0))
    return y[:rows, :d], mean[:rows], rstd[:rows]


def backward_triton(x: Any, scale: Any, mean: Any, rstd: Any, dy: Any, subtract_mean: Any, *, cfg: Any, interpret: Any) -> Any:
    rows, d, br, dp, xp = _layout(x, cfg)
    rp = xp.shape[0]
    nb = rp // br
    row = pl.BlockSpec((br, dp), lambda i: (i, 0))
    vec = pl.BlockSpec((dp,), lambda i: (0,))
    stat = pl.BlockSpec((br,), lambda i: (i,))
    part = pl.BlockSpec((None, dp), lambda i: (i, 0))
    dx, ds, do = pl.pallas_call(
        functools.partial(_bwd_kernel, d=d, subtract_mean=subtract_mean),
        out_shape=(
            jax.ShapeDtypeStruct((rp, dp), x.dtype),
            jax.ShapeDtypeStruct((nb, dp), jnp.float32),
            jax.ShapeDtypeStruct((nb, dp), jnp.float32),
        ),
        grid=(nb,),
        in_specs=[row, vec, stat, stat, row],
        out_specs=(row, part, part),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=1),
        name="cairn_norm_bwd",
    )(xp, _vec(scale, d, dp, 1.0), pad_to_multiple(mean, 0, br), pad_to_multiple(rstd, 0, br), pad_to_multiple(pad_to_multiple(dy, 0, br), 1, dp))
    return dx[:rows, :d], ds.sum(axis=0)[:d], do.sum(axis=0)[:d]


def norm_triton(
    x: jax.Array,
    scale: jax.Array | None,
    offset: jax.Array | None,
    *,
    config: Mapping[str, Any],
    interpret: bool = False,
    epsilon: float = 1e-6,
    subtract_mean: bool = True,
) -> jax.Array:
    """The Pallas Triton implementation on ``x[rows, features]``."""
    cfg = check_config(config)
    fwd = functools.partial(forward_triton, cfg=cfg, interpret=interpret)
    bwd = functools.partial(backward_triton, cfg=cfg, interpret=interpret)
    return make_norm(fwd, bwd, epsilon, subtract_mean)(x, scale, offset)


IMPLEMENTATION = Implementation(
    "layer_norm", "pallas_triton", norm_triton, frozenset({"gpu"}),
    configs=lambda *a, **k: [{**DEFAULT_CONFIG, "block_rows": b, "num_warps": w} for b in (1, 4, 16) for w in (4, 8)],
    default_config=lambda *a, **k: dict(DEFAULT_CONFIG),
)
