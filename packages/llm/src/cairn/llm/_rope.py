"""Rotary position embeddings with Hugging Face's scaling types.

Pairs ``(i, i + d/2)`` of a head vector rotate by ``position * inv_freq[i]`` (the "half"
layout of every family here). The types change ``inv_freq`` and may scale ``cos`` and
``sin`` by an attention factor:

- ``default``: ``inv_freq[i] = theta ** (-2 i / d)``;
- ``linear``: ``inv_freq / factor`` (position interpolation);
- ``dynamic``: NTK scaling: when the longest sequence ``L`` exceeds
  ``original_max_position_embeddings`` ``M``, ``theta`` becomes
  ``theta * (factor L / M - (factor - 1)) ** (d / (d - 2))``;
- ``llama3``: wavelengths above ``M / low_freq_factor`` are divided by ``factor``, those
  below ``M / high_freq_factor`` kept, the band between interpolated smoothly;
- ``yarn``: a ramp between interpolated and extrapolated frequencies over the dimensions
  whose rotations at ``M`` lie between ``beta_slow`` and ``beta_fast``, with the attention
  factor ``0.1 ln(factor) + 1`` (or ``mscale``/``mscale_all_dim``/``attention_factor``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.llm._errors import UnsupportedModelError

__all__ = ["ROPE_TYPES", "apply_rope", "check_rope", "inverse_frequencies", "rope_tables"]

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def check_rope(params: Mapping[str, Any]) -> None:
    """Raises ``UnsupportedModelError`` for a rope type not in ``ROPE_TYPES`` or missing keys."""
    kind = params.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {kind!r} is not supported; supported: {list(ROPE_TYPES)}")
    needed = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [k for k in needed.get(kind, ()) if params.get(k) is None]
    if missing:
        raise UnsupportedModelError(f"rope_type {kind!r} needs {missing} in its rope parameters, got {dict(params)}")


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    # float32 like the reference: theta ** (arange(0, d, 2) / d) in single precision
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)


def _llama3(inv: np.ndarray, p: Mapping[str, Any]) -> np.ndarray:
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old = float(p["original_max_position_embeddings"])
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > old / low, inv / np.float32(factor), inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, p: Mapping[str, Any], max_pos: int) -> tuple[np.ndarray, float]:
    factor = float(p["factor"])
    original = p.get("original_max_position_embeddings") or max_pos
    attention = p.get("attention_factor")
    if attention is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all)) if ms and ms_all else _yarn_mscale(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = correction_dim(fast), correction_dim(slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1)
    extrapolation = 1 - ramp
    pos = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
    inv = (1 / (factor * pos)) * (1 - extrapolation) + (1 / pos) * extrapolation
    return inv.astype(np.float32), float(attention)


def inverse_frequencies(params: Mapping[str, Any], dim: int, max_pos: int) -> tuple[np.ndarray, float]:
    """``(inv_freq [dim // 2] float32, attention factor)`` for static rope types.

    ``dynamic`` returns its unscaled frequencies here; :func:`rope_tables` rescales them
    from the positions.
    """
    check_rope(params)
    kind = params.get("rope_type", "default")
    theta = float(params["rope_theta"])
    if kind == "yarn":
        return _yarn(theta, dim, params, max_pos)
    inv = _base_inv_freq(theta, dim)
    if kind == "linear":
        inv = (inv / np.float32(params["factor"])).astype(np.float32)
    elif kind == "llama3":
        inv = _llama3(inv, params)
    return inv, 1.0


def rope_tables(params: Mapping[str, Any], dim: int, max_pos: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``cos, sin`` of shape ``positions.shape + (dim,)`` (float32) for int ``positions``.

    For ``dynamic`` the scaled base depends on ``max(positions) + 1`` over the whole batch,
    as in the reference implementation.
    """
    inv, attention = inverse_frequencies(params, dim, max_pos)
    inv_freq = jnp.asarray(inv)
    if params.get("rope_type", "default") == "dynamic":
        original = params.get("original_max_position_embeddings") or max_pos
        factor = float(params["factor"])
        length = jnp.maximum(jnp.max(positions) + 1, original).astype(jnp.float32)
        theta = float(params["rope_theta"]) * (factor * length / original - (factor - 1)) ** (dim / (dim - 2))
        exponent = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
        inv_freq = 1.0 / (theta ** exponent)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * attention, jnp.sin(angles) * attention


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x [batch, length, heads, dim]`` by ``cos, sin [batch, length, dim]``.

    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = concat(-x2, x1)``; the
    tables are cast to ``x``'s dtype first, as the reference does.
    """
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * c + rotated * s
