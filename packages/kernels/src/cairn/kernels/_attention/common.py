"""What every attention implementation shares: the static spec, masks, the logits transform.

Conventions (those of ``jax.nn.dot_product_attention`` and Tokamax): query
``[B, T, N, H]``, key/value ``[B, S, K, H]`` with ``N % K == 0`` (query head ``n`` reads
kv head ``n // (N // K)``). Logits ``s = scale * q.k + bias``, soft-capped as
``cap * tanh(s / cap)``, then masked. Query ``i`` may see key ``j`` when every given rule
allows it: causal ``j <= i``; window ``i - left <= j <= i + right``; lengths ``i <
q_len`` and ``j < kv_len``; segments ``q_seg[i] == kv_seg[j]``; the dense ``mask``. A row
that sees nothing gives zeros.

Lengths fold into the segment ids (:func:`folded_segments`): a padded query gets
segment ``-1`` and a padded key ``-2``, which match nothing, so every kernel needs one
integer array per side instead of four inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

PAD_Q_SEGMENT = -1
PAD_KV_SEGMENT = -2


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static (hashable) part of an attention call.

    Attributes:
      scale: the logits scale.
      is_causal: key ``j`` visible to query ``i`` only if ``j <= i``.
      window: ``(left, right)`` local window or ``None``.
      soft_cap: ``cap`` of ``cap * tanh(s / cap)`` or ``None``.
      use_segments: whether the folded segment ids must be compared (lengths or segment ids given).
    """

    scale: float
    is_causal: bool = False
    window: tuple[int, int] | None = None
    soft_cap: float | None = None
    use_segments: bool = False


def folded_segments(
    batch: int,
    q_len: int,
    kv_len: int,
    query_seq_lengths: jax.Array | None,
    key_value_seq_lengths: jax.Array | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """Segment ids ``[B, T]``, ``[B, S]`` (int32) with the lengths folded in (padding never matches)."""
    qs = (
        jnp.zeros((batch, q_len), jnp.int32)
        if q_segment_ids is None
        else q_segment_ids.astype(jnp.int32)
    )
    ks = (
        jnp.zeros((batch, kv_len), jnp.int32)
        if kv_segment_ids is None
        else kv_segment_ids.astype(jnp.int32)
    )
    if query_seq_lengths is not None:
        valid = jnp.arange(q_len)[None, :] < query_seq_lengths.astype(jnp.int32)[:, None]
        qs = jnp.where(valid, qs, PAD_Q_SEGMENT)
    if key_value_seq_lengths is not None:
        valid = jnp.arange(kv_len)[None, :] < key_value_seq_lengths.astype(jnp.int32)[:, None]
        ks = jnp.where(valid, ks, PAD_KV_SEGMENT)
    return qs, ks


def position_mask(spec: AttentionSpec, q_pos: Any, k_pos: Any, kv_len: int | None = None) -> Any:
    """Boolean visibility from positions alone (causal, window, keys past ``kv_len``).

    ``q_pos`` and ``k_pos`` broadcast against each other (e.g. ``[tq, 1]`` and ``[1, tk]``);
    works on traced values inside kernels too. Returns ``None`` when nothing is masked.
    """
    mask = None

    def both(a: Any, b: Any) -> Any:
        return b if a is None else a & b

    if spec.is_causal:
        mask = both(mask, k_pos <= q_pos)
    if spec.window is not None:
        left, right = spec.window
        mask = both(mask, (k_pos >= q_pos - left) & (k_pos <= q_pos + right))
    if kv_len is not None:
        mask = both(mask, k_pos < kv_len)
    return mask


def transform_logits(spec: AttentionSpec, s: Any) -> Any:
    """Scaled, soft-capped logits from raw ``q.k`` (float32)."""
    s = s * spec.scale
    if spec.soft_cap is not None:
        s = spec.soft_cap * jnp.tanh(s / spec.soft_cap)
    return s


def soft_cap_grad(spec: AttentionSpec, raw: Any, ds: Any) -> Any:
    """Cotangent of raw ``q.k`` from that of the transformed logits (scale and cap applied)."""
    if spec.soft_cap is not None:
        t = jnp.tanh(raw * spec.scale / spec.soft_cap)
        ds = ds * (1.0 - t * t)
    return ds * spec.scale


# One query row (a decode step over a KV cache): both products are matrix-vector products
# per (row, head). As dots, XLA's CPU backend first copies the keys and values
# ``[B, S, K, H]`` into a transposed layout on every call (at 64 rows of a 256-slot cache,
# half of a decode step); as a multiply and a float32 reduction (the dots' accumulation
# type), every query head of a group at once, each reads them once, where they lie.


def one_query_logits(qg: jax.Array, k: jax.Array) -> jax.Array:
    """``einsum("btkgh,bskh->bkgts")`` for ``t == 1``, float32: ``qg [B, 1, K, G, H]``,
    ``k [B, S, K, H]`` -> ``[B, K, G, 1, S]``."""
    raw = jnp.sum(qg[:, 0, None].astype(jnp.float32) * k[:, :, :, None, :].astype(jnp.float32), axis=-1)
    return jnp.transpose(raw, (0, 2, 3, 1))[:, :, :, None, :]


def one_query_values(p: jax.Array, v: jax.Array) -> jax.Array:
    """``einsum("bkgts,bskh->bkgth")`` for ``t == 1``, accumulated in float32: ``p [B, K,
    G, 1, S]``, ``v [B, S, K, H]`` -> ``[B, K, G, 1, H]`` float32."""
    w = jnp.transpose(p[:, :, :, 0, :].astype(jnp.float32), (0, 3, 1, 2))  # [B, S, K, G]
    return jnp.sum(w[..., None] * v[:, :, :, None, :].astype(jnp.float32), axis=1)[:, :, :, None, :]
