"""The ``xla`` implementation of ``dot_product_attention``: a plain path and a chunked one.

* plain (``chunk_size=None``): logits ``[B, K, G, T, S]`` in one piece, the composition
  ``jax.nn.dot_product_attention`` uses; fastest for short sequences, memory ``O(T * S)``.
* chunked (``chunk_size=C``): a ``lax.scan`` over key chunks with an online softmax
  (flash attention written in XLA), with a ``custom_vjp`` whose backward recomputes the
  probabilities chunk by chunk from the saved log-sum-exp, so forward *and* backward keep
  memory ``O(T * C)``: linear in the sequence length.

The config is the chunk size; the autotuner measures both paths.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.kernels import _registry
from cairn.kernels._attention.common import (
    AttentionSpec,
    one_query_logits,
    one_query_values,
    position_mask,
    soft_cap_grad,
    transform_logits,
)
from cairn.kernels._tiling import pad_axis, round_up

CHUNK_SIZES = (128, 256, 512, 1024)
# GPU/TPU: above this many logits per (batch * head) the default is the chunked path
PLAIN_LIMIT = 1024 * 1024
# CPU: the chunk size of the default, and the fewest query rows that make chunking pay
CPU_CHUNK = 128
CPU_MIN_QUERIES = 64
CPU_MIN_KEYS = 3 * CPU_CHUNK  # below this, plain measured faster (a partial chunk costs a whole scan step)


def _grouped(x: jax.Array | None, n_heads: int, groups: int) -> jax.Array | None:
    """A ``[b, n, t, s]``-broadcastable array in the logits layout ``[b, K or 1, t, G or 1, s]``.

    Logits are ``[b, K, t, G, s]``, the order ``dot_general`` produces for grouped
    queries, so the big array is never transposed.
    """
    if x is None:
        return None
    x = jnp.asarray(x)
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    b, n, t, s = x.shape
    if n == 1:
        return x.reshape(b, 1, t, 1, s)
    return x.reshape(b, n_heads // groups, groups, t, s).transpose(0, 1, 3, 2, 4)


def _grouped_mask(mask: jax.Array | None, n_heads: int, groups: int) -> jax.Array | None:
    return None if mask is None else _grouped(jnp.asarray(mask, bool), n_heads, groups)


def _and(*masks: Any) -> Any:
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out


def _per_group(
    x: jax.Array | None, n_heads: int, groups: int
) -> tuple[jax.Array | None, int | None]:
    """A ``[b, n, t, s]``-broadcastable array as ``[b, K|1, G, t, s]`` (vmap axis 2) or ``[b, K|1, t, s]``."""
    if x is None:
        return None, None
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    b, n, t, s = x.shape
    if n == 1:
        return x, None
    return x.reshape(b, n_heads // groups, groups, t, s), 2


def plain(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    qseg: jax.Array | None,
    kseg: jax.Array | None,
    spec: AttentionSpec,
    *,
    precision: Any = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    broadcast_dropout: bool = True,
) -> jax.Array:
    """Attention in one piece (differentiated by JAX); see the module docstring.

    Grouped query heads are a ``vmap`` over the group of a ``[B, T, K, H]`` core, the
    structure ``jax.nn.dot_product_attention`` uses (XLA lays the matmuls out best so).
    """
    b, t, n, d = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    keep = None
    if dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError("dropout_rate > 0 and deterministic=False need dropout_rng")
        shape = (1, 1, t, s_len) if broadcast_dropout else (b, n, t, s_len)
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, shape)
    extras = [_per_group(None if x is None else jnp.asarray(x), n, g) for x in (bias, mask, keep)]
    pos = position_mask(spec, jnp.arange(t)[:, None], jnp.arange(s_len)[None, :])
    seg = None
    if spec.use_segments and qseg is not None and kseg is not None:
        seg = qseg[:, None, :, None] == kseg[:, None, None, :]

    # causal alone never empties a row (key 0 is always visible); a window can when t > s + left
    empty = (
        seg is not None
        or mask is not None
        or (spec.window is not None and t > s_len + spec.window[0])
    )

    if t == 1 and _registry.backend() == "cpu":
        return _one_query(q, k, v, extras, _and(pos, seg), empty, spec, dropout_rate)

    def core(qh: jax.Array, bias_h: Any, mask_h: Any, keep_h: Any) -> jax.Array:
        logits = jnp.einsum(
            "btkd,bskd->bkts", qh, k, precision=precision, preferred_element_type=jnp.float32
        )
        p = _probabilities(logits, bias_h, _and(pos, seg), mask_h, keep_h, empty, spec, dropout_rate)
        return jnp.einsum("bkts,bskd->btkd", p.astype(v.dtype), v, precision=precision)

    vmapped = jax.vmap(core, in_axes=(3, *(axis for _, axis in extras)), out_axes=3)
    out = vmapped(q.reshape(b, t, kh, g, d), *(x for x, _ in extras))
    return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype)


def _one_query(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    extras: list[tuple[jax.Array | None, int | None]],
    visible: Any,
    empty: bool,
    spec: AttentionSpec,
    dropout_rate: float,
) -> jax.Array:
    """:func:`plain` for one query row (a decode step over a KV cache) on a CPU, the same
    numerics, with :func:`~cairn.kernels._attention.common.one_query_logits` and
    ``one_query_values`` for the two products (no transposed copy of the cache; other
    backends keep the dots, not measured there)."""
    b, _, n, d = q.shape
    kh = k.shape[2]
    logits = one_query_logits(q.reshape(b, 1, kh, n // kh, d), k)  # [b, K, G, 1, s]
    bias, mask, keep = ((None if x is None else x if axis is not None else x[:, :, None]) for x, axis in extras)
    if visible is not None and jnp.ndim(visible) == 4:  # segments [b, 1, t, s]
        visible = visible[:, :, None]
    p = _probabilities(logits, bias, visible, mask, keep, empty, spec, dropout_rate)
    out = one_query_values(p.astype(v.dtype), v)  # [b, K, G, 1, hv]
    return out.reshape(b, 1, n, v.shape[-1]).astype(q.dtype)


def _probabilities(
    raw: jax.Array, bias: Any, visible: Any, mask: Any, keep: Any, empty: bool, spec: AttentionSpec,
    dropout_rate: float,
) -> jax.Array:
    """The attention weights of raw float32 ``q.k``: scaled, ``bias`` added, soft-capped,
    softmax over what ``visible`` and ``mask`` allow, dropout's ``keep`` applied."""
    logits = raw * spec.scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if spec.soft_cap is not None:
        logits = spec.soft_cap * jnp.tanh(logits / spec.soft_cap)
    p = _softmax(logits, _and(visible, None if mask is None else mask.astype(bool)), empty)
    if keep is not None:
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
    return p


def _softmax(
    logits: jax.Array, visible: jax.Array | None, rows_may_be_empty: bool = True
) -> jax.Array:
    """Softmax over the last axis; invisible entries are 0 and fully masked rows all 0 (no NaN).

    Masked logits get a large finite negative value (as jax.nn does), so ``jax.nn.softmax``
    and its cheap custom derivative apply; rows that see nothing are then zeroed.
    """
    if visible is None:
        return jax.nn.softmax(logits, axis=-1)
    big_neg = -0.7 * float(jnp.finfo(jnp.float32).max)
    p = jax.nn.softmax(jnp.where(visible, logits, big_neg), axis=-1)
    if not rows_may_be_empty:
        return p
    return jnp.where(jnp.any(visible, axis=-1, keepdims=True), p, 0.0)


# --- chunked (flash attention in XLA) ---


def _chunk_setup(
    k: jax.Array, v: jax.Array, kseg: jax.Array | None, mask5: jax.Array | None, chunk: int
) -> Any:
    """Pads keys to a multiple of ``chunk`` and splits them into ``[n_chunks, ...]`` stacks."""
    _b, s_len, _kh, _d = k.shape
    sp = round_up(s_len, chunk)
    nc = sp // chunk

    def split(x: jax.Array, axis: int) -> jax.Array:
        x = pad_axis(x, axis, sp)
        shape = x.shape[:axis] + (nc, chunk) + x.shape[axis + 1 :]
        return jnp.moveaxis(x.reshape(shape), axis, 0)

    ks, vs = split(k, 1), split(v, 1)
    ksegs = None if kseg is None else split(kseg, 1)
    masks = None if mask5 is None or mask5.shape[-1] == 1 else split(mask5, 4)
    return ks, vs, ksegs, masks, nc


def _chunk_visible(
    spec: AttentionSpec,
    c: jax.Array,
    chunk: int,
    t: int,
    s_len: int,
    qseg: Any,
    kseg_c: Any,
    mask_c: Any,
) -> Any:
    k_pos = c * chunk + jnp.arange(chunk)[None, None, :]
    pos = position_mask(spec, jnp.arange(t)[:, None, None], k_pos, kv_len=s_len)
    seg = (
        None
        if kseg_c is None or qseg is None
        else qseg[:, None, :, None, None] == kseg_c[:, None, None, None, :]
    )
    return _and(pos, seg, mask_c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    qseg: Any,
    kseg: Any,
    mask: Any,
    spec: AttentionSpec,
    chunk: int,
    precision: Any,
) -> jax.Array:
    """Flash attention over key chunks of ``chunk`` (memory linear in sequence length)."""
    return _chunked_fwd(q, k, v, qseg, kseg, mask, spec, chunk, precision)[0]


def _chunked_fwd(
    q: Any,
    k: Any,
    v: Any,
    qseg: Any,
    kseg: Any,
    mask: Any,
    spec: AttentionSpec,
    chunk: int,
    precision: Any,
) -> tuple[jax.Array, Any]:
    b, t, n, d = q.shape
    s_len, kh, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = n // kh
    qg = q.reshape(b, t, kh, g, d)
    mask5 = _grouped_mask(mask, n, g)
    ks, vs, ksegs, masks, nc = _chunk_setup(k, v, kseg if spec.use_segments else None, mask5, chunk)
    qseg_used = qseg if spec.use_segments else None

    def step(carry: Any, xs: Any) -> Any:
        m, l_sum, acc = carry
        c, kc, vc, ksc, mc = xs
        raw = jnp.einsum(
            "btkgd,bckd->bktgc", qg, kc, precision=precision, preferred_element_type=jnp.float32
        )
        s = transform_logits(spec, raw)
        vis = _chunk_visible(
            spec,
            c,
            chunk,
            t,
            s_len,
            qseg_used,
            ksc,
            mask5 if mc is None and mask5 is not None else mc,
        )
        s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l_sum = l_sum * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum(
            "bktgc,bckd->bktgd",
            p.astype(v.dtype),
            vc,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return (m_new, l_sum, acc * alpha[..., None] + pv), None

    init = (
        jnp.full((b, kh, t, g), -jnp.inf, jnp.float32),
        jnp.zeros((b, kh, t, g), jnp.float32),
        jnp.zeros((b, kh, t, g, dv), jnp.float32),
    )
    (m, l_sum, acc), _ = jax.lax.scan(step, init, (jnp.arange(nc), ks, vs, ksegs, masks))
    safe_l = jnp.where(l_sum == 0.0, 1.0, l_sum)
    out = (acc / safe_l[..., None]).transpose(0, 2, 1, 3, 4).reshape(b, t, n, dv).astype(q.dtype)
    lse = jnp.where(l_sum == 0.0, 0.0, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(safe_l))
    return out, (q, k, v, qseg, kseg, mask, out, lse)


def _chunked_bwd(
    spec: AttentionSpec, chunk: int, precision: Any, res: Any, do: jax.Array
) -> tuple[Any, ...]:
    q, k, v, qseg, kseg, mask, out, lse = res
    b, t, n, d = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    qg = q.reshape(b, t, kh, g, d)
    dog = do.reshape(b, t, kh, g, -1)
    delta = (
        jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
        .reshape(b, t, kh, g)
        .transpose(0, 2, 1, 3)
    )
    mask5 = _grouped_mask(mask, n, g)
    ks, vs, ksegs, masks, nc = _chunk_setup(k, v, kseg if spec.use_segments else None, mask5, chunk)
    qseg_used = qseg if spec.use_segments else None

    def step(dq: Any, xs: Any) -> Any:
        c, kc, vc, ksc, mc = xs
        raw = jnp.einsum(
            "btkgd,bckd->bktgc", qg, kc, precision=precision, preferred_element_type=jnp.float32
        )
        s = transform_logits(spec, raw)
        vis = _chunk_visible(
            spec,
            c,
            chunk,
            t,
            s_len,
            qseg_used,
            ksc,
            mask5 if mc is None and mask5 is not None else mc,
        )
        p = jnp.exp(jnp.where(vis, s, -jnp.inf) - lse[..., None])
        dv_c = jnp.einsum(
            "bktgc,btkgd->bckd",
            p.astype(do.dtype),
            dog,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        dp = jnp.einsum(
            "btkgd,bckd->bktgc", dog, vc, precision=precision, preferred_element_type=jnp.float32
        )
        draw = soft_cap_grad(spec, raw, p * (dp - delta[..., None]))
        dq = dq + jnp.einsum(
            "bktgc,bckd->btkgd",
            draw.astype(k.dtype),
            kc,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        dk_c = jnp.einsum(
            "bktgc,btkgd->bckd",
            draw.astype(q.dtype),
            qg,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return dq, (dk_c, dv_c)

    dq, (dks, dvs) = jax.lax.scan(
        step, jnp.zeros(qg.shape, jnp.float32), (jnp.arange(nc), ks, vs, ksegs, masks)
    )

    def unsplit(x: jax.Array, like: jax.Array) -> jax.Array:
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape((b, nc * chunk) + x.shape[3:])[:, :s_len].astype(like.dtype)

    return (
        dq.reshape(q.shape).astype(q.dtype),
        unsplit(dks, k),
        unsplit(dvs, v),
        _zero(qseg),
        _zero(kseg),
        _zero(mask),
    )


def _zero(x: Any) -> Any:
    if x is None:
        return None
    return np.zeros(np.shape(x), jax.dtypes.float0)


chunked.defvjp(_chunked_fwd, _chunked_bwd)


# --- registry glue ---


def run(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    config: Mapping[str, Any],
    interpret: bool,
    **kw: Any,
) -> jax.Array:
    """``Implementation.fn`` of ``xla``: the plain path, or the chunked one for ``chunk_size``."""
    del interpret
    spec: AttentionSpec = kw["spec"]
    chunk = config.get("chunk_size")
    plain_only = kw.get("bias") is not None or kw.get("dropout_rate", 0.0) > 0.0
    if chunk is None or plain_only:
        return plain(
            q,
            k,
            v,
            kw.get("bias"),
            kw.get("mask"),
            kw.get("q_segments"),
            kw.get("kv_segments"),
            spec,
            precision=kw.get("precision"),
            dropout_rate=kw.get("dropout_rate", 0.0),
            dropout_rng=kw.get("dropout_rng"),
            broadcast_dropout=kw.get("broadcast_dropout", True),
        )
    if chunk <= 0:
        raise ValueError(f"config chunk_size must be a positive int or None, got {chunk!r}")
    return chunked(
        q,
        k,
        v,
        kw.get("q_segments"),
        kw.get("kv_segments"),
        kw.get("mask"),
        spec,
        int(chunk),
        kw.get("precision"),
    )


def configs(q: jax.Array, k: jax.Array, v: jax.Array, **kw: Any) -> Sequence[Mapping[str, Any]]:
    """Candidate configs: the plain path and every chunk size below the key length."""
    s_len = k.shape[1]
    return [{"chunk_size": None}] + [{"chunk_size": c} for c in CHUNK_SIZES if c < s_len]


def default_config(q: jax.Array, k: jax.Array, v: jax.Array, **kw: Any) -> Mapping[str, Any]:
    """The untuned choice: a heuristic on the backend and the sequence lengths.

    * CPU: chunks of ``CPU_CHUNK`` (128) keys from ``CPU_MIN_KEYS`` (384) keys on, with at
      least ``CPU_MIN_QUERIES`` (64) query rows, else plain. Below 384 keys the plain path
      measured faster, forward + backward, causal, float32 on the quiet 2-core host:
      1.7-2.4x at 129-200 keys (batch 16; a DPO batch of 129-token rows), equal at 256,
      1.4x at 320 (two chunks and a partial one); chunks won 1.1x at 384, 1.4x at 512 and
      1.45x at 1000 (batch 4), and lost 1.13x at 448. A ``[T, 128]`` logits
      block per head stays in the core's cache, where the plain path streams all
      ``T * S`` logits through memory (logits, softmax, ``P V``). Measured on a 2-core
      Xeon (medians, ``benchmarks/kernels.py`` "heuristic" rows, docs/kernels.md): at
      ``[1, 1024, 8, 64]`` causal the plain path is 2-3.5x slower than chunks of 128,
      which the autotuner picks there and at ``[4, 512, 8, 64]`` (float32 and bfloat16;
      forward + backward always; the forward alone at 1024 under heavy load preferred
      256, by up to 1.5x, where 256 loses 1.06-1.45x forward + backward); at sequence
      256 plain and chunked are within about 1.2x;
      with 2048 keys, 16 queries or fewer (decoding) run faster plain (each chunk's
      matmul is too small to pay for the scan), 64 or more faster chunked.
    * GPU and TPU (where the Pallas kernels come first and ``xla`` is the fallback):
      plain up to ``PLAIN_LIMIT`` logits per batch row and head (the fused XLA path),
      else chunks of 512 to keep memory linear.

    Bias and dropout run plain whatever the config says (the chunked path takes neither).
    """
    t, s_len = q.shape[1], k.shape[1]
    if not isinstance(t, int):  # a symbolic query length (jax.export): at most the keys, a prefill
        t = s_len
    if _registry.backend() == "cpu":
        chunked = s_len >= CPU_MIN_KEYS and t >= CPU_MIN_QUERIES
        return {"chunk_size": CPU_CHUNK if chunked else None}
    return {"chunk_size": None if t * s_len <= PLAIN_LIMIT else 512}
