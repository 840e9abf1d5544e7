"""Optimizer: holds an Optax-style gradient transformation's state for one model."""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from cairn.nn._filters import path_text
from cairn.nn._graph import state as _state
from cairn.nn._graph import update as _update
from cairn.nn._module import Dict, List, Module
from cairn.nn._sharding_rules import shard_on_create
from cairn.nn._state import State, replace_by_pure_dict, to_pure_dict
from cairn.nn._variables import OptState, Param, Variable


def _params_state(model: Module, wrt: Any) -> State:
    """The variables of ``model`` matching the one filter ``wrt``."""
    return cast(State, _state(model, wrt))


def _is_var(x) -> bool:
    return isinstance(x, Variable)


class Optimizer(Module):
    """The state of a gradient transformation ``tx`` for ``model``'s variables matching
    ``wrt`` (default :class:`Param`).

    ``tx`` is any object with Optax-style ``init(params)`` and
    ``update(updates, state, params=None, **extra)`` (Optax itself, cairn.optim, your
    own); it is duck-typed. The transformation sees the parameters as nested dicts keyed
    by path components (``{"layers": {0: {"kernel": ...}}}``), so path-based masks and
    labels work. ``update(model, grads)`` applies one step in place::

        opt = nn.Optimizer(model, optax.adamw(1e-3), wrt=nn.Param)
        grads = nn.grad(loss_fn)(model, x, y)
        opt.update(model, grads)

    Each leaf of the transformation's state is an :class:`OptState` variable, so
    ``nn.state(opt)`` has paths such as ``opt_state/0/mu/layers/0/kernel``; ``step``
    counts the updates. A transformation that creates its state with the parameters'
    shardings (cairn.optim, Optax) keeps them here: the arrays are stored as ``tx.init``
    returns them, and ``update`` writes back what the (jitted) step computed. When every
    parameter is sharded over one mesh, state arrays that ``tx.init`` puts on a single
    device (``step``, counts, scalar hyperparameters) are replicated over that mesh, so
    the whole optimizer restores from a checkpoint into shardings that jit accepts
    together.

    A parameter whose metadata has ``optimizer_sharding`` (as in Flax NNX: logical axis
    names, a ``PartitionSpec`` or a ``jax.sharding.Sharding``) gets its state arrays
    (each state leaf at the parameter's path with the parameter's shape, such as Adam's
    ``mu`` and ``nu``) placed in that sharding at init, instead of the parameter's.

    Args:
      model: the module whose variables are trained.
      tx: the gradient transformation (Optax-style ``init``/``update``).
      wrt: the filter of the variables trained (default :class:`Param`).
    """

    def __init__(self, model: Module, tx: Any, *, wrt: Any = Param) -> None:
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(
                f"Optimizer: tx must have Optax-style init and update methods, got "
                f"{type(tx).__name__}"
            )
        if not isinstance(model, Module):
            raise TypeError(f"Optimizer: expected a Module, got {type(model).__name__}")
        self.tx = tx
        self.wrt = wrt
        params = to_pure_dict(_params_state(model, wrt))
        mesh = _common_mesh(params)
        self.step = OptState(_onto(jnp.zeros((), jnp.uint32), mesh))
        opt_state = jax.tree_util.tree_map(lambda x: _onto(x, mesh), tx.init(params))
        opt_state, placed = _place_optimizer_sharding(
            opt_state, _params_state(model, wrt), mesh
        )
        names = _param_sharding_names(opt_state, _params_state(model, wrt))
        self.opt_state = _wrap(opt_state, placed, names)

    def update(self, model: Module, grads: Any, /, **kwargs: Any) -> Any:
        """One step: ``updates, state = tx.update(grads, state, params, **kwargs)`` then
        ``params += updates`` (cast back to each parameter's dtype), in place. Returns
        ``updates`` (a State of plain arrays at the parameters' paths).

        ``grads`` is the State ``nn.grad`` returns (or a pure dict of the parameters'
        structure); gradients of variables ``wrt`` does not select (``nn.grad``'s
        default ``nn.Param`` also takes ``LoRAParam``s) are left out, as Flax NNX does.

        Args:
          model: the module being trained (updated in place).
          grads: the gradient State from ``nn.grad`` (or a pure dict of the parameters' structure).
          kwargs: extra arguments for ``tx.update`` (``value``, ``grad``...).

        Raises:
          ValueError: naming the parameters selected by ``wrt`` that have no gradient.
        """
        params_state = _params_state(model, self.wrt)
        params = to_pure_dict(params_state)
        if isinstance(grads, Module):  # jax.grad of a module: a module of gradients
            grads = _params_state(grads, self.wrt)
        if isinstance(grads, State):
            grads = _grads_for(grads, params_state, self.wrt)
        kwargs = _tx_kwargs(kwargs, params_state, self.wrt)
        # the transformation's own structure: a dict / list in its state became an
        # nn.Dict / nn.List on assignment; give it back as dict / list
        opt_tree = _plain(self.opt_state)
        opt_vars = jax.tree_util.tree_leaves(opt_tree, is_leaf=_is_var)
        opt_vals = jax.tree_util.tree_map(lambda v: v.raw_value, opt_tree, is_leaf=_is_var)
        updates, new_state = self.tx.update(grads, opt_vals, params, **kwargs)
        new_params = jax.tree_util.tree_map(
            lambda p, u: jnp.asarray(p + u).astype(jnp.result_type(p)), params, updates
        )
        replace_by_pure_dict(params_state, new_params)
        data = {p: x for p, x in params_state._flat.items() if not isinstance(x, Variable)}
        if data:  # plain data attributes trained: written into the model by path
            _update(model, State.from_flat(data))
        new_leaves = jax.tree_util.tree_leaves(new_state)
        if len(new_leaves) != len(opt_vars):
            raise ValueError(
                "Optimizer.update: tx.update returned a state with a different structure"
            )
        for v, x in zip(opt_vars, new_leaves):
            spec = v._meta.get("optimizer_sharding")
            v.raw_value = x if spec is None else _keep_sharding(x, spec)
        self.step.raw_value = self.step.raw_value + jnp.uint32(1)
        if not isinstance(updates, dict):
            return updates
        # a State of plain arrays at the parameters' paths (in their order), as Flax NNX's
        by_path = State(updates)._flat
        return State.from_flat({p: by_path[p] for p in params_state._flat if p in by_path})


class ModelAndOptimizer(Optimizer):
    """An :class:`Optimizer` that keeps its model: ``update(grads)`` needs no model
    argument (Flax NNX's deprecated convenience class; prefer :class:`Optimizer`).

    Args:
      model: the module to optimize (kept as ``self.model``).
      tx: an Optax-style gradient transformation.
      wrt: the filter of the variables to optimize.
    """

    def __init__(self, model: Module, tx: Any, *, wrt: Any = Param) -> None:
        super().__init__(model, tx, wrt=wrt)
        self.model = model

    def update(self, grads: Any, /, **kwargs: Any) -> Any:  # type: ignore[override]
        """One step on ``self.model`` (see :meth:`Optimizer.update`).

        Args:
          grads: gradients with the structure of the model's trained variables (as ``nn.grad``
            returns them).
          kwargs: extra arguments for the optimizer's ``update`` (``value``, ``grad``...).
        """
        return super().update(self.model, grads, **kwargs)


def _tx_kwargs(kwargs: dict, params_state: State, wrt: Any) -> dict:
    """The extra arguments of ``tx.update`` in the transformation's structure (pure
    dicts): a State (``grad=``, as ``nn.grad`` returns it) becomes the pure dict of the
    trained parameters' entries; ``value_fn`` gets the parameters back as a State of
    the trained variables (what it was written for, as in Flax NNX)."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, State):
            v = _grads_for(v, params_state, wrt)
        elif k == "value_fn" and callable(v):
            v = _state_value_fn(v, params_state)
        out[k] = v
    return out


def _state_value_fn(value_fn: Any, params_state: State) -> Any:
    """``value_fn`` called with the pure-dict parameters as a State shaped like
    ``params_state`` (new Variables holding the values)."""
    items = list(params_state._flat.items())

    def called(pure: Any, *args: Any, **kwargs: Any) -> Any:
        flat = {}
        for path, var in items:
            x = pure
            for key in path:
                x = x[key] if key in x else x[str(key)]
            flat[path] = var.replace(value=x)
        return value_fn(State.from_flat(flat), *args, **kwargs)

    return called


def _grads_for(grads: State, params_state: State, wrt: Any) -> dict:
    """The pure dict of the gradients of the parameters ``wrt`` selects."""
    want = params_state._flat.keys()
    if grads._flat.keys() != want:
        grads = State.from_flat({p: g for p, g in grads._flat.items() if p in want})
    if grads._flat.keys() != want:
        missing = [path_text(p) for p in want if p not in grads._flat]
        raise ValueError(
            f"Optimizer.update: the gradients do not match the parameters selected by "
            f"wrt={wrt!r}: missing {missing} (no gradient for these parameters)"
        )
    return to_pure_dict(grads)


def _keep_sharding(x: Any, spec: Any) -> Any:
    """``x`` kept in the ``optimizer_sharding`` it was placed in at init (inside jit the
    update would otherwise follow the gradients' sharding)."""
    sh = spec if isinstance(spec, jax.sharding.Sharding) else None
    if sh is None:
        return x
    if isinstance(x, jax.core.Tracer):
        if _explicit(sh):
            return jax.sharding.reshard(x, sh)
        return jax.lax.with_sharding_constraint(x, sh)
    if isinstance(x, jax.Array) and x.sharding != sh:
        return jax.device_put(x, sh)
    return x


def _explicit(sh: Any) -> bool:
    mesh = getattr(sh, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def _leaf_key(entry: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def _mesh_of(x: Any, mesh: Any) -> Any:
    sh = getattr(x, "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding):
        return sh.mesh
    return mesh


def _placed(x: Any, spec: Any, mesh: Any) -> Any:
    """``x`` in the sharding ``spec`` names (a Sharding, a PartitionSpec over ``mesh``,
    or logical axis names resolved like a Variable's ``sharding_names``)."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return x
    if isinstance(spec, jax.sharding.Sharding):
        return jax.device_put(x, spec)
    if isinstance(spec, jax.sharding.PartitionSpec):
        if mesh is None:
            mesh = _context_mesh()
        if mesh is None:
            return x
        return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    return shard_on_create(x, {"sharding_names": tuple(spec), "mesh": mesh})


def _context_mesh() -> Any:
    """The mesh of ``jax.set_mesh`` / ``with jax.set_mesh(...)``, or None."""
    mesh = jax.sharding.get_mesh()
    return None if mesh is None or mesh.empty else mesh


def _place_optimizer_sharding(opt_state: Any, params_state: State, mesh: Any) -> Any:
    """Put the state leaves of each parameter carrying ``optimizer_sharding`` metadata
    (leaves whose path ends with the parameter's path and whose shape is its shape) in
    that sharding. A PartitionSpec is over the parameters' mesh, else over the mesh of
    ``jax.set_mesh``."""
    wanted = {
        path: (var.raw_value, var._meta["optimizer_sharding"])
        for path, var in params_state._flat.items()
        if isinstance(var, Variable) and var._meta.get("optimizer_sharding") is not None
    }
    leaves, treedef = jax.tree_util.tree_flatten_with_path(opt_state)
    out, placed = [], []
    for kp, x in leaves:
        keys = tuple(_leaf_key(e) for e in kp)
        sh = None
        for path, (param, spec) in wanted.items():
            if keys[-len(path) :] == path and jnp.shape(x) == jnp.shape(param):
                x = _placed(x, spec, _mesh_of(param, mesh))
                sh = getattr(x, "sharding", None)
                break
        out.append(x)
        placed.append(sh if isinstance(sh, jax.sharding.NamedSharding) else None)
    return jax.tree_util.tree_unflatten(treedef, out), placed


def _common_mesh(params):
    """The mesh every concrete parameter is sharded over, or None (no parameters, some on
    one device only, abstract values, or several meshes)."""
    meshes = set()
    for x in jax.tree_util.tree_leaves(params):
        sh = getattr(x, "sharding", None)
        if isinstance(x, jax.core.Tracer) or not isinstance(sh, jax.sharding.NamedSharding):
            return None
        meshes.add(sh.mesh)
    return meshes.pop() if len(meshes) == 1 else None


def _onto(x, mesh):
    """``x`` replicated over ``mesh`` unless it already lives on it. The step counter and
    a transformation's scalars start on one device; left there, a checkpoint restore into
    them commits them to that device, and jit then rejects them next to parameters sharded
    over the mesh."""
    if mesh is None or isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return x
    sh = x.sharding
    if isinstance(sh, jax.sharding.NamedSharding) and sh.mesh == mesh:
        return x
    target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if target.is_fully_addressable:
        return jax.device_put(x, target)
    # a mesh over several processes (jax.distributed): device_put of this process's copy
    # gave an array whose shards could not be listed (a checkpoint's snapshot failed on
    # it); build it from each process's local copy, the same value everywhere
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, target, lambda index: host[index])


class _OptDict(dict):
    """A dict inside the optimizer state, readable by attribute as well
    (``opt.opt_state[0].mu.layers[0]["kernel"]``, as Flax NNX's State-valued optimizer
    state is). A pytree flattened like a dict (sorted keys)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"the optimizer state has no key {name!r} here (keys: {list(self)})"
            ) from None


def _optdict_flatten_with_keys(d: _OptDict):
    keys = sorted(d)
    return [(jax.tree_util.DictKey(k), d[k]) for k in keys], tuple(keys)


jax.tree_util.register_pytree_with_keys(
    _OptDict,
    _optdict_flatten_with_keys,
    lambda keys, children: _OptDict(zip(keys, children)),
    flatten_func=lambda d: ([d[k] for k in sorted(d)], tuple(sorted(d))),
)


def _attr_dicts(tree: Any) -> Any:
    """Every dict in ``tree`` (at any depth, inside tuples and named tuples too) as an
    :class:`_OptDict`."""

    def conv(x: Any) -> Any:
        if type(x) is dict:
            return _OptDict({k: _attr_dicts(v) for k, v in x.items()})
        return x

    return jax.tree_util.tree_map(
        conv, tree, is_leaf=lambda x: type(x) is dict or isinstance(x, Variable)
    )


def _param_sharding_names(opt_state: Any, params_state: State) -> list:
    """Per state leaf, the sharding names (``out_sharding`` / ``sharding_names``) of the
    parameter it mirrors (a leaf whose path ends with the parameter's path and whose
    shape is its shape, as Adam's ``mu`` / ``nu``), else None."""
    named = {}
    for path, var in params_state._flat.items():
        if not isinstance(var, Variable):  # a plain data leaf has no sharding metadata
            continue
        meta = var._meta
        names = meta.get("out_sharding", meta.get("sharding_names"))
        if isinstance(names, tuple):
            named[path] = (jnp.shape(var.raw_value), names)
    out = []
    for kp, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        keys = tuple(_leaf_key(e) for e in kp)
        found = None
        for path, (shape, names) in named.items():
            if keys[-len(path):] == path and jnp.shape(x) == shape:
                found = names
                break
        out.append(found)
    return out


def _opt_leaf(x: Any, sh: Any, names: Any) -> OptState:
    """One state leaf as an :class:`OptState`: ``optimizer_sharding`` records where it was
    placed (``update`` keeps it there); ``names`` (the mirrored parameter's sharding
    names) become its ``out_sharding`` metadata, as Flax NNX's optimizer state has."""
    v = OptState(jnp.asarray(x)) if sh is None else OptState(x, optimizer_sharding=sh)
    if names is not None:  # metadata only: the leaf is already where it belongs
        object.__setattr__(v, "_meta", {**v._meta, "out_sharding": names})
    return v


def _wrap(opt_state: Any, placed: list, names: list | None = None) -> Any:
    """Each state leaf in an :class:`OptState` (see :func:`_opt_leaf`). Nested dicts read
    by attribute too; a top-level dict becomes an ``nn.Dict`` on assignment."""
    leaves, treedef_ = jax.tree_util.tree_flatten(opt_state)
    treedef: Any = treedef_
    names = names if names is not None else [None] * len(leaves)
    wrapped = treedef.unflatten(
        [_opt_leaf(x, sh, n) for x, sh, n in zip(leaves, placed, names)]
    )
    return _tuple_dicts(wrapped)


def _tuple_dicts(tree: Any) -> Any:
    """The dicts inside tuples (Optax's named-tuple states) as :class:`_OptDict`; a dict
    outside any tuple stays a dict (a module turns it into an ``nn.Dict``, which reads
    by attribute already and is walked as module state, as an ``_OptDict`` would not)."""
    if type(tree) is dict:
        return {k: _tuple_dicts(v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return _attr_dicts(tree)
    return tree


def _plain(tree):
    """``tree`` with every nn.Dict / nn.List turned back into a dict / list (the
    Variables kept as leaves), so that it has the structure ``tx.init`` returned."""
    if isinstance(tree, Dict | _OptDict):
        return {k: _plain(tree[k]) for k in tree}
    if isinstance(tree, List):
        return [_plain(v) for v in tree]
    if isinstance(tree, Variable | Module):
        return tree
    return jax.tree_util.tree_map(
        _plain, tree, is_leaf=lambda x: isinstance(x, Variable | Module | _OptDict)
    )
