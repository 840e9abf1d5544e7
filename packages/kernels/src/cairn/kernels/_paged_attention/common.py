"""What both ``paged_attention`` implementations share: the static spec and the visibility rule.

Layout (that of vLLM's and JAX's TPU paged attention, with ``dot_product_attention``'s
head convention): key/value pages ``[P, bs, K, H]`` hold ``bs`` tokens each; row ``b``'s
token at position ``j`` lives in page ``block_tables[b, j // bs]`` at slot ``j % bs``.
``lengths[b]`` counts the row's valid tokens *including* the ``T`` new ones, whose
queries sit at positions ``lengths[b] - T .. lengths[b] - 1`` (bottom-right aligned). Query
at position ``p`` sees key ``j`` when ``j <= p`` and, with a window ``w``, ``j >= p - w``;
a query at a negative position (``lengths[b] < T``, e.g. a padding row with length 0)
sees nothing and gives zeros.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PagedSpec:
    """The static (hashable) part of a ``paged_attention`` call.

    Attributes:
      scale: the logits scale.
      soft_cap: ``cap`` of ``cap * tanh(s / cap)`` or ``None``.
      window: how far left of its position a query sees (``None``: unbounded).
    """

    scale: float
    soft_cap: float | None = None
    window: int | None = None


def visible(spec: PagedSpec, q_pos: Any, k_pos: Any) -> Any:
    """Boolean visibility of key position ``k_pos`` from query position ``q_pos`` (broadcast)."""
    vis = (k_pos <= q_pos) & (q_pos >= 0)
    if spec.window is not None:
        vis = vis & (k_pos >= q_pos - spec.window)
    return vis


def logits(spec: PagedSpec, raw: Any) -> Any:
    """Scaled, soft-capped float32 logits from raw ``q.k``."""
    s = raw.astype(jnp.float32) * spec.scale
    if spec.soft_cap is not None:
        s = spec.soft_cap * jnp.tanh(s / spec.soft_cap)
    return s


def first_visible_page(spec: PagedSpec, length: Any, t: int, block_size: int) -> Any:
    """The first page any of the ``t`` queries of a row of ``length`` tokens can see."""
    if spec.window is None:
        return 0
    return jnp.maximum(0, length - t - spec.window) // block_size
