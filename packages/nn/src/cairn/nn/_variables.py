"""Variables: the boxes that hold a module's state.

A :class:`Variable` holds one array (its ``value``) plus metadata (for example the
logical axis names used for sharding). Its type says what kind of state it is
(:class:`Param`, :class:`BatchStat`, :class:`Cache`, :class:`Intermediate`, ...), which
is what filters select on.

Inside a :class:`~cairn.nn.Module` or a :class:`~cairn.nn.State`, a variable's value
takes the variable's own path (``layers/0/kernel``): there is no ``value`` component.
A variable on its own, outside any module or state, is a pytree with one leaf at path
``value``.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.nn._sharding_rules import shard_on_create

# A global counter bumped by every structural change (a module attribute set, a
# variable's metadata changed, a container mutated). Cached flattenings of a module tree
# stay valid while it is unchanged. A list so that other modules can share it cheaply.
EPOCH = [0]


def bump_epoch() -> None:
    EPOCH[0] += 1


_SHARDING_ALIASES = {"out_sharding": "sharding_names", "sharding_names": "out_sharding"}

class VariableMetadata:
    """A value boxed with metadata, returned by initializers wrapped with
    :func:`with_metadata` / :func:`with_partitioning`. Creating a :class:`Variable`
    from it unboxes the value and applies the metadata.

    Args:
      value: the value the initializer made.
      metadata: the metadata the variable built from it gets.
    """

    __slots__ = ("value", "metadata")

    def __init__(self, value: Any, metadata: dict[str, Any]) -> None:
        self.value = value
        self.metadata = dict(metadata)

    def __repr__(self) -> str:
        return f"VariableMetadata({self.value!r}, {self.metadata!r})"


def with_metadata(initializer: Callable, **metadata: Any) -> Callable:
    """Wrap ``initializer`` so that its result carries ``metadata`` into the Variable
    built from it (``nn.Param(init(key, shape))``).

    Args:
      initializer: ``init(key, shape, dtype) -> array``.
      metadata: the metadata the Variable gets.
    """

    def wrapped(*args, **kwargs):
        out = initializer(*args, **kwargs)
        if isinstance(out, VariableMetadata):
            md = {**out.metadata, **metadata}
            return VariableMetadata(out.value, md)
        return VariableMetadata(out, metadata)

    wrapped.__wrapped__ = initializer  # type: ignore[attr-defined]
    return wrapped


def _binop(op):
    def f(self, other):
        return op(self.raw_value, _unwrap(other))

    return f


def _rbinop(op):
    def f(self, other):
        return op(_unwrap(other), self.raw_value)

    return f


def _unop(op):
    def f(self):
        return op(self.raw_value)

    return f


def _unwrap(x):
    return x.raw_value if isinstance(x, Variable) else x


_NO_DEFAULT: Any = object()


class Variable:
    """A mutable box around one array plus metadata.

    Read it with ``v.value`` or ``v[...]``; write it with ``v.value = x`` or
    ``v[...] = x`` (``v[idx] = x`` updates part of the array functionally). Arithmetic,
    indexing and ``jnp`` functions work on the variable directly (``x @ self.kernel``).
    Any other keyword given to the constructor is metadata, read back as an attribute
    (``v.sharding_names``) and kept in ``v.metadata``.

    Args:
      value: the initial value (an array; a :class:`VariableMetadata` or another variable
        contributes its metadata too).
      metadata: any other keyword is metadata (``sharding_names``, ``tag``...), read back as an
        attribute and kept in ``v.metadata``.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> w = nn.Param(jnp.ones((2, 3)), sharding_names=("embed", "mlp"))
    >>> (jnp.ones((4, 2)) @ w).shape
    (4, 3)
    >>> w.sharding_names
    ('embed', 'mlp')
    """

    __slots__ = ("raw_value", "_meta")

    # ``nn.Param[jax.Array]`` in annotations, as Flax's generic ``Variable[A]`` allows
    __class_getitem__: Any = classmethod(types.GenericAlias)

    def __init__(self, value: Any, **metadata: Any) -> None:
        if isinstance(value, Variable):
            metadata = {**value._meta, **metadata}
            value = value.raw_value
        if isinstance(value, VariableMetadata):
            metadata = {**value.metadata, **metadata}
            value = value.value
        object.__setattr__(self, "_meta", metadata)
        if "sharding_names" in metadata or "sharding" in metadata or "out_sharding" in metadata:
            value = shard_on_create(value, metadata)
        object.__setattr__(self, "raw_value", value)

    # --- value access ---
    @property
    def value(self) -> Any:
        return self.raw_value

    @value.setter
    def value(self, new: Any) -> None:
        if isinstance(new, Variable):
            raise TypeError(
                f"cannot set the value of a {type(self).__name__} to another Variable "
                f"({type(new).__name__}); assign its .value instead"
            )
        object.__setattr__(self, "raw_value", new)

    def get_value(self) -> Any:
        return self.raw_value

    def set_value(self, new: Any) -> None:
        """Set ``value`` (the same as ``v.value = new``).

        Args:
          new: the new value (an array, not a variable).
        """
        self.value = new

    def __getitem__(self, idx):
        if idx is Ellipsis:
            return self.raw_value
        return self.raw_value[idx]

    def __setitem__(self, idx, new):
        new = _unwrap(new)
        if idx is Ellipsis:
            object.__setattr__(self, "raw_value", new)
        else:
            object.__setattr__(self, "raw_value", jnp.asarray(self.raw_value).at[idx].set(new))

    # --- metadata ---
    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self._meta)

    def get_metadata(self, name: str | None = None, default: Any = _NO_DEFAULT) -> Any:
        """The metadata dict (a copy), or the entry ``name`` (``default`` when it is
        missing, else ``KeyError`` naming the keys there are).

        Args:
          name: the metadata key, or None for all of it.
          default: returned for a missing ``name``.
        """
        if name is None:
            if default is not _NO_DEFAULT:
                raise TypeError("get_metadata: a default needs a name")
            return dict(self._meta)
        if name in self._meta:
            return self._meta[name]
        if default is not _NO_DEFAULT:
            return default
        raise KeyError(f"{type(self).__name__} has no metadata {name!r} (has {list(self._meta)})")

    def set_metadata(self, *args: Any, **kwargs: Any) -> None:
        """Set metadata: ``set_metadata({...})`` replaces all of it,
        ``set_metadata(name, value)`` sets one entry, ``set_metadata(k=v, ...)`` updates.

        Args:
          *args: a dict, or a name and a value.
          **kwargs: entries to update.
        """
        if args and kwargs:
            raise TypeError("set_metadata: pass a dict, a name and a value, or keywords")
        if len(args) == 1:
            object.__setattr__(self, "_meta", dict(args[0]))
        elif len(args) == 2:
            self._meta[args[0]] = args[1]
        elif args:
            raise TypeError(f"set_metadata: expected 1 or 2 positional arguments, got {len(args)}")
        else:
            self._meta.update(kwargs)
        bump_epoch()

    def add_axis(self, axis_index: int, axis_name: Any) -> None:
        """Called after a transform inserted a mapped axis into this variable's axis
        metadata (``nn.vmap`` / ``nn.scan`` with ``transform_metadata``,
        ``nn.transform_metadata``); runs the ``on_add_axis`` hooks of its metadata,
        ``hook(variable, axis_index, axis_name)``. Subclasses may override it.

        Args:
          axis_index: the position of the new axis.
          axis_name: the mapped axis's partition name (a mesh axis name or None).
        """
        for hook in self._meta.get("on_add_axis", ()):
            hook(self, axis_index, axis_name)

    def remove_axis(self, axis_index: int, axis_name: Any) -> None:
        """Called after a transform removed its mapped axis from this variable's axis
        metadata; runs the ``on_remove_axis`` hooks of its metadata. Subclasses may
        override it.

        Args:
          axis_index: the position of the removed axis.
          axis_name: the mapped axis's partition name (a mesh axis name or None).
        """
        for hook in self._meta.get("on_remove_axis", ()):
            hook(self, axis_index, axis_name)

    def get_raw_value(self) -> Any:
        """The stored value (``raw_value``)."""
        return self.raw_value

    def set_raw_value(self, value: Any) -> None:
        """Store ``value`` as it is (``raw_value``).

        Args:
          value: the new raw value (stored without any conversion).
        """
        object.__setattr__(self, "raw_value", value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the value (a Variable holding a callable proxies the call, as Flax NNX's).

        Args:
          args: the call's positional arguments.
          kwargs: the call's keyword arguments.

        Raises:
          TypeError: the value is not callable.
        """
        value = self.raw_value
        if not callable(value):
            raise TypeError(
                f"{type(self).__name__} is not callable: its value is a {type(value).__name__}"
            )
        return value(*args, **kwargs)

    def __getattr__(self, name: str):
        # only called when normal lookup fails: metadata, then array attributes
        if name.startswith("__"):
            raise AttributeError(name)
        meta = object.__getattribute__(self, "_meta")
        if name in meta:
            return meta[name]
        alias = _SHARDING_ALIASES.get(name)  # Flax NNX's out_sharding = sharding_names
        if alias is not None and alias in meta:
            return meta[alias]
        raw = object.__getattribute__(self, "raw_value")
        try:
            return getattr(raw, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__} has no metadata or array attribute {name!r}"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("raw_value",):
            object.__setattr__(self, name, value)
        elif name == "value":
            Variable.value.fset(self, value)  # type: ignore[attr-defined]
        else:
            self._meta[name] = value
            bump_epoch()

    def __delattr__(self, name: str) -> None:
        if name in self._meta:
            del self._meta[name]
            bump_epoch()
        else:
            raise AttributeError(name)

    @classmethod
    def from_metadata(cls, value: Any, metadata: dict[str, Any]) -> Variable:
        """A ``cls`` holding ``value`` with the metadata dict ``metadata`` (the inverse
        of ``v.value, v.metadata``).

        Args:
          value: the value to hold.
          metadata: the metadata dict.

        >>> from cairn import nn
        >>> nn.Param.from_metadata(1.0, {"sharding_names": None}).metadata
        {'sharding_names': None}
        """
        return cls(value, **dict(metadata))

    def replace(self, value: Any = None, **metadata: Any) -> Variable:
        """A new variable of the same type, with ``value`` (default: the same value)
        and the metadata updated by ``metadata``.

        Args:
          value: the new value; None keeps the current one.
          metadata: metadata entries to add or replace.
        """
        new = object.__new__(type(self))
        object.__setattr__(new, "_meta", {**self._meta, **metadata})
        object.__setattr__(new, "raw_value", self.raw_value if value is None else value)
        return new

    def copy(self) -> Variable:
        return self.replace()

    # --- array protocol ---
    def __jax_array__(self):
        return jnp.asarray(self.raw_value)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.raw_value, dtype=dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return jnp.shape(self.raw_value)

    @property
    def dtype(self) -> Any:
        return getattr(self.raw_value, "dtype", None) or jnp.result_type(self.raw_value)

    @property
    def ndim(self) -> int:
        return jnp.ndim(self.raw_value)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def T(self) -> Any:
        return self.raw_value.T

    def __len__(self):
        return len(self.raw_value)

    def __iter__(self):
        return iter(self.raw_value)

    def __bool__(self):
        return bool(self.raw_value)

    def __float__(self):
        return float(self.raw_value)

    def __int__(self):
        return int(self.raw_value)

    def __index__(self):
        return operator.index(self.raw_value)

    __add__ = _binop(operator.add)
    __radd__ = _rbinop(operator.add)
    __sub__ = _binop(operator.sub)
    __rsub__ = _rbinop(operator.sub)
    __mul__ = _binop(operator.mul)
    __rmul__ = _rbinop(operator.mul)
    __truediv__ = _binop(operator.truediv)
    __rtruediv__ = _rbinop(operator.truediv)
    __floordiv__ = _binop(operator.floordiv)
    __rfloordiv__ = _rbinop(operator.floordiv)
    __mod__ = _binop(operator.mod)
    __rmod__ = _rbinop(operator.mod)
    __pow__ = _binop(operator.pow)
    __rpow__ = _rbinop(operator.pow)
    __matmul__ = _binop(operator.matmul)
    __rmatmul__ = _rbinop(operator.matmul)
    __and__ = _binop(operator.and_)
    __rand__ = _rbinop(operator.and_)
    __or__ = _binop(operator.or_)
    __ror__ = _rbinop(operator.or_)
    __xor__ = _binop(operator.xor)
    __rxor__ = _rbinop(operator.xor)
    __lt__ = _binop(operator.lt)
    __le__ = _binop(operator.le)
    __gt__ = _binop(operator.gt)
    __ge__ = _binop(operator.ge)
    __neg__ = _unop(operator.neg)
    __pos__ = _unop(operator.pos)
    __abs__ = _unop(operator.abs)
    __invert__ = _unop(operator.invert)

    # in-place operators update the stored value (functional arrays underneath)
    def __iadd__(self, other):  # type: ignore[misc]
        self.value = self.raw_value + _unwrap(other)
        return self

    def __isub__(self, other):  # type: ignore[misc]
        self.value = self.raw_value - _unwrap(other)
        return self

    def __imul__(self, other):  # type: ignore[misc]
        self.value = self.raw_value * _unwrap(other)
        return self

    def __itruediv__(self, other):  # type: ignore[misc]
        self.value = self.raw_value / _unwrap(other)
        return self

    # ``==`` / ``!=`` compare the values, as Flax NNX's do (an array for array values);
    # hashing stays by identity, so a Variable can still key a dict or sit in a set
    __eq__ = _binop(operator.eq)
    __ne__ = _binop(operator.ne)
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_value_repr(self.raw_value)}{_meta_repr(self._meta)})"

    def __copy__(self):
        return self.replace()

    def __deepcopy__(self, memo):
        import copy

        new = object.__new__(type(self))
        memo[id(self)] = new  # a Variable found twice in the copied tree is copied once
        object.__setattr__(new, "_meta", copy.deepcopy(self._meta, memo))
        object.__setattr__(new, "raw_value", self.raw_value)
        return new

    def __getstate__(self):
        return {"raw_value": self.raw_value, "_meta": self._meta}

    def __setstate__(self, state):
        object.__setattr__(self, "_meta", state["_meta"])
        object.__setattr__(self, "raw_value", state["raw_value"])


def _value_repr(v) -> str:
    shape = getattr(v, "shape", None)
    dtype = getattr(v, "dtype", None)
    if shape is not None and dtype is not None:
        if isinstance(v, jax.ShapeDtypeStruct):
            return f"ShapeDtypeStruct({dtype}{list(shape)})"
        if len(shape) == 0 and not isinstance(v, jax.core.Tracer):
            try:
                return f"{np.asarray(v).item()!r}:{dtype}"
            except Exception:  # noqa: BLE001 - typed keys etc.
                pass
        return f"{dtype}{list(shape)}"
    return repr(v)


def _meta_repr(meta: dict) -> str:
    if not meta:
        return ""
    return ", " + ", ".join(f"{k}={v!r}" for k, v in meta.items())


class Param(Variable):
    """A trainable parameter (what :class:`~cairn.nn.Optimizer` updates by default)."""

    __slots__ = ()


class BatchStat(Variable):
    """Running statistics (e.g. BatchNorm's mean and variance); not trained.

    Args:
      value: the initial value (an array, or a :class:`VariableMetadata` / another variable whose
        metadata is merged in).
      metadata: any other keyword is metadata (``sharding_names``...), read back as an attribute and
        kept in ``v.metadata``.
    """

    __slots__ = ()


class Cache(Variable):
    """Decoding caches and other recomputable state (e.g. an attention KV cache)."""

    __slots__ = ()


class Intermediate(Variable):
    """Values recorded during a call with :meth:`Module.sow`."""

    __slots__ = ()


class Perturbation(Intermediate):
    """Zeros added to an intermediate value by :meth:`Module.perturb`, so that its
    gradient equals the gradient with respect to that intermediate."""

    __slots__ = ()


class OptState(Variable):
    """One leaf of an optimizer's state (held by :class:`~cairn.nn.Optimizer`)."""

    __slots__ = ()


class RngState(Variable):
    """Random-number state (keys and counters of :class:`~cairn.nn.Rngs`)."""

    __slots__ = ()


class RngKey(RngState):
    __slots__ = ()


class RngCount(RngState):
    __slots__ = ()


# --- templates: a variable without its value ---


def template_of(v: Variable) -> tuple[type, _HashableMeta]:
    """``(type, metadata)`` of ``v``: everything but its value, hashable (the pytree aux
    data of a variable, and how a module's or state's encoding stores one). Variables
    without metadata (the common case) share one template per type."""
    meta = v._meta
    if not meta:
        t = _EMPTY_TEMPLATES.get(type(v))
        if t is None:
            t = _EMPTY_TEMPLATES[type(v)] = (type(v), _HashableMeta({}))
        return t
    return (type(v), _HashableMeta(dict(meta)))


def rebuild_variable(template: tuple[type, _HashableMeta], value: Any) -> Variable:
    """A new variable of ``template``'s type and metadata (a copy of the dict) holding
    ``value``: the one way every part of cairn.nn rebuilds a variable from its template.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> w = nn.Param(jnp.ones(2), sharding_names=("embed",))
    >>> v = rebuild_variable(template_of(w), jnp.zeros(2))
    >>> type(v).__name__, v.sharding_names, v.value.tolist()
    ('Param', ('embed',), [0.0, 0.0])
    """
    new: Variable = object.__new__(template[0])
    object.__setattr__(new, "_meta", dict(template[1].meta))
    object.__setattr__(new, "raw_value", value)
    return new


# A Variable on its own is a pytree with one leaf at path "value".
def _var_flatten_with_keys(v: Variable):
    return ((jax.tree_util.GetAttrKey("value"), v.raw_value),), template_of(v)


def _var_flatten(v: Variable):
    return (v.raw_value,), template_of(v)


def _var_unflatten(aux, children):
    return rebuild_variable(aux, children[0])


class _HashableMeta:
    """Metadata dict made hashable for pytree aux data (unhashable values fall back to
    hashing by type and compare with ==)."""

    __slots__ = ("meta", "_hash")

    def __init__(self, meta: dict):
        self.meta = meta
        self._hash: int | None = None

    def __hash__(self):
        h = self._hash
        if h is None:
            h = self._hash = hash(tuple((k, static_hash(v)) for k, v in self.meta.items()))
        return h

    def __eq__(self, other):
        return isinstance(other, _HashableMeta) and static_eq(self.meta, other.meta)


def static_hash(v: Any) -> int:
    try:
        return hash(v)
    except TypeError:
        if isinstance(v, list | tuple):
            return hash((type(v), tuple(static_hash(x) for x in v)))
        if isinstance(v, dict):
            return hash((dict, tuple((k, static_hash(x)) for k, x in v.items())))
        return hash(type(v))


def static_eq(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        r = a == b
        return bool(r)
    except Exception:  # noqa: BLE001 - arrays etc. compare by identity
        return False


# (variable type, empty metadata) templates shared by every variable without metadata
_EMPTY_TEMPLATES: dict[type, tuple] = {}


def _register(cls):
    jax.tree_util.register_pytree_with_keys(
        cls, _var_flatten_with_keys, _var_unflatten, flatten_func=_var_flatten
    )


_register(Variable)


def _routed_getitem(self, idx):
    v = self.get_value()
    return v if idx is Ellipsis else v[idx]


def _routed_setitem(self, idx, new):
    new = _unwrap(new)
    if idx is not Ellipsis:
        new = jnp.asarray(self.raw_value).at[idx].set(new)
    self.set_value(new)


def _route_value_hooks(cls: type[Variable]) -> None:
    """A subclass overriding ``get_value`` / ``set_value`` (Flax NNX's hooks) has
    ``v[...]`` read / write through them; the base class keeps its direct access."""
    # assigning the methods on the subclass is the point (mypy forbids it by default)
    if "get_value" in cls.__dict__ and "__getitem__" not in cls.__dict__:
        cls.__getitem__ = _routed_getitem  # type: ignore[method-assign]
    if "set_value" in cls.__dict__ and "__setitem__" not in cls.__dict__:
        cls.__setitem__ = _routed_setitem  # type: ignore[method-assign]


def _register_subclass_hook():
    orig = Variable.__init_subclass__

    def hook(cls, **kw):
        orig(**kw)
        _register(cls)
        _route_value_hooks(cls)

    Variable.__init_subclass__ = classmethod(hook)  # type: ignore[method-assign,assignment]


_register_subclass_hook()
for _c in (Param, BatchStat, Cache, Intermediate, Perturbation, OptState, RngState, RngKey, RngCount):
    _register(_c)
