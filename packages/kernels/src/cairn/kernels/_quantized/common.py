"""QArray helpers shared by the quantized paths of every op: which scale can be applied
after the dot, and the values to feed the kernel."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import jax.numpy as jnp

from cairn.core_array import QArray


def values_of(q: QArray) -> Any:
    """``q``'s values, one element per value (sub-byte storage unpacked), as a JAX array."""
    return jnp.asarray(q.unpack().qvalue)


def full_scale(q: QArray) -> Any:
    """``q``'s scale broadcastable to ``q.shape`` (per-tile scales repeated along the tile axis)."""
    s = jnp.asarray(q.scale, jnp.float32)
    if s.ndim == 0:
        return s.reshape((1,) * q.ndim)
    if q.layout.kind == "per_tile":
        ax = q.layout.axes[0] % q.ndim
        s = jnp.repeat(s, int(cast(Any, q.layout.tile_size) or 1), axis=ax)
    return s


def split_scale(q: QArray, contracting: Sequence[int], out_axes: Sequence[int] = ()) -> tuple[Any, Any]:
    """``(values, scale)`` with ``dequantize(q) == values * scale`` and ``scale`` of size 1
    on every ``contracting`` axis, so the scale can multiply the dot's output; or
    ``(dequantized, None)`` when the layout does not allow it (a zero point, nf4, or a
    scale that varies along a contracting axis)."""
    del out_axes
    nd = q.ndim
    contracting = tuple(a % nd for a in contracting)
    if q.zero_point is not None or q.qtype == "nf4":
        return jnp.asarray(q.dequantize()), None
    s = full_scale(q)
    if any(s.shape[a] != 1 for a in contracting):
        return jnp.asarray(q.dequantize()), None
    return values_of(q), s
