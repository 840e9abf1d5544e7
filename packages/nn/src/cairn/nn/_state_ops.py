"""Function forms of the :class:`State` operations (Flax NNX's ``map_state``,
``filter_state``, ``split_state``, ``merge_state``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cairn.nn._state import State
from cairn.nn._variables import Variable


def map_state(f: Callable[[tuple, Any], Any], state: State) -> State:
    """A new :class:`State` whose entry at each path is ``f(path, variable)``; a
    non-Variable result is put in a Variable of the same type and metadata.

    Args:
      f: ``f(path, variable) -> variable or value``.
      state: the State (or a nested mapping of variables).

    >>> from cairn import nn
    >>> s = nn.state(nn.Linear(2, 3, rngs=nn.Rngs(0)))
    >>> doubled = nn.map_state(lambda path, v: v.value * 2, s)
    >>> bool((doubled["kernel"].value == 2 * s["kernel"].value).all())
    True

    Raises:
      TypeError: ``state`` is not a State or a mapping.
    """
    if not isinstance(state, State):
        state = State(state)
    out = {}
    for path, var in state._flat.items():
        new = f(path, var)
        out[path] = new if isinstance(new, Variable) else var.replace(new)
    return State.from_flat(out)


def filter_state(state: State, *filters: Any) -> State | tuple[State, ...]:
    """``state.filter(*filters)``.

    Args:
      state: the State.
      filters: one or more filters.
    """
    return state.filter(*filters)


def split_state(state: State, *filters: Any) -> State | tuple[State, ...]:
    """``state.split(*filters)``.

    Args:
      state: the State.
      filters: the filters, in order.
    """
    return state.split(*filters)


def merge_state(state: State, /, *states: State) -> State:
    """``State.merge(state, *states)``: later states win on shared paths.

    Args:
      state: the first State.
      states: more States; later ones win on shared paths.
    """
    return State.merge(state, *states)
