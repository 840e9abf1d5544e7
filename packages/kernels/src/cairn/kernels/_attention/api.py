"""``dot_product_attention``: the public op, its argument checks, and its registration."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from cairn.kernels._attention import xla as _attention_xla
from cairn.kernels._attention.common import AttentionSpec, folded_segments
from cairn.kernels._registry import (
    call,
    register_builtin,
)

OP = "dot_product_attention"
_NO_SOW = (
    "module= (sow_weights) needs the attention weights, which fused attention never forms; "
    "use cairn.nn's default attention_fn to sow them"
)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _bucket(q: jax.Array, k: jax.Array, v: jax.Array, **kw: Any) -> tuple[Any, ...]:
    """Shape bucket: dtype, batch and lengths rounded up to powers of two, heads, features."""
    spec: AttentionSpec = kw["spec"]
    return (
        jnp.dtype(q.dtype).name,
        _pow2(q.shape[0]),
        _pow2(q.shape[1]),
        _pow2(k.shape[1]),
        q.shape[2],
        k.shape[2],
        q.shape[3],
        v.shape[3],
        spec.is_causal,
        spec.window is not None,
        spec.soft_cap is not None,
        spec.use_segments,
        kw.get("bias") is not None,
        kw.get("mask") is not None,
    )


# GPU kernels load on first use (import cairn.kernels on a CPU loads no Triton or Mosaic GPU
# code); on a GPU cuDNN first: it takes the plain cases and is the fastest there
# (benchmarks/kernels_gpu.py)
register_builtin(
    OP, bucket=_bucket, preference=("cudnn", "pallas_mosaic_gpu", "pallas_triton", "xla"), xla=_attention_xla.run,
    xla_configs=_attention_xla.configs, xla_default_config=_attention_xla.default_config,
    gpu={"pallas_triton": "cairn.kernels._attention.pallas_triton",
         "pallas_mosaic_gpu": "cairn.kernels._attention.pallas_mosaic",
         "cudnn": "cairn.kernels._attention.cudnn"},
)


def _window(local_window_size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    if local_window_size is None:
        return None
    if isinstance(local_window_size, int) and not isinstance(local_window_size, bool):
        window = (local_window_size, local_window_size)
    elif isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2:
        window = (int(local_window_size[0]), int(local_window_size[1]))
    else:
        raise ValueError(
            f"local_window_size must be an int or a (left, right) pair, got {local_window_size!r}"
        )
    if min(window) < 0:
        raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}")
    return window


def _check_shapes(query: jax.Array, key: jax.Array, value: jax.Array) -> None:
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(
            "query, key and value must have the same rank >= 3 ([..., seq, heads, head_dim]), got "
            f"query {query.shape}, key {key.shape}, value {value.shape}"
        )
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(
            f"key {key.shape} and value {value.shape} must agree on all but the last axis"
        )
    if query.shape[:-3] != key.shape[:-3]:
        raise ValueError(f"query {query.shape} and key {key.shape} must have the same batch axes")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query head_dim {query.shape[-1]} != key head_dim {key.shape[-1]}")
    n, kh = query.shape[-2], key.shape[-2]
    if kh == 0 or n % kh:
        raise ValueError(
            f"key/value heads ({kh}) must divide query heads ({n}) for grouped-query attention "
            f"(query {query.shape}, key {key.shape})"
        )


def _segments(
    segment_ids: Any, b: int, t: int, s: int
) -> tuple[jax.Array | None, jax.Array | None]:
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(
                "segment_ids must be one [batch, seq] array or a (query, key_value) pair"
            )
        qs, ks = (jnp.asarray(x) for x in segment_ids)
    else:
        qs = ks = jnp.asarray(segment_ids)
    if qs.shape != (b, t) or ks.shape != (b, s):
        raise ValueError(
            f"segment_ids must be [batch, seq]: expected query {(b, t)}, key_value {(b, s)}, "
            f"got {qs.shape} and {ks.shape}"
        )
    return qs, ks


# fmt: off
def dot_product_attention(
    query: jax.Array, key: jax.Array, value: jax.Array,
    bias: jax.Array | None = None, mask: jax.Array | None = None, *,
    scale: float | None = None, is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None, key_value_seq_lengths: jax.Array | None = None,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    local_window_size: int | tuple[int, int] | None = None, logits_soft_cap: float | None = None,
    implementation: str | Sequence[str] | None = None, config: Mapping[str, Any] | None = None,
    dropout_rng: jax.Array | None = None, dropout_rate: float = 0.0, broadcast_dropout: bool = True,
    deterministic: bool = False, dtype: Any = None, precision: Any = None, module: Any = None,
) -> jax.Array:
    r"""Scaled dot-product attention, forward and backward, with grouped-query heads.

    ``softmax(cap(scale * Q K^T + bias), masked) V`` with jax.nn's and Tokamax's argument
    names (docs/kernels.md); a drop-in ``attention_fn`` for ``cairn.nn.MultiHeadAttention``.

    Args:
      query: ``[..., T, N, H]``.
      key: ``[..., S, K, H]`` with ``K`` dividing ``N``.
      value: ``[..., S, K, H_v]``, like ``key``.
      bias: broadcastable to ``[..., N, T, S]``, added to the logits (``xla`` only).
      mask: broadcastable to ``[..., N, T, S]``; ``True`` = attend (``xla`` only).
      scale: logits scale (default ``1 / sqrt(H)``).
      is_causal: keys ``j <= i`` only.
      query_seq_lengths: ``[B]`` valid query lengths.
      key_value_seq_lengths: ``[B]`` valid key/value lengths.
      segment_ids: ``[B, T]`` or a ``(query, key_value)`` pair; same segment only.
      local_window_size: ``w`` or ``(left, right)``: keys ``i - left <= j <= i + right``.
      logits_soft_cap: ``cap``: logits become ``cap * tanh(logits / cap)``.
      implementation: a name (``"xla"``, ``"pallas_triton"``, ``"pallas_mosaic_gpu"``) or
        a sequence tried in order; default: dispatch decides.
      config: the implementation's config (merged over its default).
      dropout_rng: PRNG key of the attention-weight dropout (``xla`` only).
      dropout_rate: the dropout rate.
      broadcast_dropout: one dropout mask for every batch row and head.
      deterministic: no dropout.
      dtype: computation dtype.
      precision: matmul precision.
      module: Flax's hook; must be ``None``.

    Returns:
      ``[..., T, N, H_v]`` in the query's dtype; a row that sees no key is 0.

    Raises:
      ValueError: a bad shape, head count, window, soft cap, dropout rate, segment ids,
        implementation or config key (named), or an implementation refusing the arguments.
      NotImplementedError: ``module`` given (sowing attention weights).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import cairn.kernels as ck
      >>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
      >>> out = ck.dot_product_attention(q, q, q, is_causal=True)
      >>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, q, q, is_causal=True), atol=1e-5))
      True
    """
    if module is not None:
        raise NotImplementedError(_NO_SOW)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}")
    query, key, value = (
        jnp.asarray(x) if dtype is None else jnp.asarray(x, dtype) for x in (query, key, value)
    )
    _check_shapes(query, key, value)
    lead = query.shape[:-3]
    q, k, v = (x.reshape((math.prod(lead),) + x.shape[-3:]) for x in (query, key, value))
    spec, q_seg, kv_seg = _spec(q, k, scale, is_causal, local_window_size, logits_soft_cap,
                                segment_ids, query_seq_lengths, key_value_seq_lengths)
    out = call(OP, q, k, v, implementation=implementation, config=config, spec=spec,
               bias=_flat_batch(bias), mask=_flat_batch(mask), q_segments=q_seg, kv_segments=kv_seg,
               precision=precision, dropout_rate=0.0 if deterministic else float(dropout_rate),
               dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout)
    return out.reshape(lead + out.shape[1:])
    # fmt: on


def _flat_batch(x: jax.Array | None) -> jax.Array | None:
    """A bias or mask with several leading batch axes, flattened to one (like the inputs)."""
    if x is None or jnp.ndim(x) <= 4:
        return x
    return jnp.asarray(x).reshape((-1,) + jnp.shape(x)[-3:])


def _spec(
    q: jax.Array,
    k: jax.Array,
    scale: float | None,
    is_causal: bool,
    local_window_size: int | tuple[int, int] | None,
    logits_soft_cap: float | None,
    segment_ids: Any,
    query_seq_lengths: jax.Array | None,
    key_value_seq_lengths: jax.Array | None,
) -> tuple[AttentionSpec, jax.Array | None, jax.Array | None]:
    """The static spec and the folded segment ids (``None`` when no length or segment is given)."""
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap!r}")
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    qs, ks = _segments(segment_ids, b, t, s)
    use_seg = qs is not None or query_seq_lengths is not None or key_value_seq_lengths is not None
    q_seg = kv_seg = None
    if use_seg:
        q_seg, kv_seg = folded_segments(b, t, s, query_seq_lengths, key_value_seq_lengths, qs, ks)
    spec = AttentionSpec(
        scale=float(1.0 / math.sqrt(q.shape[3]) if scale is None else scale),
        is_causal=bool(is_causal),
        window=_window(local_window_size),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        use_segments=use_seg,
    )
    return spec, q_seg, kv_seg
