"""Where optimizer state lives: each per-parameter state array on its parameter's devices.

``init`` creates every per-parameter state array directly with the sharding of the
parameter it belongs to (never replicated first and resharded later), so optimizer
memory per device is the parameter's memory per device times the number of moments.
Arrays derived from a parameter's shape (Adafactor's row and column factors, SM3's
per-axis accumulators) take the parameter's sharding along the axes they keep.

Only a *concrete* parameter carries a known sharding. Under ``jax.jit`` (``init`` traced)
the sharding is not known here; the jitted step then keeps whatever layout the caller
gives (pass ``out_shardings``, or call ``init`` eagerly on the sharded parameters).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["param_sharding", "full_like_param", "zeros_for_axes", "replicated_like",
           "stacked_blocks_like"]


def param_sharding(p):
    """The sharding of a concrete array, or None (tracers, NumPy arrays, Python numbers)."""
    if isinstance(p, jax.core.Tracer) or not isinstance(p, jax.Array):
        return None
    try:
        return p.sharding
    except Exception:  # noqa: BLE001 - deleted or exotic arrays: no placement
        return None


def _put(x, sharding):
    if sharding is None:
        return x
    return jax.device_put(x, sharding)


def full_like_param(p, fill=0.0, dtype=None):
    """``fill`` in ``p``'s shape and in ``dtype`` (default ``p``'s), with ``p``'s sharding."""
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.result_type(p)
    sh = param_sharding(p)
    if sh is None:
        return jnp.full(np.shape(p), fill, dtype)
    return jnp.full(np.shape(p), fill, dtype, device=sh)


def _spec_entries(sh: NamedSharding, ndim: int):
    spec = tuple(sh.spec)
    return spec + (None,) * (ndim - len(spec))


def zeros_for_axes(p, keep_axes, dtype=None, fill=0.0):
    """``fill`` of shape ``[p.shape[i] for i in keep_axes]``, sharded as ``p`` is along the
    kept axes (replicated along the mesh axes of the dropped ones)."""
    shape = tuple(int(np.shape(p)[i]) for i in keep_axes)
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.result_type(p)
    sh = param_sharding(p)
    if isinstance(sh, NamedSharding):
        spec = _spec_entries(sh, np.ndim(p))
        sh = NamedSharding(sh.mesh, PartitionSpec(*(spec[i] for i in keep_axes)))
        return jnp.full(shape, fill, dtype, device=sh)
    if sh is not None and len(sh.device_set) == 1:
        return jnp.full(shape, fill, dtype, device=sh)
    return jnp.full(shape, fill, dtype)


def replicated_like(p, x):
    """``x`` (a small array: a per-parameter scalar) replicated over ``p``'s mesh."""
    sh = param_sharding(p)
    if isinstance(sh, NamedSharding):
        return _put(x, NamedSharding(sh.mesh, PartitionSpec()))
    if sh is not None and len(sh.device_set) == 1:
        return _put(x, sh)
    return x


def stacked_blocks_like(p, x):
    """``x`` (a stack of per-block matrices, leading axis = blocks) spread over the mesh axes
    that shard ``p``: the block axis is split over as many of them as divide it evenly,
    the rest replicated. (Shampoo's statistics and preconditioners.)"""
    sh = param_sharding(p)
    if not isinstance(sh, NamedSharding):
        return replicated_like(p, x)
    axes = []
    for entry in _spec_entries(sh, np.ndim(p)):
        if entry is None:
            continue
        axes.extend(entry if isinstance(entry, tuple) else (entry,))
    n = x.shape[0]
    chosen, size = [], 1
    for a in axes:
        if n % (size * sh.mesh.shape[a]) == 0:
            chosen.append(a)
            size *= sh.mesh.shape[a]
    spec = PartitionSpec(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
    return _put(x, NamedSharding(sh.mesh, spec))
