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

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, Union

import jax
import numpy as np

__all__ = [
    "ArrayTree", "Params", "Updates", "OptState", "Schedule", "ScalarOrSchedule",
    "TransformInitFn", "TransformUpdateFn", "TransformUpdateExtraArgsFn", "Numeric",
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
