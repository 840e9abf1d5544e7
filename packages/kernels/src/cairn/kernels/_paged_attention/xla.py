"""The ``xla`` implementation of ``paged_attention``: a gather path and a chunked one.

* plain (``pages_per_chunk=None``): every row gathers all ``max_blocks`` pages of its
  block table (``key_pages[block_tables]``) into a contiguous ``[B, M * bs, K, H]`` view
  and runs one masked softmax; differentiable, memory ``O(B * M * bs)``.
* chunked (``pages_per_chunk=c``): a ``fori_loop`` over chunks of ``c`` block-table
  columns with an online softmax, stopping after the chunk that holds the longest row's
  last token (and, with a window, starting at the first chunk any query can see): a
  decode step reads the pages in use, not the table's full width. Forward only (the
  loop bound depends on ``lengths``).

Key/value slots past a row's length are zeroed before they meet the probabilities, so a
page's stale or uninitialised (even NaN) tail never reaches the output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from cairn.kernels import _registry
from cairn.kernels._attention.common import one_query_logits, one_query_values
from cairn.kernels._paged_attention.common import PagedSpec, first_visible_page, logits, visible
from cairn.kernels._tiling import pad_axis, round_up

# CPU default: chunks of about this many keys once the table is wider than one chunk
CPU_CHUNK_KEYS = 256
# ... and half that for a query chunk of at most this many tokens (a prefill chunk after a
# cached prefix): its cost is the keys it computes, so the last chunk's padding past the
# row's length counts, and a loop step costs little (544 keys, 32 queries, 4 heads:
# 0.51 ms at 128 keys against 0.61 ms at 256 on a 2-core CPU)
CPU_SHORT_QUERY = 64
CHUNK_KEYS = (128, 256, 512, 1024)


def _gather(pages: jax.Array, ids: jax.Array) -> jax.Array:
    """``pages[ids]`` as ``[B, len(ids[0]) * bs, K, H]`` (ids clamped into range).

    16-bit floats are gathered as their ``uint16`` bits: XLA:CPU has no bfloat16 gather
    and would convert the *whole* page pool to float32 on every call (O(pool) per step).
    """
    b, c = ids.shape
    ids = jnp.clip(ids, 0, pages.shape[0] - 1)
    if jnp.dtype(pages.dtype).itemsize == 2 and jnp.issubdtype(pages.dtype, jnp.floating):
        got = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(pages, jnp.uint16)[ids], pages.dtype)
    else:
        got = pages[ids]
    return got.reshape(b, c * pages.shape[1], *pages.shape[2:])


def _scores(qg: jax.Array, k: jax.Array) -> jax.Array:
    """``[B, K, G, T, S]`` float32 products of ``qg [B, T, K, G, H]`` and ``k [B, S, K, H]``
    (one query row on a CPU: a multiply and a reduction, no transposed copy of the keys)."""
    if qg.shape[1] == 1 and _registry.backend() == "cpu":
        return one_query_logits(qg, k)
    return jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)


def _weighted(p: jax.Array, v: jax.Array) -> jax.Array:
    """``[B, K, G, T, Hv]`` float32: probabilities ``p [B, K, G, T, S]`` times ``v [B, S, K, Hv]``."""
    if p.shape[3] == 1 and _registry.backend() == "cpu":
        return one_query_values(p, v)
    return jnp.einsum("bkgts,bskh->bkgth", p, v, preferred_element_type=jnp.float32)


def _positions(lengths: jax.Array, t: int) -> jax.Array:
    """``[B, T]`` query positions: ``lengths - T .. lengths - 1``."""
    return lengths.astype(jnp.int32)[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]


def plain(
    q: jax.Array, key_pages: jax.Array, value_pages: jax.Array, block_tables: jax.Array, lengths: jax.Array,
    spec: PagedSpec,
) -> jax.Array:
    """Gather every page of each row's table, then one masked softmax (see the module docstring)."""
    b, t, n, h = q.shape
    kh = key_pages.shape[2]
    g = n // kh
    k = _gather(key_pages, block_tables)
    v = _gather(value_pages, block_tables)
    s_len = k.shape[1]
    k_pos = jnp.arange(s_len, dtype=jnp.int32)
    v = jnp.where((k_pos[None, :] < lengths[:, None])[:, :, None, None], v, 0)
    raw = _scores(q.reshape(b, t, kh, g, h), k)
    s = logits(spec, raw)
    q_pos = _positions(lengths, t)
    vis = visible(spec, q_pos[:, None, None, :, None], k_pos)
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))
    total = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(total == 0.0, 1.0, total)
    out = jnp.transpose(_weighted(p.astype(v.dtype), v), (0, 3, 1, 2, 4))  # [b, t, K, G, hv]
    return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype)


def chunked(
    q: jax.Array, key_pages: jax.Array, value_pages: jax.Array, block_tables: jax.Array, lengths: jax.Array,
    spec: PagedSpec, pages_per_chunk: int, compute_dtype: Any = None,
) -> jax.Array:
    """Online softmax over chunks of block-table columns, only those in use (see the module docstring).

    ``compute_dtype``: the dtype each gathered chunk (and the query) is cast to for the two
    dots (``None``: the pages' own). On a CPU, 16-bit pages are computed in float32: XLA:CPU's
    bfloat16 dots with float32 accumulation are slower than the cast plus a float32 dot
    (a decode step 1.3x faster at B=16, 2048 pages of 16).
    """
    b, t, n, h = q.shape
    bs, kh = key_pages.shape[1], key_pages.shape[2]
    g, hv, c = n // kh, value_pages.shape[-1], int(pages_per_chunk)
    table = pad_axis(block_tables, 1, round_up(block_tables.shape[1], c))
    lengths = lengths.astype(jnp.int32)
    hi = jnp.minimum(table.shape[1] // c, (jnp.max(lengths) + c * bs - 1) // (c * bs))
    lo = jnp.min(first_visible_page(spec, lengths, t, bs)) // c
    qg = q.reshape(b, t, kh, g, h).astype(compute_dtype or q.dtype)
    q_pos = _positions(lengths, t)[:, None, None, :, None]

    def body(i: Any, carry: Any) -> Any:
        m, total, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(table, i * c, c, axis=1)
        k, v = _gather(key_pages, ids), _gather(value_pages, ids)
        if compute_dtype is not None:
            k, v = k.astype(compute_dtype), v.astype(compute_dtype)
        k_pos = i * c * bs + jnp.arange(c * bs, dtype=jnp.int32)
        v = jnp.where((k_pos[None, :] < lengths[:, None])[:, :, None, None], v, 0)
        raw = _scores(qg, k)
        s = jnp.where(visible(spec, q_pos, k_pos), logits(spec, raw), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        pv = _weighted(p.astype(v.dtype), v)
        return m_new, total * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

    init = (
        jnp.full((b, kh, g, t), -jnp.inf, jnp.float32),
        jnp.zeros((b, kh, g, t), jnp.float32),
        jnp.zeros((b, kh, g, t, hv), jnp.float32),
    )
    _, total, acc = jax.lax.fori_loop(lo, hi, body, init)
    out = acc / jnp.where(total == 0.0, 1.0, total)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, hv).astype(q.dtype)


def run(q: jax.Array, key_pages: jax.Array, value_pages: jax.Array, block_tables: jax.Array, lengths: jax.Array, *, config: Mapping[str, Any],
        interpret: bool, spec: PagedSpec) -> jax.Array:
    """``Implementation.fn`` of ``xla``."""
    del interpret
    c = config.get("pages_per_chunk")
    if c is None:
        return plain(q, key_pages, value_pages, block_tables, lengths, spec)
    if not isinstance(c, int) or isinstance(c, bool) or c < 1:
        raise ValueError(f"xla paged_attention config pages_per_chunk must be None or an int >= 1, got {c!r}")
    small = jnp.dtype(key_pages.dtype).itemsize < 4
    compute = jnp.float32 if small and _registry.backend() == "cpu" else None
    return chunked(q, key_pages, value_pages, block_tables, lengths, spec, c, compute)


def _chunk_pages(keys: int, block_size: int) -> int:
    return max(1, keys // block_size)


def default_config(q: Any, key_pages: Any, value_pages: Any, block_tables: Any, lengths: Any, **kw: Any) -> Mapping[str, Any]:
    """Chunks of about 256 keys once the table is wider than that (reads only the pages in use); else plain.

    On a CPU, a chunk of 2 to ``CPU_SHORT_QUERY`` queries per row takes chunks of 128 keys."""
    bs, m = key_pages.shape[1], block_tables.shape[1]
    del kw
    if _registry.backend() == "cpu" and m * bs > CPU_CHUNK_KEYS:
        keys = CPU_CHUNK_KEYS // 2 if 1 < q.shape[1] <= CPU_SHORT_QUERY else CPU_CHUNK_KEYS
        return {"pages_per_chunk": _chunk_pages(keys, bs)}
    if _registry.backend() != "cpu" and m * bs > 4 * CPU_CHUNK_KEYS:
        return {"pages_per_chunk": _chunk_pages(4 * CPU_CHUNK_KEYS, bs)}
    return {"pages_per_chunk": None}


def configs(q: Any, key_pages: Any, value_pages: Any, block_tables: Any, lengths: Any, **kw: Any) -> Sequence[Mapping[str, Any]]:
    """The plain path and chunks of 128..1024 keys that fit the table."""
    bs, m = key_pages.shape[1], block_tables.shape[1]
    pages = sorted({_chunk_pages(k, bs) for k in CHUNK_KEYS if _chunk_pages(k, bs) < m})
    return [{"pages_per_chunk": None}] + [{"pages_per_chunk": c} for c in pages]
