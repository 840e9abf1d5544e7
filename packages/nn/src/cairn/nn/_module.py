"""Module: a Python object that is also a JAX pytree.

A module's attributes fall in three kinds:

* **Variables** (``self.kernel = nn.Param(x)``): state, the pytree's leaves;
* **child modules** (and ``nn.List`` / ``nn.Dict`` containers, and tuples of modules or
  variables): pytree children;
* everything else (ints, strings, dtypes, functions, tuples of ints...): static
  configuration, kept in the pytree's aux data. Static values should be treated as
  immutable: change them by assigning the attribute again.

A plain JAX / NumPy array attribute (``self.count = jnp.array(0)``), a value of a type
given to ``nn.register_data_type`` and a value assigned as ``nn.data(x)`` are **data**:
pytree leaves and State entries kept as the plain value (see ``cairn.nn._data``). A
plain ``list`` or ``dict`` that holds modules or variables is converted to
:class:`List` / :class:`Dict` on assignment; one that holds arrays is refused unless it
is marked ``nn.data`` (use ``nn.List`` / ``nn.Dict``).
A module tree has no shared references: the same module or variable reachable from two
paths is an error (tie weights explicitly instead).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import html
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as _jax_core
from jax.tree_util import DictKey, SequenceKey

from cairn.nn._data import MARKS, Marked, is_data_value
from cairn.nn._graph import clone, iter_modules
from cairn.nn._nodes import Node, is_node
from cairn.nn._variables import EPOCH, Intermediate, Perturbation, Variable

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
_INTERNAL = "_cairn_"
_MAX_REPR_DEPTH = 12


def _contains_nodes(value) -> bool:
    leaves = jax.tree_util.tree_leaves(value, is_leaf=is_node)
    return any(isinstance(leaf, Variable | Node) for leaf in leaves)


def _contains_arrays(value) -> bool:
    leaves = jax.tree_util.tree_leaves(value, is_leaf=is_node)
    return any(isinstance(leaf, _ARRAY_TYPES) for leaf in leaves)


class SowError(TypeError, ValueError):
    """``Module.sow`` found an attribute of that name that is not a Variable of the
    sown type (a ``TypeError``, and a ``ValueError`` as Flax NNX raises)."""


class AttributesNotFoundError(AttributeError, ValueError):
    """``set_attributes`` / ``with_attributes`` / ``view`` found no selected module with
    some of the attributes given (a ``ValueError``, as Flax NNX raises, and an
    ``AttributeError``)."""


class Module(Node):
    """Base class of all modules (NNX-style: build eagerly, call eagerly, transform).

    Subclasses define ``__init__`` (create Variables and child modules; no
    ``super().__init__()`` needed) and ``__call__``.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> class Scale(nn.Module):
    ...     def __init__(self, n):
    ...         self.w = nn.Param(jnp.ones(n))
    ...         self.n = n
    ...     def __call__(self, x):
    ...         return x * self.w
    >>> m = Scale(3)
    >>> m(jnp.arange(3.0)).tolist()
    [0.0, 1.0, 2.0]
    >>> sorted(nn.state(m).flat_paths())
    ['w']
    """

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)  # registers the class as a pytree
        call = cls.__dict__.get("__call__")
        if call is not None and not getattr(call, "_cairn_wrapped", False):
            cls.__call__ = _wrap_call(call)  # type: ignore[method-assign]
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_cairn_wrapped", False):
            cls.__init__ = _wrap_init(init)  # type: ignore[method-assign]

    # --- attribute handling ---
    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith(_INTERNAL):
            object.__setattr__(self, name, value)
            return
        value, mark = _attribute_status(self, name, value)
        value = _check_attribute(self, name, value, mark)
        object.__setattr__(self, name, value)
        EPOCH[0] += 1

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        EPOCH[0] += 1

    # --- NNX-style helpers ---
    def iter_modules(self) -> Iterator[tuple[str, Module]]:
        """Yield ``(path, module)`` for this module and every submodule, depth first, in
        attribute order. Paths use the ``a/b/0`` convention; the root's path is ``""``."""
        return cast(Iterator[tuple[str, Module]], iter_modules(self))

    def iter_children(self) -> Iterator[tuple[Any, Module]]:
        """Yield ``(key, module)`` for the direct child modules."""
        for k, v in self._graph_items():
            if isinstance(v, Module):
                yield k, v

    def set_attributes(
        self, *filters: Any, raise_if_not_found: bool = True, **attributes: Any
    ) -> None:
        """Set ``attributes`` on every module in the tree (this one included) that
        already has them (and matches one of ``filters``, module types or predicates
        ``(path, module) -> bool``, if given). Raises :class:`AttributesNotFoundError`
        (an ``AttributeError`` and a ``ValueError``, Flax's type) naming the missing
        attributes if ``raise_if_not_found`` and no module had one of them.

        Args:
          filters: module types or predicates ``(path, module) -> bool``; a module must match one
            (none: every module).
          raise_if_not_found: raise when no module had one of the attributes.
          attributes: the attributes and their new values.
        """
        found = set()
        for path, mod in self.iter_modules():
            if filters and not any(
                (isinstance(f, type) and isinstance(mod, f))
                or (not isinstance(f, type) and callable(f) and f(path, mod))
                for f in filters
            ):
                continue
            for name, value in attributes.items():
                if name in mod.__dict__:
                    setattr(mod, name, value)
                    found.add(name)
        missing = set(attributes) - found
        if raise_if_not_found and missing:
            raise AttributesNotFoundError(
                f"set_attributes: Could not find at least one instance of the following "
                f"attributes: {sorted(missing)} (no module in {type(self).__name__} has "
                f"them); pass raise_if_not_found=False to ignore them"
            )

    def train(self, **attributes: Any) -> Module:
        """Training mode: ``deterministic=False`` and ``use_running_average=False`` on
        every submodule that has them (plus any extra ``attributes``). Returns self.

        Args:
          attributes: more attributes to set on every submodule that has them.
        """
        return self._set_mode(False, attributes)

    def eval(self, **attributes: Any) -> Module:
        """Evaluation mode: ``deterministic=True`` and ``use_running_average=True`` on
        every submodule that has them (plus any extra ``attributes``). Returns self.

        Args:
          attributes: more attributes to set on every submodule that has them.
        """
        return self._set_mode(True, attributes)

    def _set_mode(self, evaluating: bool, attributes: dict[str, Any]) -> Module:
        """``train`` (False) / ``eval`` (True): set both mode flags and ``attributes``."""
        self.set_attributes(
            deterministic=evaluating,
            use_running_average=evaluating,
            **attributes,
            raise_if_not_found=False,
        )
        return self

    def sow(
        self,
        variable_type: type[Variable] | str,
        name: str,
        value: Any,
        reduce_fn: Callable[[Any, Any], Any] = lambda xs, x: (*xs, x),
        init_fn: Callable[[], Any] = tuple,
    ) -> None:
        """Record ``value`` in the variable ``name`` of type ``variable_type`` (default
        :class:`Intermediate` when given a string), appending to a tuple by default.

        Args:
          variable_type: the variable type to record in (a string means :class:`Intermediate`).
          name: the attribute name of the variable.
          value: the value to record.
          reduce_fn: ``reduce_fn(accumulated, value) -> accumulated``; the default appends to a
            tuple.
          init_fn: ``init_fn() -> accumulated`` for the first record; the default gives ``()``.

        Raises:
          SowError: (a ``TypeError`` and a ``ValueError``) ``name`` already holds
            something that is not a Variable, or a Variable of another type.
        """
        if isinstance(variable_type, str):
            variable_type = Intermediate
        existing = self.__dict__.get(name)
        if existing is None:
            setattr(self, name, variable_type(reduce_fn(init_fn(), value)))
        elif isinstance(existing, variable_type):
            existing.value = reduce_fn(existing.value, value)
        elif not isinstance(existing, Variable):
            raise SowError(
                f"sow: expected attribute {name!r} of {type(self).__name__} to be a Variable, "
                f"got {type(existing).__name__}"
            )
        else:
            raise SowError(
                f"sow: expected attribute {name!r} of {type(self).__name__} to be of type "
                f"{variable_type.__name__}, got {type(existing).__name__}"
            )

    def perturb(
        self, name: str, value: Any, variable_type: type[Variable] = Perturbation
    ) -> Any:
        """Add a zero :class:`Perturbation` named ``name`` to ``value`` (created on the
        first call), so that the gradient with respect to it is the gradient with respect
        to this intermediate value.

        Args:
          name: the attribute name of the :class:`Perturbation` variable.
          value: the intermediate value to perturb.
          variable_type: the variable type created (a :class:`Perturbation` subclass).

        Returns:
          ``value`` plus the (zero) perturbation.
        """
        existing = self.__dict__.get(name)
        if existing is None:
            setattr(self, name, variable_type(jnp.zeros_like(value)))
            existing = self.__dict__[name]
        return value + existing.value

    def __repr__(self) -> str:
        return module_repr(self)

    def _repr_html_(self) -> str:
        return module_html(self)

    def __copy__(self) -> Module:
        return cast(Module, clone(self))

    def __deepcopy__(self, memo: dict) -> Module:
        # ``copy.deepcopy`` semantics over the module graph: new modules and Variables
        # (arrays are immutable and kept), static attributes deep-copied, and a module
        # or Variable found at two places (or a cycle) copied once, through ``memo``
        new = object.__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k != "_cairn_cache":
                object.__setattr__(new, k, copy.deepcopy(v, memo))
        return new


class _CallState(threading.local):
    """Per thread (two threads may trace or call modules at once, e.g. a serving engine
    compiling while the main thread exports): ``depth`` is 1 inside the outermost module
    call; while that call is traced, ``scopes`` holds (module, its path below that module)
    per active call, so each submodule call runs inside jax.named_scope(<its path>) and the
    traced program names the module every op came from (profiles, cairn.quant's rules)."""

    def __init__(self) -> None:
        self.depth = 0
        self.scopes: list[tuple[Any, str]] = []


_CALLS = _CallState()
_TRACE_CTX = _jax_core.trace_ctx
_EVAL_TRACE = _jax_core.EvalTrace


def public_methods(cls: type) -> dict[str, Callable]:
    """The public methods of module class ``cls`` (and ``__call__``) that a layer or a
    user's module defines: plain functions, not static or class methods, and not the
    generic ``Module`` API (``sow``, ``train``, ...)."""
    out = {}
    for name in dir(cls):
        if name.startswith("_") and name != "__call__":
            continue
        owner = next((k for k in cls.__mro__ if name in k.__dict__), None)
        if owner is None or owner in (Module, Node, object):
            continue
        if inspect.isfunction(owner.__dict__[name]):
            out[name] = owner.__dict__[name]
    return out


def _child_key(parent: Any, child: Any) -> str | None:
    """The path of ``child`` below ``parent``: an attribute, or an item of a container
    attribute (``layers/0``); ``None`` when ``child`` is not held by ``parent``."""
    items = parent._graph_items() if isinstance(parent, Node) else []
    for key, value in items:
        if value is child:
            return str(key)
        inner: Iterable[tuple[Any, Any]] = ()
        if isinstance(value, Node) and not isinstance(value, Module | Variable):
            inner = value._graph_items()
        elif isinstance(value, Module) and type(value).__name__ in ("List", "Dict", "Sequential"):
            inner = value._graph_items()
        elif isinstance(value, list | tuple):
            inner = enumerate(value)
        elif isinstance(value, dict):
            inner = value.items()
        for k2, v2 in inner:
            if v2 is child:
                return f"{key}/{k2}"
    return None


def _wrap_init(init):
    """``__init__`` followed, for the outermost one, by :func:`_check_after_init`."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if type(self).__init__ is __init__:
            _check_after_init(self)

    __init__._cairn_wrapped = True  # type: ignore[attr-defined]
    return __init__


def _check_after_init(module: Module) -> None:
    """A static list / dict / tuple attribute filled with arrays after its assignment
    (``self.ls = []; self.ls.append(x)``) is refused once ``__init__`` is done, as Flax
    NNX does: the arrays would be neither static nor state."""
    marks = module.__dict__.get(MARKS) or {}
    for k, v in module.__dict__.items():
        if k.startswith(_INTERNAL) or type(v) not in (list, dict, tuple) or marks.get(k):
            continue
        if _contains_arrays(v):
            raise StaticDataError(
                f"Found unexpected data on value of type {type(v).__name__!r} in static "
                f"attribute {k!r} of {type(module).__name__} after __init__: use nn.List / "
                f"nn.Dict, assign it as nn.data(...), or keep the arrays in Variables"
            )


def _scoped_call(fn: Callable, module: Any, args: tuple, kwargs: dict, scopes: list) -> Any:
    parent, path = scopes[-1]
    key = _child_key(parent, module)
    scopes.append((module, path if key is None else f"{path}/{key}" if path else key))
    try:
        if key is None:
            return fn(module, *args, **kwargs)
        with jax.named_scope(key):
            return fn(module, *args, **kwargs)
    finally:
        scopes.pop()


def _wrap_call(fn):
    """Wrap a module class's ``__call__`` so that an exception escaping the outermost
    module call gets a note naming the submodule (by path) that raised it, and, while
    tracing, each submodule call runs under ``jax.named_scope(<path below the caller>)``
    (eager calls pay one type check at the outermost call)."""

    @functools.wraps(fn)
    def __call__(self, *args, **kwargs):
        calls = _CALLS
        if calls.depth:
            scopes = calls.scopes
            if not scopes:
                return fn(self, *args, **kwargs)
            return _scoped_call(fn, self, args, kwargs, scopes)
        calls.depth = 1
        tracing = type(_TRACE_CTX.trace) is not _EVAL_TRACE
        if tracing:
            calls.scopes.append((self, ""))
        try:
            return fn(self, *args, **kwargs)
        except Exception as e:
            annotate_exception(e, [(None, self)])
            raise
        finally:
            calls.depth = 0
            if tracing:
                calls.scopes.clear()

    __call__._cairn_wrapped = True  # type: ignore[attr-defined]
    return __call__


def annotate_exception(exc: BaseException, roots: Iterable[tuple[Any, Any]]) -> None:
    """Add a note to ``exc`` naming the innermost module (by path) whose method raised
    it. ``roots``: iterable of ``(label, tree)``; label None means "the called module"."""
    try:
        if any(n.startswith("(raised in ") for n in getattr(exc, "__notes__", ())):
            return
        ids: dict[int, tuple] = {}
        for label, tree in roots:
            for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_node):
                if isinstance(leaf, Module):
                    for path, m in iter_modules(leaf):
                        ids[id(m)] = (label, path, type(m).__name__, type(leaf).__name__)
        found = None
        tb = exc.__traceback__
        while tb is not None:
            obj = tb.tb_frame.f_locals.get("self")
            if obj is not None and id(obj) in ids:
                found = ids[id(obj)]
            tb = tb.tb_next
        if found is None:
            return
        label, path, cls, root_cls = found
        where = f"path {path!r}" if path else "the root"
        of = f"argument {label}" if label is not None else root_cls
        exc.add_note(f"(raised in {cls} at {where} of {of})")
    except Exception:  # noqa: BLE001 - never mask the original error
        pass


# ``nn.data()`` / ``nn.static()`` with no value are dataclass field markers; the kind is
# kept in the field's metadata under this key
FIELD_KIND = "cairn_nn_field"
_NUMBERS = (bool, int, float, complex)


class StaticDataError(TypeError, ValueError):
    """State (an array, a Variable or a module) given as static configuration (a
    ``TypeError``, and Flax NNX's ``ValueError``)."""


def _field_kind(cls: type, name: str) -> str | None:
    """``"data"`` / ``"static"`` when ``cls`` declares ``name`` with ``nn.data()`` /
    ``nn.static()`` (a dataclass field, or a plain class attribute), else None."""
    fields = cls.__dict__.get("__dataclass_fields__") or getattr(cls, "__dataclass_fields__", None)
    f = fields.get(name) if fields else None
    if f is None:
        f = getattr(cls, name, None)
    if isinstance(f, dataclasses.Field) and FIELD_KIND in f.metadata:
        return f.metadata[FIELD_KIND]
    return _annotated_kinds(cls).get(name)


_ANNOTATED: dict[type, dict[str, str]] = {}


def _annotated_kinds(cls: type) -> dict[str, str]:
    """``{name: "data" | "static"}`` for the attributes annotated ``nn.Data[...]`` /
    ``nn.Static[...]`` in the class bodies of ``cls`` (read once per class)."""
    kinds = _ANNOTATED.get(cls)
    if kinds is None:
        kinds = {}
        for klass in reversed(cls.__mro__):
            for name, ann in klass.__dict__.get("__annotations__", {}).items():
                meta = getattr(ann, "__metadata__", ())
                text = ann if isinstance(ann, str) else ""
                if "__data__" in meta or text.split(".")[-1].startswith("Data["):
                    kinds[name] = "data"
                elif "__static__" in meta or text.split(".")[-1].startswith("Static["):
                    kinds[name] = "static"
        _ANNOTATED[cls] = kinds
    return kinds


def _attribute_status(module: Module, name: str, value: Any) -> tuple[Any, bool | None]:
    """``(value, mark)`` of an assignment: ``nn.data(x)`` / ``nn.static(x)`` set the
    attribute's status (recorded on the instance), a recorded status stays for later
    plain assignments, else a class-level ``nn.data()`` / ``nn.Data[...]`` declaration
    gives it; None: the value's type decides."""
    marks = module.__dict__.get(MARKS)
    if isinstance(value, Marked):  # nn.data(x) / nn.static(x)
        mark: bool | None = value.data
        value = value.value
    elif marks is not None and name in marks:
        mark = marks[name]  # an explicit status stays
        if not mark and is_data_value(value):
            raise StaticDataError(
                f"Cannot assign data value of type {type(value).__name__!r} to static "
                f"attribute {name!r} of {type(module).__name__}; to override the status "
                f"assign it as nn.data(...)"
            )
        return value, mark
    else:
        kind = _field_kind(type(module), name)
        if kind is None:
            return value, None
        mark = kind == "data"
    if not mark:
        value = check_static(value, name)
    if (marks or {}).get(name) is not mark:  # copy on write: the marks are a static item
        object.__setattr__(module, MARKS, {**(marks or {}), name: mark})
    return value, mark


def _container_item(container: Module, key: Any, value: Any) -> Any:
    """An item stored in ``nn.List`` / ``nn.Dict``: ``nn.data(x)`` of a value that is not
    data by type becomes a Variable (a container keeps no per-item marks)."""
    if isinstance(value, Marked):
        if not value.data:
            return check_static(value.value, str(key))
        value = value.value if is_data_value(value.value) else as_data(value.value)
    return _check_attribute(container, str(key), value)


def as_data(value: Any) -> Any:
    """``value`` as state: each array or Python number in it becomes a Variable
    (modules, Variables and containers of them are returned as they are)."""
    def one(x):
        if isinstance(x, _ARRAY_TYPES) or (isinstance(x, _NUMBERS) and not isinstance(x, Variable)):
            return Variable(x)
        return x

    return jax.tree_util.tree_map(one, value, is_leaf=is_node)


def check_static(value: Any, name: str = "") -> Any:
    """``value``, checked to hold no state (arrays, Variables, modules).

    Raises:
      StaticDataError: it does.
    """
    if isinstance(value, _ARRAY_TYPES) or is_node(value):
        found = (f"Found unexpected data on value of type {type(value).__name__} for the "
                 f"static attribute {name!r}" if name else
                 f"Found data in value of type {type(value).__name__}")
        raise StaticDataError(
            f"{found}: it is state, not static configuration; keep arrays in Variables, or "
            f"make the value a Python scalar or tuple"
        )
    return value


def _check_attribute(module: Module, name: str, value: Any, mark: bool | None = None) -> Any:
    """Validate / convert a value assigned to a module attribute (``mark``: its explicit
    status, True for data)."""
    if mark:
        return value
    if isinstance(value, _ARRAY_TYPES):
        current = module.__dict__.get(name)
        if isinstance(current, Variable):
            raise TypeError(
                f"{type(module).__name__}.{name} holds a {type(current).__name__}; "
                f"assign the array to {type(module).__name__}.{name}.value (or "
                f"`[...] = `), or wrap it in a Variable: got a plain "
                f"{type(value).__name__} of shape {np.shape(value)}"
            )
        return value  # data: a pytree leaf, a State entry
    if type(value) is list and _contains_nodes(value):
        return List(value)
    if type(value) is dict and _contains_nodes(value):
        return Dict(value)
    if isinstance(value, tuple | list | dict) and _contains_arrays(value):
        raise StaticDataError(
            f"Found data on value of type {type(value).__name__!r} assigned to static "
            f"attribute {name!r} of {type(module).__name__}: the {type(value).__name__} "
            f"contains plain arrays. Use nn.List(...) / nn.Dict(...), assign it as "
            f"nn.data(...) to make the whole value data, or wrap each array in a Variable"
        )
    return value


# --- containers ---


class _Container(Module):
    """Base of ``List`` and ``Dict``: children live in ``_cairn_items``, not attributes."""

    _cairn_items: Any  # a list (List) or a dict (Dict), set in __init__ / _graph_new

    def _graph_set(self, key, value):
        items = self._cairn_items
        if isinstance(items, list) and key == len(items):  # a new last item
            items.append(value)
        else:
            items[key] = value
        EPOCH[0] += 1

    def _graph_del(self, key):
        del self._cairn_items[key]
        EPOCH[0] += 1


class List(_Container):
    """A list of modules / variables / static values that is a module (paths
    ``name/0/...``). Supports the usual list operations.

    Args:
      items: the initial elements (modules, variables or static values).
    """

    _graph_key = SequenceKey
    _graph_store = "list"

    def __init__(self, items: Iterable[Any] = ()) -> None:
        object.__setattr__(self, "_cairn_items", [])
        for item in items:
            self.append(item)

    def _graph_items(self):
        return list(enumerate(self._cairn_items))

    @classmethod
    def _graph_new(cls, items):
        obj = object.__new__(cls)
        object.__setattr__(obj, "_cairn_items", [v for _, v in items])
        return obj

    def _check(self, value, key):
        return _container_item(self, key, value)

    def append(self, value: Any) -> None:
        """Add ``value`` at the end.

        Args:
          value: a module, variable or static value.
        """
        self._cairn_items.append(self._check(value, len(self._cairn_items)))
        EPOCH[0] += 1

    def extend(self, values: Iterable[Any]) -> None:
        """Append each of ``values``.

        Args:
          values: modules, variables or static values.
        """
        for v in values:
            self.append(v)

    def insert(self, index: int, value: Any) -> None:
        """Insert ``value`` before position ``index``.

        Args:
          index: the position (as for ``list.insert``).
          value: a module, variable or static value.
        """
        self._cairn_items.insert(index, self._check(value, index))
        EPOCH[0] += 1

    def pop(self, index: int = -1) -> Any:
        """Remove and return the element at ``index``.

        Args:
          index: the position (default the last).
        """
        v = self._cairn_items.pop(index)
        EPOCH[0] += 1
        return v

    def __getitem__(self, idx):
        # a slice is a plain list of the items (Flax NNX's List), not a new module
        return self._cairn_items[idx]

    def __setitem__(self, idx, value):
        if isinstance(idx, slice):
            self._cairn_items[idx] = [self._check(v, i) for i, v in enumerate(value)]
        else:
            self._cairn_items[idx] = self._check(value, idx)
        EPOCH[0] += 1

    def __delitem__(self, idx):
        del self._cairn_items[idx]
        EPOCH[0] += 1

    def __len__(self):
        return len(self._cairn_items)

    def __iter__(self):
        return iter(self._cairn_items)

    def __contains__(self, x):
        return any(x is y for y in self._cairn_items)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("nn.List is not callable; use nn.Sequential to chain modules")


class Dict(_Container, Mapping):
    """A string-keyed mapping of modules / variables / static values that is a module
    (paths ``name/key/...``).

    Args:
      items: a mapping or ``(key, value)`` pairs with string keys.
      kwargs: more ``key=value`` entries.
    """

    _graph_key = DictKey
    _graph_store = "dict"

    def __init__(self, items: Any = (), **kwargs: Any) -> None:
        object.__setattr__(self, "_cairn_items", {})
        for k, v in dict(items, **kwargs).items():
            self[k] = v

    def _graph_items(self):
        return list(self._cairn_items.items())

    @classmethod
    def _graph_new(cls, items):
        obj = object.__new__(cls)
        object.__setattr__(obj, "_cairn_items", dict(items))
        return obj

    def __getitem__(self, key):
        return self._cairn_items[key]

    def __setitem__(self, key, value):
        if not isinstance(key, str) or "/" in key:
            raise TypeError(f"nn.Dict keys must be strings without '/', got {key!r}")
        self._cairn_items[key] = _container_item(self, key, value)
        EPOCH[0] += 1

    def __delitem__(self, key):
        del self._cairn_items[key]
        EPOCH[0] += 1

    def __getattr__(self, name):
        items = self.__dict__.get("_cairn_items")
        if items is not None and name in items:
            return items[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or key {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        """``d.key = value`` is ``d["key"] = value`` (Flax NNX's Dict is attribute-based)."""
        if name.startswith("_") or name in type(self).__dict__:
            super().__setattr__(name, value)
        else:
            self[name] = value

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__.get("_cairn_items", ()):
            del self[name]
        else:
            super().__delattr__(name)

    def __iter__(self):
        return iter(self._cairn_items)

    def __len__(self):
        return len(self._cairn_items)

    def setdefault(self, key: str, default: Any = None) -> Any:
        """``self[key]``, first setting it to ``default`` when missing (``dict.setdefault``).

        Args:
          key: the key.
          default: the value stored when ``key`` is missing.
        """
        if key not in self._cairn_items:
            self[key] = default
        return self._cairn_items[key]

    # Mapping defines __eq__; keep identity semantics for modules
    __eq__ = object.__eq__
    __hash__ = object.__hash__


class Sequential(Module):
    """Chain of callables: the first gets all call arguments, each next one gets the
    previous output. Layers are stored in ``self.layers`` (paths ``layers/0/...``).

    Args:
      layers: the callables, in order (modules or plain functions).
    """

    def __init__(self, *layers: Callable) -> None:
        self.layers = List(layers)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not len(self.layers):  # the identity, as Flax NNX's empty Sequential
            if args and kwargs:
                raise TypeError(
                    "an empty Sequential returns its input: give positional or keyword "
                    "arguments, not both"
                )
            if kwargs:
                return kwargs
            return None if not args else args[0] if len(args) == 1 else args
        out = self.layers[0](*args, **kwargs)
        for layer in self.layers._cairn_items[1:]:
            out = layer(out)
        return out



# --- repr ---


def module_repr(m: Module, indent: int = 0, depth: int = 0) -> str:
    """The nested repr of a module: variables and child modules first, then its
    configuration (long reprs cut at 80 characters; a setting equal to its ``__init__``
    default left out), ``Name(...)`` past depth 12."""
    pad = "  " * (indent + 1)
    name = type(m).__name__
    if depth > _MAX_REPR_DEPTH:
        return f"{name}(...)"
    state_lines, config_lines = [], []
    for k, v, kind in _repr_items(m):
        key = f"{k}: " if isinstance(m, List) else f"{k}="
        if kind == "module":
            state_lines.append(f"{pad}{key}{module_repr(v, indent + 1, depth + 1)},")
        elif kind == "variable":
            state_lines.append(f"{pad}{key}{v!r},")
        else:
            config_lines.append(f"{pad}{key}{v},")
    lines = state_lines + config_lines
    if not lines:
        return f"{name}()"
    return f"{name}(\n" + "\n".join(lines) + "\n" + "  " * indent + ")"


def _repr_items(m: Module) -> Iterator[tuple[Any, Any, str]]:
    """``(key, value, kind)`` per item shown: child modules and variables as they are,
    settings as their short text, those at their ``__init__`` default skipped."""
    defaults = _init_defaults(type(m))
    for k, v in m._graph_items():
        if k == MARKS:
            continue
        if isinstance(v, Module):
            yield k, v, "module"
        elif isinstance(v, Variable):
            yield k, v, "variable"
        elif not (isinstance(k, str) and k in defaults and _same_setting(v, defaults[k])):
            r = _static_repr(v)
            yield k, (r[:77] + "..." if len(r) > 80 else r), "setting"


_INIT_DEFAULTS: dict[type, dict[str, Any]] = {}


def _init_defaults(cls: type) -> dict[str, Any]:
    """The keyword defaults of ``cls.__init__``, by parameter name (empty when unreadable)."""
    if cls not in _INIT_DEFAULTS:
        try:
            params = inspect.signature(cls).parameters  # __init__'s, without self
            found = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
        except (TypeError, ValueError):
            found = {}
        _INIT_DEFAULTS[cls] = found
    return _INIT_DEFAULTS[cls]


def _same_setting(v: Any, default: Any) -> bool:
    if v is default:
        return True
    try:
        return type(v) is type(default) and bool(v == default)
    except Exception:  # arrays and other values without a plain truth value
        return False


def module_html(m: Module, depth: int = 0) -> str:
    """The notebook form of :func:`module_repr`: nested collapsible ``<details>`` blocks,
    the top two levels open; variables and settings as in the text repr."""
    name = html.escape(type(m).__name__)
    if depth > _MAX_REPR_DEPTH:
        return f"<code>{name}(...)</code>"
    state_rows: list[str] = []
    config_rows: list[str] = []
    for k, v, kind in _repr_items(m):
        key = f"<code>{html.escape(str(k))}</code>" + (": " if isinstance(m, List) else " = ")
        if kind == "module":
            state_rows.append(f"<li>{key}{module_html(v, depth + 1)}</li>")
        else:
            row = f"<li>{key}<code>{html.escape(repr(v) if kind == 'variable' else v)}</code></li>"
            (state_rows if kind == "variable" else config_rows).append(row)
    rows = state_rows + config_rows
    if not rows:
        return f"<code>{name}()</code>"
    opened = " open" if depth < 2 else ""
    return (
        f"<details{opened}><summary><code>{name}</code></summary>"
        f"<ul style='margin:0;padding-left:1.5em;list-style:none'>{''.join(rows)}</ul></details>"
    )


def _static_repr(v) -> str:
    if isinstance(v, type):
        return v.__name__
    if callable(v) and hasattr(v, "__qualname__"):
        mod = getattr(v, "__module__", "") or ""
        name = v.__qualname__.replace(".<locals>", "")
        return f"{mod.split('.')[0]}.{name}" if mod.startswith(("jax", "numpy")) else name
    return repr(v)
