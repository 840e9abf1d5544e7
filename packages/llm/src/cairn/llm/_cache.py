"""``KVCache``: the keys and values of every layer, with one position per row.

Row ``b`` holds ``lengths[b]`` tokens, at slots ``0 .. lengths[b] - 1``; a token's slot is
its position. A call on ``[batch, T]`` new tokens writes them at slots
``lengths[b] .. lengths[b] + T - 1`` of each row and attends to slots ``<=`` its own, so
rows advance independently (ragged prompts, rows that finish early). Prompts of different
lengths are prefilled **right-padded** with their true lengths: the padding is written
past each row's length, never attended to, and overwritten by the next decode step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["KVCache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer ``keys``/``values`` ``[batch, max_length, num_key_value_heads, head_dim]``
    and ``lengths [batch]`` int32 (tokens held per row). A pytree: pass it through ``jit``.

    Args:
      keys: per layer, ``[batch, max_length, num_key_value_heads, head_dim]``.
      values: per layer, the same shape as ``keys``.
      lengths: ``[batch]`` int32, the tokens each row holds.

    >>> import jax.numpy as jnp
    >>> cache = KVCache.zeros(2, 2, 8, 1, 4, jnp.float32)
    >>> cache.keys[0].shape, cache.lengths.tolist(), cache.max_length
    ((2, 8, 1, 4), [0, 0], 8)
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def zeros(cls, num_layers: int, batch: int, max_length: int, num_kv_heads: int,
              head_dim: int, dtype: Any) -> KVCache:
        """An empty cache (every row of length 0).

        Args:
          num_layers: decoder layers.
          batch: rows.
          max_length: positions per row.
          num_kv_heads: key/value heads.
          head_dim: the width of one head.
          dtype: the keys' and values' dtype.
        """
        shape = (batch, max_length, num_kv_heads, head_dim)
        return cls(
            keys=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            values=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def max_length(self) -> int:
        """Slots per row."""
        return int(self.keys[0].shape[1])


def write(cache_kv: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """``cache_kv [B, S, K, H]`` with ``new [B, T, K, H]`` written at ``slots [B, T]``.

    Slots past the end are dropped (a padded row near the end of the cache).
    """
    rows = jnp.arange(cache_kv.shape[0])[:, None]
    return cache_kv.at[rows, slots].set(new.astype(cache_kv.dtype), mode="drop")
