"""Gated linear unit, the Pallas Triton kernel.

One program per ``[block_m, block_n]`` output tile accumulates both projections
``x @ w[:, 0]`` and ``x @ w[:, 1]`` over ``k`` blocks in float32 (``x`` is read once for
both) and applies ``activation(a) * b`` before the single store. The backward recomputes
the two projections with one XLA dot and differentiates the epilogue (``custom_vjp``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cairn.kernels._glu.xla import apply, glu_input_grads
from cairn.kernels._registry import Implementation
from cairn.kernels._tiling import checked_config, pad_to_multiple

DEFAULT_CONFIG = {"block_m": 64, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 2}


def check_config(config: Mapping[str, Any]) -> dict[str, int]:
    """The config with defaults filled in; raises ``ValueError`` naming a bad key."""
    return checked_config(config, DEFAULT_CONFIG, blocks=("block_m", "block_n", "block_k"))


def _kernel(x_ref, w_ref, o_ref, *, bk, nk, activation, precision):
    bm = x_ref.shape[0]
    bn = w_ref.shape[2]

    def body(kb, acc):
        a, b = acc
        x = x_ref[:, pl.ds(kb * bk, bk)]
        wa = w_ref[pl.ds(kb * bk, bk), 0, :]
        wb = w_ref[pl.ds(kb * bk, bk), 1, :]
        a = a + jnp.dot(x, wa, precision=precision, preferred_element_type=jnp.float32)
        b = b + jnp.dot(x, wb, precision=precision, preferred_element_type=jnp.float32)
        return a, b

    zero = jnp.zeros((bm, bn), jnp.float32)
    a, b = lax.fori_loop(0, nk, body, (zero, zero))
    out = (activation(a) if activation is not None else a) * b
    o_ref[...] = out.astype(o_ref.dtype)


def forward_triton(x: Any, weights: Any, activation: Any, *, cfg: Any, interpret: Any, precision: Any=None) -> Any:
    m = x.shape[0]
    n = weights.shape[2]
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    xp = pad_to_multiple(pad_to_multiple(x, 0, bm), 1, bk)
    wp = pad_to_multiple(pad_to_multiple(weights, 0, bk), 2, bn)
    mp, kp = xp.shape
    np_ = wp.shape[2]
    dtype = jnp.result_type(x, weights)
    out = pl.pallas_call(
        functools.partial(_kernel, bk=bk, nk=kp // bk, activation=activation, precision=precision),
        out_shape=jax.ShapeDtypeStruct((mp, np_), dtype),
        grid=(mp // bm, np_ // bn),
        in_specs=[
            pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((kp, 2, bn), lambda i, j: (0, 0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        name="cairn_gated_linear_unit",
    )(xp, wp)
    return out[:m, :n]


def glu_triton(
    x: jax.Array,
    weights: jax.Array,
    *,
    config: Mapping[str, Any],
    interpret: bool = False,
    activation: Callable[[jax.Array], jax.Array] | None = None,
    precision: Any = None,
) -> jax.Array:
    """The Pallas Triton implementation (Triton forward, recomputing XLA backward)."""
    cfg = check_config(config)
    fwd = functools.partial(forward_triton, cfg=cfg, interpret=interpret)
    return glu_vjp(fwd, activation, precision)(x, weights)


def glu_vjp(forward: Callable[..., Any], activation: Any, precision: Any) -> Callable[..., Any]:
    """A differentiable ``glu(x, w)`` from a kernel ``forward(x, w, activation, precision=)``;
    the backward recomputes both projections with one XLA dot and differentiates the gate."""

    @jax.custom_vjp
    def glu(x, w):
        return forward(x, w, activation, precision=precision)

    def fwd(x, w):
        return glu(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        k, _, n = w.shape
        wf = w.reshape(k, 2 * n)

        def epilogue(h):
            return apply(h, activation, n)

        h = jnp.dot(x, wf, precision=precision, preferred_element_type=jnp.float32)
        _, vjp = jax.vjp(epilogue, h)
        (dh,) = vjp(g.astype(jnp.float32))
        return glu_input_grads(x, w, dh, precision)

    glu.defvjp(fwd, bwd)
    return glu


IMPLEMENTATION = Implementation(
    "gated_linear_unit", "pallas_triton", glu_triton, frozenset({"gpu"}),
    configs=lambda *a, **k: [
        {**DEFAULT_CONFIG, "block_m": bm, "block_n": bn, "block_k": bk}
        for bm in (32, 64, 128) for bn in (32, 64, 128) for bk in (32, 64)
    ],
    default_config=lambda *a, **k: dict(DEFAULT_CONFIG),
)
