"""Mapped and scanned transforms: ``nn.vmap``, ``nn.scan``, ``nn.shard_map`` and the
per-variable axes (:class:`StateAxes`) they accept for a module argument."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from cairn.nn._axis_metadata import with_axis_metadata
from cairn.nn._filters import path_text, to_predicate
from cairn.nn._graph import GraphDef, flat, sync
from cairn.nn._graph_mode import check_mode, resolve_modes
from cairn.nn._module import Module
from cairn.nn._nodes import MOD, is_node
from cairn.nn._state import State
from cairn.nn._trace_cache import TraceCache
from cairn.nn._transform_plan import (
    Box,
    Plan,
    call_annotated,
    check_carry_disjoint,
    check_consistent_prefixes,
    check_prefix,
    check_tree_args,
    expose_states,
    reject_bound_method,
    run_pure,
)
from cairn.nn._transform_plan import Carry as LoopCarry
from cairn.nn._tree_names import as_pure
from cairn.nn._variables import Variable, rebuild_variable, template_of


class StateAxes:
    """Per-variable axes for one module argument of :func:`vmap` / :func:`shard_map`:
    a mapping ``{filter: axis}`` (first matching filter wins; every variable must match
    one), e.g. ``nn.StateAxes({nn.Param: 0, ...: None})``.

    Args:
      mapping: ``{filter: axis}``, ``axis`` an int or None (not mapped); or a
        :class:`State` holding each variable's axis at its path.
    """

    _cairn_prefix_mapping = True  # a per-variable prefix (graph mode only, in Flax NNX)

    def __init__(self, mapping: Mapping[Any, Any]) -> None:
        if isinstance(mapping, State):  # an axis per path: one exact-path filter each
            self.items = tuple((_AtPath(p), ax) for p, ax in mapping._flat.items())
        else:
            self.items = tuple(mapping.items())
        self.preds = tuple(to_predicate(f) for f, _ in self.items)

    def map_prefix(self, path: tuple, variable: Any) -> Any:
        """The axis of the variable ``variable`` at ``path`` (the first filter matching).

        Args:
          path: the variable's path tuple.
          variable: the variable (or plain leaf).

        Raises:
          ValueError: no filter matches.
        """
        for pred, (_, ax) in zip(self.preds, self.items):
            if pred(path, variable):
                return ax
        raise ValueError(
            f"StateAxes: {path_text(path)!r} matches none of the filters "
            f"{[f for f, _ in self.items]!r}"
        )

    def axes_for(self, graphdef: GraphDef, variables: list[Variable]) -> list:
        """The axis of each variable of a module (``graphdef`` and its variables).

        Args:
          graphdef: the module's :class:`GraphDef`.
          variables: its variables, in the order of ``graphdef.paths``.

        Raises:
          ValueError: naming a variable that matches none of the filters.
        """
        out = []
        for p, v in zip(graphdef.paths, variables):
            for pred, (_, ax) in zip(self.preds, self.items):
                if pred(p, v):
                    out.append(ax)
                    break
            else:
                raise ValueError(
                    f"StateAxes: variable {path_text(p)!r} ({type(v).__name__}) matches none "
                    f"of the filters {[f for f, _ in self.items]!r}; add `...` last"
                )
        return out

    def __repr__(self) -> str:
        return f"StateAxes({dict(self.items)!r})"


class _AtPath:
    """The filter of one exact path (a StateAxes made from a State)."""

    __slots__ = ("path",)

    def __init__(self, path: tuple) -> None:
        self.path = path

    def __call__(self, path: tuple, variable: Any) -> bool:
        return path == self.path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _AtPath) and other.path == self.path

    def __hash__(self) -> int:
        return hash(("_AtPath", self.path))

    def __repr__(self) -> str:
        return f"AtPath({path_text(self.path)!r})"


# --- axes of a plan's leaves ---


def _prefix_axes(args, kwargs, in_axes) -> list:
    """Per plan leaf axis from a per-argument prefix ``in_axes``."""
    if not isinstance(in_axes, tuple | list):
        in_axes = (in_axes,) * len(args)
    if len(in_axes) != len(args):
        raise ValueError(
            f"in_axes has {len(in_axes)} entries for {len(args)} positional arguments"
        )
    axes = []
    for a, ax in zip(args, in_axes):
        if isinstance(a, Module | Variable):
            axes.append(ax)
            continue
        if isinstance(ax, StateAxes):
            raise TypeError(
                f"StateAxes can only be given for a module argument, not {type(a).__name__}"
            )
        # expand a prefix tree over the argument's leaves (modules/variables are leaves)
        sub: Any = jax.tree_util.tree_flatten(expose_states(a), is_leaf=is_node)[1]
        if ax is None or isinstance(ax, int | PartitionSpec):
            axes.extend([ax] * sub.num_leaves)
        else:
            if _holds_state(ax):  # a State of axes / specs (plain leaves) against a State
                a = as_pure(a)  # of Variables: matched by path, one leaf per Variable
                sub = jax.tree_util.tree_flatten(a, is_leaf=is_node)[1]
            axes.extend(sub.flatten_up_to(_broadcast_prefix(ax, a)))
    if kwargs:
        axes.extend([0] * len(jax.tree_util.tree_leaves(kwargs, is_leaf=is_node)))
    return axes


def _holds_state(prefix: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(prefix, is_leaf=lambda x: isinstance(x, State))
    return any(isinstance(x, State) for x in leaves)


def _broadcast_prefix(prefix, tree):
    return jax.tree_util.tree_map(
        lambda ax, sub: jax.tree_util.tree_map(lambda _: ax, sub, is_leaf=is_node),
        prefix,
        tree,
        is_leaf=lambda x: x is None or is_node(x),
    )


def _module_axes(ax, desc: GraphDef, varlist, dyn) -> list:
    """One axis per variable of a module leaf: from a :class:`StateAxes`, from a module
    made by :func:`~cairn.nn.prefix` (its Variables hold the axes), or one for all."""
    if isinstance(ax, StateAxes):
        return ax.axes_for(desc, varlist)
    if isinstance(ax, Module):
        c = flat(ax)
        if c.graphdef.paths != desc.paths:
            raise ValueError(
                f"in_axes: the prefix module ({type(ax).__name__}) does not have the "
                f"structure of the argument ({desc.type.__name__}): paths "
                f"{list(c.graphdef.path_strings)} vs {list(desc.path_strings)}"
            )
        return [v.raw_value for v in c.variables]
    return [ax] * len(dyn)


def _leaf_axes_tree(plan: Plan, axes) -> list:
    """Axes for the plan's dyn list (a module leaf gets its axis for every value)."""
    return [
        _module_axes(ax, desc, vl, d)
        if k == MOD
        else (ax.raw_value if isinstance(ax, Variable) else ax)
        for k, d, ax, desc, vl in zip(plan.kinds, plan.dyn, axes, plan.descs, plan.varlists)
    ]


def _check_mapped_ranks(plan: Plan, axes) -> None:
    """A clear error naming the variable when a mapped module has a variable whose rank
    is too small for its axis."""
    for kind, desc, d, ax0, vl in zip(plan.kinds, plan.descs, plan.dyn, axes, plan.varlists):
        if kind != MOD:
            continue
        for p, v, ax in zip(desc.paths, d, _module_axes(ax0, desc, vl, d)):
            if not isinstance(ax, int):
                continue
            nd = len(getattr(v, "shape", ()))
            if not (-nd <= ax < nd):
                raise ValueError(
                    f"nn.vmap: variable {path_text(p)!r} of {desc.type.__name__} has rank "
                    f"{nd} and cannot be mapped along axis {ax}; pass in_axes=None for this "
                    f"module (broadcast) or give every variable a batch axis"
                )


# --- the transforms ---


def vmap(
    f: Callable | None = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    axis_name: Any = None,
    axis_size: int | None = None,
    spmd_axis_name: Any = None,
    transform_metadata: Mapping[str, Any] = MappingProxyType({}),
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Callable:
    """Vectorize ``f`` over axes of its arguments. ``in_axes`` is ``jax.vmap``'s per-
    argument prefix; for a module argument it is one int (every variable is mapped
    along that axis) or ``None`` (broadcast). Changes to a mapped module come back
    stacked along the same axis; a broadcast module must not be changed by batched
    values. Modules created inside ``f`` come out stacked (``out_axes``): this is how
    stacked layers for :func:`scan` are made.

    Args:
      f: the function to vectorize; None returns a decorator.
      in_axes: ``jax.vmap``'s per-argument prefix (for a module: one int or None).
      out_axes: the output axes (created modules come out stacked along them).
      axis_name: a name for the mapped axis (for collectives).
      axis_size: the mapped size when no input is mapped.
      spmd_axis_name: mesh axis names the mapped axis is sharded over.
      transform_metadata: ``{nn.PARTITION_NAME: mesh_axis, ...}``: inside ``f`` the mapped
        axis is removed from the sharding names of the mapped variables, and inserted
        into those of the variables ``f`` creates or returns (see
        :func:`~cairn.nn.transform_metadata`).
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
      graph_updates: Flax NNX's keyword, accepted for compatibility (one behaviour here).

    >>> import jax, jax.numpy as jnp
    >>> from cairn import nn
    >>> class W(nn.Module):
    ...     def __init__(self, key):
    ...         self.w = nn.Param(jax.random.normal(key, (3,)))
    >>> stacked = nn.vmap(W)(jax.random.split(jax.random.key(0), 4))
    >>> stacked.w.shape
    (4, 3)
    """
    check_mode("vmap", graph, graph_updates)
    check_prefix(in_axes, "in_axes", "vmap", graph, graph_updates)
    check_prefix(out_axes, "out_axes", "vmap", graph, graph_updates)
    reject_bound_method(f, "vmap")
    if f is None:
        return functools.partial(
            vmap, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name,
            axis_size=axis_size, spmd_axis_name=spmd_axis_name,
            transform_metadata=transform_metadata, graph=graph, graph_updates=graph_updates,
        )
    if transform_metadata:
        f = with_axis_metadata(f, in_axes, out_axes, transform_metadata, "vmap")

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        check_tree_args("vmap", (args, kwargs), graph)
        return _mapped_call(
            jax.vmap, f, args, kwargs, in_axes, out_axes,
            {"axis_name": axis_name, "axis_size": axis_size, "spmd_axis_name": spmd_axis_name},
            link=True, no_alias=not resolve_modes(graph, graph_updates)[2],
        )

    return wrapper


def pmap(
    f: Callable | None = None,
    axis_name: Any = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    static_broadcasted_argnums: int | tuple[int, ...] = (),
    devices: Any = None,
    backend: str | None = None,
    axis_size: int | None = None,
    donate_argnums: int | tuple[int, ...] = (),
    global_arg_shapes: Any = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Callable:
    """``jax.pmap`` where arguments may be modules: like :func:`vmap`, but the mapped
    axis is spread over devices (its size must not exceed the device count). A
    module's entry in ``in_axes`` / ``out_axes`` is an int, None, a :class:`StateAxes`
    or a module made by :func:`~cairn.nn.prefix`; changes to a mapped module come back
    stacked along its axis. Modules created inside ``f`` come out per ``out_axes``.

    Args:
      f: the function; None returns a decorator.
      axis_name: the name of the mapped axis, for collectives inside ``f``.
      in_axes: per positional argument, as in :func:`vmap`.
      out_axes: per output, as in :func:`vmap`.
      static_broadcasted_argnums: not supported with modules (must be empty).
      devices: the devices to map over (``jax.pmap``'s).
      backend: ``jax.pmap``'s backend.
      axis_size: the size of the mapped axis when no argument is mapped.
      donate_argnums: not supported (must be empty): the caller's modules keep their
        buffers.
      global_arg_shapes: must be None (removed from JAX).
      graph: Flax NNX's graph-mode keyword (checked; see the README table).
      graph_updates: Flax NNX's graph-updates keyword (checked).

    Raises:
      NotImplementedError: for ``static_broadcasted_argnums``, ``donate_argnums`` or
        ``global_arg_shapes``.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> m = nn.Linear(2, 3, rngs=nn.Rngs(0))
    >>> nn.pmap(lambda m, x: m(x), in_axes=(None, 0))(m, jnp.ones((1, 4, 2))).shape
    (1, 4, 3)
    """
    check_mode("pmap", graph, graph_updates)
    check_prefix(in_axes, "in_axes", "pmap", graph, graph_updates)
    check_prefix(out_axes, "out_axes", "pmap", graph, graph_updates)
    reject_bound_method(f, "pmap")
    for name, v in (("static_broadcasted_argnums", static_broadcasted_argnums),
                    ("donate_argnums", donate_argnums)):
        if v not in ((), None):
            raise NotImplementedError(
                f"nn.pmap: {name}={v!r} is not supported; close over static values instead"
            )
    if global_arg_shapes is not None:
        raise NotImplementedError("nn.pmap: global_arg_shapes is not supported by JAX any more")
    if f is None:
        return functools.partial(
            pmap, axis_name=axis_name, in_axes=in_axes, out_axes=out_axes, devices=devices,
            backend=backend, axis_size=axis_size, graph=graph, graph_updates=graph_updates,
        )
    opts = {"axis_name": axis_name, "devices": devices, "backend": backend, "axis_size": axis_size}

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return _mapped_call(jax.pmap, f, args, kwargs, in_axes, out_axes, opts)

    return wrapper


def _mapped_call(
    mapper, f, args, kwargs, in_axes, out_axes, opts: dict, link: bool = False,
    no_alias: bool = False,
) -> Any:
    """``mapper`` (``jax.vmap`` / ``jax.pmap``) of ``f(*args, **kwargs)`` with module
    arguments: their values go in along their axes and the new values come back along
    the same axes; module-aware ``out_axes`` are expanded for the traced output."""
    if kwargs and isinstance(in_axes, tuple | list) and len(in_axes) > len(args):
        args, kwargs = _bind_positional(f, args, kwargs)
    plan = Plan((args, kwargs), link)
    axes = _prefix_axes(args, kwargs, in_axes)
    leaf_axes = _leaf_axes_tree(plan, axes)
    check_consistent_prefixes(plan, leaf_axes)
    _check_mapped_ranks(plan, axes)
    box = Box()
    # a module argument's changes come back along its axes: one int / None covers any
    # number of variables (also ones f creates, as in a vmapped __init__); otherwise one
    # axis per value (a module's: a list of them)
    back_axes: list[Any] = [ax if k == MOD and (ax is None or isinstance(ax, int)) else la
                            for k, ax, la in zip(plan.kinds, axes, leaf_axes)]
    per_var = any(k == MOD and isinstance(ax, StateAxes | Module) for k, ax in zip(plan.kinds, axes))
    if _has_module_axes(out_axes) or per_var:
        probe_box = Box()
        probe = jax.vmap(
            run_pure(f, plan, probe_box), in_axes=(leaf_axes,), out_axes=0,
            axis_name=opts.get("axis_name"), axis_size=opts.get("axis_size"),
        )
        out_shape, dyn_shape = jax.eval_shape(probe, plan.dyn)
        if _has_module_axes(out_axes):
            out_axes = _expand_out_axes(out_axes, out_shape)
        if per_var:  # per-variable axes of the structure f leaves behind
            back_axes = _new_leaf_axes(plan, axes, back_axes, probe_box.value, dyn_shape)
    pure = run_pure(f, plan, box, "vmap" if no_alias else None)
    names: dict[int, tuple] = {}
    if per_var:  # by variable path, so that JAX's axis errors name the variable
        names = {i: probe_box.value[i].path_strings for i, (k, ax) in
                 enumerate(zip(plan.kinds, axes)) if k == MOD and isinstance(ax, StateAxes | Module)}
        back_axes = [dict(zip(names[i], a)) if i in names else a for i, a in enumerate(back_axes)]
        pure = _by_path(pure, names)
    try:
        out, new_dyn = mapper(pure, in_axes=(leaf_axes,), out_axes=(out_axes, back_axes),
                              **opts)(plan.dyn)
    except ValueError as e:
        if names:
            _name_spec_error(e, out_shape, dyn_shape, names)
        raise
    new_dyn = [[d[n] for n in names[i]] if i in names else d for i, d in enumerate(new_dyn)]
    plan.write_back(plan.fill(new_dyn), box.value)
    return out


def _name_spec_error(e: ValueError, out_shape: Any, dyn_shape: list, names: dict) -> None:
    """Re-raise JAX's ``vmap`` out-axes mismatch naming the output it is about (JAX's own
    path is off by the ``None`` outputs it skips): for a module's variable, its path,
    e.g. ``[1][0]['broadcast']`` for a broadcast variable a batched value was written to."""
    ctx = e.__context__
    idx = getattr(ctx, "leaf_idx", None)
    if idx is None:
        return
    named = [dict(zip(names[i], d)) if i in names else d for i, d in enumerate(dyn_shape)]
    pairs = jax.tree_util.tree_flatten_with_path((out_shape, named))[0]
    if idx >= len(pairs):
        return
    where = jax.tree_util.keystr(pairs[idx][0])
    raise ValueError(
        f"at vmap out_axes{where}, got axis spec {getattr(ctx, 'dst', None)} but output was "
        f"batched on axis {getattr(ctx, 'src', None)}: a variable with axis None (broadcast) "
        f"was given a batched value; map it (an int axis) or keep batched values out of it"
    ) from None


def _by_path(pure: Callable, names: dict) -> Callable:
    """``pure`` whose new values of the plan leaves in ``names`` are dicts keyed by the
    variables' path strings instead of lists."""

    def named(dyn):
        out, new_dyn = pure(dyn)
        return out, [dict(zip(names[i], d)) if i in names else d for i, d in enumerate(new_dyn)]

    return named


def _new_leaf_axes(plan: Plan, axes: list, back_axes: list, descs: list, dyn: list) -> list:
    """``back_axes`` with the axes of each module argument given a :class:`StateAxes`
    or prefix module recomputed for its structure after the call (``descs``, and
    ``dyn``: the shapes of its new values)."""
    out = list(back_axes)
    for i, (k, ax) in enumerate(zip(plan.kinds, axes)):
        if k == MOD and isinstance(ax, StateAxes | Module) and descs[i] != plan.descs[i]:
            shell = descs[i].build_from_values(dyn[i])
            out[i] = _module_axes(ax, descs[i], flat(shell).variables, dyn[i])
    return out


def _bind_positional(f: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Keyword arguments that name positional parameters of ``f`` moved to their
    positions (so a per-position ``in_axes`` covers ``MLP(key=k)``)."""
    try:
        ba = inspect.signature(f).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    return tuple(ba.args), dict(ba.kwargs)


def _is_axes_leaf(x: Any) -> bool:
    return x is None or isinstance(x, int | PartitionSpec | StateAxes | Module | Variable)


def _has_module_axes(out_axes: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(out_axes, is_leaf=_is_axes_leaf)
    return any(isinstance(x, StateAxes | Module | Variable) for x in leaves)


def _expand_out_axes(out_axes: Any, out: Any) -> Any:
    """``out_axes`` with each :class:`StateAxes` / prefix module replaced by a module of
    the output's structure whose variables hold their axes (a prefix JAX accepts)."""

    def one(ax, sub):
        if isinstance(ax, StateAxes | Module):
            if not isinstance(sub, Module):
                raise ValueError(
                    f"out_axes: {ax!r} is given for an output that is not a module "
                    f"({type(sub).__name__})"
                )
            c = flat(sub)
            return c.graphdef.build_from_values(_module_axes(ax, c.graphdef, c.variables, c.variables))
        if isinstance(ax, Variable):
            return ax.raw_value
        return ax

    if _is_axes_leaf(out_axes):
        return one(out_axes, out)
    return jax.tree_util.tree_map(one, out_axes, out, is_leaf=_is_axes_leaf)


class Carry:
    """Marker for ``nn.scan``'s ``in_axes`` / ``out_axes``: the argument (or output)
    at this position is the loop carry, threaded from one step to the next."""


def _axes_tuple(axes: Any, n: int, what: str) -> tuple:
    if not isinstance(axes, tuple):
        return (axes,) * n
    if len(axes) != n:
        raise ValueError(f"nn.scan: {what} has {len(axes)} entries for {n} arguments")
    return axes


def _check_scan_axes(in_axes: tuple, out_axes: Any) -> None:
    """Validate ``nn.scan``'s axes (when the scan is made, as Flax NNX does).

    Raises:
      ValueError: an axis that is not Carry, an int or None; None in ``out_axes``
        (a scan output is stacked, never broadcast); several Carry entries; Carry in
        only one of ``in_axes`` and ``out_axes``.
    """
    outs = out_axes if isinstance(out_axes, tuple) else (out_axes,)
    for ax in outs:
        if isinstance(ax, StateAxes | Module):
            raise ValueError(
                f"nn.scan: Cannot broadcast output state. Got {type(ax).__name__} in "
                f"out_axes={out_axes!r}: an output is stacked (an int) or the carry; give "
                f"per-variable axes in in_axes"
            )
    for ax in (*in_axes, *outs):
        if isinstance(ax, StateAxes | Module):  # in in_axes: outs were checked above
            continue
        if ax is not Carry and _is_prefix_tree(ax) and any(a is ax for a in in_axes):
            _check_prefix_tree(ax)
            continue
        if not (ax is Carry or ax is None or (isinstance(ax, int) and not isinstance(ax, bool))):
            raise ValueError(
                f"nn.scan: axes must be nn.Carry, an int, None, or (in in_axes, for a module) "
                f"a StateAxes or prefix module, got {ax!r}"
            )
    if any(ax is None for ax in outs):
        raise ValueError(
            f"nn.scan: Cannot broadcast output state: every out_axes entry is stacked over the "
            f"scan (an int) or the carry, got out_axes={out_axes!r}"
        )
    if sum(a is Carry for a in in_axes) > 1 or sum(a is Carry for a in outs) > 1:
        raise ValueError(
            f"nn.scan: Found multiple Carry definitions (in_axes={in_axes!r}, "
            f"out_axes={out_axes!r}); one argument and one output at most are the carry"
        )
    if (Carry in in_axes) != (Carry in outs):
        raise ValueError(
            f"nn.scan: If one of in_axes or out_axes has Carry, the other must also have "
            f"Carry (in_axes={in_axes!r}, out_axes={out_axes!r})"
        )


def _is_prefix_tree(ax: Any) -> bool:
    return isinstance(ax, dict | list | tuple)


def _check_prefix_tree(ax: Any) -> None:
    """An ``in_axes`` entry that is a pytree prefix (``{'a': 0, 'b': None}``) for a plain
    argument: its leaves are ints or None (the carry is one whole argument)."""
    for leaf in jax.tree_util.tree_leaves(ax, is_leaf=lambda x: x is None or x is Carry):
        if not (leaf is None or (isinstance(leaf, int) and not isinstance(leaf, bool))):
            raise ValueError(
                f"nn.scan: a pytree prefix in in_axes holds ints or None, got {leaf!r} in "
                f"{ax!r} (nn.Carry is a whole argument, not a part of one)"
            )


def _expand_prefix_args(f: Callable, args: tuple, in_ax: tuple) -> tuple[Callable, tuple, tuple]:
    """``f``, ``args`` and ``in_ax`` with every argument whose axis is a pytree prefix
    split into one argument per leaf (with its own axis); the returned function puts
    each argument back together before calling ``f``."""
    if not any(_is_prefix_tree(ax) for ax in in_ax):
        return f, args, in_ax
    new_args: list = []
    new_ax: list = []
    rebuild: list = []  # per original argument: (treedef, count) or None
    treedef: Any  # jaxlib's PyTreeDef, which mypy does not resolve
    for a, ax in zip(args, in_ax):
        if not _is_prefix_tree(ax):
            new_args.append(a)
            new_ax.append(ax)
            rebuild.append(None)
            continue
        leaves, treedef = jax.tree_util.tree_flatten(expose_states(a), is_leaf=is_node)
        new_args.extend(leaves)
        new_ax.extend(treedef.flatten_up_to(_broadcast_prefix(ax, a)))
        rebuild.append((treedef, len(leaves)))

    def joined(*flat_args):
        it = iter(flat_args)
        call = [next(it) if r is None else r[0].unflatten([next(it) for _ in range(r[1])])
                for r in rebuild]
        return f(*call)

    return joined, tuple(new_args), tuple(new_ax)


class _ScanSplit:
    """The variables of one ``nn.scan`` argument whose axes are given per variable (a
    :class:`StateAxes` or a prefix module for a module), or of an argument given None
    that holds modules or Variables. Each variable is, by its axis:

    * scanned (an int): sliced along that axis, its per-step values stacked back;
    * carried (``nn.Carry``, or None for a whole argument): threaded through the steps,
      its last value kept, as Flax NNX does for a broadcast argument it mutates;
    * broadcast (None in a StateAxes or prefix): every step sees its value from before
      the scan; a change made in a step is not kept (Flax NNX's broadcast state).

    Args:
      arg: the argument.
      ax: its ``in_axes`` entry.
    """

    def __init__(self, arg: Any, ax: Any) -> None:
        self.nodes, self.outer = jax.tree_util.tree_flatten(arg, is_leaf=is_node)
        self.defs: list = []  # per node: its GraphDef (a module), None (a Variable) or leaf
        variables: list[Variable] = []
        for n in self.nodes:
            if isinstance(n, Module):
                c = flat(n)
                self.defs.append(c.graphdef)
                variables.extend(c.variables)
            elif isinstance(n, Variable):
                self.defs.append(None)
                variables.append(n)
            else:
                self.defs.append(False)
        self.variables = variables
        if isinstance(ax, StateAxes | Module):
            if len(self.nodes) != 1 or not isinstance(arg, Module):
                raise TypeError(
                    f"nn.scan: a {type(ax).__name__} in in_axes is for a module argument, "
                    f"got {type(arg).__name__}"
                )
            c = flat(arg)
            axes = _module_axes(ax, c.graphdef, c.variables, c.variables)
        else:
            axes = [Carry] * len(variables)
        self.state_axes = ax if isinstance(ax, StateAxes) else None
        self.grown: tuple | None = None  # (new GraphDef, new paths, their axes) if a step adds variables
        for a in axes:
            if not (a is Carry or a is None or (isinstance(a, int) and not isinstance(a, bool))):
                raise ValueError(f"nn.scan: a variable's axis must be nn.Carry, an int or None, got {a!r}")
        self.axes = axes
        self.scanned = [i for i, a in enumerate(axes) if a is not Carry and a is not None]
        self.carried = [i for i, a in enumerate(axes) if a is Carry]

    def init(self) -> tuple[list, list]:
        """The carried values and the scanned values (their axis moved to the front)."""
        vs = self.variables
        xs = [_move_axis(vs[i].raw_value, self.axes[i], 0) for i in self.scanned]
        return [vs[i].raw_value for i in self.carried], xs

    def build(self, carry: list, xs: list) -> Any:
        """The argument for one step: new modules / Variables holding the step's values."""
        values = [v.raw_value for v in self.variables]
        for i, x in zip(self.carried, carry):
            values[i] = x
        for i, x in zip(self.scanned, xs):
            values[i] = x
        it = iter(values)
        self.built: list[Any] = []
        for n, d in zip(self.nodes, self.defs):
            if isinstance(d, GraphDef):
                self.built.append(d.build_from_values([next(it) for _ in d.paths]))
            elif d is None:
                self.built.append(rebuild_variable(template_of(n), next(it)))
            else:
                self.built.append(n)
        return cast(Any, self.outer).unflatten(self.built)

    def parts(self) -> tuple[list, list]:
        """The carried and scanned values after a step (the step's own objects)."""
        values: list = []
        extra: list = []
        for n, d in zip(self.built, self.defs):
            if isinstance(d, GraphDef):
                c = flat(n)
                if c.graphdef != d:
                    kept, extra = self._grow(n, d, c)
                    values.extend(kept)
                    continue
                values.extend(v.raw_value for v in c.variables)
            elif d is None:
                values.append(cast(Variable, n).raw_value)
        return [values[i] for i in self.carried], [values[i] for i in self.scanned] + extra

    def _grow(self, n: Any, d: GraphDef, c: Any) -> tuple[list, list]:
        """A step that added variables to a module with a :class:`StateAxes` (``sow``
        of an ``Intermediate``, as Flax NNX allows): the values of the variables it had,
        and those of the new ones, which must map to an int axis (stacked over the
        steps, like a scanned output).

        Raises:
          ValueError: variables removed, or a new variable with a carried / broadcast axis.
        """
        by_path = dict(zip(c.graphdef.paths, c.variables))
        new_paths = [p for p in c.graphdef.paths if p not in set(d.paths)]
        if self.state_axes is None or any(p not in by_path for p in d.paths) or not new_paths:
            raise ValueError(
                f"nn.scan: the structure of {type(n).__name__} changed in a step "
                f"(variables or attributes removed or replaced); a scanned module with "
                f"per-variable axes keeps its structure in the loop"
            )
        new_axes = self.state_axes.axes_for(c.graphdef, c.variables)
        axis_of = dict(zip(c.graphdef.paths, new_axes))
        for p in new_paths:
            if not isinstance(axis_of[p], int) or isinstance(axis_of[p], bool):
                raise ValueError(
                    f"nn.scan: a step added the variable {path_text(p)!r} to "
                    f"{type(n).__name__} with axis {axis_of[p]!r}; a variable made in a "
                    f"step is stacked over the steps, so its StateAxes entry must be an int"
                )
        self.grown = (c.graphdef, new_paths, [axis_of[p] for p in new_paths])
        kept = [by_path[p].raw_value for p in d.paths]
        return kept, [by_path[p].raw_value for p in new_paths]

    def write_back(self, carry: list, ys: list) -> None:
        """Give the argument's variables their values after the scan (and the module
        the variables its steps added, stacked)."""
        for i, x in zip(self.carried, carry):
            self.variables[i].value = x
        for i, y in zip(self.scanned, ys):
            self.variables[i].value = _move_axis(y, self.axes[i], 0, back=True)
        if self.grown is not None:
            gd, new_paths, new_axes = self.grown
            old = dict(zip(cast(GraphDef, self.defs[0]).paths, (v.raw_value for v in self.variables)))
            added = ys[len(self.scanned):]
            for p, y, a in zip(new_paths, added, new_axes):
                old[p] = _move_axis(y, a, 0, back=True)
            sync(self.nodes[0], gd.build_from_values([old[p] for p in gd.paths]))


def _needs_split(arg: Any, ax: Any) -> bool:
    if isinstance(ax, StateAxes | Module):
        return True
    if ax is not None:
        return False
    return any(is_node(x) for x in jax.tree_util.tree_leaves(arg, is_leaf=is_node))


def _scan_axes(f, args, in_axes, out_axes, run):
    """``nn.scan`` with NNX-style ``in_axes`` / ``out_axes`` over ``f(*args)``, using the
    plain carry-and-xs scan ``run(body, init, xs)``."""
    if in_axes is Carry and len(args) != 1:
        raise ValueError(
            f"nn.scan: When in_axes=Carry, the function must take exactly one argument (the "
            f"carry), got {len(args)} arguments"
        )
    in_ax = _axes_tuple(in_axes, len(args), "in_axes")
    _check_scan_axes(in_ax, out_axes)
    f, args, in_ax = _expand_prefix_args(f, args, in_ax)
    outs = out_axes if isinstance(out_axes, tuple) else (out_axes,)
    ci = in_ax.index(Carry) if Carry in in_ax else None
    splits = {i: _ScanSplit(a, ax) for i, (a, ax) in enumerate(zip(args, in_ax)) if _needs_split(a, ax)}
    xi = [i for i, a in enumerate(in_ax) if isinstance(a, int) and i not in splits]
    # a scanned axis other than 0 is moved to the front (and a module's state moved back)
    xs_in = tuple(_move_axis(args[i], in_ax[i], 0) for i in xi)
    s_init = [s.init() for s in splits.values()]

    def body(c, xs):
        full = list(args)
        if ci is not None:
            full[ci] = c[0]
        for i, x in zip(xi, xs[0]):
            full[i] = x
        for (i, sp), sc, sx in zip(splits.items(), c[1], xs[1]):
            full[i] = sp.build(sc, sx)
        out = f(*full)
        parts = [sp.parts() for sp in splits.values()]
        s_c, s_y = [p[0] for p in parts], [p[1] for p in parts]
        if not isinstance(out_axes, tuple):
            return ((out, s_c), (None, s_y)) if out_axes is Carry else ((None, s_c), (out, s_y))
        if not isinstance(out, tuple) or len(out) != len(outs):
            raise ValueError(
                f"nn.scan: out_axes={out_axes!r} needs f to return a tuple of "
                f"{len(outs)}, got {type(out).__name__}"
            )
        new_c = out[outs.index(Carry)] if Carry in outs else None
        return (new_c, s_c), (tuple(o for o, a in zip(out, outs) if a is not Carry), s_y)

    init = (args[ci] if ci is not None else None, [p[0] for p in s_init])
    (c_final, s_c), (ys, s_y) = run(body, init, (xs_in, [p[1] for p in s_init]))
    for i, moved in zip(xi, xs_in):
        if moved is not args[i]:
            _copy_state_back(args[i], moved, in_ax[i])
    for sp, sc, sy in zip(splits.values(), s_c, s_y):
        sp.write_back(sc, sy)
    if not isinstance(out_axes, tuple):
        return c_final if out_axes is Carry else _move_axis(ys, out_axes, 0, back=True)
    it = iter(ys)
    return tuple(c_final if a is Carry else _move_axis(next(it), a, 0, back=True) for a in outs)


def _move_axis(tree: Any, axis: Any, front: int, back: bool = False) -> Any:
    """``tree`` with its arrays' ``axis`` moved to ``front`` (``back``: from ``front``
    to ``axis``); the same object for axis 0 or None."""
    if axis is None or axis == 0 or tree is None:
        return tree
    src, dst = (front, axis) if back else (axis, front)
    return jax.tree_util.tree_map(lambda x: jnp.moveaxis(x, src, dst), tree)


def _copy_state_back(orig: Any, moved: Any, axis: int) -> None:
    """Give the variables of ``orig`` the values of ``moved``'s (its copy with ``axis``
    moved to the front, after the scan changed them), with the axis moved back."""
    is_var = lambda x: isinstance(x, Variable)  # noqa: E731
    ov = [v for v in jax.tree_util.tree_leaves(orig, is_leaf=is_var) if is_var(v)]
    mv = [v for v in jax.tree_util.tree_leaves(moved, is_leaf=is_var) if is_var(v)]
    for o, m in zip(ov, mv):
        o.value = jnp.moveaxis(m.value, 0, axis)


def _scan_run(step, init, xs=None, *, length, reverse, unroll):
    """The plain carry-and-xs scan behind :func:`scan`: ``step(carry, x) -> (carry, y)``
    with modules in the carry threaded and modules in ``xs`` sliced (their per-step
    changes written back stacked)."""
    carry = LoopCarry(init)
    xplan = Plan(xs)
    check_carry_disjoint(carry.plan, xplan)
    box = Box()

    def body(c_dyn, x_dyn):
        c = carry.rebuild(c_dyn)
        x, x_rebuilt = xplan.rebuild(x_dyn)
        new_c, y = call_annotated(step, (c, x), {})
        new_c_dyn = carry.extract(new_c, "nn.scan")
        x_new_dyn, box.value = xplan.collect(x_rebuilt)
        return new_c_dyn, (y, x_new_dyn)

    c_final, (ys, x_states) = jax.lax.scan(
        body, carry.dyn, xplan.dyn, length=length, reverse=reverse, unroll=unroll
    )
    out_carry = carry.finish(c_final)
    xplan.write_back(xplan.fill(x_states), box.value)
    return out_carry, ys


def scan(
    f: Callable | None = None,
    *,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    in_axes: Any = (Carry, 0),
    out_axes: Any = (Carry, 0),
    transform_metadata: Mapping[str, Any] = MappingProxyType({}),
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Callable:
    """``jax.lax.scan`` over ``f(carry, x) -> (carry, y)`` where modules may appear in
    the carry (threaded through, updated at the end) and in ``xs`` (sliced along the
    leading axis of every variable; per-step changes come back stacked). Scan over
    stacked layers: ``nn.scan(lambda h, layer: (layer(h), None))(x, stacked_layers)``.

    Args:
      f: ``f(carry, x) -> (carry, y)`` (or as ``in_axes``/``out_axes`` say); None: a decorator.
      length: the number of steps when nothing is scanned over; None reads it from the inputs.
      reverse: scan from the end.
      unroll: ``jax.lax.scan``'s unroll.
      in_axes: per argument :class:`Carry`, an int (scanned axis), ``None`` (whole to each
        step, its Variables threaded) or, for a module, a :class:`StateAxes` / ``prefix``
        (per variable; None: broadcast, changes not kept); default ``f(carry, x)``.
      out_axes: per output, :class:`Carry` or ``0`` (stacked).
      transform_metadata: ``{nn.PARTITION_NAME: mesh_axis, ...}``: inside a step the
        scanned axis is removed from the scanned variables' sharding names (put back
        after), and inserted into those of stacked output variables.
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
      graph_updates: Flax NNX's keyword, accepted for compatibility (one behaviour here).

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> total = nn.scan(lambda c, x: c + x, in_axes=(nn.Carry, 0), out_axes=nn.Carry)
    >>> float(total(0.0, jnp.arange(4.0)))
    6.0

    Raises:
      ValueError: an axis other than ``nn.Carry``, 0 or None; ``nn.Carry`` in only one
        of ``in_axes`` and ``out_axes``; a step returning the wrong structure.
    """
    check_mode("scan", graph, graph_updates)
    check_prefix(in_axes, "in_axes", "scan", graph, graph_updates)
    check_prefix(out_axes, "out_axes", "scan", graph, graph_updates)
    reject_bound_method(f, "scan")
    if f is None:
        return functools.partial(
            scan, length=length, reverse=reverse, unroll=unroll, in_axes=in_axes,
            out_axes=out_axes, transform_metadata=transform_metadata,
        )
    if transform_metadata:
        f = with_axis_metadata(f, in_axes, out_axes, transform_metadata, "scan")

    run = functools.partial(_scan_run, length=length, reverse=reverse, unroll=unroll)
    _check_scan_axes(in_axes if isinstance(in_axes, tuple) else (in_axes,), out_axes)
    if in_axes == (Carry, 0) and out_axes == (Carry, 0):
        cached = TraceCache(lambda init, xs=None: run(f, init, xs))

        @functools.wraps(f)
        def wrapper(init, xs=None):
            return cached(init, xs)

        return wrapper

    cached_axes = TraceCache(lambda *args: _scan_axes(f, args, in_axes, out_axes, run))

    @functools.wraps(f)
    def axes_wrapper(*args):
        return cached_axes(*args)

    return axes_wrapper


class StateSharding(StateAxes):
    """Per-variable partition specs for one module argument of :func:`shard_map` (and
    of :func:`~cairn.nn.jit`'s ``in_shardings`` / ``out_shardings``): a mapping
    ``{filter: spec}``, first matching filter wins, as :class:`StateAxes`.

    Args:
      mapping: ``{filter: PartitionSpec or Sharding}``; every variable must match one
        filter (end with ``...`` for a default).

    >>> from jax.sharding import PartitionSpec as P
    >>> from cairn import nn
    >>> s = nn.StateSharding({nn.PathContains("kernel"): P(None, "model"), ...: P()})
    >>> s.items[0][1] == P(None, "model")
    True
    """

    def __repr__(self) -> str:
        return f"StateSharding({dict(self.items)!r})"


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec | StateAxes | Module | Variable)


def shard_map(
    f: Callable | None = None,
    *,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool = True,
    axis_names: Any = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Callable:
    """``jax.shard_map`` where arguments may be modules: a module's entry in
    ``in_specs`` is one ``PartitionSpec`` for every variable, a :class:`StateSharding`
    or a module made by :func:`~cairn.nn.prefix` holding specs; the module's changed
    state comes back with the same specs. A module output's entry in ``out_specs`` may
    be a :class:`StateSharding` or a prefix module too.

    Args:
      f: the function; None returns a decorator.
      mesh: the device mesh.
      in_specs: per positional argument, a spec (prefix) as above.
      out_specs: per output, a spec (prefix) as above.
      check_vma: ``jax.shard_map``'s replication check.
      axis_names: ``jax.shard_map``'s manual axes (default: all of ``mesh``).
      graph: Flax NNX's graph-mode keyword (checked; see the README table).
      graph_updates: Flax NNX's graph-updates keyword (checked).
    """
    check_mode("shard_map", graph, graph_updates)
    check_prefix(in_specs, "in_specs", "shard_map", graph, graph_updates)
    check_prefix(out_specs, "out_specs", "shard_map", graph, graph_updates)
    if f is None:
        return functools.partial(
            shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma,
            axis_names=axis_names, graph=graph, graph_updates=graph_updates,
        )
    reject_bound_method(f, "shard_map")

    @functools.wraps(f)
    def wrapper(*args):
        check_tree_args("shard_map", args, graph)
        plan = Plan((args, {}), link=True)
        specs = in_specs
        if _is_spec_leaf(specs):
            specs = (specs,) * len(args)
        leaf_specs = _leaf_axes_tree(plan, _prefix_axes(args, {}, tuple(specs)))
        check_consistent_prefixes(plan, leaf_specs)
        box = Box()
        kw: dict[str, Any] = {"mesh": mesh, "in_specs": (leaf_specs,)}
        if axis_names is not None:
            kw["axis_names"] = axis_names
        outs = out_specs
        if any(isinstance(x, StateAxes | Module | Variable)
               for x in jax.tree_util.tree_leaves(outs, is_leaf=_is_spec_leaf)):
            probe = _shard_map(run_pure(f, plan, Box()), False, out_specs=PartitionSpec(), **kw)
            out_shape, _ = jax.eval_shape(probe, plan.dyn)
            outs = _expand_out_axes(outs, out_shape)
        sm = _shard_map(run_pure(f, plan, box), check_vma, out_specs=(outs, leaf_specs), **kw)
        out, new_dyn = sm(plan.dyn)
        plan.write_back(plan.fill(new_dyn), box.value)
        return out

    return wrapper


def _shard_map(fun: Callable, check_vma: bool, **kw: Any) -> Callable:
    try:
        return jax.shard_map(fun, check_vma=check_vma, **kw)
    except TypeError:  # older jax spelling
        return jax.shard_map(fun, check_rep=check_vma, **kw)  # type: ignore[call-overload]
