"""Flax NNX's ``Pytree`` / ``data`` / ``static`` attribute markers, in cairn.nn terms.

In cairn.nn every :class:`Module` is the NNX ``Pytree``: Variables, child modules and
plain data attributes (arrays, values of a type given to :func:`register_data_type`,
values assigned as ``nn.data(x)``) are the pytree's children; everything else is static
configuration. ``nn.static(x)`` makes an attribute static (it must hold no data).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated, Any, TypeVar

import jax

from cairn.nn._data import Marked, is_data_value, register_data_type
from cairn.nn._module import FIELD_KIND, Module, check_static
from cairn.nn._nodes import is_node

__all__ = [
    "A", "Data", "Pytree", "Static", "data", "dataclass", "has_data", "is_data",
    "register_data_type", "static",
]

A = TypeVar("A")

#: NNX's base class of graph objects; a cairn.nn Module is one (``train``, ``eval``,
#: ``sow`` included).
Pytree = Module

#: annotation metadata of :data:`Data` / :data:`Static`
DATA_ANNOTATION = "__data__"
STATIC_ANNOTATION = "__static__"

#: ``x: nn.Data[int]`` in a class body: the attribute ``x`` is data (a pytree leaf)
Data = Annotated[A, DATA_ANNOTATION]
#: ``x: nn.Static[jax.Array]`` in a class body: the attribute ``x`` is static
Static = Annotated[A, STATIC_ANNOTATION]


def is_data(value: Any, /) -> bool:
    """Whether ``value`` is data by its type: an array, a Variable, a module, or a value
    of a type given to :func:`register_data_type` (a list, dict or tuple is not, even
    holding arrays: see :func:`has_data`).

    Args:
      value: any value.
    """
    return is_node(value) or is_data_value(value)


def has_data(value: Any, /) -> list[Any]:
    """The data values (see :func:`is_data`) found in the pytree ``value``, in order.

    Args:
      value: any value or pytree.
    """
    leaves = jax.tree_util.tree_leaves(value, is_leaf=is_data)
    return [x for x in leaves if is_data(x)]


_MISSING: Any = object()


def _marker(kind: str, field_kwargs: dict) -> Any:
    metadata = {**field_kwargs.pop("metadata", {}), FIELD_KIND: kind}
    return dataclasses.field(metadata=metadata, **field_kwargs)


def data(value: Any = _MISSING, /, **field_kwargs: Any) -> Any:
    """Mark ``value`` as data when assigned to a module attribute: the attribute is a
    pytree leaf and a State entry holding the plain value (``self.count = nn.data(0)``),
    and stays data when assigned again. In an ``nn.List`` / ``nn.Dict`` a value that
    is not data by type becomes a :class:`Variable` (containers keep no per-item marks).
    With no value it is a field marker (``x: int = nn.data()``, in a class body or an
    ``nn.dataclass``): what is assigned to that attribute is data.

    Args:
      value: an array, a number, a pytree of them, a module or a Variable; none: a marker.
      field_kwargs: ``dataclasses.field`` options of the marker (``default=``...).

    >>> import jax, jax.numpy as jnp
    >>> from cairn import nn
    >>> class Counter(nn.Pytree):
    ...     def __init__(self):
    ...         self.count = nn.data(jnp.array(0))
    >>> c = Counter(); type(c.count).__name__, jax.tree.leaves(c)
    ('ArrayImpl', [Array(0, dtype=int32, weak_type=True)])
    """
    if value is _MISSING:
        return _marker("data", field_kwargs)
    if field_kwargs:
        raise TypeError(f"nn.data: field options {sorted(field_kwargs)} are for the marker form nn.data()")
    return Marked(value, True)


def static(value: Any = _MISSING, /, **field_kwargs: Any) -> Any:
    """Mark ``value`` as static configuration when assigned to a module attribute (an
    attribute marked ``nn.data`` before becomes static; values that are not data are
    static already). With no value it is a field marker (``n: int = nn.static()``):
    assigning state to that attribute raises.

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
    return Marked(check_static(value), False)


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
