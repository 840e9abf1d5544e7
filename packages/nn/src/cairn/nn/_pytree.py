"""Flax NNX's ``Pytree`` / ``data`` / ``static`` attribute markers, in cairn.nn terms.

In cairn.nn every :class:`Module` is the NNX ``Pytree``: Variables and child modules
are the pytree's children, everything else is static configuration. ``nn.data(x)``
makes ``x`` state: arrays in it become :class:`Variable` s (cairn.nn keeps no plain
arrays as attributes, so that all state is a Variable); modules and Variables are
already data. ``nn.static(x)`` is ``x``: non-array values are static already.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar

import jax
import numpy as np

from cairn.nn._module import Module
from cairn.nn._nodes import is_node
from cairn.nn._variables import Variable

A = TypeVar("A")
_ARRAYS = (jax.Array, np.ndarray, np.generic)

#: NNX's base class of graph objects; a cairn.nn Module is one (``train``, ``eval``,
#: ``sow`` included).
Pytree = Module


def data(value: A, /) -> A:
    """Mark ``value`` as state (a pytree child) when assigned to a module attribute:
    each array in it becomes a :class:`Variable`; modules, Variables and containers of
    them are returned as they are.

    Args:
      value: an array, a pytree of arrays, a module or a Variable.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> class Counter(nn.Pytree):
    ...     def __init__(self):
    ...         self.count = nn.data(jnp.array(0))
    >>> c = Counter(); type(c.count).__name__, int(c.count + 1)
    ('Variable', 1)
    """
    return jax.tree_util.tree_map(
        lambda x: Variable(x) if isinstance(x, _ARRAYS) else x, value, is_leaf=is_node
    )


def static(value: A, /) -> A:
    """Mark ``value`` as static configuration: returns it (values that are not arrays,
    Variables or modules are static in cairn.nn already).

    Args:
      value: a static value (not an array, Variable or module).

    Raises:
      TypeError: ``value`` is an array, a Variable or a module (state cannot be static).
    """
    if isinstance(value, _ARRAYS) or is_node(value):
        raise TypeError(
            f"nn.static: a {type(value).__name__} is state, not static configuration; "
            f"keep arrays in Variables, or make the value a Python scalar or tuple"
        )
    return value


def dataclass(cls: type | None = None, /, **kwargs: Any) -> Any:
    """``dataclasses.dataclass`` for a Module class (Flax NNX's ``nnx.dataclass``): the
    fields become constructor arguments and are assigned as attributes (Variables and
    modules are state, other values static). Equality and hashing stay by identity and
    the module's own ``repr`` is kept unless asked for.

    Args:
      cls: the class (or none: returns a decorator taking it).
      **kwargs: ``dataclasses.dataclass`` options.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> @nn.dataclass
    ... class Affine(nn.Module):
    ...     w: nn.Param
    ...     scale: float = 1.0
    >>> Affine(nn.Param(jnp.ones(2))).scale
    1.0
    """
    kwargs = {"eq": False, "repr": False, **kwargs}
    if cls is None:
        return functools.partial(dataclass, **kwargs)
    return dataclasses.dataclass(cls, **kwargs)
