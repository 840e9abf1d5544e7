"""Duck-typed protocols the sibling packages meet through (no imports between them)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Checkpointable", "GradientTransformationLike", "is_checkpointable"]


@runtime_checkable
class Checkpointable(Protocol):
    """An object whose state is a small JSON-able dict (a data iterator, a counter).

    ``set_state(get_state())`` on a fresh object makes it continue exactly where the
    original was.
    """

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state``.

        Args:
          state: what ``get_state()`` returned (on this object or an equal one).
        """


@runtime_checkable
class GradientTransformationLike(Protocol):
    """Optax-style ``init`` / ``update`` pair (cairn.optim, Optax itself, ...)."""

    def init(self, params: Any) -> Any:
        """The initial optimizer state.

        Args:
          params: the parameters (a pytree).
        """

    def update(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        """``(new_updates, new_state)``.

        Args:
          updates: the gradients (a pytree like ``params``).
          state: the state from ``init`` or the previous ``update``.
          params: the current parameters, for transformations that need them.
          **extra_args: extra arguments some transformations take (a loss value...).
        """


def is_checkpointable(x: Any) -> bool:
    """Whether ``x`` meets :class:`Checkpointable`: callable ``get_state`` and ``set_state``.

    Unlike ``isinstance(x, Checkpointable)``, a non-callable attribute of either name
    does not count. Every package decides "save its state, not its leaves" by this.

    Args:
      x: any object.

    >>> class Counter:
    ...     def get_state(self): return {"n": 0}
    ...     def set_state(self, state): pass
    >>> is_checkpointable(Counter()), is_checkpointable({"get_state": 1})
    (True, False)
    """
    return callable(getattr(x, "get_state", None)) and callable(getattr(x, "set_state", None))
