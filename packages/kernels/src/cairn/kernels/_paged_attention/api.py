"""``paged_attention`` (attention over a block table) and ``paged_kv_write``: the public ops.

A paged KV cache keeps keys and values in fixed-size pages shared by all sequences; each
sequence owns a block table of page ids, so memory is claimed as tokens arrive and equal
prefixes can share pages (``cairn.serving``'s ``PagedCache`` manages the tables).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.kernels._paged_attention import xla as _paged_attention_xla
from cairn.kernels._paged_attention.common import PagedSpec
from cairn.kernels._registry import (
    call,
    register_builtin,
)

OP = "paged_attention"


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _bucket(q, key_pages, value_pages, block_tables, lengths, **kw: Any) -> tuple[Any, ...]:
    """Shape bucket: dtype, batch, new tokens and table width rounded up to powers of two, heads, dims, page size."""
    spec: PagedSpec = kw["spec"]
    return (
        jnp.dtype(q.dtype).name,
        _pow2(q.shape[0]),
        _pow2(q.shape[1]),
        _pow2(block_tables.shape[1]),
        key_pages.shape[1],
        q.shape[2],
        key_pages.shape[2],
        q.shape[3],
        value_pages.shape[3],
        spec.window is not None,
        spec.soft_cap is not None,
    )


def _example(q, key_pages, value_pages, block_tables, lengths, **kw: Any) -> tuple[Any, ...]:
    """Autotuning values: every row's table full of distinct valid ids, every row at full length.

    (Zeros would time an empty loop: the chunked path stops at the longest row.)
    """
    b, width = block_tables.shape
    pages, bs = key_pages.shape[:2]
    if isinstance(block_tables, jax.ShapeDtypeStruct):
        block_tables = jnp.asarray(np.arange(b * width).reshape(b, width) % pages, block_tables.dtype)
    if isinstance(lengths, jax.ShapeDtypeStruct):
        lengths = jnp.full(lengths.shape, width * bs, lengths.dtype)
    return q, key_pages, value_pages, block_tables, lengths


# registered once: a doctest run imports this module a second time under another name.
# Triton first on a GPU: one decode step at batch 64, 4096 tokens, bf16 on an H200 took
# 0.57 ms against the xla path's 1.48 ms (benchmarks/kernels_gpu.py); the CPU runs xla.
register_builtin(
    OP, bucket=_bucket, preference=("pallas_triton", "xla"), example=_example, xla=_paged_attention_xla.run,
    xla_configs=_paged_attention_xla.configs, xla_default_config=_paged_attention_xla.default_config,
    gpu={"pallas_triton": "cairn.kernels._paged_attention.pallas_triton"},
)


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_arrays(q: Any, kp: Any, vp: Any, tables: Any, lengths: Any) -> None:
    """Ranks, shapes and dtypes; raises naming the argument and what was expected."""
    if q.ndim != 4:
        raise ValueError(f"query must be [batch, q_len, num_heads, head_dim], got shape {q.shape}")
    if kp.ndim != 4 or vp.ndim != 4:
        raise ValueError(
            "key_pages and value_pages must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {kp.shape} and {vp.shape}"
        )
    if kp.shape[:-1] != vp.shape[:-1]:
        raise ValueError(f"key_pages {kp.shape} and value_pages {vp.shape} must agree on all but the last axis")
    if q.shape[3] != kp.shape[3]:
        raise ValueError(f"query head_dim {q.shape[3]} != key_pages head_dim {kp.shape[3]}")
    if kp.shape[2] == 0 or q.shape[2] % kp.shape[2]:
        raise ValueError(
            f"num_kv_heads ({kp.shape[2]}) must divide num_heads ({q.shape[2]}) for grouped-query "
            f"attention (query {q.shape}, key_pages {kp.shape})"
        )
    if q.shape[1] < 1 or kp.shape[1] < 1:
        raise ValueError(f"q_len and block_size must be >= 1, got query {q.shape}, key_pages {kp.shape}")
    b = q.shape[0]
    if tables.ndim != 2 or tables.shape[0] != b or tables.shape[1] < 1:
        raise ValueError(f"block_tables must be [batch={b}, max_blocks_per_seq >= 1], got shape {tables.shape}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [batch={b}], got shape {lengths.shape}")
    for name, x in (("block_tables", tables), ("lengths", lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array (int32), got dtype {x.dtype}")
    for name, x in (("query", q), ("key_pages", kp), ("value_pages", vp)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating array, got dtype {x.dtype}")
    if not q.dtype == kp.dtype == vp.dtype:
        raise TypeError(
            f"query, key_pages and value_pages must share one dtype, got {q.dtype}, {kp.dtype}, {vp.dtype}"
        )


def check_block_ids(tables: Any, ends: Any, num_blocks: int, block_size: int, what: str) -> None:
    """Eager check: every page a row uses (positions ``< ends[b]``) is a valid block id.

    Skipped when ``tables`` or ``ends`` is traced (under ``jit`` ids are clamped into range).
    """
    if not (_is_concrete(tables) and _is_concrete(ends)):
        return
    tables, ends = np.asarray(tables), np.asarray(ends)
    width = tables.shape[1]
    for b, end in enumerate(ends.tolist()):
        if end < 0 or end > width * block_size:
            raise ValueError(
                f"{what} of row {b} is {end}, outside [0, max_blocks_per_seq * block_size = {width} * {block_size}]"
            )
        used = tables[b, : -(-end // block_size)]
        bad = np.flatnonzero((used < 0) | (used >= num_blocks))
        if bad.size:
            j = int(bad[0])
            raise ValueError(
                f"block_tables[{b}, {j}] = {int(used[j])} is not a block id in [0, num_blocks={num_blocks}) "
                f"(row {b} uses {used.size} blocks for {end} tokens)"
            )


def _spec(q: jax.Array, scale: float | None, logits_soft_cap: float | None, local_window_size: Any) -> PagedSpec:
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap!r}")
    window = local_window_size
    if isinstance(window, (tuple, list)):
        if len(window) != 2 or window[1] != 0:
            raise ValueError(
                "local_window_size must be an int w or a pair (w, 0): paged attention is causal, "
                f"got {local_window_size!r}"
            )
        window = window[0]
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0):
        raise ValueError(f"local_window_size must be a non-negative int, got {local_window_size!r}")
    return PagedSpec(
        scale=float(1.0 / math.sqrt(q.shape[3]) if scale is None else scale),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        window=None if window is None else int(window),
    )


# fmt: off
def paged_attention(
    query: jax.Array, key_pages: jax.Array, value_pages: jax.Array, block_tables: jax.Array,
    lengths: jax.Array, *, scale: float | None = None, logits_soft_cap: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | Sequence[str] | None = None, config: Mapping[str, Any] | None = None,
) -> jax.Array:
    r"""Causal attention of new tokens over a paged KV cache, with grouped-query heads.

    Row ``b`` has ``lengths[b]`` tokens; the one at position ``j`` has its key and value in
    page ``block_tables[b, j // bs]`` at slot ``j % bs``. The ``T`` queries are the row's
    *last* ``T`` tokens, at positions ``lengths[b] - T .. lengths[b] - 1`` (``T = 1``: a
    decode step; ``T > 1``: a prefill chunk after a cached prefix, or a whole prompt), and
    query ``p`` sees keys ``j <= p`` (and ``j >= p - w`` with a window ``w``):
    ``softmax(cap(scale * q.k)) v`` over those. Table entries past a row's last page are
    never read (pad with anything); key/value slots past ``lengths[b]`` never reach the
    output, whatever they hold. A row with ``lengths[b] < T`` gives zeros for the queries
    at negative positions (``lengths = 0``: a padding row, all zeros).

    Args:
      query: ``[B, T, N, H]``.
      key_pages: ``[num_blocks, block_size, K, H]``; ``K`` divides ``N`` (query head ``n``
        reads kv head ``n // (N // K)``). Same dtype as ``query``.
      value_pages: like ``key_pages`` (its last size may differ).
      block_tables: int ``[B, max_blocks_per_seq]`` page ids per row.
      lengths: int ``[B]`` valid tokens per row, the new ones included.
      scale: logits scale (default ``1 / sqrt(H)``).
      logits_soft_cap: ``cap``: logits become ``cap * tanh(logits / cap)``.
      local_window_size: ``w`` (or ``(w, 0)``, as ``dot_product_attention`` spells it):
        query ``p`` sees keys ``p - w .. p`` (a sliding window).
      implementation: ``"xla"`` or ``"pallas_triton"`` (or a sequence).
      config: the implementation's config (``{"pages_per_chunk": None | c}`` for ``xla``).

    Returns:
      ``[B, T, N, H_v]`` in the query's dtype.

    Raises:
      ValueError: a bad shape, head count, window or soft cap (named); with concrete
        ``block_tables`` and ``lengths``, a length outside the table or a used block id
        outside ``[0, num_blocks)`` (row and column named; under ``jit`` ids are clamped).
      TypeError: non-integer tables or lengths, non-float or mixed-dtype query and pages.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import cairn.kernels as ck
      >>> pages = jax.random.normal(jax.random.key(0), (6, 4, 2, 8))   # 6 pages of 4 tokens
      >>> q = jax.random.normal(jax.random.key(1), (1, 1, 4, 8))       # one decode step
      >>> table = jnp.array([[5, 0, 3]])                              # positions 0-3, 4-7, 8-11
      >>> out = ck.paged_attention(q, pages, pages, table, jnp.array([10]))
      >>> kv = pages[table[0]].reshape(12, 2, 8)[None, :10]           # the same keys, contiguous
      >>> ref = ck.dot_product_attention(q, kv, kv)
      >>> bool(jnp.allclose(out, ref, atol=1e-5))
      True
    """
    q, kp, vp = jnp.asarray(query), jnp.asarray(key_pages), jnp.asarray(value_pages)
    tables, lens = jnp.asarray(block_tables), jnp.asarray(lengths)
    _check_arrays(q, kp, vp, tables, lens)
    check_block_ids(block_tables, lengths, kp.shape[0], kp.shape[1], "lengths")
    spec = _spec(q, scale, logits_soft_cap, local_window_size)
    return call(OP, q, kp, vp, tables.astype(jnp.int32), lens.astype(jnp.int32),
                implementation=implementation, config=config, spec=spec)
    # fmt: on


def _check_write(kp: Any, vp: Any, nk: Any, nv: Any, tables: Any, positions: Any) -> None:
    if kp.ndim != 4 or kp.shape[:-1] != vp.shape[:-1]:
        raise ValueError(
            "key_pages and value_pages must be [num_blocks, block_size, num_kv_heads, head_dim] and agree "
            f"on all but the last axis, got {kp.shape} and {vp.shape}"
        )
    if nk.ndim != 4 or nk.shape[2:] != kp.shape[2:] or nv.shape[:3] != nk.shape[:3] or nv.shape[3:] != vp.shape[3:]:
        raise ValueError(
            f"new_keys {nk.shape} / new_values {nv.shape} must be [batch, q_len, num_kv_heads, head_dim] "
            f"matching key_pages {kp.shape} / value_pages {vp.shape}"
        )
    b, t = nk.shape[:2]
    if tables.ndim != 2 or tables.shape[0] != b:
        raise ValueError(f"block_tables must be [batch={b}, max_blocks_per_seq], got shape {tables.shape}")
    if positions.shape != (b, t):
        raise ValueError(f"positions must be [batch={b}, q_len={t}], got shape {positions.shape}")
    for name, x in (("block_tables", tables), ("positions", positions)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array (int32), got dtype {x.dtype}")
    if nk.dtype != kp.dtype or nv.dtype != vp.dtype:
        raise TypeError(
            f"new_keys/new_values dtypes ({nk.dtype}, {nv.dtype}) must match the pages' ({kp.dtype}, {vp.dtype})"
        )


def paged_kv_write(
    key_pages: jax.Array,
    value_pages: jax.Array,
    new_keys: jax.Array,
    new_values: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new tokens' keys and values into their pages: returns the updated pages.

    Token ``(b, t)`` at position ``p = positions[b, t]`` goes to page
    ``block_tables[b, p // bs]``, slot ``p % bs``. A negative position is skipped (a
    padding token or row). One scatter per array; jit it with the pages donated
    (``jax.jit(paged_kv_write, donate_argnums=(0, 1))``) and XLA updates them in place.
    Two tokens writing one slot leave either value: never write into a block shared with
    another sequence (``cairn.serving.PagedCache`` shares only full, read-only blocks).

    Args:
      key_pages: ``[num_blocks, block_size, K, H]``.
      value_pages: like ``key_pages`` (its last size may differ).
      new_keys: ``[B, T, K, H]`` in the key pages' dtype.
      new_values: ``[B, T, K, H_v]`` in the value pages' dtype.
      block_tables: int ``[B, max_blocks_per_seq]``.
      positions: int ``[B, T]`` absolute positions of the new tokens (``-1``: skip).

    Returns:
      ``(key_pages, value_pages)`` with the new tokens written.

    Raises:
      ValueError: bad shapes; with concrete tables and positions, a position past the
        table or a target block id outside ``[0, num_blocks)`` (row and column named).
      TypeError: non-integer tables or positions, dtypes that differ from the pages'.

    Example:
      >>> import jax.numpy as jnp
      >>> kp = vp = jnp.zeros((4, 2, 1, 1))
      >>> new = jnp.ones((1, 3, 1, 1))
      >>> kp, vp = paged_kv_write(kp, vp, new, new, jnp.array([[2, 0]]), jnp.array([[1, 2, 3]]))
      >>> kp[:, :, 0, 0].tolist()
      [[1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
    """
    kp, vp = jnp.asarray(key_pages), jnp.asarray(value_pages)
    nk, nv = jnp.asarray(new_keys), jnp.asarray(new_values)
    tables, pos = jnp.asarray(block_tables), jnp.asarray(positions)
    _check_write(kp, vp, nk, nv, tables, pos)
    num_blocks, bs = kp.shape[:2]
    if _is_concrete(positions) and _is_concrete(block_tables):
        p = np.asarray(positions)
        check_block_ids(block_tables, p.max(axis=1, initial=-1) + 1, num_blocks, bs, "the last position + 1")
    pos = pos.astype(jnp.int32)
    col = jnp.clip(pos // bs, 0, tables.shape[1] - 1)
    page = jnp.take_along_axis(tables.astype(jnp.int32), col, axis=1)
    # skipped tokens (and out-of-range ids under jit) get an index past the end: dropped
    slot = jnp.where((pos >= 0) & (page >= 0) & (page < num_blocks), page * bs + pos % bs, num_blocks * bs)
    flat = slot.reshape(-1)

    def scatter(pages: jax.Array, new: jax.Array) -> jax.Array:
        # 16-bit floats are scattered as their uint16 bits: XLA:CPU has no bfloat16 scatter
        # and would convert the whole pool to float32 and back on every write
        dtype = pages.dtype
        bits = jnp.dtype(dtype).itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)
        if bits:
            pages, new = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (pages, new))
        rows = pages.reshape(num_blocks * bs, *pages.shape[2:])
        rows = rows.at[flat].set(new.reshape(-1, *new.shape[2:]), mode="drop").reshape(pages.shape)
        return jax.lax.bitcast_convert_type(rows, dtype) if bits else rows

    return scatter(kp, nk), scatter(vp, nv)
