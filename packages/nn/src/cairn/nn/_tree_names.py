"""Small tree helpers of Flax NNX's public surface: ``as_pure``, ``restore_int_paths``,
``find_duplicates``, ``to_tree`` / ``from_tree``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from cairn.nn._data import plain
from cairn.nn._filters import to_predicate
from cairn.nn._graph import merge, split
from cairn.nn._nodes import Node, is_node, key_of, tuple_has_nodes
from cairn.nn._state import State
from cairn.nn._variables import Variable


def as_pure(tree: Any) -> Any:
    """``tree`` with every :class:`Variable` replaced by its value (a State becomes a
    State of plain values), e.g. to save or export without metadata.

    Args:
      tree: a pytree holding Variables and / or States.
    """
    def one(x: Any) -> Any:
        if isinstance(x, State):
            return State.from_flat(
                {p: v.raw_value if isinstance(v, Variable) else v for p, v in x._flat.items()}
            )
        return x.raw_value if isinstance(x, Variable) else x

    return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: isinstance(x, State | Variable))


def restore_int_paths(pure_dict: Mapping) -> dict:
    """``pure_dict`` (nested dicts, as :func:`~cairn.nn.to_pure_dict` makes) with every
    key that is the decimal text of an int turned back into that int (a checkpoint
    restored by a JSON-keyed store gives ``"0"`` for a list index).

    Args:
      pure_dict: nested mappings of values.

    Raises:
      TypeError: ``pure_dict`` is not a mapping.
    """
    if not isinstance(pure_dict, Mapping):
        raise TypeError(f"restore_int_paths: expected a mapping, got {type(pure_dict).__name__}")

    def key(k: Any) -> Any:
        if isinstance(k, str) and k.lstrip("-").isdigit():
            return int(k)
        return k

    return {
        key(k): restore_int_paths(v) if isinstance(v, Mapping) else v
        for k, v in pure_dict.items()
    }


def _children(x: Any) -> list[tuple[tuple, Any]]:
    """``(path suffix, child)`` of a node (its items, tuples opened) or a pytree."""
    if isinstance(x, Node):
        out = []
        for k, v in x._graph_items():
            if isinstance(v, tuple) and tuple_has_nodes(v):
                for kp, y in jax.tree_util.tree_flatten_with_path(v, is_leaf=is_node)[0]:
                    out.append(((k, *(key_of(e) for e in kp)), y))
            else:
                out.append(((k,), v))
        return out
    flat = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x and is_node(y))[0]
    return [(tuple(key_of(e) for e in kp), y) for kp, y in flat if kp]


def find_duplicates(node: Any, /, *, only: Any = ...) -> list[list[tuple]]:
    """The groups of paths at which the same module or Variable object is found in
    ``node`` (a module or a pytree of them), one list of path tuples per object found
    more than once (a shared object is not walked into again).

    Args:
      node: a module, a Variable or a pytree holding them.
      only: a filter of the objects considered (default: all).
    """
    pred = to_predicate(only)
    seen: dict[int, list[tuple]] = {}
    order: list[int] = []

    def visit(x: Any, path: tuple) -> None:
        if isinstance(x, Node | Variable):
            i = id(x)
            if i in seen:
                seen[i].append(path)
                return
            if isinstance(x, Node) or pred(path, plain(x)):
                seen[i] = [path]
                order.append(i)
            if isinstance(x, Variable):
                return
        for suffix, child in _children(x):
            visit(child, (*path, *suffix))

    visit(node, ())
    return [seen[i] for i in order if len(seen[i]) > 1]


class NodeStates:
    """A module (or Variable) of a :func:`to_tree` result: its GraphDef and State
    (a pytree whose leaves are the state's values).

    Args:
      graphdef: the node's GraphDef (pytree aux data: static).
      states: the node's State(s), one per filter of the split (the pytree children).
      metadata: anything to carry with the node as static aux data (Flax NNX's
        ``NodeStates.metadata``); :func:`to_tree` leaves it None.
    """

    __slots__ = ("graphdef", "states", "metadata")

    def __init__(self, graphdef: Any, states: tuple, metadata: Any = None) -> None:
        self.graphdef = graphdef
        self.states = states
        self.metadata = metadata

    @property
    def state(self) -> Any:
        if len(self.states) != 1:
            raise ValueError(f"NodeStates has {len(self.states)} states; use .states")
        return self.states[0]

    def __repr__(self) -> str:
        return f"NodeStates({self.graphdef!r}, {len(self.states)} state(s))"


jax.tree_util.register_pytree_node(
    NodeStates,
    lambda n: (n.states, (n.graphdef, n.metadata)),
    lambda aux, states: NodeStates(aux[0], tuple(states), aux[1]),
)


def to_tree(tree: Any, /, *, prefix: Any = None, split_fn: Any = None, **_: Any) -> Any:
    """``tree`` with every module and Variable in it replaced by a :class:`NodeStates`
    (its GraphDef and State): a pure pytree that ``jax`` transforms can take.
    :func:`from_tree` turns it back.

    Args:
      tree: a pytree holding modules / Variables.
      prefix: a prefix tree of ``tree`` (e.g. vmap axes); the same object under two
        different prefix values is an error.
      split_fn: ``(path, prefix, node) -> (graphdef, *states)`` (default
        ``nn.split(node)``).

    Raises:
      ValueError: the same module or Variable is found under two different prefixes
        ("Inconsistent aliasing detected").
    """
    leaves_p, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)
    prefixes = _broadcast_prefix(prefix, tree)
    seen: dict[int, tuple[Any, Any, NodeStates]] = {}
    out = []
    for (kp, x), pre in zip(leaves_p, prefixes):
        if not is_node(x):
            out.append(x)
            continue
        hit = seen.get(id(x))
        if hit is not None:
            if hit[1] != pre:
                raise ValueError(
                    f"Inconsistent aliasing detected: the same {type(x).__name__} object is "
                    f"found under the prefixes {hit[1]!r} and {pre!r}"
                )
            out.append(hit[2])
            continue
        path = tuple(key_of(e) for e in kp)
        parts = split_fn(path, pre, x) if split_fn is not None else split(x)
        ns = NodeStates(parts[0], tuple(parts[1:]))
        seen[id(x)] = (x, pre, ns)
        out.append(ns)
    return jax.tree_util.tree_unflatten(treedef, out)


def _broadcast_prefix(prefix: Any, tree: Any) -> list:
    """One prefix value per leaf of ``tree`` (modules and Variables are leaves)."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_node)
    if prefix is None or not isinstance(prefix, tuple | list | dict):
        return [prefix] * len(leaves)
    out: list = []
    subs = prefix.values() if isinstance(prefix, dict) else prefix
    parts = tree.values() if isinstance(tree, dict) else tree
    for p, t in zip(subs, parts):
        out.extend(_broadcast_prefix(p, t))
    return out


def from_tree(tree: Any, /, **_: Any) -> Any:
    """The inverse of :func:`to_tree`: each :class:`NodeStates` merged back into its
    module or Variable (the same NodeStates object gives the same module).

    Args:
      tree: a pytree from :func:`to_tree`.
    """
    built: dict[int, Any] = {}

    def one(x: Any) -> Any:
        if not isinstance(x, NodeStates):
            return x
        m = built.get(id(x))
        if m is None:
            m = built[id(x)] = merge(x.graphdef, *x.states)
        return m

    return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: isinstance(x, NodeStates))


def check_tree_mode(fn: str, node: Any, graph: bool | None) -> None:
    """With ``graph=False`` (Flax NNX's tree mode), refuse a module of a class defined
    with ``pytree=False``: it is no JAX pytree, so tree mode cannot walk it.

    Raises:
      ValueError: naming the class and the path where it is found.
    """
    if graph is not False:
        return
    seen: set[int] = set()

    def visit(x: Any, path: tuple) -> None:
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, Node) and not type(x)._cairn_pytree:
            raise ValueError(
                f"nn.{fn}(graph=False): {type(x).__name__} is defined with pytree=False and "
                f"is not a pytree; use graph=True. Found at path {path!r}"
            )
        if isinstance(x, Variable):
            return
        for suffix, child in _children(x):
            visit(child, (*path, *suffix))

    visit(node, ())
