"""Type aliases with Optax's names (``optax.Params``, ``optax.OptState``, ...).

They exist so that annotations written for Optax (``def fit(params: optax.Params)``) evaluate
after ``import cairn.optim as optax``; they describe, they do not check.

>>> from cairn import optim
>>> def step(params: optim.Params, state: optim.OptState) -> optim.Updates:
...     return params
>>> step({"w": 1.0}, ())
{'w': 1.0}
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, Union

import jax
import numpy as np

__all__ = [
    "ArrayTree", "Params", "Updates", "OptState", "Schedule", "ScalarOrSchedule",
    "TransformInitFn", "TransformUpdateFn", "TransformUpdateExtraArgsFn", "Numeric",
    "resolve_annotations",
]

Numeric = Union[jax.Array, np.ndarray, np.number, bool, int, float, complex]  # noqa: UP007
# Union (not |): the recursive string references cannot be joined with | at runtime
ArrayTree = Union[Numeric, Iterable["ArrayTree"], Mapping[Any, "ArrayTree"]]  # noqa: UP007
Params = ArrayTree  # a pytree of parameters
Updates = ArrayTree  # a pytree with the structure of Params
OptState = ArrayTree  # whatever ``init`` returns: NamedTuples, tuples, dicts of arrays
Schedule = Callable[[Numeric], Numeric]  # step count -> value
ScalarOrSchedule = Union[float, jax.Array, Schedule]  # noqa: UP007


class TransformInitFn(Protocol):
    """``init(params) -> state``."""

    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    """``update(updates, state, params=None) -> (updates, state)``."""

    def __call__(self, updates: Updates, state: OptState,
                 params: Params | None = None) -> tuple[Updates, OptState]: ...


class TransformUpdateExtraArgsFn(Protocol):
    """``update(updates, state, params=None, **extra_args) -> (updates, state)``."""

    def __call__(self, updates: Updates, state: OptState, params: Params | None = None,
                 **extra_args: Any) -> tuple[Updates, OptState]: ...


def resolve_annotations(namespace: dict[str, Any]) -> None:
    """Evaluate the string annotations of the functions a module defines, in place.

    Our modules use ``from __future__ import annotations``, so ``inspect.signature`` would
    show ``learning_rate: 'ScalarOrSchedule'`` (a string). Code written for Optax inspects
    signatures and compares with the objects (Optax's own tests run a schedule through every
    optimizer whose ``learning_rate`` is annotated ``ScalarOrSchedule`` or ``Schedule``), so
    each factory module calls this at its end with ``globals()``. An annotation that does
    not evaluate stays a string.

    Args:
      namespace: the module's ``globals()``.
    """
    module = namespace["__name__"]
    for obj in list(namespace.values()):
        if not (inspect.isfunction(obj) and obj.__module__ == module):
            continue
        annotations = obj.__annotations__
        for key, value in list(annotations.items()):
            if isinstance(value, str):
                try:
                    annotations[key] = eval(value, namespace)
                except Exception:  # a name only known to type checkers
                    pass
