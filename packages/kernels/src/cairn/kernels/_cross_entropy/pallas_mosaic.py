"""Linear softmax cross-entropy, the Pallas Mosaic GPU forward kernel (``plgpu.kernel``).

One program per block of ``block_b`` tokens (64 or 128 rows: one warpgroup's ``wgmma``
takes a multiple of 64) walks the vocabulary
in blocks of ``block_v``: each block's logits accumulate in registers with ``plgpu.wgmma``
over hidden blocks streamed through shared memory by ``plgpu.emit_pipeline``, and fold into
the running max and sum of exponentials (online logsumexp); only ``logsumexp`` per token
leaves the chip. ``block_v`` must divide the vocabulary (no padded, masked columns: 32000,
128256 and other vocabularies that are multiples of 32 qualify; others use another
implementation). The label logit ``x[t] . w[:, label[t]]`` is one gathered row dot in XLA,
and the backward is the chunked XLA backward of ``_cross_entropy_xla`` (as the Triton
implementation's). 16-bit operands only (``wgmma``). On the CPU it runs under Mosaic GPU's
interpret mode.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from cairn.kernels._cross_entropy.pallas_triton import supports as triton_supports
from cairn.kernels._cross_entropy.xla import make_loss
from cairn.kernels._registry import Implementation
from cairn.kernels._tiling import checked_config, mosaic_interpret_params, pad_to_multiple

# max_concurrent_steps 4: 18.2 ms against 24.6 with 2 on an H200 (tokens 8192, hidden 4096,
# vocab 128256, block_v 256; benchmarks/kernels_gpu.py --sweep); block_b 128 was slower there
DEFAULT_CONFIG = {"block_b": 64, "block_v": 128, "block_h": 64, "max_concurrent_steps": 4, "block_v_bwd": 2048}


def check_config(config: Mapping[str, Any]) -> dict[str, int]:
    """The config with defaults filled in; raises ``ValueError`` naming a bad key."""
    cfg = checked_config(config, DEFAULT_CONFIG, blocks=("block_v", "block_h"), lo=32, hi=256, counts=("max_concurrent_steps", "block_v_bwd"))
    if cfg["block_b"] not in (64, 128):
        raise ValueError(
            f"config block_b={cfg['block_b']!r} does not fit: one warpgroup's wgmma takes 64 or 128 rows "
            "(the [block_b, block_v] float32 accumulator lives in its registers)"
        )
    return cfg


def _body(x_gmem, w_gmem, lse_gmem, *, bb, bv, bh, nv, nh, steps):
    i = lax.axis_index("b")

    def block_logits(j):
        def acc_scope(acc_ref):
            def step(_, xs, ws):
                plgpu.wgmma(acc_ref, xs, ws)
                # wgmma is asynchronous: the pipeline refills this step's shared-memory
                # buffers as soon as the body returns, so wait for the products that read them
                plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(
                step,
                grid=(nh,),
                in_specs=[
                    plgpu.BlockSpec((bb, bh), lambda h: (i, h)),
                    plgpu.BlockSpec((bh, bv), lambda h: (h, j)),
                ],
                max_concurrent_steps=steps,
            )(x_gmem, w_gmem)
            return acc_ref[...]

        return pl.run_scoped(acc_scope, plgpu.ACC((bb, bv), jnp.float32))

    def fold(logits, m):
        return jnp.exp(logits - lax.broadcast_in_dim(m, (bb, bv), [0])).sum(axis=1)

    def vstep(j, carry):
        m, s = carry
        logits = block_logits(j)
        new_m = jnp.maximum(m, logits.max(axis=1))
        return new_m, s * jnp.exp(m - new_m) + fold(logits, new_m)

    # the first block outside the loop: the running max and sum start in the reduced
    # WGMMA layout of its row reductions (no layout cast of a constant needed)
    first = block_logits(0)
    m0 = first.max(axis=1)
    m, s = lax.fori_loop(1, nv, vstep, (m0, fold(first, m0)))

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bb,), jnp.float32))
    def _store(o_smem):
        o_smem[...] = m + jnp.log(s)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, lse_gmem.at[pl.ds(i * bb, bb)])
        plgpu.wait_smem_to_gmem(0)


def stats_mosaic(x: Any, labels: Any, w: Any, *, cfg: Mapping[str, int], interpret: bool) -> tuple[Any, Any]:
    """``(logsumexp, label_logit)`` per token: the kernel, and a gathered row dot."""
    b = x.shape[0]
    bb, bv, bh = cfg["block_b"], cfg["block_v"], cfg["block_h"]
    if w.shape[1] % bv:
        raise ValueError(f"config block_v={bv} does not fit: it must divide the vocabulary size {w.shape[1]}")
    xp = pad_to_multiple(pad_to_multiple(x, 0, bb), 1, bh)  # zero hidden columns add nothing to the logits
    wp = pad_to_multiple(w, 0, bh)
    body = functools.partial(
        _body, bb=bb, bv=bv, bh=bh, nv=wp.shape[1] // bv, nh=xp.shape[1] // bh,
        steps=cfg["max_concurrent_steps"],
    )
    lse = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((xp.shape[0],), jnp.float32),
        grid=(xp.shape[0] // bb,),
        grid_names=("b",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_interpret_params(interpret),
    )(xp, wp)
    cols = jnp.take(w, labels.astype(jnp.int32), axis=1).T  # [b, hidden]
    ll = jnp.sum(x.astype(jnp.float32) * cols.astype(jnp.float32), axis=1)
    return lse[:b], ll


def cross_entropy_mosaic(
    x: jax.Array,
    labels: jax.Array,
    weights: jax.Array,
    *,
    config: Mapping[str, Any],
    interpret: bool = False,
    reduction: str = "sum",
    precision: Any = None,
) -> jax.Array:
    """The Pallas Mosaic GPU implementation (Mosaic forward, chunked XLA backward)."""
    cfg = check_config(config)
    stats = functools.partial(stats_mosaic, cfg=cfg, interpret=interpret)
    block_v = min(cfg["block_v_bwd"], weights.shape[1])
    return make_loss(stats, block_v, precision)(x, labels, weights, reduction)


def _supports(x: Any, labels: Any, weights: Any, **kwargs: Any) -> str | None:
    reason = triton_supports(x, labels, weights, **kwargs)
    if reason is not None:
        return reason
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"x dtype {jnp.dtype(x.dtype).name}: wgmma takes bfloat16 or float16"
    if weights.shape[1] % 32:
        return f"vocabulary size {weights.shape[1]} is not a multiple of 32 (block_v must divide it)"
    return None


def _default(x: Any, labels: Any, weights: Any, **_: Any) -> dict[str, Any]:
    v = weights.shape[1]
    return {**DEFAULT_CONFIG, "block_v": next((b for b in (256, 128, 64) if v % b == 0), 32)}


def _configs(x: Any, labels: Any, weights: Any, **_: Any) -> list[dict[str, Any]]:
    v = weights.shape[1]
    # every program reads the whole weight once: 128 token rows halve that traffic, with a
    # [128, block_v] float32 accumulator (block_v 256 would take all 255 registers a thread has)
    return [
        {**DEFAULT_CONFIG, "block_b": bb, "block_v": bv, "block_h": bh, "max_concurrent_steps": st}
        for bb in (64, 128) for bv in (64, 128, 256) if v % bv == 0 and bb * bv <= 16384
        for bh in (64, 128) for st in (2, 4)
    ]


IMPLEMENTATION = Implementation(
    "linear_softmax_cross_entropy_loss", "pallas_mosaic_gpu", cross_entropy_mosaic, frozenset({"gpu"}),
    configs=_configs, default_config=_default, supports=_supports,
)
