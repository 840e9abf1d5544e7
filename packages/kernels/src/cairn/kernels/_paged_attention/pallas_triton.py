"""The ``pallas_triton`` implementation of ``paged_attention`` (forward only).

One program per (row, kv head, block of query rows), grid ``(B, K, T * G / block_rows)``.
A row's queries of one kv head, ``T * G`` of them (``G`` query heads per kv head, ``T``
new tokens), form a ``[T * G, H]`` matrix (padded to a power of two >= 16); each program
takes ``block_rows`` of them and walks the row's block table page by page: it reads the
page id from the table, loads that page's ``[bs, H]`` keys and values of its head, and folds
them into an online softmax. The loop runs from the first page its queries can see (with
a window) to the page of its last query's position (causal), so a decode step reads only
the pages in use and a prefill chunk's early rows skip the later pages. Slots past the
row's length are masked and their values zeroed (a stale or NaN tail never leaks).

With ``partitions`` P > 1 (flash decoding) each row's pages are split into P contiguous
runs, one program each (grid ``(B, K, row blocks * P)``): a decode step of few rows and kv
heads then keeps more of the GPU busy and each program walks a P-th of the pages. Every
program writes its unnormalised sum, running maximum and softmax denominator in float32,
and a small XLA step merges the P parts (rescaled to the common maximum); an empty part
(maximum ``-inf``) adds nothing.

Triton's ``dot`` needs power-of-two sizes of at least 16, so the head dim and the block
size must be such (padding the pages would copy the whole cache every call); the query
tile is padded to a power of two. On a backend without a GPU it runs with
``interpret=True`` (the HLO interpreter).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from cairn.kernels._attention.pallas_triton import _pallas
from cairn.kernels._paged_attention.common import PagedSpec, first_visible_page, logits, visible
from cairn.kernels._registry import Implementation
from cairn.kernels._tiling import pad_axis


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, (int(n) - 1).bit_length()))


def _kernel(bt_ref, len_ref, q_ref, k_ref, v_ref, *out_refs: Any, spec: PagedSpec, t: int, g: int,
            partitions: int) -> None:
    length = len_ref[0]
    bs = k_ref.shape[1]
    q = q_ref[...]
    rows = q.shape[0]
    first_row = pl.program_id(2) // partitions * rows
    q_pos = (length - t + (first_row + jnp.arange(rows)) // g)[:, None]
    # this row block's queries sit at positions length - t + first_row // g .. + (rows - 1) // g
    lo = first_visible_page(spec, length, t - first_row // g, bs)
    hi = jnp.clip(length - t + (first_row + rows - 1) // g + 1, 0, length)
    hi = (hi + bs - 1) // bs
    if partitions > 1:  # this program's run of the pages: the part-th of P near-equal runs
        part = pl.program_id(2) % partitions
        per = (hi - lo + partitions - 1) // partitions
        lo, hi = lo + part * per, jnp.minimum(lo + (part + 1) * per, hi)

    def body(j: Any, carry: Any) -> Any:
        m, total, acc = carry
        page = bt_ref[j]
        k = k_ref[page]
        k_pos = j * bs + jnp.arange(bs)
        in_row = k_pos < length
        v = jnp.where(in_row[:, None], v_ref[page], 0).astype(v_ref.dtype)
        raw = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        vis = visible(spec, q_pos, k_pos[None, :]) & in_row[None, :]
        s = jnp.where(vis, logits(spec, raw), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, total * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, v_ref.shape[-1]), jnp.float32),
    )
    m, total, acc = jax.lax.fori_loop(lo, hi, body, init)
    if partitions == 1:
        out_refs[0][...] = (acc / jnp.where(total == 0.0, 1.0, total)[:, None]).astype(out_refs[0].dtype)
    else:
        acc_ref, m_ref, total_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        total_ref[...] = total


def _merge(acc: jax.Array, m: jax.Array, total: jax.Array, dtype: Any) -> jax.Array:
    """Merge the parts ``[..., P, rows(, hv)]`` of a split softmax into ``[..., rows, hv]``."""
    top = jnp.max(m, axis=-2, keepdims=True)
    w = jnp.exp(m - jnp.where(top == -jnp.inf, 0.0, top))  # an empty part (m = -inf) weighs 0
    num = jnp.sum(acc * w[..., None], axis=-3)
    den = jnp.sum(total * w, axis=-2)
    return (num / jnp.where(den == 0.0, 1.0, den)[..., None]).astype(dtype)


def run(q: jax.Array, key_pages: jax.Array, value_pages: jax.Array, block_tables: jax.Array, lengths: jax.Array, *, config: Mapping[str, Any],
        interpret: bool, spec: PagedSpec) -> jax.Array:
    """``Implementation.fn`` of ``pallas_triton``."""
    b, t, n, h = q.shape
    pages, bs, kh, _ = key_pages.shape
    g, hv = n // kh, value_pages.shape[-1]
    rows = _pow2(t * g, 16)
    block_rows = min(rows, int(config["block_rows"]))
    table = pad_axis(block_tables.astype(jnp.int32), 1, _pow2(block_tables.shape[1]))
    # [B, T, K, G, H] -> [B, K, T * G, H]: row r of a kv head is token r // G, query head r % G
    qk = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, h)
    qk = pad_axis(qk, 2, rows)
    parts = int(config.get("partitions", 1))
    if parts < 1:
        raise ValueError(f"pallas_triton: config partitions must be >= 1, got {parts}")
    params = pl_triton.CompilerParams(num_warps=int(config["num_warps"]), num_stages=int(config["num_stages"]))
    blocks = rows // block_rows
    if parts == 1:
        out_shape = [jax.ShapeDtypeStruct((b, kh, rows, hv), q.dtype)]
        out_specs = [pl.BlockSpec((None, None, block_rows, hv), lambda i, j, r: (i, j, r, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((b, kh, parts, rows, hv), jnp.float32),
                     jax.ShapeDtypeStruct((b, kh, parts, rows), jnp.float32),
                     jax.ShapeDtypeStruct((b, kh, parts, rows), jnp.float32)]
        out_specs = [
            pl.BlockSpec((None, None, None, block_rows, hv), lambda i, j, r: (i, j, r % parts, r // parts, 0)),
            pl.BlockSpec((None, None, None, block_rows), lambda i, j, r: (i, j, r % parts, r // parts)),
            pl.BlockSpec((None, None, None, block_rows), lambda i, j, r: (i, j, r % parts, r // parts)),
        ]
    outs = _pallas(
        functools.partial(_kernel, spec=spec, t=t, g=g, partitions=parts),
        5,
        out_shape,
        grid=(b, kh, blocks * parts),
        in_specs=[
            pl.BlockSpec((None, table.shape[1]), lambda i, j, r: (i, 0)),
            pl.BlockSpec((None, 1), lambda i, j, r: (i, 0)),
            pl.BlockSpec((None, None, block_rows, h), lambda i, j, r: (i, j, r // parts, 0)),
            pl.BlockSpec((pages, bs, None, h), lambda i, j, r: (0, 0, j, 0)),
            pl.BlockSpec((pages, bs, None, hv), lambda i, j, r: (0, 0, j, 0)),
        ],
        out_specs=out_specs,
        compiler_params=params,
        interpret=interpret,
        name="cairn_paged_attention",
    )(table, lengths.astype(jnp.int32).reshape(b, 1), qk, key_pages, value_pages)
    out = outs[0] if parts == 1 else _merge(outs[0], outs[1], outs[2], q.dtype)
    out = out[:, :, : t * g].reshape(b, kh, t, g, hv).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, n, hv)


def supports(q: Any, key_pages: Any, value_pages: Any, block_tables: Any, lengths: Any, **kw: Any) -> str | None:
    """``None``, or why ``pallas_triton`` cannot take these arguments."""
    bs = key_pages.shape[1]
    for name, size in (("block_size", bs), ("head_dim", q.shape[-1]), ("value head_dim", value_pages.shape[-1])):
        if size < 16 or size & (size - 1):
            return f"{name} must be a power of two >= 16 for Triton's dot, got {size} (use implementation='xla')"
    if max(q.shape[-1], value_pages.shape[-1]) > 256:
        return f"head_dim {max(q.shape[-1], value_pages.shape[-1])} > 256 is not supported"
    return None


#: about as many programs as keep a large GPU busy (an H200 has 132 SMs)
_TARGET_PROGRAMS = 512


def default_config(q: Any, key_pages: Any, value_pages: Any, block_tables: Any, *args: Any, **kw: Any
                   ) -> Mapping[str, Any]:
    """Query row blocks of 64 (fewer when there are fewer rows), 4 warps, 2 stages; the pages
    split into up to 32 runs when fewer than about 512 programs would run otherwise (a few
    long rows), each run at least 16 pages.

    Args:
      q: the queries ``[B, T, N, H]``.
      key_pages: the key pages ``[P, bs, K, H]``.
      value_pages: the value pages (unused).
      block_tables: the block tables ``[B, max_blocks]``.
      *args: the op's other arguments (unused).
      **kw: the op's keywords (unused).
    """
    b, t, n, _ = q.shape
    kh = key_pages.shape[2]
    programs = b * kh * max(1, _pow2(t * (n // kh), 16) // 64)
    parts = max(1, min(32, _TARGET_PROGRAMS // programs, block_tables.shape[1] // 16))
    return {"block_rows": 64, "num_warps": 4, "num_stages": 2, "partitions": parts}


def configs(*args: Any, **kw: Any) -> Sequence[Mapping[str, Any]]:
    """Row blocks of 16..128, 4 or 8 warps, 2 stages, and the pages split 1, 8 or 16 ways."""
    return [{"block_rows": r, "num_warps": w, "num_stages": 2, "partitions": p}
            for p in (1, 8, 16) for r in (16, 32, 64, 128) for w in (4, 8)]


IMPLEMENTATION = Implementation(
    op="paged_attention",
    name="pallas_triton",
    fn=run,
    platforms=frozenset({"gpu"}),
    configs=configs,
    default_config=default_config,
    supports=supports,
)
