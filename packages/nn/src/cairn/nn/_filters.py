"""Filters select variables by type and path.

A filter is anything :func:`to_predicate` accepts:

* a :class:`~cairn.nn.Variable` subclass (``nn.Param``): variables of that type;
* a string: a regular expression that must match the whole path (``"layers/\\d+/kernel"``);
* ``...`` or ``True``: everything; ``False`` or ``None``: nothing;
* a filter object (:class:`OfType`, :class:`PathContains`, :class:`PathRegex`,
  :class:`Any`, :class:`All`, :class:`Not`, :class:`Everything`, :class:`Nothing`);
* a list or tuple of filters: any of them;
* a callable ``(path: tuple, variable) -> bool``.

Paths given to predicates are tuples of keys (strings for attributes and dict keys,
ints for list indices); string forms follow ``cairn.core_array``'s convention
(:func:`path_str`: the keys named by ``key_name`` and joined with ``/``).
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Callable
from typing import Any as _AnyT

from cairn.core_array import PathError, compile_pattern, path_of
from cairn.nn._data import DataSlot
from cairn.nn._variables import Variable

Predicate = Callable[[tuple, Variable], bool]


# --- path strings ---


def path_str(path: tuple) -> str:
    """The path string of a key tuple, by ``cairn.core_array``'s convention.

    >>> path_str(("layers", 0, "kernel")), path_str(())
    ('layers/0/kernel', '')

    Raises:
      cairn.core_array.PathError: a key is not a str or an int, or is a str that is
        empty or holds ``/``.
    """
    return path_of(path)


def path_text(path: tuple) -> str:
    """:func:`path_str` for an error message: never raises (a path with a key the
    convention rejects is shown with each key's ``str`` joined by ``/``)."""
    try:
        return path_of(path)
    except PathError:
        return "/".join(str(k) for k in path)


# --- filter objects ---


class Filter:
    """Base class of filter objects: callables ``(path, variable) -> bool``."""

    def __call__(self, path: tuple, variable: Variable) -> bool:  # pragma: no cover
        raise NotImplementedError


class OfType(Filter):
    """Variables (or plain data leaves, such as arrays) that are instances of ``type``.

    Args:
      type: a :class:`Variable` subclass, or another class (``jax.Array``) for plain
        data leaves.
    """

    def __init__(self, type: type) -> None:  # noqa: A002 - NNX's argument name
        if not isinstance(type, builtins.type):
            raise TypeError(f"OfType expects a class (e.g. nn.Param), got {type!r}")
        self.type = type

    def __call__(self, path: tuple, variable: Variable) -> bool:
        if type(variable) is DataSlot:  # a data attribute is matched by its value
            variable = variable.raw_value
        return isinstance(variable, self.type)

    def __repr__(self):
        return f"OfType({self.type.__name__})"

    def __eq__(self, other):
        return isinstance(other, OfType) and other.type is self.type

    def __hash__(self):
        return hash(("OfType", self.type))


class PathContains(Filter):
    """Variables whose path contains ``key`` as one of its components (``exact=False``:
    whose path has a component containing ``str(key)`` as a substring).

    Args:
      key: a path component (a string or an int index).
      exact: match whole components; False matches a component containing ``str(key)``.
    """

    def __init__(self, key: _AnyT, exact: bool = True) -> None:
        self.key = key
        self.exact = bool(exact)

    def __call__(self, path: tuple, variable: Variable) -> bool:
        if not self.exact:
            return any(str(self.key) in str(k) for k in path)
        return self.key in path or str(self.key) in (str(k) for k in path)

    def __repr__(self):
        return f"PathContains({self.key!r}, exact={self.exact})"

    def __eq__(self, other):
        return (
            isinstance(other, PathContains)
            and other.key == self.key
            and other.exact == self.exact
        )

    def __hash__(self):
        return hash(("PathContains", self.key, self.exact))


class PathRegex(Filter):
    """Variables whose ``/``-joined path matches ``pattern`` (``re.fullmatch``), or whose
    ``tag`` (a random stream's name, on ``RngKey`` / ``RngCount``) is ``pattern`` itself,
    so ``"dropout"`` also selects the dropout stream's state, as Flax NNX's string filters.

    Args:
      pattern: a regular expression (string or compiled) matched in full against the ``/``-joined
        path.
    """

    def __init__(self, pattern: str | re.Pattern) -> None:
        if not isinstance(pattern, str | re.Pattern):
            raise TypeError(
                f"PathRegex expects a regular expression string, got {type(pattern).__name__}"
            )
        try:
            self.regex = compile_pattern(pattern)
        except PathError as e:  # name the filter; keep re's own words on what is wrong
            detail = e.__context__ if e.__context__ is not None else e
            raise PathError(f"invalid path regex filter {pattern!r}: {detail}") from None
        self.pattern = pattern

    def __call__(self, path: tuple, variable: Variable) -> bool:
        if self.regex.fullmatch(path_str(path)) is not None:
            return True
        meta = getattr(variable, "_meta", None)
        if not meta:
            return False
        return meta.get("tag") == self.pattern

    def __repr__(self):
        return f"PathRegex({self.pattern!r})"

    def __eq__(self, other):
        return isinstance(other, PathRegex) and other.pattern == self.pattern

    def __hash__(self):
        return hash(("PathRegex", self.pattern))


class WithTag(Filter):
    """Variables whose ``tag`` metadata is ``tag`` (the RNG variables of a stream
    carry its name: ``WithTag("dropout")``).

    Args:
      tag: the tag to match (an RNG stream's name).
    """

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __call__(self, path: tuple, variable: Variable) -> bool:
        return getattr(variable, "_meta", {}).get("tag") == self.tag

    def __repr__(self):
        return f"WithTag({self.tag!r})"

    def __eq__(self, other):
        return isinstance(other, WithTag) and other.tag == self.tag

    def __hash__(self):
        return hash(("WithTag", self.tag))


class Any(Filter):
    """Variables matched by at least one of ``filters``.

    Args:
      filters: the filters (Variable types, path regex strings, ``...``, lists, filter objects or
        predicates ``(path, variable) -> bool``) of which a variable must match one.
    """

    def __init__(self, *filters: _AnyT) -> None:
        self.filters = filters
        self.preds = tuple(to_predicate(f) for f in filters)

    def __call__(self, path: tuple, variable: Variable) -> bool:
        return any(p(path, variable) for p in self.preds)

    def __repr__(self):
        return f"Any{self.filters!r}"

    def __eq__(self, other):
        return isinstance(other, Any) and other.filters == self.filters

    def __hash__(self):
        return hash(("Any", self.filters))


class All(Filter):
    """Variables matched by every one of ``filters``.

    Args:
      filters: the filters (Variable types, path regex strings, ``...``, lists, filter objects or
        predicates ``(path, variable) -> bool``) a variable must all match.
    """

    def __init__(self, *filters: _AnyT) -> None:
        self.filters = filters
        self.preds = tuple(to_predicate(f) for f in filters)

    def __call__(self, path: tuple, variable: Variable) -> bool:
        return all(p(path, variable) for p in self.preds)

    def __repr__(self):
        return f"All{self.filters!r}"

    def __eq__(self, other):
        return isinstance(other, All) and other.filters == self.filters

    def __hash__(self):
        return hash(("All", self.filters))


class Not(Filter):
    """Variables not matched by ``filter``.

    Args:
      filter: the filter to negate.
    """

    def __init__(self, filter: _AnyT) -> None:  # noqa: A002
        self.filter = filter
        self.pred = to_predicate(filter)

    def __call__(self, path: tuple, variable: Variable) -> bool:
        return not self.pred(path, variable)

    def __repr__(self):
        return f"Not({self.filter!r})"

    def __eq__(self, other):
        return isinstance(other, Not) and other.filter == self.filter

    def __hash__(self):
        return hash(("Not", self.filter))


class Everything(Filter):
    """Every variable."""

    def __call__(self, path: tuple, variable: Variable) -> bool:
        return True

    def __repr__(self):
        return "Everything()"

    def __eq__(self, other):
        return isinstance(other, Everything)

    def __hash__(self):
        return hash("Everything")


class Nothing(Filter):
    """No variable."""

    def __call__(self, path: tuple, variable: Variable) -> bool:
        return False

    def __repr__(self):
        return "Nothing()"

    def __eq__(self, other):
        return isinstance(other, Nothing)

    def __hash__(self):
        return hash("Nothing")


# --- filters from any accepted form ---

_EVERYTHING = Everything()
_NOTHING = Nothing()


def to_predicate(f: _AnyT) -> Predicate:
    """Turn any accepted filter into a predicate ``(path_tuple, variable) -> bool``.

    Raises ``TypeError`` naming the filter when it is not one of the accepted forms.

    Args:
      f: a Variable type, a path regex string, ``...``/True/False/None, a list of filters, a filter
        object or a callable.
    """
    if isinstance(f, Filter):
        return f
    if f is Ellipsis or f is True:
        return _EVERYTHING
    if f is None or f is False:
        return _NOTHING
    if isinstance(f, type):  # a Variable type, or a type of plain data (jax.Array)
        return OfType(f)
    if isinstance(f, str):
        return PathRegex(f)
    if isinstance(f, list | tuple):
        return Any(*f)
    if callable(f):
        return f
    raise TypeError(
        f"unknown filter {f!r} of type {type(f).__name__}: expected a Variable type, a "
        f"path regex string, ..., True/False/None, a list of filters, a filter object "
        f"(OfType, PathContains, Any, All, Not, Everything, Nothing) or a callable "
        f"(path, variable) -> bool"
    )
