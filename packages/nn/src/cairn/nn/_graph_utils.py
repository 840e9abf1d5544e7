"""Flax NNX's graph helpers built on split / merge: ``map``, ``unpack``, ``flatten``,
``prefix``, ``to_flat_state`` / ``from_flat_state``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cairn.nn._data import plain
from cairn.nn._filters import path_text, to_predicate
from cairn.nn._graph import flat, merge, split
from cairn.nn._graph_mode import check_mode
from cairn.nn._module import Module
from cairn.nn._nodes import PREFIX_TREES
from cairn.nn._state import GraphState, State
from cairn.nn._tree_names import check_tree_mode
from cairn.nn._tree_root import LeafDef, VariableDef
from cairn.nn._variables import Variable

Node = Module


def map(  # noqa: A001  (Flax's name)
    f: Callable[[tuple, Any], Any],
    node: Node,
    /,
    *,
    graph: bool | None = None,
    recreate_variables: bool = True,
) -> Node:
    """A new tree like ``node`` whose Variable at each path is ``f(path, variable)``.

    A result that is not a Variable is put in a Variable of the same type and metadata
    (``recreate_variables=False`` stores it as it is: a plain attribute). ``node`` is
    not changed.

    Args:
      f: ``(path_tuple, variable) -> new value or Variable``.
      node: a module.
      graph: Flax NNX's mode keyword (one behaviour here).
      recreate_variables: wrap non-Variable results in a Variable (the default).

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> zeros = nn.map(lambda path, v: jnp.zeros_like(v.value), nn.Linear(2, 3, rngs=nn.Rngs(0)))
    >>> float(zeros.kernel.value.sum()), type(zeros.kernel).__name__
    (0.0, 'Param')
    """
    check_mode("map", graph)
    gd, st = split(node)
    new: dict = {}
    plain: dict = {}
    for path, var in st._flat.items():
        out = f(path, var)
        if isinstance(out, Variable):
            new[path] = out
        elif recreate_variables:
            new[path] = _holding(var, out)
        else:
            new[path] = var.replace(var.raw_value)
            plain[path] = out
    root = gd.build_from_variables([new[p] for p in gd.paths])
    for path, value in plain.items():
        _set_at(root, path, value)
    return root


def _holding(var: Variable, value: Any) -> Variable:
    """A Variable like ``var`` holding ``value`` (None included, which ``replace``
    would read as "keep the value")."""
    new = var.replace()
    new.set_raw_value(value)
    return new


def _set_at(root: Any, path: tuple, value: Any) -> None:
    owner = root
    for k in path[:-1]:
        owner = owner[k] if isinstance(owner, list | tuple | dict) else getattr(owner, k)
    if isinstance(owner, list | dict):
        owner[path[-1]] = value
    else:
        setattr(owner, path[-1], value)


def unpack(
    node: Node, *filters: Any, graph: bool | None = None
) -> GraphState | tuple[GraphState, ...]:
    """Like :func:`split`, but each State carries the GraphDef (a :class:`GraphState`),
    so ``nn.merge(*states)`` rebuilds the module without a separate GraphDef.

    Args:
      node: a module.
      *filters: filters partitioning the variables (none: all of them, one State).
      graph: Flax NNX's mode keyword (one behaviour here).

    >>> from cairn import nn
    >>> params, rest = nn.unpack(nn.BatchNorm(2, rngs=nn.Rngs(0)), nn.Param, ...)
    >>> type(nn.merge(params, rest)).__name__
    'BatchNorm'
    """
    check_mode("unpack", graph)
    gd, *states = split(node, *filters)
    out = tuple(GraphState.wrap(gd, s) for s in states)
    return out[0] if len(out) == 1 else out


def flatten(
    node: Any, /, *, with_paths: bool = True, graph: bool | None = None
) -> tuple[Any, Any]:
    """``(graphdef, flat)``: ``flat`` is the list of ``(path_tuple, Variable or plain
    leaf)`` pairs in the GraphDef's order (``with_paths=False``: the list of values). A
    pytree root's pairs are sorted by path (Flax NNX's order); a lone Variable or leaf
    is one pair at the empty path. :func:`unflatten` is the inverse.

    Args:
      node: a module, a pytree holding modules / Variables / leaves, a Variable or a leaf.
      with_paths: pair each Variable with its path (default) or give the raw values.
      graph: Flax NNX's mode keyword (one behaviour here).
    """
    check_mode("flatten", graph)
    check_tree_mode("flatten", node, graph)
    if not isinstance(node, Node):
        gd, st = split(node)
        pairs = [((), st)] if isinstance(gd, VariableDef | LeafDef) else sorted(
            st._flat.items(), key=lambda pv: tuple((isinstance(k, str), k) for k in pv[0])
        )
        if with_paths:
            return gd, pairs
        return gd, [v.raw_value if isinstance(v, Variable) else v for _, v in pairs]
    c = flat(node)
    vs = [plain(v) for v in c.variables] if c.graphdef.has_data else c.variables
    if with_paths:
        return c.graphdef, list(zip(c.graphdef.paths, vs))
    return c.graphdef, [v.raw_value for v in c.variables]


def unflatten(graphdef: Any, flat_state: Any, /, **_: Any) -> Any:
    """The inverse of :func:`flatten`: the module (or pytree, Variable, leaf) of
    ``graphdef`` holding the values of ``flat_state``.

    Args:
      graphdef: a GraphDef (or a lone Variable's / leaf's definition) from ``flatten``.
      flat_state: ``(path, value)`` pairs, a ``{path: value}`` mapping or a State.
    """
    return merge(graphdef, flat_state)


class FlatState(list):
    """The ``(path_tuple, value)`` pairs of a State (a list), with Flax NNX's
    ``paths`` and ``leaves`` views."""

    @property
    def paths(self) -> tuple:
        return tuple(p for p, _ in self)

    @property
    def leaves(self) -> list:
        return [v for _, v in self]


def to_flat_state(state: State) -> list[tuple[tuple, Variable]]:
    """The ``(path_tuple, Variable)`` pairs of ``state`` (Flax's ``FlatState``).

    Args:
      state: a :class:`State`.
    """
    if not isinstance(state, State):
        raise TypeError(f"nn.to_flat_state: expected a State, got {type(state).__name__}")
    return FlatState(state._flat.items())


def from_flat_state(flat_state: Any) -> State:
    """A :class:`State` from ``(path_tuple, Variable)`` pairs or a ``{path: Variable}``
    mapping (inverse of :func:`to_flat_state`).

    Args:
      flat_state: the pairs or the mapping.
    """
    return State.from_flat(flat_state)


def prefix(
    node: Any,
    filter_map: Mapping[Any, Any] | Callable[[tuple, Any], Any],
    /,
    *,
    graph: bool | None = None,
) -> Any:
    """A tree like ``node`` whose every Variable holds a prefix value instead of its
    array: ``filter_map(path, variable)``, or the value of the first filter of a
    ``{filter: value}`` mapping that matches. Used as ``in_axes`` of :func:`vmap` (and
    of ``jax.vmap``) it gives each variable its own axis.

    Args:
      node: a module, a Variable (its prefix is the value itself) or a pytree of them.
      filter_map: a callable ``(path, variable) -> value`` or a ``{filter: value}``
        mapping (checked in order; ``...`` matches everything).
      graph: Flax NNX's mode keyword (one behaviour here).

    Raises:
      ValueError: naming a variable that no filter matches.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> bn = nn.BatchNorm(2, rngs=nn.Rngs(0))
    >>> axes = nn.prefix(bn, {nn.Param: None, nn.BatchStat: 0})
    >>> axes.mean.value, axes.scale.value
    (0, None)
    """
    check_mode("prefix", graph)
    fn = _prefix_fn(filter_map)
    if isinstance(node, Variable):  # the prefix of the whole Variable
        return fn((), node)
    if isinstance(node, Module):
        tree = map(fn, node)
        PREFIX_TREES.add(tree)
        return tree
    if isinstance(node, list | tuple):
        return type(node)(prefix(x, filter_map) for x in node)
    if isinstance(node, dict):
        return {k: prefix(v, filter_map) for k, v in node.items()}
    return node


def _prefix_fn(filter_map: Any) -> Callable[[tuple, Any], Any]:
    if callable(filter_map) and not isinstance(filter_map, Mapping):
        return filter_map
    items = [(to_predicate(f), f, v) for f, v in dict(filter_map).items()]

    def fn(path: tuple, var: Any) -> Any:
        for pred, _, value in items:
            if pred(path, var):
                return value
        raise ValueError(
            f"nn.prefix: No filter matched the variable at {path_text(path)!r} "
            f"({type(var).__name__}); filters: {[f for _, f, _ in items]!r}"
        )

    return fn


def set_metadata(node: Node, /, *, only: Any = Variable, **metadata: Any) -> None:
    """Set ``metadata`` on every Variable of ``node`` matching ``only``, in place.

    Args:
      node: a module.
      only: a filter of the Variables to change (default: all of them).
      **metadata: the entries to set.

    >>> from cairn import nn
    >>> m = nn.BatchNorm(2, rngs=nn.Rngs(0))
    >>> nn.set_metadata(m, frozen=True, only=nn.Param)
    >>> m.scale.get_metadata("frozen"), m.mean.get_metadata("frozen", None)
    (True, None)
    """
    pred = to_predicate(only)
    for path, var in split(node)[1]._flat.items():
        if pred(path, var):
            var.set_metadata(**metadata)


def iter_children(node: Node, /, *, graph: bool | None = None) -> Any:
    """``(name, child)`` for each direct child module of ``node`` (inside lists and
    dicts too, named by their key), in attribute order.

    Args:
      node: a module.
      graph: Flax NNX's mode keyword (one behaviour here).
    """
    check_mode("iter_children", graph)
    check_tree_mode("iter_children", node, graph)
    for key, value in node._graph_items():
        if isinstance(value, Module):
            yield key, value
