"""The encoding of a module tree's nodes: how a node is taken apart and rebuilt.

A **node** (a :class:`~cairn.nn.Module`, including the ``nn.List`` / ``nn.Dict``
containers) is an ordered sequence of ``(key, value)`` items (its attributes, or its
container items). Each item is encoded as an entry ``(key, tag, payload)``:

* ``STATIC``: configuration; the payload is :class:`Static` (the value, hashable);
* ``VAR``: a :class:`~cairn.nn.Variable`; the payload is its template
  (:func:`~cairn.nn._variables.template_of`: type and metadata, no value);
* ``MOD``: a child node; the payload is the child's own encoding in a tree encoding
  (:func:`encode_tree`), ``None`` in a one-node pytree encoding (the child is a
  pytree child);
* ``TREE``: a tuple holding variables or nodes; the payload is ``(treedef, leaves)``
  with one ``(VAR, template)``, ``(MOD, payload)`` or ``(REF, index)`` per leaf;
* ``REF``: (tree encodings only) a module or variable met earlier in the walk (a
  shared reference, or a cycle back to an ancestor): the payload is its index, ``j >= 0``
  the ``j``-th variable of the tree, ``j < 0`` the ``~j``-th node in pre-order.

A node's encoding is ``(node class, entries)``. The same tags serve the whole package:
the JAX pytree registration of every node class (one level: variables' values and child
nodes are the pytree children), the cached tree encoding behind ``GraphDef`` (the whole
tree, with the variables in order and their paths), and the transforms' argument plans
(which add ``LEAF`` for a plain pytree leaf). :func:`build_node` is the one place that
turns an encoding back into a node.

Paths are tuples of keys (attribute names and dict keys as given, list indices as
ints); their strings follow ``cairn.core_array``'s convention.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from cairn.core_array import key_name
from cairn.nn._data import (
    DATA_BY_TYPE,
    DATA_TEMPLATE,
    MARKS,
    DataSlot,
    bind_slot,
    data_value,
    is_data_value,
    item_is_data,
)
from cairn.nn._filters import path_text
from cairn.nn._variables import (
    _EMPTY_TEMPLATES,
    EPOCH,
    Variable,
    rebuild_variable,
    static_eq,
    static_hash,
    template_of,
)

# --- entry tags ---

STATIC, VAR, MOD, TREE, LEAF, REF = 0, 1, 2, 3, 4, 5


class SharedReferenceError(ValueError):
    """The same module or variable is reachable from two paths of one tree where that
    is not allowed: in tree mode (``graph=False``), or passed to a transform in a way
    that makes its two places disagree."""


class Static:
    """Wraps a static attribute value for pytree aux data: hashable even when the value
    is not (hash by type / structure), compared with ``==``."""

    __slots__ = ("value", "_h")

    def __init__(self, value: Any) -> None:
        self.value = value
        self._h: int | None = None

    def __hash__(self) -> int:
        h = self._h
        if h is None:
            h = self._h = static_hash(self.value)
        return h

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and (
            type(self.value) is type(other.value) and static_eq(self.value, other.value)
        )

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


# --- the node protocol ---


# modules made by ``nn.prefix``: prefix trees, not graph nodes, for the transforms' checks
PREFIX_TREES: weakref.WeakSet = weakref.WeakSet()


class Node:
    """Base of every module class: the graph protocol that the encoding uses.

    ``_graph_items`` lists the node's ``(key, value)`` items; ``_graph_new`` builds a
    node from such items without running ``__init__``; ``_graph_set`` / ``_graph_del``
    change one item without conversion checks. ``_graph_key`` is the ``jax.tree_util``
    key type of the node's pytree children, and ``_graph_store`` says how
    ``_graph_new`` stores the items (``"attrs"``: the instance ``__dict__``;
    ``"list"`` / ``"dict"``: a ``_cairn_items`` list / dict), so that compiled
    builders can inline it. Every subclass is registered as a JAX pytree.
    """

    _graph_key: Callable[[Any], Any] = GetAttrKey
    _graph_store: str | None = "attrs"
    _cairn_pytree = True  # ``class M(nn.Module, pytree=False)``: not a JAX pytree

    def __init_subclass__(cls, pytree: bool = True, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        cls._cairn_pytree = bool(pytree)
        if pytree:  # else a JAX leaf; the graph functions still see its children
            jax.tree_util.register_pytree_with_keys(
                cls, flatten_node_with_keys, unflatten_node, flatten_func=flatten_node
            )

    def _graph_items(self) -> list[tuple[Any, Any]]:
        """(key, value) pairs of this node, in order (internal attributes skipped)."""
        return [(k, v) for k, v in self.__dict__.items() if not k.startswith("_cairn_")]

    @classmethod
    def _graph_new(cls, items: Any) -> Node:
        obj = object.__new__(cls)
        obj.__dict__.update(items)
        return obj

    def _graph_set(self, key: Any, value: Any) -> None:
        """Set one child without conversion checks (used when syncing after transforms)."""
        object.__setattr__(self, key, value)
        EPOCH[0] += 1

    def _graph_del(self, key: Any) -> None:
        object.__delattr__(self, key)
        EPOCH[0] += 1


def graph_store(cls: type) -> str | None:
    """How ``cls._graph_new`` stores items (see :class:`Node`), or None when the class
    that defines the ``_graph_new`` it uses does not say (a custom one: call it)."""
    for klass in cls.__mro__:
        if "_graph_new" in klass.__dict__:
            return klass.__dict__.get("_graph_store")
    return None


def _flatten_nodes(tree: Any) -> tuple[list, Any]:
    return jax.tree_util.tree_flatten(tree, is_leaf=is_node)


def is_node(x: Any) -> bool:
    """Whether ``x`` is a variable or a node (a leaf for pytree walks over arguments)."""
    return isinstance(x, Variable | Node)


def tuple_has_nodes(v: tuple) -> bool:
    """Whether the tuple ``v`` holds a variable or a node somewhere inside."""
    for x in jax.tree_util.tree_leaves(v, is_leaf=is_node):
        if isinstance(x, Variable | Node):
            return True
    return False


def key_of(entry: Any) -> Any:
    """The path-tuple key of a ``jax.tree_util`` key entry met inside a tuple item:
    the int of a sequence position or an int dict key, else the component
    ``cairn.core_array.key_name`` names it by (so its string is the convention's).

    >>> from jax.tree_util import DictKey, SequenceKey
    >>> key_of(SequenceKey(2)), key_of(DictKey("w"))
    (2, 'w')

    Raises:
      cairn.core_array.PathError: the key cannot be a path component (not a str or an
        int, or a str holding ``/``).
    """
    if isinstance(entry, SequenceKey):
        return entry.idx
    if isinstance(entry, FlattenedIndexKey):
        return entry.key
    if isinstance(entry, DictKey) and type(entry.key) is int:
        return entry.key
    return key_name(entry)


# --- one node: the pytree registration ---


# ``cairn.nn._graph.flat`` (the cached encoding of a tree), set when it is imported
FLAT: list[Callable[[Any], Any] | None] = [None]


def flatten_node_with_keys(node: Node) -> tuple[list, tuple]:
    """One level of ``node`` as a pytree: variables' values and child nodes are the
    children (a variable's value at the variable's own key), the rest is aux data.

    A pytree has no shared references: as Flax NNX's tree mode, a tree holding a
    module or Variable at two places (or a cycle) raises :class:`SharedReferenceError`
    naming both paths (one cached lookup per node when nothing is shared)."""
    flat = FLAT[0]
    if flat is not None and flat(node).graphdef.refs:
        encode_tree(node, strict=True)  # raises, naming the two paths
    children: list[tuple[Any, Any]] = []
    entries: list[tuple] = []
    key_cls = node._graph_key
    marks = node.__dict__.get(MARKS)
    for k, v in node._graph_items():
        if isinstance(v, Variable):
            children.append((key_cls(k), v.raw_value))
            entries.append((k, VAR, template_of(v)))
        elif isinstance(v, Node):
            children.append((key_cls(k), v))
            entries.append((k, MOD, None))
        elif isinstance(v, tuple) and tuple_has_nodes(v):
            leaves, treedef = _flatten_nodes(v)
            leafdefs = tuple(
                (VAR, template_of(x)) if isinstance(x, Variable) else (MOD, None)
                for x in leaves
            )
            inner = treedef.unflatten(
                [x.raw_value if isinstance(x, Variable) else x for x in leaves]
            )
            children.append((key_cls(k), inner))
            entries.append((k, TREE, (treedef, leafdefs)))
        elif item_is_data(marks, k, v):
            children.append((key_cls(k), v))
            entries.append((k, VAR, DATA_TEMPLATE))
        else:
            entries.append((k, STATIC, Static(v)))
    return children, (type(node), tuple(entries))


def flatten_node(node: Node) -> tuple[list, tuple]:
    children, aux = flatten_node_with_keys(node)
    return [c for _, c in children], aux


def unflatten_node(aux: tuple, children: Any) -> Node:
    """Inverse of :func:`flatten_node`: a TREE child is split back into its leaves."""
    leaves = []
    dynamic = (e for e in aux[1] if e[1] != STATIC)
    for (_, tag, payload), child in zip(dynamic, children):
        if tag == TREE:
            leaves.extend(payload[0].flatten_up_to(child))
        else:
            leaves.append(child)
    return build_node(aux, iter(leaves), rebuild_variable, nested=False)


def build_node(
    encoding: tuple,
    values: Iterator[Any],
    new_variable: Callable[[Any, Any], Any] | None = None,
    nested: bool = True,
) -> Node:
    """The node of ``encoding`` (``(cls, entries)``), taking from ``values`` in order
    one value per VAR entry or leaf (used as it is, or ``new_variable(template,
    value)``) and, unless ``nested`` (a MOD payload is the child's encoding, built
    from the same ``values``), one child node per MOD entry or leaf. STATIC values are
    used as they are."""
    cls, entries = encoding
    items = []
    for k, tag, payload in entries:
        if tag == VAR:
            x = next(values)
            if payload[0] is DataSlot:  # a data attribute: the plain value
                if new_variable is not None:
                    new_variable(payload, x)
                items.append((k, data_value(x)))
                continue
            items.append((k, x if new_variable is None else new_variable(payload, x)))
        elif tag == MOD:
            if nested:
                items.append((k, build_node(payload, values, new_variable)))
            else:
                items.append((k, next(values)))
        elif tag == STATIC:
            items.append((k, payload.value))
        else:
            treedef, leafdefs = payload
            leaves = []
            for lt, lp in leafdefs:
                if lt != VAR:
                    leaves.append(build_node(lp, values, new_variable) if nested else next(values))
                elif new_variable is None:
                    leaves.append(next(values))
                else:
                    leaves.append(new_variable(lp, next(values)))
            items.append((k, treedef.unflatten(leaves)))
    return cls._graph_new(items)


# --- a whole tree: the encoding behind GraphDef ---


def shared_error(obj: Any, first: tuple, second: tuple) -> SharedReferenceError:
    """The error of a shared reference where none is allowed (tree mode)."""
    return SharedReferenceError(
        f"Duplicate {type(obj).__name__}: the same object is found at paths "
        f"{path_text(first) or '<root>'!r} and {path_text(second) or '<root>'!r}; tree "
        f"mode (graph=False) does not support shared references (use graph mode, the "
        f"default, or nn.clone to make an independent copy)"
    )


class _TreeEncoder:
    """One walk of a module tree: its encoding, its variables and their paths.

    A module or variable met a second time (shared, or a cycle back to an ancestor) is
    encoded as a ``REF`` to its first place, unless ``strict`` (tree mode), where it
    raises :class:`SharedReferenceError` naming both paths."""

    __slots__ = ("variables", "paths", "seen", "node_paths", "refs", "strict", "has_data")

    def __init__(self, strict: bool = False):
        self.variables: list[Variable] = []
        self.paths: list[tuple] = []
        # id -> REF index: j >= 0 the j-th variable, j < 0 the ~j-th node (pre-order)
        self.seen: dict[int, int] = {}
        self.node_paths: list[tuple] = []
        self.refs = False
        self.strict = strict
        self.has_data = False

    def ref(self, obj: Any, j: int, p: tuple) -> int:
        """The payload of a REF to ``obj`` (seen before as ``j``) met at ``p``."""
        if self.strict:
            first = self.paths[j] if j >= 0 else self.node_paths[~j]
            raise shared_error(obj, first, p)
        self.refs = True
        return j

    def add_var(self, v: Variable, p: tuple) -> tuple:
        self.seen[id(v)] = len(self.variables)
        self.variables.append(v)
        self.paths.append(p)
        return template_of(v)

    def tree_entry(self, v: tuple, p: tuple) -> tuple:
        """The ``(treedef, leafdefs)`` payload of a tuple item holding nodes."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(v, is_leaf=is_node)
        leafdefs: list[tuple[int, Any]] = []  # (REF, index) / (VAR, template) / (MOD, encoding)
        for kp, x in flat:
            sp = (*p, *(key_of(e) for e in kp))
            if not isinstance(x, Variable | Node):
                raise TypeError(
                    f"{path_text(sp)!r}: a tuple holding modules or variables must "
                    f"hold only those (and None); found {type(x).__name__}"
                )
            j = self.seen.get(id(x))
            if j is not None:
                leafdefs.append((REF, self.ref(x, j, sp)))
            elif isinstance(x, Variable):
                leafdefs.append((VAR, self.add_var(x, sp)))
            else:
                leafdefs.append((MOD, self.visit(x, sp)))
        return (treedef, tuple(leafdefs))

    def visit(self, node: Node, path: tuple) -> tuple:
        """The encoding of ``node`` (not seen before) at ``path``."""
        seen = self.seen
        seen[id(node)] = ~len(self.node_paths)
        self.node_paths.append(path)
        entries: list[tuple] = []
        d = node.__dict__
        marks = d.get(MARKS)
        if type(node)._graph_items is _PLAIN_ITEMS:  # skip the list copy of __dict__
            items = [
                kv for kv in d.items()
                if kv[0][0] != "_" or not kv[0].startswith("_cairn_")
            ]
        else:
            items = node._graph_items()
        variables, paths = self.variables, self.paths
        for k, v in items:
            p = (*path, k)
            if isinstance(v, Variable):  # add_var inlined: the hot case
                i = id(v)
                j = seen.get(i)
                if j is not None:
                    entries.append((k, REF, self.ref(v, j, p)))
                    continue
                seen[i] = len(variables)
                variables.append(v)
                paths.append(p)
                t = None if v._meta else _EMPTY_TEMPLATES.get(type(v))
                entries.append((k, VAR, t if t is not None else template_of(v)))
            elif isinstance(v, Node):
                j = seen.get(id(v))
                if j is not None:
                    entries.append((k, REF, self.ref(v, j, p)))
                else:
                    entries.append((k, MOD, self.visit(v, p)))
            elif isinstance(v, tuple) and tuple_has_nodes(v):
                entries.append((k, TREE, self.tree_entry(v, p)))
            elif (
                item_is_data(marks, k, v) if marks is not None
                else DATA_BY_TYPE.get(type(v)) or (type(v) not in DATA_BY_TYPE and is_data_value(v))
            ):  # the by-type cache inlined: this runs once per static attribute
                variables.append(data_slot(node, k))
                paths.append(p)
                entries.append((k, VAR, DATA_TEMPLATE))
                self.has_data = True
            else:
                entries.append((k, STATIC, Static(v)))
        return (type(node), tuple(entries))


_PLAIN_ITEMS = Node._graph_items


def data_slot(node: Node, key: Any) -> DataSlot:
    """The slot of ``node``'s data item ``key``: bound to where ``_graph_new`` stores the
    items (the instance dict, or the container's list / dict)."""
    store = graph_store(type(node))
    if store == "attrs":
        return bind_slot(node.__dict__, key)
    if store in ("list", "dict"):
        return bind_slot(node.__dict__["_cairn_items"], key)
    src = node.__dict__.get("_cairn_src")  # a pytree root level: its list or dict
    if type(src) in (list, dict):
        return bind_slot(src, key)
    if "_cairn_src" in node.__dict__:  # a tuple or another immutable pytree level
        return bind_slot(node.__dict__["_cairn_items"], key)
    return bind_slot(_ItemsView(node), key)


class _ItemsView:
    """``store[key]`` over a node with a custom ``_graph_new``: reads its items, writes
    through ``_graph_set``."""

    __slots__ = ("node",)

    def __init__(self, node: Node) -> None:
        self.node = node

    def __getitem__(self, key: Any) -> Any:
        for k, v in self.node._graph_items():
            if k == key:
                return v
        raise KeyError(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.node._graph_set(key, value)


def encode_tree(root: Node, strict: bool = False) -> tuple[tuple, tuple, list, bool, bool]:
    """``(encoding, paths, variables, refs, has_data)`` of the tree under ``root``: the
    nested encoding (a MOD payload is the child's encoding), the path tuple of each
    variable (its first path when shared) and the variables themselves, once each, in
    the same order, whether the encoding holds ``REF`` entries (shared references) and
    whether it holds data slots.

    Args:
      root: the root node.
      strict: raise on a shared reference (tree mode) instead of encoding a ``REF``.

    A data attribute (an array, or a value marked ``nn.data``) takes a variable slot:
    its template is :data:`DATA_TEMPLATE` and its entry in the list a
    :class:`~cairn.nn._data.DataSlot`.

    Raises:
      SharedReferenceError: ``strict`` and a node or variable is reachable at two paths.
      TypeError: a tuple item mixes nodes or variables with other values.
    """
    enc = _TreeEncoder(strict)
    encoding = enc.visit(root, ())
    return encoding, tuple(enc.paths), enc.variables, enc.refs, enc.has_data


# --- rebuilding an encoding with shared references ---

_PENDING = object()


def _fill(obj: Node, store: str, items: list) -> None:
    """Give ``obj`` (made by ``object.__new__``) its items as ``_graph_new`` would for
    ``store`` (see :class:`Node`)."""
    if store == "attrs":
        obj.__dict__.update(items)
    elif store == "list":
        object.__setattr__(obj, "_cairn_items", [v for _, v in items])
    else:
        object.__setattr__(obj, "_cairn_items", dict(items))


class _SharedBuilder:
    """Rebuilds a tree encoding holding ``REF`` entries: every node and variable is
    made once and each REF reuses it. A node is created before its items (for the
    stores of :class:`Node`), so a cycle back to an ancestor closes."""

    def __init__(self, values: Iterator[Any], new_variable: Callable[[Any, Any], Any] | None):
        self.values = values
        self.new_variable = new_variable
        self.nodes: list[Any] = []
        self.variables: list[Any] = []

    def var(self, template: Any) -> Any:
        x = next(self.values)
        if template[0] is DataSlot:  # a data attribute: its plain value (never a REF target)
            if self.new_variable is not None:
                self.new_variable(template, x)
            v = data_value(x)
        else:
            v = x if self.new_variable is None else self.new_variable(template, x)
        self.variables.append(v)  # keeps REF indices aligned with the encoder's list
        return v

    def ref(self, j: int) -> Any:
        if j >= 0:
            return self.variables[j]
        obj = self.nodes[~j]
        if obj is _PENDING:
            raise ValueError(
                "cannot rebuild a cycle through a node whose class builds itself from its "
                "items (a custom _graph_new)"
            )
        return obj

    def leaf(self, tag: int, payload: Any) -> Any:
        if tag == VAR:
            return self.var(payload)
        if tag == MOD:
            return self.node(payload)
        return self.ref(payload)

    def node(self, encoding: tuple) -> Node:
        cls, entries = encoding
        store = graph_store(cls)
        idx = len(self.nodes)
        # made before its items (a REF among them may point back at it), unless its class
        # builds it from the items (a custom _graph_new): _PENDING until then
        made: Node | None = object.__new__(cls) if store in ("attrs", "list", "dict") else None
        self.nodes.append(_PENDING if made is None else made)
        items = []
        for k, tag, payload in entries:
            if tag == STATIC:
                items.append((k, payload.value))
            elif tag == TREE:
                treedef, leafdefs = payload
                items.append((k, treedef.unflatten([self.leaf(t, p) for t, p in leafdefs])))
            else:
                items.append((k, self.leaf(tag, payload)))
        if made is None:
            built: Node = cls._graph_new(items)
            self.nodes[idx] = built
            return built
        assert store is not None  # made is set only for a store named above
        _fill(made, store, items)
        return made


def build_shared(
    encoding: tuple, values: Iterator[Any], new_variable: Callable[[Any, Any], Any] | None = None
) -> Node:
    """:func:`build_node` (nested) of a tree encoding that holds ``REF`` entries: one
    object per node and variable, found again at every place that refers to it."""
    return _SharedBuilder(values, new_variable).node(encoding)
