"""Walking a module tree: ``iter_graph`` (every module, Variable and static value, children
first) and ``recursive_map`` (rebuild a tree bottom-up), Flax NNX's names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cairn.nn._graph import check_tree, flat, tree_mode
from cairn.nn._graph_mode import check_mode
from cairn.nn._nodes import Node, shared_error
from cairn.nn._tree_names import check_tree_mode
from cairn.nn._variables import Variable


def iter_graph(node: Any, /, *, graph: bool | None = None) -> Iterator[tuple[tuple, Any]]:
    """``(path, value)`` for every module, Variable, container and static value under
    ``node`` (a module or a list / tuple / dict of them), children before their parent,
    attributes in definition order; the root comes last with path ``()``. A module or
    Variable found at several places (or through a cycle) is visited once, at its first
    path.

    Args:
      node: a module, or a list / tuple / dict of them.
      graph: False (tree mode) raises ``SharedReferenceError`` (a ``ValueError``) on a
        shared reference or a cycle instead; None follows ``nn.set_graph_mode``.

    >>> from cairn import nn
    >>> for path, v in nn.iter_graph(nn.Linear(2, 3, use_bias=False, rngs=nn.Rngs(0))):
    ...     if isinstance(v, nn.Variable | nn.Module):
    ...         print(path, type(v).__name__)
    ('kernel',) Param
    () Linear
    """
    check_mode("iter_graph", graph)
    check_tree_mode("iter_graph", node, graph)
    strict = tree_mode(graph)
    seen: dict[int, tuple] = {}

    def rec(x: Any, path: tuple) -> Iterator[tuple[tuple, Any]]:
        if isinstance(x, Node | Variable):
            first = seen.get(id(x))
            if first is not None:  # shared, or a cycle: visited once, at its first path
                if strict:
                    raise shared_error(x, first, path)
                return
            seen[id(x)] = path
        if isinstance(x, Node):
            for k, v in x._graph_items():
                yield from rec(v, (*path, k))
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                yield from rec(v, (*path, i))
        elif isinstance(x, dict):
            for k, v in x.items():
                yield from rec(v, (*path, k))
        yield path, x

    yield from rec(node, ())


def recursive_map(f: Any, node: Node, /, *, graph: bool | None = None) -> Any:
    """Apply ``f(path, x)`` to every module and Variable of ``node``, children before
    parents, on a new tree sharing ``node``'s Variables: what ``f`` returns replaces
    ``x`` (return ``x`` to keep it). Returns ``f((), new_root)``.

    Args:
      f: ``f(path, x) -> replacement`` for every module and Variable.
      node: the module tree, or a list / tuple / dict (nested) of modules and Variables
        (each container is rebuilt and also given to ``f``).
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).

    >>> from cairn import nn
    >>> m = nn.Sequential(nn.Linear(2, 2, rngs=nn.Rngs(0)), nn.Linear(2, 2, rngs=nn.Rngs(1)))
    >>> names = []
    >>> _ = nn.recursive_map(lambda p, x: names.append("/".join(map(str, p))) or x, m)
    >>> names[:3]
    ['layers/0/kernel', 'layers/0/bias', 'layers/0']

    Raises:
      SharedReferenceError: tree mode (``graph=False``) and a module or Variable is
        found at two paths (or a cycle). In graph mode each is mapped once.
    """
    check_mode("recursive_map", graph)
    check_tree_mode("recursive_map", node, graph)
    if not isinstance(node, Node):
        return _map_pytree(f, node, tree_mode(graph))
    c = flat(node)
    check_tree(node, c, graph)
    root = c.graphdef.build_from_variables(c.variables)
    done: dict[int, Any] = {}  # a shared module / Variable is mapped once (graph mode)

    def rec(x: Any, path: tuple) -> Any:
        if id(x) in done:
            return done[id(x)]
        done[id(x)] = x  # a cycle back to ``x`` keeps it while it is being mapped
        if isinstance(x, Node):
            for k, v in list(x._graph_items()):
                if isinstance(v, Node | Variable):
                    new = rec(v, (*path, k))
                    if new is not v:
                        x._graph_set(k, new)
        new = done[id(x)] = f(path, x)
        return new

    return rec(root, ())


def _map_pytree(f: Any, tree: Any, strict: bool) -> Any:
    """:func:`recursive_map` over a list / tuple / dict of modules and Variables: each
    module is mapped on its own new tree; containers are rebuilt, then given to ``f``.
    A module or Variable found twice is mapped once (``strict``, tree mode: raises)."""
    seen: dict[int, tuple] = {}
    done: dict[int, Any] = {}

    def rec(x: Any, path: tuple) -> Any:
        if isinstance(x, Node | Variable):
            if id(x) in seen:
                if strict:
                    raise shared_error(x, seen[id(x)], path)
                return done[id(x)]
            seen[id(x)] = path
            if isinstance(x, Variable):
                new = done[id(x)] = f(path, x)
                return new
            new = done[id(x)] = recursive_map(
                lambda p, y: f((*path, *p), y), x, graph=not strict
            )
            return new
        if isinstance(x, list | tuple):
            items = [rec(v, (*path, i)) for i, v in enumerate(x)]
            new = type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
            return f(path, new)
        if isinstance(x, dict):
            return f(path, type(x)((k, rec(v, (*path, k))) for k, v in x.items()))
        return x

    return rec(tree, ())
