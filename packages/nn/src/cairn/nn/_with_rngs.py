"""``nn.with_rngs``: a copy of a tree whose RNG streams are split, forked or broadcast
(Flax NNX's functional counterpart of ``split_rngs`` / ``fork_rngs``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax

from cairn.nn._graph_mode import check_mode
from cairn.nn._module import Module
from cairn.nn._nodes import is_node
from cairn.nn._rng_utils import _only_predicate
from cairn.nn._rngs import RngStream
from cairn.nn._traversal import recursive_map

_MISSING: Any = object()


def _rules(spec: Any) -> list[tuple[Callable, Any]]:
    """``[(stream predicate, shape)]`` from an int / tuple (every stream) or a
    ``{filter: shape}`` mapping (first match wins)."""
    if spec is None:
        return []
    if isinstance(spec, Mapping):
        return [(_only_predicate(f), s) for f, s in spec.items()]
    return [(_only_predicate(...), spec)]


def _fork_rules(fork: Any) -> list[tuple[Callable, bool]]:
    """``[(predicate, catch_all)]``: ``...`` / True fork only the streams no other rule
    took; a named filter that also matches a split stream is an error."""
    if fork is None:
        return []
    items = list(fork) if isinstance(fork, list | tuple) else [fork]
    return [(_only_predicate(f), f is Ellipsis or f is True) for f in items]


def _match(rules: list, path: tuple, s: RngStream) -> tuple[bool, Any]:
    for pred, shape in rules:
        if pred((*path, "key"), s.key):
            return True, shape
    return False, None


def _new_stream(path: tuple, s: RngStream, split, fork, broadcast, only) -> RngStream:
    """The replacement of one stream (``s`` itself advances when a rule applies)."""
    if not only((*path, "key"), s.key):
        return _copy(s)
    hits = []
    for kind, rules in (("split", split), ("broadcast", broadcast)):
        hit, shape = _match(rules, path, s)
        if hit:
            hits.append((kind, shape))
    forks = [catch_all for p, catch_all in fork if p((*path, "key"), s.key)]
    if forks and not (hits and all(forks)):
        hits.append(("fork", None))
    if len(hits) > 1:
        raise ValueError(
            f"nn.with_rngs: the stream {s.tag!r} at {'/'.join(map(str, path)) or '.'} "
            f"matches multiple rules ({', '.join(k for k, _ in hits)}); give it one"
        )
    if not hits:
        return _copy(s)
    kind, shape = hits[0]
    if kind == "split":
        return s.split(shape)
    if kind == "broadcast":
        return s.broadcast(shape)
    return s.fork()


def _copy(s: RngStream) -> RngStream:
    new = RngStream(s.key.raw_value, tag=s.tag)
    new.count.raw_value = s.count.raw_value
    return new


def with_rngs(
    node: Any = _MISSING,
    /,
    *,
    split: Any = None,
    fork: Any = None,
    broadcast: Any = None,
    only: Any = True,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Any:
    """A copy of ``node`` (a module, ``Rngs`` or pytree of them) in which every
    :class:`RngStream` is replaced: streams matching ``split`` hold keys split to that
    shape, those matching ``broadcast`` hold the next key repeated to that shape, those
    matching ``fork`` get an independent key; the others are copied unchanged. The
    original streams keep their keys (a replaced one advances its counter). Without
    ``node``, a decorator applying the rules to the decorated function's arguments.

    Args:
      node: the tree.
      split: an int / shape for every stream, or ``{filter: shape}`` (first match wins;
        a string names a stream).
      fork: a filter, or a sequence of filters, of the streams to fork (``...``: all).
      broadcast: like ``split``, repeating the stream's next key.
      only: restrict every rule to the streams matching this filter.
      graph: Flax NNX's mode keyword (one behaviour here).
      graph_updates: Flax NNX's mode keyword (one behaviour here).

    Raises:
      ValueError: a stream matching more than one rule.

    >>> from cairn import nn
    >>> rngs = nn.Rngs(params=0, dropout=1)
    >>> new = nn.with_rngs(rngs, split={"params": 4}, fork=...)
    >>> new.params.key.shape, new.dropout.key.shape, rngs.params.key.shape
    ((4,), (), ())
    """
    check_mode("with_rngs", graph, graph_updates)
    rules = (_rules(split), _fork_rules(fork), _rules(broadcast), _only_predicate(only))
    if node is _MISSING:
        return functools.partial(_decorate, rules=rules)
    return _apply(node, rules)


def _apply(node: Any, rules: tuple) -> Any:
    def one(path: tuple, x: Any) -> Any:
        return _new_stream(path, x, *rules) if isinstance(x, RngStream) else x

    def leaf(x: Any) -> Any:
        if isinstance(x, RngStream):
            return one((), x)
        if isinstance(x, Module):
            return recursive_map(one, x)
        return x

    return jax.tree_util.tree_map(leaf, node, is_leaf=is_node)


def _decorate(f: Callable, *, rules: tuple) -> Callable:
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _apply((args, kwargs), rules)
        return f(*args, **kwargs)

    return wrapper
