"""Sharding by logical axis names.

A parameter declares the logical names of its axes in its metadata
(``sharding_names=("embed", "mlp")``, usually through :func:`with_partitioning`).
Under :func:`sharding_rules` (a mesh plus ``LogicalAxisRules`` from
``cairn.core_array``) every variable created with such names is placed in its
``NamedSharding``: inside ``nn.jit`` / ``jax.jit`` as a sharding constraint, so the
compiled initializer writes each shard directly (see :func:`sharded_init`); eagerly with
``jax.device_put``; and as ``ShapeDtypeStruct(..., sharding=...)`` in
:func:`abstract_model`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from cairn.nn._graph import flat, merge, split
from cairn.nn._graph import state as _state
from cairn.nn._graph_mode import check_mode
from cairn.nn._jit import eval_shape, jit
from cairn.nn._module import Module
from cairn.nn._sharding_rules import (
    context_mesh,
    current_rules,
    mesh_and_rules,
    names_for,
    names_of,
    sharding_for,
    sharding_rules,
)
from cairn.nn._state import State
from cairn.nn._variables import Variable, rebuild_variable, template_of, with_metadata


def with_partitioning(
    initializer: Callable,
    sharding_names: Sequence[str | None] | None = None,
    mesh: Any = None,
    *,
    sharding: Sequence[str | None] | None = None,
    **metadata: Any,
) -> Callable:
    """Wrap ``initializer`` so the Variable built from its result carries
    ``sharding_names`` (one logical axis name, or None, per array dim).

    Called eagerly with a mesh (given here or from an enclosing :func:`sharding_rules`),
    the initializer runs as a compiled function whose output is the ``NamedSharding``
    of those names, so each device computes and stores only its own shard: the full
    array never exists on one device. Inside a trace (``nn.jit``, ``sharded_init``)
    it runs as is and the Variable gets a sharding constraint.

    Args:
      initializer: ``init(key, shape, dtype) -> array``.
      sharding_names: one logical axis name (or None) per array dim.
      mesh: the device mesh; None uses the one of :func:`sharding_rules`.
      sharding: Flax NNX's name of ``sharding_names`` (give one of the two).
      metadata: more metadata for the Variable.

    Raises:
      TypeError: neither or both of ``sharding_names`` and ``sharding`` given.

    >>> import jax, jax.numpy as jnp
    >>> from cairn import nn
    >>> init = nn.with_partitioning(lambda key, shape: jnp.zeros(shape), ("embed", "mlp"))
    >>> nn.Param(init(jax.random.key(0), (2, 3))).sharding_names
    ('embed', 'mlp')
    """
    if (sharding_names is None) == (sharding is None):
        raise TypeError(
            "with_partitioning: give the axis names once, as sharding_names (or Flax's "
            f"sharding=), got sharding_names={sharding_names!r}, sharding={sharding!r}"
        )
    chosen = sharding if sharding is not None else sharding_names
    assert chosen is not None  # checked above
    names = tuple(chosen)
    md = {"sharding_names": names, **metadata}
    if mesh is not None:
        md["mesh"] = mesh

    def init(*args, **kwargs):
        target = _eager_target(names, mesh, args, kwargs)
        if target is None:
            return initializer(*args, **kwargs)
        return _born_sharded(initializer, names, target, args, kwargs)

    init.__wrapped__ = initializer  # type: ignore[attr-defined]
    return with_metadata(init, **md)


# compiled initializers keyed by (initializer, static arguments, sharding)
_BORN_SHARDED: dict[Any, Callable] = {}


def _eager_target(names: tuple, mesh: Any, args, kwargs) -> NamedSharding | None:
    """The sharding an eager initializer call should produce directly, or None (no
    mesh in scope, or traced arguments: a trace places values by constraint)."""
    if mesh is None and current_rules() is None and context_mesh() is None:
        return None
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    found = mesh_and_rules(mesh, names)
    return None if found is None else sharding_for(names, len(names), *found)


def _born_sharded(initializer: Callable, names: tuple, target: NamedSharding, args, kwargs):
    """``initializer(*args, **kwargs)`` computed by a jitted function with
    ``out_shardings=target``: arrays in the arguments (keys) are traced, everything else
    (shapes, dtypes) is static and part of the cache key."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    is_dyn = tuple(isinstance(x, jax.Array | np.ndarray) for x in leaves)
    static = tuple(None if d else x for d, x in zip(is_dyn, leaves))
    dyn = [x for d, x in zip(is_dyn, leaves) if d]
    try:
        key = (initializer, treedef, is_dyn, static, target)
        hash(key)
    except TypeError:
        key = None
    fn = _BORN_SHARDED.get(key) if key is not None else None
    if fn is None:

        def call(dyn_values):
            it = iter(dyn_values)
            full = [next(it) if d else x for d, x in zip(is_dyn, static)]
            a, kw = treedef.unflatten(full)  # type: ignore[attr-defined]
            return initializer(*a, **kw)

        out = jax.eval_shape(call, dyn)
        if not isinstance(out, jax.ShapeDtypeStruct):  # not one array: no placement
            return initializer(*args, **kwargs)
        if len(out.shape) != len(names):
            raise ValueError(
                f"with_partitioning: sharding_names {names} has {len(names)} entries but "
                f"the initializer returned an array of shape {out.shape}"
            )
        fn = jax.jit(call, out_shardings=target)
        if key is not None:
            if len(_BORN_SHARDED) > 512:
                _BORN_SHARDED.clear()
            _BORN_SHARDED[key] = fn
    return fn(dyn)


def get_partition_spec(tree: Any, rules: Any = None, mesh: Any = None) -> Any:
    """The same tree (a Module's :func:`~cairn.nn.state`, a State, or a Variable) with
    each variable's value replaced by its ``PartitionSpec`` (``PartitionSpec()`` when it
    has no ``sharding_names``). Without ``rules``, the active :func:`sharding_rules`; with
    none active the names are the mesh axes themselves (``("a", "b")`` gives
    ``PartitionSpec("a", "b")``, as in Flax NNX).

    Args:
      tree: a State, a module's state or a Variable.
      rules: logical-axis rules; None uses the active :func:`sharding_rules`.
      mesh: the mesh the rules refer to; None uses the active one.
    """
    from cairn.core_array import logical_to_partition_spec

    if isinstance(tree, Module):
        tree = _state(tree)
    ctx = current_rules()
    if rules is None and ctx is not None:
        mesh = mesh if mesh is not None else ctx[0]
        rules = ctx[1]

    def spec(v):
        if not isinstance(v, Variable):
            return v
        names = names_of(v._meta)
        if names is None:
            return v.replace(PartitionSpec())
        if rules is None:
            return v.replace(PartitionSpec(*names))
        return v.replace(logical_to_partition_spec(names, rules, mesh))

    return _map_variables(spec, tree)


def _map_variables(fn, tree):
    if isinstance(tree, Variable):
        return fn(tree)
    if isinstance(tree, State):
        return State.from_flat({p: fn(v) for p, v in tree._flat.items()})
    return jax.tree_util.tree_map(
        lambda x: fn(x) if isinstance(x, Variable) else _map_variables(fn, x)
        if isinstance(x, State) else x,
        tree,
        is_leaf=lambda x: isinstance(x, Variable | State),
    )


def get_named_sharding(tree: Any, mesh: Any, rules: Any = None) -> Any:
    """Like :func:`get_partition_spec` but with ``NamedSharding(mesh, spec)`` values.

    Args:
      tree: a State, a module's state or a Variable.
      mesh: the device mesh.
      rules: logical-axis rules; None uses the active :func:`sharding_rules`.
    """
    specs = get_partition_spec(tree, rules, mesh)
    return _map_variables(lambda v: v.replace(NamedSharding(mesh, v.raw_value)), specs)


def abstract_model(
    fn: Callable, *args: Any, mesh: Any = None, rules: Any = None, **kwargs: Any
) -> Any:
    """Build ``fn(*args, **kwargs)`` abstractly (``jax.eval_shape``: no memory, no
    compute). Every variable's value is a ``jax.ShapeDtypeStruct``; with a mesh (given
    or from :func:`sharding_rules`) it carries the variable's ``NamedSharding`` (logical
    names through ``rules``; replicated without names). The standard target for
    restoring a checkpoint.

    Args:
      fn: the constructor (or any function building modules).
      args: its positional arguments.
      mesh: the device mesh for the shardings; None uses the one of :func:`sharding_rules`.
      rules: logical-axis rules (a ``LogicalAxisRules`` or ``(name, mesh_axes)`` pairs); None uses
        the active ones.
      kwargs: its keyword arguments.
    """
    ctx = current_rules()
    if mesh is None and ctx is not None:
        mesh = ctx[0]
    if rules is None and ctx is not None:
        rules = ctx[1]
    out = eval_shape(fn, *args, **kwargs)
    if mesh is None:
        return out
    if rules is None:
        from cairn.core_array import LogicalAxisRules

        rules = LogicalAxisRules([])
    mods = [out] if isinstance(out, Module) else [
        x for x in jax.tree_util.tree_leaves(out, is_leaf=lambda x: isinstance(x, Module))
        if isinstance(x, Module)
    ]
    for m in mods:
        for v in flat(m).variables:
            val = v.raw_value
            if not isinstance(val, jax.ShapeDtypeStruct):
                continue
            names = names_of(v._meta)
            if names is None:
                sh = NamedSharding(mesh, PartitionSpec())
            else:
                sh = sharding_for(names, len(val.shape), mesh, rules)
            v.raw_value = jax.ShapeDtypeStruct(val.shape, val.dtype, sharding=sh)
    return out


def as_abstract(tree: Any, *, graph: bool | None = None) -> Any:
    """A copy of ``tree`` (a module, a pytree of modules, usually from
    :func:`~cairn.nn.eval_shape`) whose variables hold ``jax.ShapeDtypeStruct`` values;
    a variable with axis names (``sharding_names``, or Flax NNX's ``out_sharding``)
    carries their ``NamedSharding`` on its own ``mesh`` metadata, else the mesh of
    :func:`sharding_rules` or of ``jax.set_mesh`` (Flax NNX's ``nnx.as_abstract``).

    Args:
      tree: the module(s); arrays and ShapeDtypeStructs are both accepted as values.
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
    """
    check_mode("as_abstract", graph)
    gd, st = split(tree)
    flat_st = {(): st} if isinstance(st, Variable) else st._flat
    out = {}
    for p, v in flat_st.items():
        val = v.raw_value
        if not isinstance(val, jax.ShapeDtypeStruct) and hasattr(val, "shape") and hasattr(val, "dtype"):
            val = jax.ShapeDtypeStruct(val.shape, val.dtype)
        names = names_for(v._meta, len(getattr(val, "shape", ())))
        if names is not None and isinstance(val, jax.ShapeDtypeStruct):
            found = mesh_and_rules(v._meta.get("mesh"), names)
            if found is not None:
                sh = sharding_for(names, len(val.shape), *found)
                val = jax.ShapeDtypeStruct(val.shape, val.dtype, sharding=sh)
        out[p] = rebuild_variable(template_of(v), val)
    if isinstance(st, Variable):
        return merge(gd, out[()])
    return merge(gd, State.from_flat(out))


def sharded_init(
    fn: Callable, *args: Any, mesh: Any = None, rules: Any = None, **kwargs: Any
) -> Any:
    """Create ``fn(*args, **kwargs)`` (typically a model constructor) inside one
    compiled function whose outputs are each variable's ``NamedSharding``: every
    parameter is written shard by shard, never as a full copy on one device. Variables
    without ``sharding_names`` are replicated.

    Args:
      fn: the constructor (or any function building modules).
      args: its positional arguments.
      mesh: the device mesh; None uses the one of :func:`sharding_rules`.
      rules: logical-axis rules; None uses the active ones.
      kwargs: its keyword arguments.
    """
    ctx = current_rules()
    if mesh is None and ctx is not None:
        mesh = ctx[0]
    if rules is None and ctx is not None:
        rules = ctx[1]
    if mesh is None:
        raise ValueError("sharded_init needs a mesh (argument or nn.sharding_rules context)")
    if rules is None:
        from cairn.core_array import LogicalAxisRules

        rules = LogicalAxisRules([])

    def create(*a, **kw):
        model = fn(*a, **kw)
        for v in flat(model).variables:
            names = names_of(v._meta)
            val = v.raw_value
            if not hasattr(val, "shape"):
                continue
            sh = (
                NamedSharding(mesh, PartitionSpec())
                if names is None
                else sharding_for(names, len(val.shape), mesh, rules)
            )
            v.raw_value = jax.lax.with_sharding_constraint(val, sh)
        return model

    with sharding_rules(rules, mesh):
        return jit(create)(*args, **kwargs)
