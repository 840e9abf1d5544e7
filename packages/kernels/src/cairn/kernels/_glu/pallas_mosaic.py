"""Gated linear unit, the Pallas Mosaic GPU kernel (``plgpu.kernel``, Hopper ``wgmma``).

One program per ``[block_m, block_n]`` output tile streams ``x`` blocks and the matching
value and gate blocks of ``weights`` (viewed as ``[k, 2n]``: value columns first, gate
columns from ``n`` on) through shared memory with ``plgpu.emit_pipeline``; two ``wgmma``
accumulators hold both projections, and ``activation(a) * b`` is applied in registers
before one store through shared memory. The backward is the Triton implementation's
(one XLA dot recomputes the projections). 16-bit operands only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from cairn.kernels._glu.pallas_triton import glu_vjp
from cairn.kernels._registry import Implementation
from cairn.kernels._tiling import checked_config, mosaic_interpret_params, pad_to_multiple

DEFAULT_CONFIG = {"block_m": 64, "block_n": 64, "block_k": 64, "max_concurrent_steps": 2}


def check_config(config: Mapping[str, Any]) -> dict[str, int]:
    """The config with defaults filled in; raises ``ValueError`` naming a bad key."""
    cfg = checked_config(config, DEFAULT_CONFIG, blocks=("block_k", "block_n"), lo=32, hi=256, counts=("max_concurrent_steps",))
    if cfg["block_m"] not in (64, 128):
        raise ValueError(f"config block_m={cfg['block_m']!r} does not fit: wgmma needs 64 or 128")
    return cfg


def _body(x_gmem, w_gmem, o_gmem, *, bm, bn, bk, nk, gate_block, activation, steps):
    i = lax.axis_index("m")
    j = lax.axis_index("n")

    def acc_scope(acc_a, acc_b):
        def step(_, xs, wa, wb):
            plgpu.wgmma(acc_a, xs, wa)
            plgpu.wgmma(acc_b, xs, wb)
            # wgmma is asynchronous: the pipeline refills this step's shared-memory buffers
            # as soon as the body returns, so wait for the products that read them
            plgpu.wgmma_wait(0)

        plgpu.emit_pipeline(
            step,
            grid=(nk,),
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kb: (i, kb)),
                plgpu.BlockSpec((bk, bn), lambda kb: (kb, j)),
                plgpu.BlockSpec((bk, bn), lambda kb: (kb, gate_block + j)),
            ],
            max_concurrent_steps=steps,
        )(x_gmem, w_gmem, w_gmem)
        return acc_a[...], acc_b[...]

    a, b = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)), plgpu.ACC((bm, bn)))
    out = (activation(a) if activation is not None else a) * b

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), o_gmem.dtype))
    def _store(o_smem):
        o_smem[...] = out.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(i * bm, bm), pl.ds(j * bn, bn)])
        plgpu.wait_smem_to_gmem(0)


def forward_mosaic(
    x: Any, weights: Any, activation: Any, *, cfg: Mapping[str, int], interpret: bool, precision: Any = None
) -> Any:
    """The forward kernel on ``x[m, k]`` and ``weights[k, 2, n]``."""
    del precision  # wgmma runs at the operands' precision
    m = x.shape[0]
    n = weights.shape[2]
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    xp = pad_to_multiple(pad_to_multiple(x, 0, bm), 1, bk)
    wp = pad_to_multiple(pad_to_multiple(weights, 0, bk), 2, bn)
    kp, np_ = wp.shape[0], wp.shape[2]
    body = functools.partial(
        _body, bm=bm, bn=bn, bk=bk, nk=kp // bk, gate_block=np_ // bn, activation=activation,
        steps=cfg["max_concurrent_steps"],
    )
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((xp.shape[0], np_), x.dtype),
        grid=(xp.shape[0] // bm, np_ // bn),
        grid_names=("m", "n"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_interpret_params(interpret),
    )(xp, wp.reshape(kp, 2 * np_))
    return out[:m, :n]


def glu_mosaic(
    x: jax.Array,
    weights: jax.Array,
    *,
    config: Mapping[str, Any],
    interpret: bool = False,
    activation: Callable[[jax.Array], jax.Array] | None = None,
    precision: Any = None,
) -> jax.Array:
    """The Pallas Mosaic GPU implementation (Mosaic forward, recomputing XLA backward)."""
    cfg = check_config(config)
    fwd = functools.partial(forward_mosaic, cfg=cfg, interpret=interpret)
    return glu_vjp(fwd, activation, precision)(x, weights)


def _supports(x: Any, weights: Any, **_: Any) -> str | None:
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"x dtype {jnp.dtype(x.dtype).name}: wgmma takes bfloat16 or float16"
    return None


IMPLEMENTATION = Implementation(
    "gated_linear_unit", "pallas_mosaic_gpu", glu_mosaic, frozenset({"gpu"}),
    configs=lambda *a, **k: [
        {**DEFAULT_CONFIG, "block_m": bm, "block_n": bn, "block_k": 64, "max_concurrent_steps": st}
        for bm in (64, 128) for bn in (64, 128, 256) for st in (2, 4)
    ],
    default_config=lambda *a, **k: dict(DEFAULT_CONFIG),
    supports=_supports,
)
