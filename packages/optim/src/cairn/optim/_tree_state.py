"""Find and replace values of an optimizer state by name (``tree.get``, ``tree.set``), and map
over the copies of the parameter tree inside a state (``tree.map_params``).

A value is found by its *name*: a dict key, a NamedTuple field, an attribute of a registered
dataclass, or the class name of a NamedTuple (which names the whole tuple). Paths are tuples of
JAX key entries; a NamedTuple field appears as :class:`NamedTupleKey` so that a filter can tell
``ScaleByAdamState.count`` from ``ScaleByScheduleState.count``.

>>> import jax.numpy as jnp
>>> from cairn import optim
>>> state = optim.adam(1e-3).init({"w": jnp.zeros(2)})
>>> round(float(optim.tree.get(state, "learning_rate")), 6)
0.001
>>> state = optim.tree.set(state, learning_rate=jnp.asarray(0.01))
>>> round(float(optim.tree.get(state, "learning_rate")), 6)
0.01

>>> int(optim.tree.get(state, "count"))  # kept by Adam and by the learning rate, both 0
0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["NamedTupleKey", "get_all_with_path", "get", "set", "map_params"]

KeyPath = tuple[Any, ...]
Filter = Callable[[KeyPath, Any], bool]


@dataclasses.dataclass(frozen=True)
class NamedTupleKey:
    """Path entry of a NamedTuple field: the tuple's class name and the field name.

    Args:
      tuple_name: the NamedTuple's class name.
      name: the field name.
    """

    tuple_name: str
    name: str

    def __str__(self) -> str:
        return f"{self.tuple_name}.{self.name}"


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _entry_name(entry: Any) -> Any:
    for attr in ("name", "key"):
        if hasattr(entry, attr) and not isinstance(entry, jax.tree_util.SequenceKey):
            return getattr(entry, attr)
    return None


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    """``[(key entry, child)]`` one level down, or None for a leaf."""
    if _is_namedtuple(node):
        return [(NamedTupleKey(type(node).__name__, f), getattr(node, f)) for f in node._fields]
    if isinstance(node, dict):
        return [(jax.tree_util.DictKey(k), v) for k, v in node.items()]
    if isinstance(node, (list, tuple)):
        return [(jax.tree_util.SequenceKey(i), v) for i, v in enumerate(node)]
    if node is None:
        return []
    flat, td = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda y: y is not node)
    if jax.tree_util.treedef_is_leaf(td):
        return None
    return [(path[0], child) for path, child in flat]


def _rebuild(node: Any, children: list[Any]) -> Any:
    if _is_namedtuple(node):
        return type(node)(*children)
    if isinstance(node, dict):
        return type(node)(zip(node.keys(), children))
    if isinstance(node, (list, tuple)):
        return type(node)(children)
    td = jax.tree_util.tree_structure(node, is_leaf=lambda y: y is not node)
    return jax.tree_util.tree_unflatten(td, children)


def _accept(filtering: Filter | None, path: KeyPath, value: Any) -> bool:
    return filtering is None or bool(filtering(path, value))


def get_all_with_path(tree: Any, key: Any,
                      filtering: Filter | None = None) -> list[tuple[KeyPath, Any]]:
    """Every ``(path, value)`` of ``tree`` whose name is ``key``, in traversal order.

    Args:
      tree: any pytree (an optimizer state, a dict of params).
      key: the name to look for (dict key, NamedTuple field or NamedTuple class name).
      filtering: optional ``filtering(path, value) -> bool`` keeping only some matches.

    Returns:
      A list of ``(path, value)``; a path is a tuple of JAX key entries (NamedTuple fields
      as :class:`NamedTupleKey`), readable with :func:`jax.tree_util.keystr`.
    """
    found: list[tuple[KeyPath, Any]] = []

    def walk(node: Any, path: KeyPath) -> None:
        if _is_namedtuple(node) and type(node).__name__ == key and _accept(filtering, path, node):
            found.append((path, node))
        kids = _children(node)
        for entry, child in kids or []:
            p = (*path, entry)
            if _entry_name(entry) == key and _accept(filtering, p, child):
                found.append((p, child))
            else:
                walk(child, p)

    walk(tree, ())
    return found


def _same(a: Any, b: Any) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb:  # type: ignore[operator]
        return False
    for x, y in zip(la, lb):
        if jax.numpy.shape(x) != jax.numpy.shape(y):
            return False
        if isinstance(x, jax.core.Tracer) or isinstance(y, jax.core.Tracer):
            if jax.numpy.result_type(x) != jax.numpy.result_type(y):
                return False
            continue
        try:
            if not bool(jax.numpy.all(jax.numpy.asarray(x) == jax.numpy.asarray(y))):
                return False
        except TypeError:
            if x is not y and x != y:
                return False
    return True


def get(tree: Any, key: Any, default: Any = None, filtering: Filter | None = None) -> Any:
    """The one value of ``tree`` named ``key`` (``default`` if there is none).

    Args:
      tree: any pytree, typically an optimizer state.
      key: the name to look for (dict key, NamedTuple field or NamedTuple class name).
      default: returned when nothing matches.
      filtering: optional ``filtering(path, value) -> bool`` to choose among matches.

    Values inside our ``ScaleByLearningRateState`` (bookkeeping that Optax's aliases do not
    have: the learning rate and its step count) are used only when nothing else matches.
    Several matches that hold the same value (our Adam keeps its step count both in
    ``ScaleByAdamState`` and in the learning-rate state, and ``inject_hyperparams`` mirrors the
    learning rate into the inner state) give that value, the outermost one; under tracing,
    where values cannot be compared, matches of equal shapes and dtypes count as the same.

    Raises:
      KeyError: several values match and differ (the message lists their paths).
    """
    found = get_all_with_path(tree, key, filtering)
    primary = [(p, v) for p, v in found if not any(
        getattr(e, "tuple_name", None) == "ScaleByLearningRateState" for e in p)]
    found = primary or found
    if len(found) > 1 and not all(_same(found[0][1], v) for _, v in found[1:]):
        paths = [jax.tree_util.keystr(p) for p, _ in found]
        raise KeyError(f"tree.get: {len(found)} values are named {key!r} (at {paths}); "
                       "pass filtering=lambda path, value: ... to choose one")
    return found[0][1] if found else default


def set(tree: Any, filtering: Filter | None = None, /, **kwargs: Any) -> Any:  # noqa: A001
    """A copy of ``tree`` with every value named by a keyword replaced by that keyword's value.

    Args:
      tree: any pytree, typically an optimizer state.
      filtering: optional ``filtering(path, value) -> bool`` restricting which matches change.
      **kwargs: ``name=new_value`` pairs.

    Raises:
      KeyError: a keyword names nothing in ``tree`` (or nothing the filter accepts).
    """
    used: list[str] = []

    def walk(node: Any, path: KeyPath) -> Any:
        if _is_namedtuple(node):
            name = type(node).__name__
            if name in kwargs and _accept(filtering, path, node):
                used.append(name)
                return kwargs[name]
        kids = _children(node)
        if not kids:
            return node
        out = []
        for entry, child in kids:
            p, name = (*path, entry), _entry_name(entry)
            if name in kwargs and _accept(filtering, p, child):
                used.append(name)
                out.append(kwargs[name])
            else:
                out.append(walk(child, p))
        return _rebuild(node, out)

    new = walk(tree, ())
    missing = sorted(k for k in kwargs if k not in used)
    if missing:
        raise KeyError(f"tree.set: no value named {missing} in the tree"
                       + (" (that the filter accepts)" if filtering is not None else ""))
    return new


@jax.tree_util.register_pytree_node_class
class _ParamsPlaceholder:
    """An empty pytree node standing for "the params" while ``init`` builds a state."""

    def tree_flatten(self) -> tuple[tuple[()], None]:
        return (), None

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> _ParamsPlaceholder:
        del aux, children
        return cls()


def map_params(initable: Any, f: Callable[..., Any], state: Any, /, *rest: Any,
               transform_non_params: Callable[..., Any] | None = None,
               is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """Apply ``f`` leaf-wise to every copy of the parameter tree inside ``state``.

    ``init`` is run once on a placeholder to learn where the state holds parameter-shaped
    trees (moments, averages); those subtrees become ``jax.tree.map(f, subtree, *rest)``, the
    other leaves ``transform_non_params(leaf)`` (unchanged when it is None). Typical use:
    turn the params' partition specs into the state's.

    Args:
      initable: a transformation (an object with ``init``) or an ``init`` callable.
      f: ``f(state_leaf, *rest_leaves) -> new_leaf``.
      state: the optimizer state to map over.
      *rest: trees with the params' structure passed along to ``f``.
      transform_non_params: applied to every leaf that is not part of a params copy.
      is_leaf: passed to :func:`jax.tree.map` over each params copy.
    """
    init = initable.init if hasattr(initable, "init") else initable
    template = init(_ParamsPlaceholder())

    def one(tmpl: Any, sub: Any) -> Any:
        if isinstance(tmpl, _ParamsPlaceholder):
            return jax.tree.map(f, sub, *rest, is_leaf=is_leaf)
        return transform_non_params(sub) if transform_non_params is not None else sub

    is_ph = lambda x: isinstance(x, _ParamsPlaceholder)  # noqa: E731
    return jax.tree.map(one, template, state, is_leaf=is_ph)
