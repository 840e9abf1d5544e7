"""Flax NNX's ``Pytree`` / ``data`` / ``static`` attribute markers, in cairn.nn terms.

In cairn.nn every :class:`Module` is the NNX ``Pytree``: Variables and child modules
are the pytree's children, everything else is static configuration. ``nn.data(x)``
makes ``x`` state: arrays and numbers in it become :class:`Variable` s (cairn.nn keeps no plain
arrays as attributes, so that all state is a Variable); modules and Variables are
already data. ``nn.static(x)`` is ``x``: non-array values are static already.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar

from cairn.nn._module import FIELD_KIND, Module, as_data, check_static

A = TypeVar("A")

#: NNX's base class of graph objects; a cairn.nn Module is one (``train``, ``eval``,
#: ``sow`` included).
Pytree = Module


_MISSING: Any = object()


def _marker(kind: str, field_kwargs: dict) -> Any:
    metadata = {**field_kwargs.pop("metadata", {}), FIELD_KIND: kind}
    return dataclasses.field(metadata=metadata, **field_kwargs)


def data(value: Any = _MISSING, /, **field_kwargs: Any) -> Any:
    """Mark ``value`` as state (a pytree child) when assigned to a module attribute:
    each array or Python number in it becomes a :class:`Variable`; modules, Variables
    and containers of them are returned as they are. With no value it is a field
    marker (``x: jax.Array = nn.data()``, in a class body or an ``nn.dataclass``):
    what is assigned to that attribute is made state the same way.

    Args:
      value: an array, a number, a pytree of them, a module or a Variable; none: a marker.
      field_kwargs: ``dataclasses.field`` options of the marker (``default=``...).

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> class Counter(nn.Pytree):
    ...     def __init__(self):
    ...         self.count = nn.data(jnp.array(0))
    >>> c = Counter(); type(c.count).__name__, int(c.count + 1)
    ('Variable', 1)
    """
    if value is _MISSING:
        return _marker("data", field_kwargs)
    if field_kwargs:
        raise TypeError(f"nn.data: field options {sorted(field_kwargs)} are for the marker form nn.data()")
    return as_data(value)


def static(value: Any = _MISSING, /, **field_kwargs: Any) -> Any:
    """Mark ``value`` as static configuration: returns it (values that are not arrays,
    Variables or modules are static in cairn.nn already). With no value it is a field
    marker (``n: int = nn.static()``): assigning state to that attribute raises.

    Args:
      value: a static value (not an array, Variable or module); none: a marker.
      field_kwargs: ``dataclasses.field`` options of the marker (``default=``...).

    Raises:
      TypeError: ``value`` is an array, a Variable or a module (state cannot be static);
        the error is also a ``ValueError``, Flax NNX's type.
    """
    if value is _MISSING:
        return _marker("static", field_kwargs)
    if field_kwargs:
        raise TypeError(f"nn.static: field options {sorted(field_kwargs)} are for the marker form nn.static()")
    return check_static(value)


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
