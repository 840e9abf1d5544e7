"""Gated linear unit, the XLA implementation: one matmul for both projections.

``weights[k, 2, n]`` is viewed as ``[k, 2n]`` (a free reshape), so ``x @ w`` is one dot
that produces the value and gate projections together (the plain composition runs two
dots and reads ``x`` twice); the activation and the product fuse into the dot's
epilogue. The backward is JAX's own derivative of this single-dot form.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp


def apply(h: jax.Array, activation: Callable[[jax.Array], jax.Array] | None, n: int) -> jax.Array:
    a, b = h[..., :n], h[..., n:]
    return (activation(a) if activation is not None else a) * b


def glu_xla(
    x: jax.Array,
    weights: jax.Array,
    *,
    config: Mapping[str, Any],
    interpret: bool = False,
    activation: Callable[[jax.Array], jax.Array] | None = None,
    precision: Any = None,
) -> jax.Array:
    """The XLA implementation on ``x[m, k]`` and ``weights[k, 2, n]`` (no config keys)."""
    del config, interpret
    k, _, n = weights.shape
    dtype = jnp.result_type(x, weights)
    h = jnp.dot(x, weights.reshape(k, 2 * n), precision=precision, preferred_element_type=jnp.float32)
    return apply(h, activation, n).astype(dtype)
