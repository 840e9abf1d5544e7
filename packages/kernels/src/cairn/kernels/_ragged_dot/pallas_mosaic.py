"""Ragged dot, the Pallas Mosaic GPU implementation (``plgpu.kernel``, Hopper ``wgmma``).

Mode ``"m"``: one program per (work item, column block) streams ``lhs`` and ``rhs[group]``
blocks through shared memory with ``plgpu.emit_pipeline`` and accumulates with
``plgpu.wgmma``; each item writes its whole row tile to its own slot of an
``[items * block_m, n]`` buffer (no two programs write the same bytes) and one XLA gather
puts every row in place (rows after ``sum(group_sizes)`` become zeros). Mode ``"k"``
(the weight gradient) runs the Triton kernel. 16-bit operands only (``wgmma``).

On the CPU it runs under Mosaic GPU's interpret mode (``InterpretGPUParams``), which
simulates shared memory, TMA copies, barriers and ``wgmma``.
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

from cairn.kernels._ragged_dot.pallas_triton import DEFAULT_CONFIG as TRITON_DEFAULT
from cairn.kernels._ragged_dot.pallas_triton import forward_k
from cairn.kernels._ragged_dot.xla import make_ragged, out_dtype, schedule
from cairn.kernels._registry import Implementation
from cairn.kernels._tiling import checked_config, mosaic_interpret_params, pad_to_multiple

DEFAULT_CONFIG = {"block_m": 64, "block_k": 64, "block_n": 64, "max_concurrent_steps": 2}


def check_config(config: Mapping[str, Any]) -> dict[str, int]:
    """The config with defaults filled in; raises ``ValueError`` naming a bad key."""
    cfg = checked_config(config, DEFAULT_CONFIG, blocks=("block_k", "block_n"), lo=32, hi=256, counts=("max_concurrent_steps",))
    if cfg["block_m"] not in (64, 128):
        raise ValueError(f"config block_m={cfg['block_m']!r} does not fit: wgmma needs 64 or 128")
    return cfg


def _body(tile_ref, x_gmem, w_gmem, grp_ref, o_gmem, *, bm, bk, bn, nk, steps):
    i = lax.axis_index("i")
    j = lax.axis_index("n")
    t = tile_ref[i]
    g = grp_ref[i]

    def acc_scope(acc_ref):
        def step(_, xs, ws):
            plgpu.wgmma(acc_ref, xs, ws)
            # wgmma is asynchronous: the pipeline refills this step's shared-memory buffers
            # as soon as the body returns, so wait for the products that read them
            plgpu.wgmma_wait(0)

        plgpu.emit_pipeline(
            step,
            grid=(nk,),
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kb: (t, kb)),
                plgpu.BlockSpec((bk, bn), lambda kb: (kb, j)),
            ],
            max_concurrent_steps=steps,
        )(x_gmem, w_gmem.at[g])
        return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), o_gmem.dtype))
    def _store(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(i * bm, bm), pl.ds(j * bn, bn)])
        plgpu.wait_smem_to_gmem(0)


def _row_slots(gs: jax.Array, m: int, bm: int) -> tuple[jax.Array, jax.Array]:
    """For each row: its slot in the item buffer, and whether it is in a group."""
    ends = jnp.minimum(jnp.cumsum(gs.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first = starts // bm
    counts = jnp.where(ends > starts, (jnp.maximum(ends - 1, 0) // bm) - first + 1, 0)
    off_start = jnp.cumsum(counts) - counts
    r = jnp.arange(m, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(ends, r, side="right"), gs.shape[0] - 1)
    item = off_start[g] + r // bm - first[g]
    return item * bm + r % bm, r < ends[-1]


def forward_m(lhs: Any, rhs: Any, gs: Any, dtype: Any, *, cfg: Any, interpret: Any) -> Any:
    """Mode m on the Mosaic GPU kernel: ``[m, k] x [g, k, n] -> [m, n]``."""
    m = lhs.shape[0]
    n = rhs.shape[2]
    bm, bk, bn = cfg["block_m"], cfg["block_k"], cfg["block_n"]
    x = pad_to_multiple(pad_to_multiple(lhs, 0, bm), 1, bk)
    w = pad_to_multiple(pad_to_multiple(rhs.astype(lhs.dtype), 1, bk), 2, bn)
    np_ = w.shape[2]
    sch = schedule(gs, m, bm)
    items = sch.tile.shape[0]
    body = functools.partial(_body, bm=bm, bk=bk, bn=bn, nk=x.shape[1] // bk, steps=cfg["max_concurrent_steps"])
    buf = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((items * bm, np_), dtype),
        grid=(items, np_ // bn),
        grid_names=("i", "n"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_interpret_params(interpret),
    )(sch.tile, x, w, sch.group)
    slot, valid = _row_slots(gs, m, bm)
    rows = jnp.take(buf[:, :n], slot, axis=0)
    return jnp.where(valid[:, None], rows, jnp.zeros_like(rows))


def ragged_dot_mosaic(
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
    """The Pallas Mosaic GPU implementation (mode k and ``drhs`` on the Triton kernel)."""
    del precision  # wgmma runs at the operands' precision
    cfg = check_config(config)
    dtype = out_dtype(lhs, rhs, preferred_element_type)
    tcfg = {**TRITON_DEFAULT, "block_m": cfg["block_m"], "block_k": cfg["block_k"], "block_n": cfg["block_n"]}
    fm = functools.partial(forward_m, cfg=cfg, interpret=interpret)
    fk = functools.partial(forward_k, cfg=tcfg, interpret=interpret)
    return make_ragged(fm, fk)(ragged, lhs, rhs, group_sizes, dtype)


def _supports(lhs: Any, rhs: Any, *_: Any, **__: Any) -> str | None:
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if jnp.dtype(a.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"{name} dtype {jnp.dtype(a.dtype).name}: wgmma takes bfloat16 or float16"
    if jnp.dtype(lhs.dtype) != jnp.dtype(rhs.dtype):
        return "lhs and rhs dtypes differ"
    return None


def _configs(*_: Any, **__: Any) -> list[dict[str, Any]]:
    return [
        {**DEFAULT_CONFIG, "block_m": bm, "block_n": bn, "block_k": 64, "max_concurrent_steps": s}
        for bm in (64, 128) for bn in (64, 128, 256) for s in (2, 4)
    ]


IMPLEMENTATION = Implementation(
    "ragged_dot", "pallas_mosaic_gpu", ragged_dot_mosaic, frozenset({"gpu"}), configs=_configs,
    default_config=lambda *a, **k: dict(DEFAULT_CONFIG), supports=_supports,
)
