"""Plain data attributes of a module: arrays (and values marked ``nn.data``) that are
pytree leaves without being Variables.

A module attribute holding a JAX / NumPy array, a value of a type given to
:func:`register_data_type`, or a value assigned through ``nn.data(...)`` is *data*: a
leaf of the module's pytree and of its :class:`~cairn.nn.State`, kept as the plain
value (``m.a`` is the array, ``nn.state(m)["a"]`` is the array).

Inside the tree encoding (``cairn.nn._nodes``) such an attribute takes a slot of the
flat variable list like a Variable does, so the transforms, ``split`` / ``merge`` and
``update`` handle it with the same code. The slot is a :class:`DataSlot`: an internal
Variable subclass whose ``raw_value`` reads and writes the attribute of the module it
was found in (an unbound slot, made while rebuilding a tree from values, holds its
value itself). A DataSlot never reaches the user: States, attributes and filters see
the plain value.

Per-instance marks (``nn.data(x)`` on a value that is not data by type, ``nn.static(x)``
on one that is) are kept in the module's ``__dict__`` under :data:`MARKS`, a static
item of the encoding, so that they survive ``split`` / ``merge`` and the transforms.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from cairn.nn._variables import Variable, template_of

#: the instance attribute holding ``{name: is_data}`` marks set explicitly
MARKS = "_nn_marks"

#: types whose values are data when assigned to a module attribute
DATA_TYPES: set[type] = set()
_BASE_TYPES = (jax.Array, np.ndarray)


def register_data_type(type_: type, /) -> type:
    """Make values of ``type_`` data (pytree leaves, State entries) when they are
    assigned to a module attribute, as arrays are. Usable as a class decorator.

    Args:
      type_: the class whose instances are data.

    Returns:
      ``type_`` itself.

    Raises:
      TypeError: ``type_`` is not a class.
    """
    if not isinstance(type_, type):
        raise TypeError(f"nn.register_data_type: expected a class, got {type_!r}")
    DATA_TYPES.add(type_)
    DATA_BY_TYPE.clear()
    return type_


# data-ness by exact type, filled on first sight: the encoder asks once per static
# attribute, and isinstance against jax.Array (an ABC) costs far more than a dict hit
DATA_BY_TYPE: dict[type, bool] = {}


def is_data_value(v: Any) -> bool:
    """Whether ``v`` is data by its type alone (an array or a registered data type)."""
    t = type(v)
    r = DATA_BY_TYPE.get(t)
    if r is None:
        # isinstance, not issubclass: a tracer is a jax.Array only to isinstance
        r = DATA_BY_TYPE[t] = isinstance(v, _BASE_TYPES) or t in DATA_TYPES
    return r


def item_is_data(marks: Any, key: Any, v: Any) -> bool:
    """Whether the item ``key`` of a node holding ``v`` (not a Variable, a node or a tuple
    of them) is data: an explicit mark wins (``None`` is never data: it is an empty
    pytree), else the type decides."""
    if marks is not None:
        m = marks.get(key)
        if m is not None:
            return m and v is not None
    return is_data_value(v)


class _AllLeaves:
    """The marks of one level of a pytree root (``cairn.nn._tree_root``): every leaf
    is data, as Flax NNX takes every leaf of a pytree as state; the level's structure
    item stays static."""

    __slots__ = ()

    def get(self, key: Any, default: Any = None) -> Any:
        return default if key == "_treedef_" else True


ALL_LEAVES = _AllLeaves()


class Marked:
    """``nn.data(x)`` / ``nn.static(x)``: ``x`` with the status its attribute takes when
    it is assigned (unwrapped by the module's ``__setattr__``)."""

    __slots__ = ("value", "data")

    def __init__(self, value: Any, data: bool) -> None:
        self.value = value
        self.data = data

    def __repr__(self) -> str:
        return f"nn.{'data' if self.data else 'static'}({self.value!r})"


_RAW = Variable.__dict__["raw_value"]  # the slot descriptor of Variable.raw_value


class DataSlot(Variable):
    """Internal: a data attribute of one node as a slot of the flat variable list."""

    __slots__ = ("_store", "_key")

    # the slots are read through their descriptors: an unset slot raises AttributeError
    # here instead of reaching Variable.__getattr__ (which reads raw_value again)
    def _get(self) -> Any:
        try:
            store = _STORE.__get__(self, DataSlot)
        except AttributeError:  # unbound: the value is held here
            return _RAW.__get__(self, DataSlot)
        return store[_KEY.__get__(self, DataSlot)]

    def _set(self, value: Any) -> None:
        try:
            store = _STORE.__get__(self, DataSlot)
        except AttributeError:
            _RAW.__set__(self, value)
            return
        store[_KEY.__get__(self, DataSlot)] = value

    raw_value = property(_get, _set)


_STORE = DataSlot.__dict__["_store"]
_KEY = DataSlot.__dict__["_key"]


def bind_slot(store: Any, key: Any) -> DataSlot:
    """A :class:`DataSlot` reading and writing ``store[key]`` (a node's ``__dict__`` or
    its item list / dict)."""
    s = object.__new__(DataSlot)
    object.__setattr__(s, "_meta", {})
    object.__setattr__(s, "_store", store)
    object.__setattr__(s, "_key", key)
    return s


#: the VAR template (``(type, metadata)``) of every data attribute in an encoding
DATA_TEMPLATE = template_of(bind_slot({}, None))


def data_value(x: Any) -> Any:
    """The plain value of a data slot's entry in a variable list: a slot's or a
    Variable's value, or ``x`` itself."""
    return x.raw_value if isinstance(x, Variable) else x


def plain(v: Any) -> Any:
    """``v``, or its value when it is a :class:`DataSlot` (what users and filters see)."""
    return v.raw_value if type(v) is DataSlot else v
