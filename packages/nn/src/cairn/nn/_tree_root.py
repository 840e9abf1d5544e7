"""Roots that are not modules: ``nn.split`` / ``state`` / ``graphdef`` / ``merge`` /
``update`` of a list, dict, tuple (any pytree) holding modules and Variables, of a lone
Variable, or of a plain leaf, as Flax NNX allows.

A pytree root is wrapped, one :class:`PytreeNode` per pytree level, into a node tree the
ordinary encoding handles: a level's children are its items (keys: list positions,
dict keys, attribute names), its ``jax`` tree structure is a static item, and leaves
that are neither modules nor Variables are data (State entries holding the plain leaf). Variable paths are the pytree's
(``[linear, bn]`` gives ``0/kernel``, ``1/scale``...). :func:`unwrap` turns the node
tree back into the pytree after ``merge``.

A lone Variable's "state" is the Variable itself and a plain leaf's is the leaf, as in
Flax NNX: :class:`VariableDef` and :class:`LeafDef` are their graph definitions.
"""

from __future__ import annotations

from typing import Any

import jax

from cairn.nn._data import ALL_LEAVES, MARKS
from cairn.nn._nodes import Node, is_node, key_of
from cairn.nn._variables import Variable, template_of

_TREEDEF = "_treedef_"  # the static item holding a level's jax tree structure


class PytreeNode(Node):
    """One level of a pytree root (see the module docstring); internal."""

    def _graph_items(self) -> list[tuple[Any, Any]]:
        return list(self.__dict__["_cairn_items"].items())

    @classmethod
    def _graph_new(cls, items: Any) -> PytreeNode:
        obj = object.__new__(cls)
        object.__setattr__(obj, "_cairn_items", dict(items))
        return obj

    _graph_store = None

    def _graph_set(self, key: Any, value: Any) -> None:
        raise TypeError("a pytree root is rebuilt by nn.merge, not changed in place")

    def _graph_del(self, key: Any) -> None:
        raise TypeError("a pytree root is rebuilt by nn.merge, not changed in place")


def is_pytree_root(x: Any) -> bool:
    """Whether ``x`` is a container pytree (not a module, Variable or leaf)."""
    if is_node(x):
        return False
    leaves = jax.tree_util.tree_leaves(x, is_leaf=lambda y: y is not x)
    return not (len(leaves) == 1 and leaves[0] is x)


def wrap(x: Any) -> Any:
    """``x`` as a tree of :class:`PytreeNode` (modules, Variables and leaves as they are)."""
    if is_node(x) or not is_pytree_root(x):
        return x
    kids, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    items: dict = {}
    for kp, child in kids:
        items[key_of(kp[0])] = wrap(child)
    items[_TREEDEF] = treedef
    node = PytreeNode._graph_new(items)
    # every leaf is data (Flax NNX's state of a pytree); a plain leaf of a list or dict
    # is written back into that container (nn.update)
    object.__setattr__(node, MARKS, ALL_LEAVES)
    object.__setattr__(node, "_cairn_src", x)
    return node


def unwrap(x: Any) -> Any:
    """The pytree a :class:`PytreeNode` tree stands for."""
    if not isinstance(x, PytreeNode):
        return x
    items = dict(x.__dict__["_cairn_items"])
    treedef = items.pop(_TREEDEF)
    return treedef.unflatten([unwrap(v) for v in items.values()])


class VariableDef:
    """The graph definition of a lone Variable: its type and metadata.

    Args:
      template: the Variable's template (``template_of``).
    """

    __slots__ = ("template",)

    def __init__(self, template: Any) -> None:
        self.template = template

    @classmethod
    def of(cls, v: Variable) -> VariableDef:
        return cls(template_of(v))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VariableDef) and other.template == self.template

    def __hash__(self) -> int:
        return hash(("VariableDef", self.template))

    def __repr__(self) -> str:
        return f"VariableDef({self.template[0].__name__})"


class LeafDef:
    """The graph definition of a plain leaf (an array, a number...): its "state" is
    the leaf itself."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LeafDef)

    def __hash__(self) -> int:
        return hash("LeafDef")

    def __repr__(self) -> str:
        return "LeafDef()"


for _cls in (VariableDef, LeafDef):  # pytrees with no leaves, as GraphDef
    jax.tree_util.register_pytree_node(_cls, lambda g: ((), g), lambda g, _: g)
