"""Flax NNX's graph-mode switches: ``set_graph_mode``, ``set_graph_updates`` and the
``graph=`` / ``graph_updates=`` keywords of the transforms and graph functions.

In Flax NNX 0.12.8 ``graph=True`` walks modules as a graph (shared references allowed)
and ``graph=False`` treats them as pytrees (a shared reference is an error);
``graph_updates=True`` also propagates structural changes made inside a transform
(a new attribute, a swapped submodule) back to the caller's objects.

Cairn follows the graph mode's shared references (a module or Variable at two places
of one model is kept once) and refuses them in tree mode, as Flax does. Every transform
writes both value and structural changes back in both modes. The keywords are checked
and recorded (``current_value()`` reports them, as Flax's does), and ``nn.grad`` /
``nn.value_and_grad`` return a module argument's gradient as a State in full graph mode
(``graph and graph_updates``, the default) and as a module of the same structure
otherwise (Flax's tree mode).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_DEFAULTS = {"graph_mode": True, "graph_updates": True}


class _Stacks(threading.local):
    def __init__(self) -> None:
        self.graph_mode: list[bool] = []
        self.graph_updates: list[bool] = []


_STACKS = _Stacks()


def _check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"nn.{name} expects a bool, got {value!r} ({type(value).__name__})")
    return value


class _ModeSwitch:
    """Base of the two switches: set on call, restored by ``with`` or per call as a
    decorator (Flax's ``set_graph_mode`` protocol)."""

    _name = ""

    @classmethod
    def _stack(cls) -> list[bool]:
        return getattr(_STACKS, cls._name)

    def __init__(self, value: bool, /) -> None:
        self.new_value = _check_flag(value, f"set_{self._name}")
        stack = self._stack()
        self.prev_value: bool | None = stack[-1] if stack else None
        if stack:
            stack[-1] = self.new_value
        else:
            stack.append(self.new_value)

    @classmethod
    def current_value(cls) -> bool:
        """The value in force: the innermost switch, else the default (True)."""
        stack = cls._stack()
        return stack[-1] if stack else _DEFAULTS[cls._name]

    def __enter__(self) -> _ModeSwitch:
        if self.prev_value is not None:
            self._stack().insert(-1, self.prev_value)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack().pop()

    def __call__(self, f: F) -> F:
        stack = self._stack()
        stack.pop()
        if self.prev_value is not None:
            stack.append(self.prev_value)
        value = self.new_value

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._stack().append(value)
            try:
                return f(*args, **kwargs)
            finally:
                self._stack().pop()

        return wrapper  # type: ignore[return-value]


class set_graph_mode(_ModeSwitch):  # noqa: N801  (Flax's name)
    """Set the default of the ``graph=`` keyword (Flax NNX's graph / tree mode).

    Calling it sets the value; used as ``with nn.set_graph_mode(False):`` it is restored
    on exit, and as a decorator it applies only inside the decorated function. Cairn
    has one mode (modules are pytrees, state changes are written back), so the value is
    recorded and reported by ``nn.set_graph_mode.current_value()`` but changes nothing.

    Args:
      value: True for graph mode, False for tree mode.

    >>> from cairn import nn
    >>> with nn.set_graph_mode(False):
    ...     nn.set_graph_mode.current_value()
    False
    >>> nn.set_graph_mode.current_value()
    True
    """

    _name = "graph_mode"


class set_graph_updates(_ModeSwitch):  # noqa: N801  (Flax's name)
    """Set the default of the ``graph_updates=`` keyword; see :class:`set_graph_mode`.

    Args:
      value: whether transforms propagate structural changes (Cairn always does).
    """

    _name = "graph_updates"


def resolve_modes(graph: bool | None, graph_updates: bool | None) -> tuple[bool, bool, bool]:
    """``(graph, graph_updates, both)`` with None replaced by the switches' values;
    ``both`` is Flax's full graph mode (``graph and graph_updates``)."""
    g = set_graph_mode.current_value() if graph is None else graph
    u = set_graph_updates.current_value() if graph_updates is None else graph_updates
    return g, u, g and u


def check_mode(fn: str, graph: Any = None, graph_updates: Any = None) -> None:
    """Validate the ``graph`` / ``graph_updates`` keywords of ``nn.<fn>``: each is
    None or a bool. Both modes behave the same in Cairn (see the module docstring)."""
    for name, value in (("graph", graph), ("graph_updates", graph_updates)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(
                f"nn.{fn}: {name}= expects True, False or None, got {value!r}"
            )


class var_defaults:  # noqa: N801  (Flax's name)
    """Flax NNX's switch of the Variable representation (``hijax`` Variables that are
    JAX values themselves, ``ref`` Variables backed by ``jax.Ref``).

    A Cairn Variable is always a plain Python box around an array (the module is the
    pytree), so only ``False`` / ``None`` can be honoured; ``True`` raises
    ``NotImplementedError`` when the context is entered or the decorated function is
    called. ``nn.var_defaults()`` reports the defaults (``hijax=False, ref=False``).

    Args:
      hijax: must be False or None.
      ref: must be False or None.
    """

    def __init__(self, *, hijax: bool | None = None, ref: bool | None = None) -> None:
        self.hijax = bool(hijax)
        self.ref = bool(ref)

    def _check(self) -> None:
        wanted = [n for n in ("hijax", "ref") if getattr(self, n)]
        if wanted:
            raise NotImplementedError(
                f"nn.var_defaults({', '.join(f'{n}=True' for n in wanted)}): Cairn Variables "
                f"are plain boxes around arrays (the module is the pytree); hijax / ref "
                f"Variables are not supported"
            )

    def __enter__(self) -> var_defaults:
        self._check()
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __call__(self, f: F) -> F:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._check()
            return f(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"var_defaults(hijax={self.hijax}, ref={self.ref})"

    # a read-only mapping of the defaults, as Flax NNX's: dict(nn.var_defaults())
    def __getitem__(self, key: str) -> bool:
        if key not in ("hijax", "ref"):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Any:
        return iter(("hijax", "ref"))

    def __len__(self) -> int:
        return 2

    def __contains__(self, key: object) -> bool:
        return key in ("hijax", "ref")

    def keys(self) -> tuple[str, str]:
        """The names of the defaults: ``("hijax", "ref")``."""
        return ("hijax", "ref")
