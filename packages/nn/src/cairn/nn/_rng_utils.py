"""Reshaping and reseeding the RNG streams inside a module tree (Flax NNX's
``split_rngs`` / ``fork_rngs`` / ``reseed`` / ``restore_rngs``).

``split_rngs(node, splits=n)`` replaces the key of every selected :class:`RngStream`
under ``node`` by ``n`` keys (and its counter by ``n`` counters), in place, so that the
streams can be passed as a batched (axis 0) argument of ``nn.vmap`` / ``nn.scan``; the
returned :class:`SplitBackups` puts the old keys back (``restore_rngs`` or ``with``).
Used as a decorator (no ``node``), it splits the streams in the decorated function's
arguments for the duration of the call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from cairn.nn._filters import Any as AnyOf
from cairn.nn._filters import WithTag, to_predicate
from cairn.nn._graph import clone
from cairn.nn._graph_mode import check_mode, resolve_modes
from cairn.nn._nodes import Node, is_node, key_of
from cairn.nn._rngs import Rngs, RngStream

_MISSING: Any = object()


def _only_predicate(only: Any) -> Callable:
    """A stream filter: a string names a stream (its tag) or is a path regex."""
    if isinstance(only, str):
        return AnyOf(WithTag(only), to_predicate(only))
    return to_predicate(only)


def iter_streams(node: Any) -> Iterator[tuple[tuple, RngStream]]:
    """``(path, stream)`` for every :class:`RngStream` reachable from ``node`` (a module,
    or any pytree of modules such as ``(args, kwargs)``)."""
    seen: set[int] = set()

    def rec(x, path):
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, RngStream):
            yield path, x
            return
        for k, v in x._graph_items():
            if isinstance(v, Node):
                yield from rec(v, (*path, k))
            elif isinstance(v, tuple | list | dict):
                yield from walk(v, (*path, k))

    def walk(tree, path):
        for kp, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)[0]:
            if isinstance(x, Node):
                yield from rec(x, (*path, *(key_of(e) for e in kp)))

    yield from walk(node, ())


def _selected(only: Any, node: Any) -> list[RngStream]:
    pred = _only_predicate(only)
    return [
        s
        for path, s in iter_streams(node)
        if pred((*path, "key"), s.key) and pred((*path, "count"), s.count)
    ]


class SplitBackups(list):
    """The keys and counters :func:`split_rngs` / :func:`fork_rngs` replaced; give it to
    :func:`restore_rngs`, or use it as a context manager to restore them on exit."""

    def __enter__(self) -> SplitBackups:
        return self

    def __exit__(self, *exc: object) -> None:
        restore_rngs(self)


def restore_rngs(backups: Any, /) -> None:
    """Put back the keys (and counters) saved in ``backups``.

    Args:
      backups: what :func:`fork_rngs` or :func:`split_rngs` returned.
    """
    for stream, key, *count in backups:
        stream.key.value = key
        if count:
            stream.count.value = count[0]


def _counts_shape(splits: int | tuple[int, ...], shape: tuple, squeeze: bool) -> tuple:
    if squeeze:
        return shape
    return ((splits,) if isinstance(splits, int) else tuple(splits)) + tuple(shape)


def _decorator(transform: Callable, in_place: bool, **options: Any) -> Callable:
    """The decorator form: in full graph mode the arguments' streams are changed for
    the call and restored after it; otherwise the function gets changed copies."""

    def deco(f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            if not in_place:
                args, kwargs = transform((args, kwargs), graph_updates=False, **options)
                return f(*args, **kwargs)
            with transform((args, kwargs), **options):
                return f(*args, **kwargs)

        return wrapper

    return deco


def _tree_copy(node: Any) -> Any:
    """Flax's tree mode: a copy of ``node`` whose modules and Variables are new objects
    (the caller's are left untouched); a tree without any is returned as it is."""
    if not any(is_node(x) for x in jax.tree_util.tree_leaves(node, is_leaf=is_node)):
        return node
    return clone(node)


def split_rngs(
    node: Any = _MISSING,
    /,
    *,
    splits: int | tuple[int, ...],
    only: Any = ...,
    squeeze: bool = False,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Any:
    """Split, in place, the streams under ``node`` selected by ``only`` (a filter, or
    a stream name) into ``splits`` keys each: the new key is
    ``jax.random.split(stream(), splits)`` and the counter restarts at zero (shape
    ``splits``). Returns the :class:`SplitBackups` that restores them; without ``node``,
    a decorator that splits the decorated function's arguments during each call.

    Args:
      node: the module or Rngs whose streams are split; left out, a decorator is returned.
      splits: the number (or shape) of keys per stream.
      only: the streams to split (a filter or a stream name; ``...``: all).
      squeeze: with ``splits=1``, keep the key's shape (no new axis).
      graph: Flax NNX's graph-mode keyword (None: the :class:`set_graph_mode` switch).
      graph_updates: Flax NNX's keyword (None: the switch). Unless both are True (full
        graph mode, the default), ``node`` is left untouched and a copy with split
        streams is returned (the decorator passes such copies to the function).

    >>> from cairn import nn
    >>> rngs = nn.Rngs(params=0, dropout=1)
    >>> with nn.split_rngs(rngs, splits=5, only="params"):
    ...     rngs.params.key.shape, rngs.dropout.key.shape
    ((5,), ())
    >>> rngs.params.key.shape
    ()

    Raises:
      ValueError: ``squeeze=True`` with ``splits`` other than 1.
    """
    check_mode("split_rngs", graph, graph_updates)
    in_place = resolve_modes(graph, graph_updates)[2]
    if node is _MISSING:
        return _decorator(split_rngs, in_place, splits=splits, only=only, squeeze=squeeze)
    if squeeze and splits != 1:
        raise ValueError(f"split_rngs: squeeze=True needs splits=1, got splits={splits!r}")
    if not in_place:
        copy = _tree_copy(node)
        split_rngs(copy, splits=splits, only=only, squeeze=squeeze, graph=True, graph_updates=True)
        return copy
    backups = SplitBackups()
    for stream in _selected(only, node):
        key = stream()
        backups.append((stream, stream.key.value, stream.count.value))
        key = jax.random.split(key, splits)
        if squeeze:
            key = key[0]
        stream.key.value = key
        shape = _counts_shape(splits, jnp.shape(stream.count.value), squeeze)
        stream.count.value = jnp.zeros(shape, jnp.uint32)
    return backups


def fork_rngs(
    node: Any = _MISSING,
    /,
    *,
    split: Any = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Any:
    """Fork, in place, every stream under ``node``: each gets a fresh key
    ``stream()`` (or ``split`` of them) and a zero counter, so that the callee draws
    numbers independent of the caller's. ``split`` is ``None``, a number / shape for every
    stream, or a mapping ``{filter: splits}``. Returns the :class:`SplitBackups`;
    without ``node``, a decorator.

    Args:
      node: the module or Rngs whose streams are forked; left out, a decorator is returned.
      split: None, a number / shape of keys for every stream, or ``{filter: splits}``.
      graph: Flax NNX's graph-mode keyword (None: the :class:`set_graph_mode` switch).
      graph_updates: Flax NNX's keyword (None: the switch). Unless both are True (full
        graph mode, the default), ``node`` is left untouched and a forked copy is
        returned (the decorator passes such copies to the function).

    >>> from cairn import nn
    >>> rngs = nn.Rngs(params=0, dropout=1)
    >>> with nn.fork_rngs(rngs, split={"params": 3, ...: None}):
    ...     rngs.params.key.shape, rngs.dropout.key.shape
    ((3,), ())
    """
    check_mode("fork_rngs", graph, graph_updates)
    in_place = resolve_modes(graph, graph_updates)[2]
    if node is _MISSING:
        return _decorator(fork_rngs, in_place, split=split)
    if not in_place:
        copy = _tree_copy(node)
        fork_rngs(copy, split=split, graph=True, graph_updates=True)
        return copy
    if split is None:
        split = {...: None}
    elif isinstance(split, int | tuple):
        split = {...: split}
    backups = SplitBackups()
    done: set[int] = set()
    for only, splits in split.items():
        for stream in _selected(only, node):
            if id(stream) in done:
                continue
            done.add(id(stream))
            forked = stream.fork(split=splits)
            backups.append((stream, stream.key.value, stream.count.value))
            stream.key.value = forked.key.value
            stream.count.value = forked.count.value
    return backups


def _scalars_only(path: tuple, key: jax.Array, shape: tuple) -> jax.Array:
    if shape != ():
        raise ValueError(
            f"reseed: the stream at {'/'.join(map(str, path)) or '<root>'} holds keys of "
            f"shape {shape}; pass policy='match_shape' to split the new key to that shape"
        )
    return key


def _match_shape(path: tuple, key: jax.Array, shape: tuple) -> jax.Array:
    return key if shape == () else jax.random.split(key, shape)


def reseed(
    node: Any,
    /,
    *,
    policy: str | Callable = "scalars_only",
    graph: bool | None = None,
    **stream_keys: Any,
) -> None:
    """Give the named streams under ``node`` new seeds, in place (``reseed(model,
    dropout=42)``). The new key of a stream named ``s`` is the first key a fresh
    ``Rngs(s=seed)`` would give; ``policy`` says what to do for a stream holding
    several keys: ``"scalars_only"`` (raise), ``"match_shape"`` (split the new key to
    that shape) or a callable ``(path, key, shape) -> key``.

    Args:
      node: the module or Rngs holding the streams.
      policy: ``"scalars_only"``, ``"match_shape"`` or a callable ``(path, key, shape) -> key``.
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
      stream_keys: ``stream_name=seed`` for each stream to reseed.

    >>> from cairn import nn
    >>> rngs = nn.Rngs(dropout=1)
    >>> a = rngs.dropout.normal((2,)); nn.reseed(rngs, dropout=1)
    >>> bool((a == rngs.dropout.normal((2,))).all())
    False

    Raises:
      ValueError: an unknown ``policy``; a split stream under ``"scalars_only"``.
    """
    check_mode("reseed", graph)
    if policy == "scalars_only":
        policy = _scalars_only
    elif policy == "match_shape":
        policy = _match_shape
    elif not callable(policy):
        raise ValueError(
            f"reseed: policy must be 'scalars_only', 'match_shape' or a callable "
            f"(path, key, shape) -> key, got {policy!r}"
        )
    fresh = Rngs(**stream_keys)
    for path, stream in iter_streams(node):
        if stream.tag in stream_keys:
            key = policy(path, fresh[stream.tag](), tuple(stream.key.value.shape))
            stream.key.value = key
            stream.count.value = jnp.zeros(key.shape, jnp.uint32)
