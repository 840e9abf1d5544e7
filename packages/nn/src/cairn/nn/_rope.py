"""Rotary position embedding (RoPE, Su et al. 2021): function and module.

For a head vector ``x`` of size ``d`` at position ``p``, pairs of features ``(x_a, x_b)``
are rotated by the angle ``p * theta_i`` with ``theta_i = base ** (-2 i / d)``,
``i = 0 .. d/2 - 1``:

``x_a' = x_a cos(p theta_i) - x_b sin(p theta_i)``,
``x_b' = x_b cos(p theta_i) + x_a sin(p theta_i)``.

Pairs are ``(i, i + d/2)`` ("half" layout, GPT-NeoX / Llama in Hugging Face) by default,
or ``(2i, 2i + 1)`` with ``interleaved=True`` (the original RoFormer layout). With
``rotary_dim < d`` only the first ``rotary_dim`` features rotate; the rest pass through.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from cairn.nn import _checks
from cairn.nn._module import Module

__all__ = ["RotaryEmbedding", "apply_rotary_embedding", "rotary_frequencies"]


def rotary_frequencies(dim: int, base: float = 10000.0, dtype: Any = jnp.float32) -> jax.Array:
    """``theta_i = base ** (-2 i / dim)`` for ``i < dim // 2``.

    Args:
      dim: the rotated width (even).
      base: the frequency base.
      dtype: the result's dtype.

    Returns:
      ``(dim // 2,)``.
    """
    if dim < 2 or dim % 2:
        raise ValueError(f"rotary dim must be a positive even number, got {dim}")
    return (base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)).astype(dtype)


def apply_rotary_embedding(
    x: jax.Array,
    positions: jax.Array | None = None,
    *,
    base: float = 10000.0,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    scale_factor: float = 1.0,
) -> jax.Array:
    """Rotates ``x`` of shape ``(*batch, length, heads, head_dim)`` by its positions.

    ``positions`` (int or float) has shape ``(*batch, length)`` or ``(length,)``; default
    ``arange(length)``. ``scale_factor > 1`` divides positions (linear position
    interpolation). The angles are computed in float32, the rotation in at least float32
    (float64 stays float64); the result has ``x``'s dtype.

    Args:
      x: ``(*batch, length, heads, head_dim)``.
      positions: ``(*batch, length)`` or ``(length,)`` int or float positions; None uses
        ``arange(length)``.
      base: the frequency base :math:`\\theta` (``base ** (-2i / rotary_dim)``).
      rotary_dim: rotate only the first ``rotary_dim`` features (even); None rotates all of
        ``head_dim``.
      interleaved: pair features ``(2i, 2i+1)`` (RoFormer layout) instead of ``(i, i + d/2)``
        (GPT-NeoX/Llama style).
      scale_factor: divides the positions (linear position interpolation); 1 for none.

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((1, 4, 2, 8))
    >>> apply_rotary_embedding(q).shape
    (1, 4, 2, 8)
    """
    if x.ndim < 3:
        raise ValueError(
            f"apply_rotary_embedding expected (*batch, length, heads, head_dim), got shape "
            f"{tuple(x.shape)}"
        )
    d = x.shape[-1]
    rd = d if rotary_dim is None else int(rotary_dim)
    if rd > d or rd < 2 or rd % 2:
        raise ValueError(
            f"apply_rotary_embedding: rotary_dim {rd} must be even and <= head_dim {d}"
        )
    length = x.shape[-3]
    if positions is None:
        positions = jnp.arange(length)
    positions = jnp.asarray(positions)
    if positions.shape[-1] != length:
        raise ValueError(
            f"apply_rotary_embedding: positions of shape {tuple(positions.shape)} do not match "
            f"length {length} of x with shape {tuple(x.shape)}"
        )
    theta = rotary_frequencies(rd, base)
    ang = (positions.astype(jnp.float32) / scale_factor)[..., None] * theta  # (..., L, rd/2)
    ang = ang[..., None, :]  # heads axis
    # rotate in at least float32 (float64 inputs keep their precision)
    ct = jnp.promote_types(jnp.float32, x.dtype)
    cos, sin = jnp.cos(ang).astype(ct), jnp.sin(ang).astype(ct)
    xr, xp = x[..., :rd].astype(ct), x[..., rd:]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        ra = a * cos - b * sin
        rb = b * cos + a * sin
        out = jnp.stack([ra, rb], axis=-1).reshape(xr.shape)
    else:
        a, b = xr[..., : rd // 2], xr[..., rd // 2 :]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    out = out.astype(x.dtype)
    return jnp.concatenate([out, xp], axis=-1) if rd < d else out


class RotaryEmbedding(Module):
    """Module form of :func:`apply_rotary_embedding` (no parameters, configuration only).

    Args:
      head_dim: the width of one head.
      base: the frequency base.
      rotary_dim: rotate only the first this many features; None for all.
      interleaved: pair features ``(2i, 2i+1)`` instead of ``(i, i + d/2)``.
      scale_factor: divides the positions (linear position interpolation).

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> rope = nn.RotaryEmbedding(8)
    >>> rope(jnp.ones((1, 4, 2, 8)), positions=jnp.arange(4)).shape
    (1, 4, 2, 8)
    """

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        rotary_dim: int | None = None,
        interleaved: bool = False,
        scale_factor: float = 1.0,
    ) -> None:
        head_dim = _checks.positive_int("RotaryEmbedding", "head_dim", head_dim)
        rd = head_dim if rotary_dim is None else rotary_dim
        rd = _checks.positive_int("RotaryEmbedding", "rotary_dim", rd)
        if rd > head_dim or rd < 2 or rd % 2:
            raise ValueError(f"RotaryEmbedding: rotary_dim {rd} must be even and <= {head_dim}")
        self.head_dim = head_dim
        self.base = _checks.positive_float("RotaryEmbedding", "base", base)
        self.rotary_dim = rd
        self.interleaved = bool(interleaved)
        self.scale_factor = _checks.positive_float("RotaryEmbedding", "scale_factor", scale_factor)

    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"RotaryEmbedding expected last axis {self.head_dim}, got {x.shape[-1]} in input "
                f"of shape {tuple(x.shape)}"
            )
        return apply_rotary_embedding(
            x, positions, base=self.base, rotary_dim=self.rotary_dim,
            interleaved=self.interleaved, scale_factor=self.scale_factor,
        )
