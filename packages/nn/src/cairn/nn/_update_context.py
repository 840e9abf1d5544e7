"""Flax NNX's ``update_context`` / ``split_context`` / ``merge_context``: the four-step
protocol a hand-written transform uses to carry structural changes made inside it back
to the caller's objects.

Inside ``update_context(tag)``: (1) an outer ``split_context(tag)`` splits the caller's
nodes (they are remembered in order); (2) inside the transform ``merge_context(tag,
inner=True)`` merges new objects; (3) an inner ``split_context(tag)`` splits them again
after the changes; (4) the outer ``merge_context(tag, inner=False)`` merges the result
into the nodes remembered in (1), in place (new attributes and submodules included), and
returns them, so ``m3 is m1``. Without a tag the contexts split and merge plainly.

Also here: ``nn.call``, a method call on a ``(graphdef, state)`` pair that returns the
output and the pair after the call (``PureState`` is that pair's type).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator
from typing import Any, TypeVar

from cairn.nn._graph import GraphDef, merge, split, sync
from cairn.nn._nodes import Node
from cairn.nn._state import State

_STACKS: dict[Hashable, list[UpdateContext]] = {}


class UpdateContext:
    """The state of one ``update_context``: the nodes the outer split saw."""

    def __init__(self, tag: Hashable) -> None:
        self.tag = tag
        self.outer: list[Any] | None = None  # nodes of the outer split, in order

    def __repr__(self) -> str:
        return f"UpdateContext(tag={self.tag!r})"


class update_context:  # noqa: N801  (Flax's name; a context manager and a decorator)
    """Open an :class:`UpdateContext` named ``tag`` (see the module docstring).

    >>> from cairn import nn
    >>> class Foo(nn.Module):
    ...     pass
    >>> m1 = Foo()
    >>> with nn.update_context("t"):
    ...     with nn.split_context("t") as ctx:
    ...         gd, st = ctx.split(m1)
    ...     with nn.merge_context("t", inner=True) as ctx:
    ...         m2 = ctx.merge(gd, st)
    ...     m2.a = 1
    ...     with nn.split_context("t") as ctx:
    ...         gd, st = ctx.split(m2)
    ...     with nn.merge_context("t", inner=False) as ctx:
    ...         m3 = ctx.merge(gd, st)
    >>> m3 is m1, m1.a
    (True, 1)

    Args:
      tag: the context's name (the split and merge contexts name it too).
    """

    def __init__(self, tag: Hashable) -> None:
        self.tag = tag

    def __enter__(self) -> UpdateContext:
        ctx = UpdateContext(self.tag)
        _STACKS.setdefault(self.tag, []).append(ctx)
        return ctx

    def __exit__(self, *exc: Any) -> None:
        stack = _STACKS[self.tag]
        stack.pop()
        if not stack:
            del _STACKS[self.tag]

    def __call__(self, f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return f(*args, **kwargs)

        return wrapper


def current_update_context(tag: Hashable) -> UpdateContext:
    """The innermost open :class:`UpdateContext` named ``tag``.

    Args:
      tag: the context's name.

    Raises:
      ValueError: none is open.
    """
    stack = _STACKS.get(tag)
    if not stack:
        raise ValueError(f"no update_context({tag!r}) is open")
    return stack[-1]


class SplitContext:
    """What ``split_context`` yields: ``split`` as :func:`~cairn.nn.split`."""

    def __init__(self, tag: Hashable | None) -> None:
        self.tag = tag
        self.nodes: list[Any] = []

    def split(self, node: Any, *filters: Any) -> tuple:
        """``nn.split(node, *filters)``, remembering ``node`` for the outer merge.

        Args:
          node: the module (or pytree of modules) to split.
          filters: the states' filters.
        """
        self.nodes.append(node)
        return split(node, *filters)


class MergeContext:
    """What ``merge_context`` yields: ``merge`` as :func:`~cairn.nn.merge`; the outer
    merge of an update context updates the remembered nodes in place."""

    def __init__(self, tag: Hashable | None, inner: bool | None) -> None:
        self.tag = tag
        self.inner = inner
        self.count = 0

    def merge(self, graphdef: Any, state: Any, *states: Any) -> Any:
        """``nn.merge(graphdef, state, *states)``; in the outer merge of an update
        context, the result is written into the node the outer split saw at the same
        position, which is returned.

        Args:
          graphdef: the structure.
          state: a State.
          states: more States.
        """
        new = merge(graphdef, state, *states)
        if self.tag is None or self.inner is not False:
            return new
        outer = current_update_context(self.tag).outer or []
        i, self.count = self.count, self.count + 1
        if i >= len(outer):
            return new
        target = outer[i]
        if isinstance(target, Node) and type(target) is type(new):
            sync(target, new)
            return target
        return new


@contextlib.contextmanager
def split_context(tag: Hashable | None = None) -> Iterator[SplitContext]:
    """A context whose ``split`` is :func:`~cairn.nn.split`; under
    ``update_context(tag)`` the first one (outside the transform) remembers the nodes
    it splits.

    Args:
      tag: the update context's name, or None for a plain split.
    """
    ctx = SplitContext(tag)
    yield ctx
    if tag is not None:
        update = current_update_context(tag)
        if update.outer is None:
            update.outer = ctx.nodes


@contextlib.contextmanager
def merge_context(tag: Hashable | None = None, inner: bool | None = None) -> Iterator[MergeContext]:
    """A context whose ``merge`` is :func:`~cairn.nn.merge`; under
    ``update_context(tag)``, ``inner=False`` (outside the transform) merges into the
    nodes the outer split remembered.

    Args:
      tag: the update context's name, or None for a plain merge.
      inner: True inside the transform, False for the last merge outside it; required
        with a tag.

    Raises:
      ValueError: a tag without ``inner``.
    """
    if tag is not None and inner is None:
        raise ValueError("merge_context: inner= must be given (True or False) with a tag")
    if tag is not None:
        current_update_context(tag)
    yield MergeContext(tag, inner)


# --- nn.call: a method call on a (graphdef, state) pair, the pure way ---

A = TypeVar("A")
# what ``nn.split(node)`` returns, as a type; ``nn.PureState[Model]`` as Flax NNX's
PureState = tuple[GraphDef[A], State]


class CallableProxy:
    """What :func:`call` returns: attribute and item access select a method (or a
    submodule's), calling it runs it on a merged copy and returns ``(output, (graphdef,
    state))`` of the copy after the call.

    Args:
      pure: the ``(graphdef, state, ...)`` tuple.
      path: the attribute / item steps chosen so far (``("attr", name)`` or
        ``("item", key)``).
    """

    def __init__(self, pure: tuple, path: tuple = ()) -> None:
        self._pure = pure
        self._path = path

    def __getattr__(self, name: str) -> CallableProxy:
        if name.startswith("__"):
            raise AttributeError(name)
        return CallableProxy(self._pure, (*self._path, ("attr", name)))

    def __getitem__(self, key: Any) -> CallableProxy:
        return CallableProxy(self._pure, (*self._path, ("item", key)))

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, tuple]:
        node = merge(*self._pure, copy=True)
        target = node
        for kind, key in self._path:
            target = getattr(target, key) if kind == "attr" else target[key]
        out = target(*args, **kwargs)
        return out, split(node)


def call(pure: tuple, /) -> CallableProxy:
    """Call a method of the node a ``(graphdef, state)`` pair describes, without an
    object: ``out, pure = nn.call(pure).method(x)`` (``nn.call(pure)(x)`` calls the node
    itself, ``nn.call(pure)["key"].method()`` a part of it). The call runs on a copy;
    the new pair holds its state after the call (a counter it increments, a new
    attribute), so this works inside ``jax.jit`` on plain pytrees.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> pure = nn.split(nn.Linear(2, 3, rngs=nn.Rngs(0)))
    >>> y, pure = nn.call(pure)(jnp.ones((1, 2)))
    >>> y.shape
    (1, 3)

    Args:
      pure: a ``(graphdef, state, ...)`` tuple as :func:`~cairn.nn.split` returns.
    """
    if not isinstance(pure, tuple) or not pure or not isinstance(pure[0], GraphDef):
        raise TypeError(
            f"nn.call: expected the (graphdef, state) tuple nn.split returns, got "
            f"{type(pure).__name__}"
        )
    return CallableProxy(pure)
