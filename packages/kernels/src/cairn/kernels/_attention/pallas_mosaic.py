"""The ``pallas_mosaic_gpu`` implementation of ``dot_product_attention`` (Hopper, ``plgpu.kernel``).

The forward is a Mosaic GPU kernel written with ``plgpu.kernel`` (``pallas_call`` for
Mosaic GPU is deprecated): one program per (head, query block, batch) copies its query
block to shared memory with TMA, walks the visible key blocks (TMA copies of K and V),
computes ``Q K^T`` (key and value blocks double-buffered: the next block's copies run
while this one computes; K is handed over as ``[B, K, H, S]``, so both ``wgmma`` operands
are plain row-major tiles) and ``P V`` with ``wgmma`` into float32 accumulators and keeps an online
softmax in registers; it writes the output and the log-sum-exp. The backward reuses the
``pallas_triton`` dq and dk/dv kernels on the saved log-sum-exp (Triton runs on the same
GPUs).

Takes float16/bfloat16, head dims up to 256 (padded to 64/128/256), causal, window, soft
cap, GQA, ragged lengths (padded keys are masked by position). Not: lengths given as
arrays, segment ids, ``bias``, a dense ``mask``, dropout, float32 (use ``pallas_triton``
or ``xla``).

Without a GPU the kernel runs under Mosaic GPU's interpreter
(``InterpretGPUParams``, which simulates shared memory, TMA, barriers and ``wgmma`` on the
CPU); CI runs it that way and also lowers it with ``jax.export(platforms=["cuda"])``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from cairn.kernels._attention import pallas_triton as _attention_triton
from cairn.kernels._attention.common import AttentionSpec, transform_logits
from cairn.kernels._registry import Implementation
from cairn.kernels._tiling import mosaic_interpret_params


def _registers(interpreted: bool, bq: int, bk: int, dv: int) -> tuple[Any, Any]:
    """The initial (max, sum, accumulator) registers and an iota in the wgmma layout.

    The CPU interpreter has no ``layout_cast``: registers have no layout there.
    """
    if interpreted:

        def iota(axis: int) -> Any:
            return jax.lax.broadcasted_iota(jnp.int32, (bq, bk), axis)

        def cast(x: Any, layout: Any) -> Any:
            del layout
            return x
    else:

        def iota(axis: int) -> Any:
            return plgpu.broadcasted_iota(jnp.int32, (bq, bk), axis, layout=plgpu.Layout.WGMMA)

        def cast(x: Any, layout: Any) -> Any:
            return plgpu.layout_cast(x, layout)

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    init = (
        cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout),
        cast(jnp.zeros((bq,), jnp.float32), row_layout),
        cast(jnp.zeros((bq, dv), jnp.float32), plgpu.Layout.WGMMA),
    )
    return init, iota


def _online_softmax(s: Any, m: Any, l_sum: Any, acc: Any) -> tuple[Any, Any, Any, Any]:
    """One online-softmax update: new max, sum, rescaled accumulator, and the block's P."""
    m_new = jnp.maximum(m, s.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - jax.lax.broadcast_in_dim(m_safe, s.shape, [0]))
    l_sum = l_sum * alpha + p.sum(axis=1)
    return m_new, l_sum, acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0]), p


def _block_logits(q_smem: Any, kt_smem: Any, spec: AttentionSpec, rows: Any, cols: Any, s_len: int | None) -> Any:
    """``Q K^T`` of one key block (``wgmma`` into a float32 accumulator), transformed and masked."""
    bq, bk = q_smem.shape[0], kt_smem.shape[-1]

    def qk(acc_ref: Any) -> Any:
        plgpu.wgmma(acc_ref, q_smem, kt_smem)
        return acc_ref[...]

    s = transform_logits(spec, pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32)))
    vis = _attention_triton.position_mask(spec, rows, cols, kv_len=s_len)
    return s if vis is None else jnp.where(vis, s, -jnp.inf)


def _store(m: Any, l_sum: Any, acc: Any, o_smem: Any, lse_smem: Any, o_gmem: Any, lse_gmem: Any) -> None:
    """Normalise the accumulator, stage output and log-sum-exp in shared memory, copy them out."""
    empty = l_sum == 0.0
    safe_l = jnp.where(empty, 1.0, l_sum)
    o_smem[...] = (acc / jax.lax.broadcast_in_dim(safe_l, acc.shape, [0])).astype(o_smem.dtype)
    lse_smem[...] = jnp.where(empty, 0.0, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(safe_l))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem)
    plgpu.copy_smem_to_gmem(lse_smem, lse_gmem)
    plgpu.wait_smem_to_gmem(0)


# fmt: off
def _fwd_body(
    q_ref: Any, kt_ref: Any, v_ref: Any, o_ref: Any, lse_ref: Any, *, spec: AttentionSpec,
    bq: int, bk: int, groups: int, s_len: int | None, nk: int, interpreted: bool, buffers: int,
) -> None:  # fmt: on
    h = jax.lax.axis_index("heads")
    qi = jax.lax.axis_index("q_seq")
    b = jax.lax.axis_index("batch")
    kv_h = jax.lax.div(h, jnp.array(groups, h.dtype))
    q0 = qi * bq
    d, dv = q_ref.shape[-1], v_ref.shape[-1]
    left, right = _attention_triton._reach(spec)
    lo, hi = _attention_triton._block_range(q0, bq, bk, nk, left, right)
    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def scoped(
        q_smem: Any, kt_smem: Any, v_smem: Any, p_smem: Any, o_smem: Any, lse_smem: Any,
        q_bar: Any, k_bars: Any, v_bars: Any,
    ) -> None:
        # 2 buffers: step j reads slot j % 2 while block j + 1 is copied into the other (each
        # step reads its accumulators, i.e. waits for its wgmmas); 1: copy, wait, compute
        def fetch(j: Any, slot: Any) -> None:
            start = j * bk
            plgpu.copy_gmem_to_smem(kt_ref.at[b, kv_h, :, pl.ds(start, bk)], kt_smem.at[slot], k_bars.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(start, bk), kv_h], v_smem.at[slot], v_bars.at[slot])

        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], q_smem, q_bar.at[0])

        if buffers == 2:
            @pl.when(lo < hi)
            def _first() -> None:
                fetch(lo, 0)

        plgpu.barrier_wait(q_bar.at[0])
        init, iota = _registers(interpreted, bq, bk, dv)

        def step(j: Any, carry: Any) -> Any:
            m, l_sum, acc = carry
            start = j * bk
            slot = jax.lax.rem(j - lo, buffers)
            if buffers == 2:
                @pl.when(j + 1 < hi)
                def _prefetch() -> None:
                    fetch(j + 1, 1 - slot)
            else:
                fetch(j, slot)

            plgpu.barrier_wait(k_bars.at[slot])

            s = _block_logits(q_smem, kt_smem.at[slot], spec, iota(0) + q0, iota(1) + start, s_len)
            m_new, l_sum, acc, p = _online_softmax(s, m, l_sum, acc)
            plgpu.barrier_wait(v_bars.at[slot])

            # P goes through shared memory: the CPU interpreter takes wgmma operands only there
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()

            def pv(acc_ref: Any) -> Any:
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]

            # a fresh accumulator per step (the CPU interpreter has no run_state); one add more
            acc = acc + pl.run_scoped(pv, plgpu.ACC((bq, dv), jnp.float32))
            return m_new, l_sum, acc

        m, l_sum, acc = jax.lax.fori_loop(lo, hi, step, init)
        _store(m, l_sum, acc, o_smem, lse_smem, o_ref.at[b, pl.ds(q0, bq), h], lse_ref.at[b, h, pl.ds(q0, bq)])

    dtype = q_ref.dtype
    pl.run_scoped(
        scoped,
        plgpu.SMEM((bq, d), dtype, transforms=tiles),
        plgpu.SMEM((buffers, d, bk), dtype, transforms=tiles),
        plgpu.SMEM((buffers, bk, dv), dtype, transforms=tiles),
        plgpu.SMEM((bq, bk), dtype, transforms=tiles),
        plgpu.SMEM((bq, dv), dtype, transforms=tiles),
        plgpu.SMEM((bq,), jnp.float32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=buffers),
        plgpu.Barrier(num_barriers=buffers),
    )


def _forward(
    q: Any, k: Any, v: Any, spec: AttentionSpec, cfg: Mapping[str, Any], s_len: int, interpret: Any
) -> tuple[Any, Any]:
    b, tp, n, _ = q.shape
    sp, kh = k.shape[1], k.shape[2]
    bq, bk = cfg["block_q"], cfg["block_k"]
    body = functools.partial(
        _fwd_body,
        spec=spec,
        bq=bq,
        bk=bk,
        groups=n // kh,
        s_len=s_len if s_len < sp else None,
        nk=sp // bk,
        interpreted=interpret is not None,
        buffers=cfg.get("kv_buffers", 2),
    )
    out, lse = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((b, tp, n, v.shape[3]), q.dtype),
            jax.ShapeDtypeStruct((b, n, tp), jnp.float32),
        ),
        grid=(n, tp // bq, b),
        grid_names=("heads", "q_seq", "batch"),
        interpret=interpret,
    )(q, k.transpose(0, 2, 3, 1), v)
    return out, lse


def _interpret_arg(interpret: bool) -> Any:
    return mosaic_interpret_params(interpret, poison=_attention_triton._POISON.get())


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(
    q: Any,
    k: Any,
    v: Any,
    qseg: Any,
    kseg: Any,
    spec: AttentionSpec,
    cfg: tuple[Any, ...],
    s_len: int,
    interpret: bool,
) -> Any:
    del qseg, kseg
    return _forward(q, k, v, spec, dict(cfg), s_len, _interpret_arg(interpret))[0]


def _flash_fwd(
    q: Any,
    k: Any,
    v: Any,
    qseg: Any,
    kseg: Any,
    spec: AttentionSpec,
    cfg: tuple[Any, ...],
    s_len: int,
    interpret: bool,
) -> Any:
    out, lse = _forward(q, k, v, spec, dict(cfg), s_len, _interpret_arg(interpret))
    return out, (q, k, v, qseg, kseg, out, lse)


def _flash_bwd(
    spec: AttentionSpec, cfg: tuple[Any, ...], s_len: int, interpret: bool, res: Any, do: Any
) -> Any:
    tri = {**dict(cfg), "num_warps": 4, "num_stages": 2}
    dq, dk, dv = _attention_triton._backward(res, do, spec, tri, s_len, interpret)

    def zero(x):
        return jnp.zeros(x.shape, jax.dtypes.float0)

    return dq, dk, dv, zero(res[3]), zero(res[4])


_flash.defvjp(_flash_fwd, _flash_bwd)


def run(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    config: Mapping[str, Any],
    interpret: bool,
    **kw: Any,
) -> jax.Array:
    """``Implementation.fn`` of ``pallas_mosaic_gpu``."""
    for key in ("block_q", "block_k"):
        if config.get(key) not in (64, 128):
            raise ValueError(
                f"pallas_mosaic_gpu config {key} must be 64 or 128 (one warpgroup's wgmma rows), "
                f"got {config.get(key)!r}"
            )
    if config.get("kv_buffers", 2) not in (1, 2):
        raise ValueError(
            f"pallas_mosaic_gpu config kv_buffers must be 1 (copy each key block when it is needed) "
            f"or 2 (copy the next while this one computes), got {config.get('kv_buffers')!r}"
        )
    return _attention_triton.padded_call(_flash, q, k, v, kw, config, interpret, head_multiple=64)


def supports(q: jax.Array, k: jax.Array, v: jax.Array, **kw: Any) -> str | None:
    """``None``, or why ``pallas_mosaic_gpu`` cannot take these arguments."""
    reason = _attention_triton.supports(q, k, v, **kw)
    if reason is not None:
        return reason
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return (
            f"dtype {jnp.dtype(q.dtype).name} is not supported (wgmma here takes float16/bfloat16)"
        )
    if kw["spec"].use_segments:
        return "query_seq_lengths, key_value_seq_lengths and segment_ids are not supported (use 'pallas_triton')"
    return None


def default_config(q: jax.Array, k: jax.Array, v: jax.Array, **kw: Any) -> Mapping[str, Any]:
    """Query and key blocks of 64, key and value blocks double-buffered."""
    return {"block_q": 64, "block_k": 64, "kv_buffers": 2}


def configs(q: jax.Array, k: jax.Array, v: jax.Array, **kw: Any) -> Sequence[Mapping[str, Any]]:
    """Blocks of 64 or 128 for queries and keys, 1 or 2 key/value buffers."""
    return [{"block_q": bq, "block_k": bk, "kv_buffers": nb} for bq in (64, 128) for bk in (64, 128) for nb in (1, 2)]


IMPLEMENTATION = Implementation(
    op="dot_product_attention",
    name="pallas_mosaic_gpu",
    fn=run,
    platforms=frozenset({"gpu"}),
    configs=configs,
    default_config=default_config,
    supports=supports,
)
