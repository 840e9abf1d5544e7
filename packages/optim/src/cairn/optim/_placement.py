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

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["param_sharding", "full_like_param", "zeros_for_axes", "replicated_like",
           "stacked_blocks_like"]


def param_sharding(p: Any) -> Any:
    """The sharding of a concrete array placed on purpose, or None: tracers, NumPy arrays,
    Python numbers, and arrays left uncommitted on the default device (their state stays
    uncommitted too, so jit may place it with them; a committed sharding would also be
    written into the compiled program, which then compiles slower for nothing)."""
    if isinstance(p, jax.core.Tracer) or not isinstance(p, jax.Array):
        return None
    try:
        sh = p.sharding
        if len(sh.device_set) == 1 and not getattr(p, "committed", True):
            return None
        return sh
    except Exception:  # noqa: BLE001 - deleted or exotic arrays: no placement
        return None


def _put(x, sharding):
    if sharding is None:
        return x
    return jax.device_put(x, sharding)


def full_like_param(p: Any, fill: float = 0.0,
                    dtype: jax.typing.DTypeLike | None = None) -> jax.Array:
    """``fill`` in ``p``'s shape and in ``dtype`` (default ``p``'s), with ``p``'s sharding."""
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.result_type(p)
    sh = param_sharding(p)
    if sh is None:
        return jnp.full(np.shape(p), fill, dtype)
    return jnp.full(np.shape(p), fill, dtype, device=sh)


def _spec_entries(sh: NamedSharding, ndim: int):
    spec = tuple(sh.spec)
    return spec + (None,) * (ndim - len(spec))


def zeros_for_axes(p: Any, keep_axes: Any, dtype: jax.typing.DTypeLike | None = None,
                   fill: float = 0.0) -> jax.Array:
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


def replicated_like(p: Any, x: Any) -> jax.Array:
    """``x`` (a small array: a per-parameter scalar) replicated over ``p``'s mesh."""
    sh = param_sharding(p)
    if isinstance(sh, NamedSharding):
        return _put(x, NamedSharding(sh.mesh, PartitionSpec()))
    if sh is not None and len(sh.device_set) == 1:
        return _put(x, sh)
    return x


def stacked_blocks_like(p: Any, x: Any) -> jax.Array:
    """``x`` (a stack of per-block matrices, leading axis = blocks) spread over the mesh axes
    that shard ``p``: the block axis is split over as many of them as divide it evenly,
    the rest replicated. (Shampoo's statistics and preconditioners.)"""
    sh = param_sharding(p)
    if not isinstance(sh, NamedSharding):
        return replicated_like(p, x)
    axes: list[Any] = []
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


def common_mesh(params: Any) -> Any:
    """The mesh every concrete parameter is sharded over (``NamedSharding``), or None
    (no parameters, tracers, a parameter on one device only, or several meshes)."""
    meshes = set()
    for x in jax.tree_util.tree_leaves(params):
        sh = param_sharding(x)
        if not isinstance(sh, NamedSharding):
            return None
        meshes.add(sh.mesh)
    return meshes.pop() if len(meshes) == 1 else None


def place_scalars(state: Any, params: Any) -> Any:
    """``state`` with every array that is not on the parameters' mesh (step counts, scalar
    hyperparameters, made on one device) replicated over that mesh, when all parameters
    share one; otherwise unchanged. A checkpoint restore into such a state then gives
    arrays that jit accepts next to the sharded parameters."""
    mesh = common_mesh(params)
    if mesh is None:
        return state
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(x):
        if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
            return x
        sh = x.sharding
        if isinstance(sh, NamedSharding) and sh.mesh == mesh:
            return x
        if replicated.is_fully_addressable:
            return jax.device_put(x, replicated)
        # a mesh over several jax.distributed processes: device_put of this process's copy
        # gave an array whose shards could not be listed (a checkpoint's snapshot failed,
        # and jit forwards such an unchanged input to its output); build it from each
        # process's own copy, the same value everywhere
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, replicated, lambda index: host[index])

    return jax.tree_util.tree_map(place, state)


def params_record(params: Any) -> Any:
    """``(treedef, paths, shardings)`` of concrete parameters sharded over several devices
    (NamedSharding), or None: what a jitted step constrains the state to (see
    :func:`constrain_like_params`)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    shardings = []
    for x in leaves:
        sh = param_sharding(x)
        if not isinstance(sh, NamedSharding) or len(sh.device_set) <= 1:
            return None
        shardings.append(sh)
    if not shardings:
        return None
    from cairn.core_array import tree_paths

    return treedef, tuple(tree_paths(params)), tuple(shardings)


def constrain_like_params(updates: Any, state: Any, record: Any) -> tuple[Any, Any]:
    """Under ``jit``, pin the updates and every per-parameter state leaf
    (``<...>/<param path>`` of the parameter's shape) to the sharding its parameter had at
    ``init``. Without it XLA's propagation may lay a replicated parameter's update and
    moments out along a batch axis (seen in the 8-device LM recipe: a norm scale sharded
    along 'data'). Skipped eagerly, for other trees, and when the traced values live on a
    mesh of another shape than the recorded one (a state restored onto another mesh without
    a new ``init``)."""
    if record is None:
        return updates, state
    treedef, paths, shardings = record
    leaves, td = jax.tree_util.tree_flatten(updates)
    if td != treedef or not leaves or not isinstance(leaves[0], jax.core.Tracer):
        return updates, state
    try:
        traced_mesh = jax.typeof(leaves[0]).sharding.mesh
        if tuple(traced_mesh.shape.items()) != tuple(shardings[0].mesh.shape.items()):
            return updates, state
    except Exception:  # noqa: BLE001 - no abstract mesh information: leave XLA to it
        return updates, state
    from cairn.core_array import tree_paths

    wsc = jax.lax.with_sharding_constraint
    by_path = {p: (sh, np.shape(x)) for p, sh, x in zip(paths, shardings, leaves)}
    updates = jax.tree_util.tree_unflatten(td, [wsc(x, sh) for x, sh in zip(leaves, shardings)])
    s_leaves, s_td = jax.tree_util.tree_flatten(state)
    out = []
    for x, path in zip(s_leaves, tree_paths(state)):
        parts = path.split("/")
        hit = None
        for k in range(1, len(parts)):
            hit = by_path.get("/".join(parts[k:]))
            if hit is not None:
                break
        out.append(wsc(x, hit[0]) if hit is not None and hit[1] == np.shape(x) else x)
    return updates, jax.tree_util.tree_unflatten(s_td, out)
