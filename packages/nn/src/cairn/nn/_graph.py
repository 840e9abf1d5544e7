"""Structure of a module tree: GraphDef, cached flattening, split / merge and friends.

Encoding a module tree (``cairn.nn._nodes.encode_tree``) gives its :class:`GraphDef`
(classes, static attributes, variable types and metadata: everything but the values)
and the list of its Variables in order. The result is cached on the root module and
reused while no structural change happened anywhere (a global counter, bumped by every
module attribute assignment, container mutation and variable metadata change; setting a
variable's ``value`` is not structural). That cache is what makes ``split``, ``state``
and the transforms cost no per-node Python work on repeated calls.

This module works on the node protocol of ``cairn.nn._nodes`` and sits below
``cairn.nn._module``, whose ``Module`` methods (``iter_modules``, ``copy``) use it.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

import cairn.nn._nodes as _nodes_module
from cairn.nn._data import DataSlot, data_value, plain
from cairn.nn._filters import path_str, path_text, to_predicate
from cairn.nn._graph_mode import check_mode, set_graph_mode
from cairn.nn._nodes import (
    MOD,
    STATIC,
    VAR,
    Node,
    SharedReferenceError,
    build_node,
    build_shared,
    encode_tree,
    graph_store,
    is_node,
    key_of,
    tuple_has_nodes,
)
from cairn.nn._state import GraphState, State
from cairn.nn._tree_root import LeafDef, PytreeNode, VariableDef, is_pytree_root, unwrap, wrap
from cairn.nn._variables import EPOCH, Variable, rebuild_variable

# the node type a GraphDef describes (``GraphDef[Model]``); for type checkers only
_N = TypeVar("_N")


class GraphDef(Generic[_N]):
    """The static structure of a module tree: everything except the variables' values.

    Hashable and comparable, so it can key compilation caches. ``paths`` lists the path
    tuple of each variable, in the order of the flat variable list.

    Args:
      node: the nested node description (types, static attributes, variable slots).
      paths: the path tuple of each variable, in flat order (a shared variable once,
        at its first path).
      refs: whether ``node`` holds shared references (``REF`` entries: a module or
        variable found at more than one place, or a cycle).
      has_data: whether some slots of the flat list are plain data attributes (a
        module's arrays assigned without a Variable) rather than Variables.
    """

    __slots__ = (
        "node", "paths", "refs", "_hash", "_index", "_pstrs", "_uses", "_codegen", "_specs", "has_data"
    )

    # ``nn.GraphDef[Model]`` in annotations, as Flax's generic ``GraphDef[A]`` (Generic
    # tells type checkers; at run time a subscript stays a plain types.GenericAlias)
    __class_getitem__: Any = classmethod(types.GenericAlias)

    def __init__(self, node: tuple, paths: tuple, refs: bool = False, has_data: bool = False) -> None:
        self.node = node
        self.paths = paths
        self.refs = refs
        # some slots are plain data attributes (see cairn.nn._data), not Variables
        self.has_data = has_data
        self._hash: int | None = None
        self._index: dict[tuple, int] | None = None
        self._pstrs: tuple[str, ...] | None = None
        self._uses = 0
        self._codegen: Callable[[Any], Node] | None = None
        # shapes and dtypes (avals) of the variables when the graph was first handed out
        # by split / graphdef: what nn.merge checks against (not part of hash / equality)
        self._specs: list | None = None

    @property
    def num_variables(self) -> int:
        return len(self.paths)

    @property
    def path_strings(self) -> tuple[str, ...]:
        """The path string of each variable (computed once per GraphDef)."""
        s = self._pstrs
        if s is None:
            s = self._pstrs = tuple(path_str(p) for p in self.paths)
        return s

    @property
    def path_index(self) -> dict[tuple, int]:
        d = self._index
        if d is None:
            d = self._index = {p: i for i, p in enumerate(self.paths)}
        return d

    @property
    def type(self) -> type:
        return self.node[0]

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = self._hash = hash(self.node)
        return h

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, GraphDef):
            return NotImplemented
        return hash(self) == hash(other) and self.node == other.node

    def __repr__(self) -> str:
        name = "pytree" if self.node[0] is PytreeNode else self.node[0].__name__
        return f"GraphDef({name}, num_variables={len(self.paths)})"

    # --- rebuilding ---
    def build_from_variables(self, variables: list[Variable]) -> Node:
        """A new module tree of this structure holding ``variables`` (reused, not copied).

        Args:
          variables: the variables, in the order of ``paths``.
        """
        build = self._codegen
        if build is not None:
            root = build(variables)
        elif self.refs:
            root = build_shared(self.node, iter(variables))
        else:
            self._uses += 1
            if self._uses >= 2:  # used again: compile a straight-line builder
                build = self._codegen = _codegen_builder(self.node)
                root = build(variables)
            else:
                root = build_node(self.node, iter(variables))
        if not self.has_data:  # data slots bind to the new nodes: encoded on first use
            object.__setattr__(root, "_cairn_cache", _Flat(EPOCH[0], self, list(variables)))
        return root

    def build_from_values(self, values: Any, reuse: dict[int, Variable] | None = None) -> Node:
        """A new module tree of this structure with new variables holding ``values``.

        Args:
          values: the variables' values, in the order of ``paths``.
          reuse: variable index -> an existing Variable to place there instead of a new
            one (a Variable shared with another transform argument).
        """
        out: list = []

        def new_var(template, value):
            v = rebuild_variable(template, value) if reuse is None else reuse.get(len(out))
            if v is None:
                v = rebuild_variable(template, value)
            out.append(v)
            return v

        if self.refs:
            root = build_shared(self.node, iter(values), new_var)
        else:
            root = build_node(self.node, iter(values), new_var)
        if not self.has_data:
            object.__setattr__(root, "_cairn_cache", _Flat(EPOCH[0], self, out))
        return root


# A GraphDef is a pytree with no leaves (all of it is static aux data), as Flax NNX's
# is: it passes through ``jax.jit`` (in and out) as an ordinary argument, and
# ``jax.tree.map`` over ``(graphdef, state)`` sees only the state's arrays.
jax.tree_util.register_pytree_node(GraphDef, lambda g: ((), g), lambda g, _: g)


class _Flat:
    __slots__ = ("epoch", "graphdef", "variables")

    def __init__(self, epoch, graphdef, variables):
        self.epoch = epoch
        self.graphdef = graphdef
        self.variables = variables


# how a compiled builder stores a node's items, per _graph_store (None: call _graph_new)
_STORE_LINES = {
    "attrs": lambda name, c, parts: (
        f"    {name} = new({c}); {name}.__dict__.update({{"
        + ", ".join(f"{k!r}: {e}" for k, e in parts)
        + "})"
    ),
    "list": lambda name, c, parts: (
        f"    {name} = new({c}); setattr_({name}, '_cairn_items', ["
        + ", ".join(e for _, e in parts)
        + "])"
    ),
    "dict": lambda name, c, parts: (
        f"    {name} = new({c}); setattr_({name}, '_cairn_items', {{"
        + ", ".join(f"{k!r}: {e}" for k, e in parts)
        + "})"
    ),
}


class _Codegen:
    """Source of a function that rebuilds one module tree from its variable list."""

    def __init__(self):
        self.consts: list = []
        self.lines: list[str] = []
        self.modules = 0
        self.nvars = 0

    def const(self, x) -> str:
        self.consts.append(x)
        return f"K[{len(self.consts) - 1}]"

    def var(self) -> str:
        self.nvars += 1
        return f"v[{self.nvars - 1}]"

    def leaf(self, tag, payload) -> str:
        if tag != VAR:
            return self.emit(payload)
        if payload[0] is DataSlot:  # a data attribute holds the plain value
            return f"dv({self.var()})"
        return self.var()

    def emit(self, encoding) -> str:
        cls, entries = encoding
        name = f"m{self.modules}"
        self.modules += 1
        parts = []
        for k, tag, payload in entries:
            if tag == STATIC:
                expr = f"{self.const(payload)}.value"
            elif tag in (VAR, MOD):
                expr = self.leaf(tag, payload)
            else:
                treedef, leafdefs = payload
                subs = ", ".join(self.leaf(lt, lp) for lt, lp in leafdefs)
                expr = f"{self.const(treedef)}.unflatten([{subs}])"
            parts.append((k, expr))
        c = self.const(cls)
        line = _STORE_LINES.get(graph_store(cls) or "")
        if line is not None:
            self.lines.append(line(name, c, parts))
        else:
            body = ", ".join(f"({k!r}, {e})" for k, e in parts)
            self.lines.append(f"    {name} = {c}._graph_new([{body}])")
        return name


def _codegen_builder(node):
    """Compile a function that rebuilds the module tree of ``node`` from a list of
    Variables in one straight-line body (no per-node interpretation)."""
    gen = _Codegen()
    root = gen.emit(node)
    src = "def build(v):\n" + "\n".join(gen.lines) + f"\n    return {root}\n"
    ns = {
        "K": gen.consts, "new": object.__new__, "setattr_": object.__setattr__, "dv": data_value
    }
    exec(compile(src, "<cairn.nn graph builder>", "exec"), ns)
    return ns["build"]


def fresh_flat(root: Node) -> _Flat:
    """The uncached encoding of ``root``'s tree."""
    encoding, paths, variables, refs, has_data = encode_tree(root)
    return _Flat(EPOCH[0], GraphDef(encoding, paths, refs, has_data), variables)


def flat(node: Node) -> _Flat:
    """The (cached) GraphDef and variable list of ``node``."""
    c = node.__dict__.get("_cairn_cache")
    if c is not None and c.epoch == EPOCH[0]:
        return c
    if not isinstance(node, Node):
        raise TypeError(f"expected a cairn.nn Module, got {type(node).__name__}")
    c = fresh_flat(node)
    object.__setattr__(node, "_cairn_cache", c)
    return c


# --- tree mode: no shared references ---


def tree_mode(graph: bool | None) -> bool:
    """Whether ``graph`` (the keyword, None for the switch's value) asks for tree mode."""
    return not (set_graph_mode.current_value() if graph is None else graph)


def check_tree(root: Node, c: _Flat, graph: bool | None, original: Any = None) -> None:
    """In tree mode (``graph=False`` or ``set_graph_mode(False)``), raise
    :class:`SharedReferenceError` naming both paths when ``root``'s tree (cached as
    ``c``) holds a module or Variable at two places or a cycle, or when the pytree
    ``original`` holds one ``jax.Ref`` twice. Costs one attribute read in graph mode
    and for unshared trees."""
    if not tree_mode(graph):
        return
    if c.graphdef.refs:
        encode_tree(root, strict=True)  # raises, naming the two paths
    if original is not None:
        seen: dict[int, str] = {}
        for kp, x in jax.tree_util.tree_flatten_with_path(original, is_leaf=is_node)[0]:
            if isinstance(x, _REF_TYPES):
                p = jax.tree_util.keystr(kp)
                if id(x) in seen:
                    raise SharedReferenceError(
                        f"Duplicate {type(x).__name__}: the same object is found at paths "
                        f"{seen[id(x)]!r} and {p!r}; tree mode (graph=False) does not "
                        f"support shared references"
                    )
                seen[id(x)] = p


_REF_TYPES = tuple(t for t in (getattr(jax, "Ref", None),) if isinstance(t, type))


_nodes_module.FLAT[0] = flat  # the pytree flattening's shared-reference check


# --- public functional API ---


def _check_module(node, fn):
    if not isinstance(node, Node):
        raise TypeError(f"nn.{fn}: expected a cairn.nn Module, got {type(node).__name__}")


def _as_root(node: Any) -> Any:
    """``node`` as a module tree (a pytree root wrapped, see ``cairn.nn._tree_root``),
    or the :class:`VariableDef` / :class:`LeafDef` of a lone Variable / plain leaf."""
    if isinstance(node, Node):
        return node
    if isinstance(node, Variable):
        return VariableDef.of(node)
    if is_pytree_root(node):
        return wrap(node)
    return LeafDef()


def _leaf_matches(f: Any, x: Any) -> bool:
    if isinstance(x, Variable):
        return bool(to_predicate(f)((), x))
    if f is ... or f is True:
        return True
    return isinstance(f, type) and isinstance(x, f)


def _split_single(gd: Any, x: Any, filters: tuple, fn: str, exhaustive: bool) -> list:
    """A lone Variable's or leaf's "states": ``x`` itself at the first filter it
    matches, empty States elsewhere (Flax NNX's convention)."""
    outs: list = [State() for _ in filters]
    for i, f in enumerate(filters):
        if _leaf_matches(f, x):
            outs[i] = x
            return outs
    if exhaustive:
        raise ValueError(
            f"nn.{fn}: the {type(x).__name__} matched none of the filters {filters!r}; add "
            f"`...` as the last filter"
        )
    return outs


def graphdef(node: Node, *, graph: bool | None = None) -> GraphDef:
    """The :class:`GraphDef` (static structure) of ``node``.

    Args:
      node: a module tree.
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
    """
    check_mode("graphdef", graph)
    original = node
    node = _as_root(node)
    if isinstance(node, VariableDef | LeafDef):
        return node  # type: ignore[return-value]
    c = flat(node)
    check_tree(node, c, graph, original)
    if c.graphdef._specs is None:
        _record_specs(c)
    return c.graphdef


def _partition(c: _Flat, filters, fn: str, exhaustive: bool) -> list[State]:
    for f in filters[:-1]:
        if f is ... or f is True:
            raise ValueError(
                f"nn.{fn}: `...` or `True` can only be used as the last filters (the first "
                f"matching filter wins, so the filters after it would get nothing), got "
                f"{filters!r}"
            )
    preds = [to_predicate(f) for f in filters]
    outs: list[dict] = [{} for _ in preds]
    for p, v in zip(c.graphdef.paths, c.variables):
        v = plain(v)  # a data attribute is filtered, and handed out, as its value
        for o, pred in zip(outs, preds):
            if pred(p, v):
                o[p] = v
                break
        else:
            if exhaustive:
                raise ValueError(
                    f"nn.{fn}: Non-exhaustive filters, got a non-empty remainder: the variable "
                    f"at {path_text(p)!r} ({type(v).__name__}) matched none of the filters "
                    f"{filters!r}; add `...` as the last filter"
                )
    return [State.from_flat(o) for o in outs]


def split(node: Node, *filters: Any, graph: bool | None = None) -> tuple:
    """Split ``node`` into its :class:`GraphDef` and one :class:`State` per filter
    (one State with everything when no filter is given). The States hold the module's
    own Variable objects (not copies). Every variable must match a filter; the first
    match wins; use ``...`` last to collect the rest.

    Args:
      node: the module tree (or a pytree of modules and Variables; a lone Variable or a
        plain leaf is its own state).
      filters: the filters, in order; none puts everything in one State.
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> class M(nn.Module):
    ...     def __init__(self):
    ...         self.w = nn.Param(jnp.ones(2))
    ...         self.s = nn.BatchStat(jnp.zeros(2))
    >>> gd, params, rest = nn.split(M(), nn.Param, ...)
    >>> params.flat_paths(), rest.flat_paths()
    (['w'], ['s'])
    >>> m2 = nn.merge(gd, params, rest)
    """
    check_mode("split", graph)
    root = _as_root(node)
    if isinstance(root, VariableDef | LeafDef):
        return (root, *_split_single(root, node, filters or (...,), "split", True))
    c = flat(root)
    check_tree(root, c, graph, node)
    if c.graphdef._specs is None:
        _record_specs(c)
    if not filters:
        return c.graphdef, State._from_cache(c.graphdef, c.variables)
    return (c.graphdef, *_partition(c, filters, "split", True))


def state(node: Node, *filters: Any, graph: bool | None = None) -> State | tuple[State, ...]:
    """The variables of ``node`` as a :class:`State` (one per filter: a tuple when more
    than one filter is given). Unlike :func:`split`, variables matching no filter are
    left out. ``node`` may also be a State (its variables, filtered the same way).

    Args:
      node: a module tree (or a State).
      filters: the filters; none gives every variable.
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).

    Raises:
      TypeError: ``node`` is neither a module nor a State.
    """
    check_mode("state", graph)
    if isinstance(node, State):
        if not filters:
            return State.from_flat(node._flat)
        return node.filter(*filters)
    root = _as_root(node)
    if isinstance(root, VariableDef | LeafDef):
        outs = _split_single(root, node, filters or (...,), "state", False)
        return outs[0] if len(outs) == 1 else tuple(outs)
    c = flat(root)
    check_tree(root, c, graph, node)
    if not filters:
        return State._from_cache(c.graphdef, c.variables)
    states = _partition(c, filters, "state", False)
    return states[0] if len(states) == 1 else tuple(states)


def variables(node: Node, *filters: Any, graph: bool | None = None) -> State | tuple[State, ...]:
    """Alias of :func:`state` (NNX name).

    Args:
      node: a module tree (or a State).
      filters: the filters; none gives every variable.
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
    """
    check_mode("variables", graph)
    return state(node, *filters, graph=graph)


def merge(graphdef: Any, *states: Any, copy: bool = False) -> Any:
    """Rebuild a module tree from its :class:`GraphDef` and States. The States' Variable
    objects are used as they are (``copy=True`` copies them). Raises ``ValueError``
    naming any path the states lack or have in excess.

    A pytree root comes back as the pytree (list, dict...); a lone Variable's or a
    leaf's definition gives back the one state that is not an empty State.

    Args:
      graphdef: the structure, from :func:`split`.
      states: the States holding every variable of ``graphdef`` (at least one).
      copy: copy the Variable objects instead of reusing them.

    Raises:
      TypeError: no State is given.
    """
    if isinstance(graphdef, GraphState):
        graphdef, states = _graph_states(graphdef, states)
    states = tuple(_pairs_state(s) for s in states)
    if isinstance(graphdef, VariableDef | LeafDef):
        return _merge_single(graphdef, states, copy)
    if not isinstance(graphdef, GraphDef):
        raise TypeError(f"nn.merge: expected a GraphDef first, got {type(graphdef).__name__}")
    if not states:  # Python's own words for the missing argument, as Flax NNX's signature
        raise TypeError(
            "merge() missing 1 required positional argument: 'state' (the State from "
            "nn.split; an empty State for a module without variables)"
        )
    vs = None
    if len(states) == 1 and isinstance(states[0], State):
        h = states[0]._hint
        if h is not None and (h[0] is graphdef or h[0] == graphdef):
            vs = h[1]
    if vs is None:
        combined: dict = {}
        for s in states:
            if not isinstance(s, State):
                s = State(s)
            combined.update(s._flat)
        try:
            vs = [combined[p] for p in graphdef.paths]
        except KeyError:
            missing = [path_text(p) for p in graphdef.paths if p not in combined]
            raise ValueError(f"nn.merge: the states have no variable at {missing}") from None
        if len(combined) != len(vs):
            idx = graphdef.path_index
            extra = [path_text(p) for p in combined if p not in idx]
            raise ValueError(f"nn.merge: the states have variables not in the graph: {extra}")
        if graphdef._specs is not None:
            _check_merge_values(graphdef, vs)
        if not all(isinstance(v, Variable) for v in vs):
            # plain values (a pure dict, a State of arrays): a Variable slot gets a new
            # Variable of the graph's type and metadata, a data slot the value itself
            root = build_node(graphdef.node, iter(vs), _as_variable)
            return unwrap(root) if isinstance(root, PytreeNode) else root
    if copy:
        vs = [v.copy() if isinstance(v, Variable) else v for v in vs]
    root = graphdef.build_from_variables(vs)
    return unwrap(root) if isinstance(root, PytreeNode) else root


def _as_variable(template: tuple, x: Any) -> Any:
    """``x`` at a Variable slot of ``template`` in :func:`merge`: a Variable as it is,
    a plain value in a new Variable of the template (a data slot keeps the value)."""
    if isinstance(x, Variable) or template[0] is DataSlot:
        return x
    return rebuild_variable(template, x)


def _pairs_state(s: Any) -> Any:
    """A flat state given as a list of ``(path tuple, value)`` pairs (``nn.flatten``'s)
    as a State; anything else as it is."""
    if type(s) is list and all(type(x) is tuple and len(x) == 2 and type(x[0]) is tuple for x in s):
        if len(s) == 1 and s[0][0] == ():  # a lone Variable's / leaf's pair
            return s[0][1]
        return State.from_flat(s)
    return s


def _merge_single(graphdef: VariableDef | LeafDef, states: tuple, copy: bool) -> Any:
    """``merge`` of a lone Variable's or leaf's definition: the one non-empty state."""
    found = [s for s in states if not (isinstance(s, State) and not s._flat)]
    if len(found) != 1:
        raise ValueError(
            f"nn.merge: {graphdef!r} needs exactly one value among the states (the others "
            f"empty States), got {len(found)}"
        )
    x = found[0]
    if isinstance(graphdef, VariableDef):
        if not isinstance(x, Variable):
            raise TypeError(f"nn.merge: {graphdef!r} needs a Variable, got {type(x).__name__}")
        return x.copy() if copy else x
    return x


def _graph_states(first: GraphState, rest: tuple) -> tuple[GraphDef, tuple]:
    """``merge(*graph_states)`` (from ``nn.unpack``): the shared GraphDef and the states."""
    for s in rest:
        if not isinstance(s, GraphState):
            raise ValueError(
                f"nn.merge: Expected GraphState object after a GraphState, got "
                f"{type(s).__name__}; pass every state from nn.unpack or use nn.split"
            )
        if s.graphdef != first.graphdef:
            raise ValueError(
                "nn.merge: the GraphDef must be the same for every GraphState; these came "
                "from different modules"
            )
    return first.graphdef, (first, *rest)


def update(node: Node, *states: Any) -> None:
    """Set the values (and metadata) of ``node``'s variables from ``states`` (States or
    nested mappings of Variables), matching by path. Raises ``ValueError`` naming a path
    that ``node`` does not have.

    Args:
      node: the module tree to update in place.
      states: States or nested mappings of Variables.
    """
    if isinstance(node, Variable):
        for s in states:
            if isinstance(s, Variable):
                _copy_variable(node, s)
            elif not (isinstance(s, State | Mapping) and not s):
                raise TypeError(
                    f"nn.update: a Variable is updated from a Variable (or empty States), "
                    f"got {type(s).__name__}"
                )
        return
    shown = type(node).__name__
    if not isinstance(node, Node) and is_pytree_root(node):
        node = wrap(node)
    _check_module(node, "update")
    c = flat(node)
    idx = c.graphdef.path_index
    aliases = None
    for s in states:
        fl = s._flat if isinstance(s, State) else State(s)._flat
        for p, v in fl.items():
            i = idx.get(p)
            if i is None and c.graphdef.refs:  # the path of a shared Variable's other place
                if aliases is None:
                    aliases = _alias_index(node, c)
                i = aliases.get(p)
            if i is None:
                raise ValueError(
                    f"nn.update: {shown} has no variable at {path_text(p)!r}"
                )
            target = c.variables[i]
            if target is v:
                continue
            if isinstance(v, Variable):
                _check_update_value(node, p, target, v.raw_value)
                _copy_variable(target, v)
            else:
                _check_update_value(node, p, target, v)
                object.__setattr__(target, "raw_value", v)


def _alias_index(root: Node, c: _Flat) -> dict[tuple, int]:
    """Every path of every variable of ``root``'s tree (a shared one at each of its
    places, a cycle followed once) -> its index in ``c.variables``."""
    index = {id(v): i for i, v in enumerate(c.variables)}
    out: dict[tuple, int] = {}

    def rec(node: Node, path: tuple, stack: set[int]) -> None:
        stack.add(id(node))
        for k, v in node._graph_items():
            leaves = [((), v)]
            if isinstance(v, tuple) and tuple_has_nodes(v):
                flat_v = jax.tree_util.tree_flatten_with_path(v, is_leaf=is_node)[0]
                leaves = [(tuple(key_of(e) for e in kp), x) for kp, x in flat_v]
            for sub, x in leaves:
                if isinstance(x, Variable) and id(x) in index:
                    out.setdefault((*path, k, *sub), index[id(x)])
                elif isinstance(x, Node) and id(x) not in stack:
                    rec(x, (*path, k, *sub), stack)
        stack.discard(id(node))

    rec(root, (), set())
    return out


# --- value checks of merge / update ---
# A wrong shape or dtype raises here, naming the path,
# instead of later inside lax.dot_general with no path. Only array-like values are
# checked (arrays, tracers, ShapeDtypeStructs); shapes of tracers are static, so the
# checks also hold at trace time under jax.jit.

_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)


def _spec_error(fn, owner, path, what, expected, got) -> ValueError:
    return ValueError(
        f"nn.{fn}: wrong {what} for the variable at {path_text(path)!r}{owner}: expected "
        f"{expected}, got {got}"
    )


def _spec(x):
    """The aval of a JAX array or tracer (an attribute read: cheap), the value itself for
    another array-like (NumPy, ShapeDtypeStruct), else None (not checked)."""
    try:
        return x.aval
    except AttributeError:
        return x if isinstance(x, _ARRAYS) else None


def _check_update_value(node, path, target: Variable, new) -> None:
    """``update`` writes into an existing variable: the shape and the dtype must stay."""
    old, new = _spec(target.raw_value), _spec(new)
    if old is None or new is None or old is new:
        return
    if old.shape == new.shape and old.dtype == new.dtype:
        return
    owner = f" of {type(node).__name__}"
    if old.shape != new.shape:
        raise _spec_error("update", owner, path, "shape", tuple(old.shape), tuple(new.shape))
    if old.dtype != new.dtype:
        raise _spec_error("update", owner, path, "dtype", old.dtype, new.dtype)


_KINDS = (
    jax.dtypes.extended,
    np.floating,
    np.complexfloating,
    np.signedinteger,
    np.unsignedinteger,
    np.bool_,
)


def _dtype_kind(dt):
    """The family of ``dt`` (float, complex, signed, unsigned, bool, extended such as
    key arrays); ``jax.dtypes.issubdtype`` places bfloat16 / float8 / int4 correctly."""
    for kind in _KINDS:
        if jax.dtypes.issubdtype(dt, kind):
            return kind
    return dt


def _record_specs(c: _Flat) -> None:
    """Keep the avals (shape and dtype, no data) of ``c``'s variables on its graph, once
    per GraphDef: ``x.aval`` costs a tenth of reading ``x.shape`` and ``x.dtype``."""
    try:  # every value a JAX array (the common case): one comprehension, no calls
        specs = [v.raw_value.aval for v in c.variables]
    except AttributeError:
        specs = [_spec(v.raw_value) for v in c.variables]
    c.graphdef._specs = specs


def _check_merge_values(graphdef: GraphDef, variables: list) -> None:
    """``merge`` builds a module from new values: each one must have the graph's shape
    where it has the graph's rank (a value with fewer or more axes is a mapped or stacked
    state: ``jax.vmap`` / ``lax.scan`` over layers, ``nn.vmap``), and the same kind of
    dtype (a cast between float dtypes, e.g. to bfloat16 for inference, is allowed)."""
    for i, (old, v) in enumerate(zip(graphdef._specs or (), variables)):
        x = v.raw_value if isinstance(v, Variable) else v
        try:  # the _spec fast path inlined: this loop runs once per variable
            new = x.aval
        except AttributeError:
            new = _spec(x)
        if new is old or old is None or new is None:
            continue
        if new.shape == old.shape and new.dtype == old.dtype:
            continue
        if old.shape != new.shape and len(old.shape) == len(new.shape):
            if _in_shard_map():  # a shard's local shape: checked by shard_map itself
                continue
            raise _spec_error(
                "merge", "", graphdef.paths[i], "shape", tuple(old.shape), tuple(new.shape)
            )
        if old.dtype != new.dtype and _dtype_kind(old.dtype) != _dtype_kind(new.dtype):
            raise _spec_error("merge", "", graphdef.paths[i], "dtype", old.dtype, new.dtype)


def _in_shard_map() -> bool:
    """Whether this runs inside ``shard_map`` (mesh axes in manual mode), where a value
    has its shard's shape, not the global one."""
    try:
        return bool(jax.sharding.get_abstract_mesh().manual_axes)
    except AttributeError:  # an older jax without abstract meshes
        return False


def clone(
    node: Node, variables: bool = True, *, arrays: bool = False, graph: bool | None = None
) -> Node:
    """An independent copy of ``node``: new module and Variable objects; the arrays are
    immutable and shared unless ``arrays=True`` copies their buffers too (a clone that
    ``jit(donate_argnums=...)`` can donate next to the original).

    Args:
      node: a module, a Variable, a State, or a pytree (tuple, list, dict) holding
        modules and Variables (each is cloned; they must not share Variables).
      variables: new Variable objects (default); False shares the Variables.
      arrays: also copy the array buffers.
      graph: Flax NNX's mode keyword (one behaviour here).

    Raises:
      TypeError: ``node`` holds no module, Variable or State.
      SharedReferenceError: tree mode (``graph=False``) and a module or Variable is
        found at two places.
    """
    check_mode("clone", graph)
    if not isinstance(node, Node):
        return _clone_other(node, variables, arrays, graph)
    c = flat(node)
    check_tree(node, c, graph)
    if not variables:
        if arrays:
            raise ValueError("nn.clone: arrays=True needs variables=True")
        return c.graphdef.build_from_variables(list(c.variables))
    vals = [v.raw_value for v in c.variables]
    if arrays:
        vals = [jnp.array(x, copy=True) if isinstance(x, jax.Array) else x for x in vals]
    return c.graphdef.build_from_values(vals)


def _clone_variable(v: Variable, variables: bool, arrays: bool) -> Variable:
    if not variables:
        return v
    x = v.raw_value
    if arrays and isinstance(x, jax.Array):
        x = jnp.array(x, copy=True)
    return v.replace(value=x)


def _clone_other(node: Any, variables: bool, arrays: bool, graph: bool | None = None) -> Any:
    """:func:`clone` of a Variable, a State or a pytree of modules / Variables."""
    if arrays and not variables:
        raise ValueError("nn.clone: arrays=True needs variables=True")
    if isinstance(node, Variable):
        return _clone_variable(node, variables, arrays)
    if isinstance(node, State):
        return State.from_flat(
            {p: _clone_variable(v, variables, arrays) for p, v in node.flat_state().items()}
        )
    is_leaf = lambda x: isinstance(x, Node | Variable | State)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(node, is_leaf=is_leaf)
    if not any(is_leaf(x) for x in leaves):
        raise TypeError(
            f"nn.clone: expected a cairn.nn Module, Variable, State or a pytree holding them, "
            f"got {type(node).__name__}"
        )
    seen: set[int] = set()
    for x in leaves:
        vs = flat(x).variables if isinstance(x, Node) else [x] if isinstance(x, Variable) else []
        for v in vs:
            if id(v) in seen:
                if tree_mode(graph) or any(isinstance(y, State) for y in leaves):
                    raise SharedReferenceError(
                        f"nn.clone: the same {type(v).__name__} object is reachable from two "
                        f"entries of the {type(node).__name__}; tree mode (graph=False) "
                        f"does not support shared references"
                    )
                # graph mode: clone the pytree as one graph, so the copies share too
                return unwrap(clone(wrap(node), variables, arrays=arrays))
            seen.add(id(v))
    return treedef.unflatten(  # type: ignore[attr-defined]
        [clone(x, variables, arrays=arrays) if is_leaf(x) else x for x in leaves]
    )


def _get_child(node, key):
    if isinstance(node, Node):
        for k, v in node._graph_items():
            if k == key:
                return v
    elif isinstance(node, Mapping):
        return node[key]
    elif isinstance(node, tuple | list):
        return node[key]
    return getattr(node, key)


def pop(node: Node, *filters: Any) -> State | tuple[State, ...]:
    """Remove the variables matching ``filters`` from ``node`` and return them as a
    :class:`State` (one per filter; a tuple for several). Variables inside tuples
    cannot be popped (tuples are immutable).

    Args:
      node: the module (or a pytree of lists / dicts holding modules, Variables and
        plain leaves) to remove variables and data from.
      filters: the filters of the variables to remove.
    """
    if not isinstance(node, Node) and is_pytree_root(node):
        node = wrap(node)
    _check_module(node, "pop")
    if not filters:
        raise TypeError("nn.pop needs at least one filter")
    c = flat(node)
    states = _partition(c, filters, "pop", False)
    # last paths first: removing a list item must not shift the ones still to remove
    for p in sorted((p for s in states for p in s._flat), key=_path_order, reverse=True):
        owner = node
        for k in p[:-1]:
            owner = _get_child(owner, k)
        src = owner.__dict__.get("_cairn_src") if isinstance(owner, PytreeNode) else None
        if src is not None and type(src) in (list, dict):  # exact types (mypy: not None)
            del src[p[-1]]
        elif isinstance(owner, Node) and not isinstance(owner, PytreeNode):
            owner._graph_del(p[-1])
        else:
            raise TypeError(
                f"nn.pop: cannot remove {path_text(p)!r}: its parent is a "
                f"{type(src if src is not None else owner).__name__}, not a module, list or dict"
            )
    return states[0] if len(states) == 1 else tuple(states)


def _path_order(p: tuple) -> tuple:
    return tuple((isinstance(k, str), k) for k in p)


def iter_modules(node: Node, *, graph: bool | None = None) -> Iterator[tuple[str, Node]]:
    """``(path, module)`` for ``node`` (path ``""``) and every submodule, depth first; a
    module found at several places is given once, at its first path.

    Args:
      node: a module.
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
    """
    check_mode("iter_modules", graph)
    seen: set[int] = set()  # a shared module (or a cycle) is visited once

    def rec(m, path):
        if id(m) in seen:
            return
        seen.add(id(m))
        yield path_str(path), m
        for k, v in m._graph_items():
            if isinstance(v, Node):
                yield from rec(v, (*path, k))
            elif isinstance(v, tuple) and tuple_has_nodes(v):
                for kp, x in jax.tree_util.tree_flatten_with_path(v, is_leaf=is_node)[0]:
                    if isinstance(x, Node):
                        yield from rec(x, (*path, k, *(key_of(e) for e in kp)))

    return rec(node, ())


def _copy_variable(target: Variable, source: Variable) -> None:
    """Give ``target`` the value and metadata of ``source`` in place (a metadata change
    is a structural change: it bumps the graph epoch)."""
    object.__setattr__(target, "raw_value", source.raw_value)
    if target._meta != source._meta:
        object.__setattr__(target, "_meta", dict(source._meta))
        EPOCH[0] += 1


def sync(target: Node, source: Node) -> None:
    """Make ``target`` equal to ``source`` in place, reusing ``target``'s objects where
    the types agree (so references held by the caller stay valid). A module or Variable
    that ``source`` holds at several places (or in a cycle) is synced once and found as
    the same target object at each of them."""
    s = _Syncer()
    s.sync(target, source)
    s.adopt()


class _Syncer:
    """One :func:`sync`: ``memo`` maps the id of each source module / Variable already
    handled to the object the target holds for it; ``placed`` lists the source modules
    moved into the target as they are (new attributes), whose children may refer to
    source objects that have a target counterpart."""

    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}
        self.placed: list[Node] = []

    def sync(self, target: Node, source: Node) -> None:
        if type(target) is not type(source):
            raise TypeError(
                f"cannot update a {type(target).__name__} in place from a "
                f"{type(source).__name__}"
            )
        memo = self.memo
        memo[id(source)] = target
        t_items = dict(target._graph_items())
        s_keys = set()
        for k, sv in source._graph_items():
            s_keys.add(k)
            tv = t_items.get(k, _MISSING)
            done = memo.get(id(sv)) if isinstance(sv, Variable | Node) else None
            if done is not None:
                if tv is not done:
                    target._graph_set(k, done)
            elif isinstance(sv, Variable) and type(tv) is type(sv):
                memo[id(sv)] = tv
                _copy_variable(tv, sv)
            elif isinstance(sv, Node) and type(tv) is type(sv):
                self.sync(tv, sv)
            elif isinstance(sv, tuple) and isinstance(tv, tuple) and tuple_has_nodes(sv):
                self.sync_tuple(target, k, tv, sv)
            elif tv is _MISSING or not (tv is sv or _same_static(tv, sv)):
                if isinstance(sv, Variable | Node):
                    memo[id(sv)] = sv
                    if isinstance(sv, Node):
                        self.placed.append(sv)
                target._graph_set(k, sv)
        for k in reversed(list(t_items)):
            if k not in s_keys:
                target._graph_del(k)

    def sync_tuple(self, target: Node, k: Any, tv: tuple, sv: tuple) -> None:
        """The tuple item ``k`` (holding modules or Variables)."""
        s_leaves, s_def = _flatten_nodes(sv)
        t_leaves, t_def = _flatten_nodes(tv)
        if s_def != t_def or not all(type(a) is type(b) for a, b in zip(s_leaves, t_leaves)):
            target._graph_set(k, sv)
            return
        for a, b in zip(t_leaves, s_leaves):
            if id(b) in self.memo:
                continue
            if isinstance(a, Variable):
                self.memo[id(b)] = a
                _copy_variable(a, b)
            else:
                self.sync(a, b)

    def adopt(self) -> None:
        """Point the children of placed modules at the target's counterparts."""
        seen: set[int] = set()
        stack = list(self.placed)
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            for k, v in node._graph_items():
                if not isinstance(v, Variable | Node):
                    continue
                mapped = self.memo.get(id(v), v)
                if mapped is not v:
                    node._graph_set(k, mapped)
                elif isinstance(v, Node):
                    stack.append(v)


def _flatten_nodes(tree: Any) -> tuple[list, Any]:
    """Leaves and treedef of ``tree`` with variables and nodes as leaves."""
    return jax.tree_util.tree_flatten(tree, is_leaf=is_node)


def _same_static(a, b) -> bool:
    if isinstance(a, Variable | Node) or isinstance(b, Variable | Node):
        return False
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001
        return False


_MISSING = object()
