"""The sharding-rules context and the placement of a variable when it is created.

This is the part of sharding that :class:`~cairn.nn.Variable` itself needs (a variable
created with ``sharding_names`` metadata under :func:`sharding_rules` is placed in its
``NamedSharding``), so it sits below ``_variables``; the rest (``with_partitioning``,
``get_partition_spec``, ``abstract_model``, ``sharded_init``) is in ``_sharding``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

_CTX: list[tuple[Any, Any]] = []  # stack of (mesh, rules)


@contextlib.contextmanager
def sharding_rules(rules: Any, mesh: Any = None) -> Iterator[None]:
    """Context in which variables with ``sharding_names`` metadata are created in
    their ``NamedSharding`` on ``mesh`` (rules: a ``LogicalAxisRules`` or a sequence of
    ``(logical_name, mesh_axes)`` pairs).

    Args:
      rules: a ``LogicalAxisRules`` or a sequence of ``(logical_name, mesh_axes)`` pairs.
      mesh: the device mesh variables are placed on; None sets only the rules (a mesh is then
        given where shardings are made, e.g. to :func:`sharded_init`).
    """
    from cairn.core_array import LogicalAxisRules

    if not isinstance(rules, LogicalAxisRules):
        rules = LogicalAxisRules(rules)
    _CTX.append((mesh, rules))
    try:
        yield
    finally:
        _CTX.pop()


@contextlib.contextmanager
def logical_axis_rules(rules: Any) -> Iterator[None]:
    """Flax's spelling of :func:`sharding_rules` without a mesh: logical axis names map
    to mesh axes by ``rules`` inside the context, on the mesh of an enclosing
    :func:`sharding_rules` or ``jax.set_mesh``. A variable's own ``sharding_rules``
    metadata is tried before these.

    Args:
      rules: a ``LogicalAxisRules`` or a sequence of ``(logical_name, mesh_axes)`` pairs.
    """
    ctx = current_rules()
    with sharding_rules(rules, ctx[0] if ctx is not None else None):
        yield


_EAGER = [True]  # use_eager_sharding's stack top: place variables when created


@contextlib.contextmanager
def use_eager_sharding(value: bool = True) -> Iterator[None]:
    """Context in which variables with axis names are (True, the default) or are not
    (False) placed in their sharding when created (Flax NNX's ``use_eager_sharding``).

    Args:
      value: whether to place variables when they are created.
    """
    _EAGER.append(bool(value))
    try:
        yield
    finally:
        _EAGER.pop()


def context_mesh() -> Any:
    """The mesh of an enclosing ``jax.set_mesh`` / ``jax.sharding.use_mesh``, or None
    (inside ``jax.jit`` its abstract mesh, which sharding constraints accept)."""
    get = getattr(jax.sharding, "get_mesh", None)
    if get is None:
        return None
    try:
        mesh = get()
    except ValueError:  # inside jax.jit: only the abstract mesh is known
        mesh = jax.sharding.get_abstract_mesh()
    return None if getattr(mesh, "empty", True) else mesh


def current_rules() -> tuple[Any, Any] | None:
    """The innermost ``(mesh, rules)`` of :func:`sharding_rules`, or None."""
    return _CTX[-1] if _CTX else None


def mesh_and_rules(mesh: Any, names: tuple, own_rules: Any = None) -> tuple[Any, Any] | None:
    """The mesh (the given one, else the ``sharding_rules`` context's) and the rules
    (the context's, else each name mapped to the mesh axis of the same name; a
    variable's ``own_rules`` come first); None when no mesh is in scope.

    Raises:
      ValueError: ``own_rules`` maps a name the context maps differently.
    """
    ctx = current_rules()
    ctx_mesh, rules = ctx if ctx is not None else (None, None)
    mesh = mesh if mesh is not None else ctx_mesh
    if mesh is None:
        mesh = context_mesh()
    if mesh is None:
        return None
    from cairn.core_array import LogicalAxisRules

    if rules is None:
        rules = LogicalAxisRules([(n, n) for n in names if n is not None])
    if own_rules:
        own = list(LogicalAxisRules(own_rules))
        mine = dict(own)
        for name, axes in rules:
            if name in mine and mine[name] != axes:
                raise ValueError(
                    f"inconsistent logical axis rules for {name!r}: the variable's "
                    f"sharding_rules map it to {mine[name]!r}, the context to {axes!r}"
                )
        rules = LogicalAxisRules(own + [(n, a) for n, a in rules if n not in mine])
    return mesh, rules


def names_of(metadata: dict) -> tuple | None:
    """The logical axis names in a variable's metadata (``sharding_names``, the older
    ``sharding``, or Flax NNX's ``out_sharding``, which may be a ``PartitionSpec`` of
    mesh axis names), or None (no names, or a ready ``PartitionSpec`` as ``sharding``)."""
    names = metadata.get("sharding_names", metadata.get("sharding"))
    if names is None:
        out = metadata.get("out_sharding")
        own = _own_sharding(out)
        if own is not None:  # a NamedSharding: the mesh axes of its spec
            spec = getattr(own, "spec", None)
            return None if spec is None else tuple(spec)
        return None if out is None else tuple(out)
    if isinstance(names, PartitionSpec):
        return None
    return tuple(names)


def names_for(metadata: dict, ndim: int) -> tuple | None:
    """:func:`names_of` for an array of rank ``ndim``: Flax NNX's ``out_sharding`` may
    be shorter than the rank (a ``PartitionSpec``'s missing trailing axes are
    replicated), so it is padded with None; ``sharding_names`` must match exactly."""
    names = names_of(metadata)
    if names is None or "sharding_names" in metadata or "sharding" in metadata:
        return names
    return names + (None,) * max(0, ndim - len(names))


def sharding_for(names: tuple, ndim: int, mesh: Any, rules: Any) -> NamedSharding:
    """The ``NamedSharding`` of an array of rank ``ndim`` with logical axis ``names``.

    Raises:
      ValueError: ``names`` does not have one entry per axis.
    """
    from cairn.core_array import named_sharding

    if len(names) != ndim:
        raise ValueError(
            f"sharding_names {names} has {len(names)} entries for an array of rank {ndim}"
        )
    return named_sharding(mesh, names, rules)


def _own_sharding(out: Any) -> Any:
    """The ``jax.sharding.Sharding`` an ``out_sharding`` entry names by itself: a
    ``NamedSharding``, or the sharding of a ``Format`` (layout + sharding); else None
    (axis names or a PartitionSpec, resolved against a mesh)."""
    if isinstance(out, jax.sharding.Sharding):
        return out
    inner = getattr(out, "sharding", None)
    if type(out).__name__ == "Format" and isinstance(inner, jax.sharding.Sharding):
        return inner
    return None


def _check_axis_types(mesh: Any) -> None:
    """A mesh given to a Variable has all axes Auto or all Explicit (Flax NNX's rule).

    Raises:
      ValueError: naming the mixed axis types.
    """
    types = set(getattr(mesh, "axis_types", ()) or ())
    if len(types) > 1 and jax.sharding.AxisType.Manual not in types:
        raise ValueError(
            f"Variable mesh: all axes must be Explicit or all Auto to place a variable, got "
            f"mixed axis types {tuple(mesh.axis_types)} for axes {tuple(mesh.axis_names)}"
        )


def _place(value: Any, sharding: Any) -> Any:
    """``value`` in ``sharding``: a constraint for a tracer, ``device_put`` for an array,
    a sharded ``ShapeDtypeStruct`` for an abstract value."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    if isinstance(value, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(value, sharding)
    if isinstance(value, jax.Array):
        if isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh):
            # a concrete value made inside a trace (a broadcast key under vmap): the
            # context mesh there is abstract, so constrain instead of placing
            return jax.lax.with_sharding_constraint(value, sharding)
        return jax.device_put(value, sharding)
    return value


def shard_on_create(value: Any, metadata: dict) -> Any:
    """``value`` placed in the sharding its ``metadata``'s axis names give under the
    active rules (a constraint for a tracer, ``device_put`` for an array, a sharded
    ``ShapeDtypeStruct`` for an abstract value); unchanged when no mesh is in scope."""
    eager = metadata.get("eager_sharding")
    if not (_EAGER[-1] if eager is None else eager):  # a variable's own choice wins
        return value
    own = _own_sharding(metadata.get("out_sharding"))
    if own is not None:  # a NamedSharding (or a layout Format's) carries its mesh
        return _place(value, own)
    mesh = metadata.get("mesh")
    if mesh is not None:
        _check_axis_types(mesh)
    if mesh is None and current_rules() is None and context_mesh() is None:
        return value
    ndim = len(getattr(value, "shape", ()))
    names = names_for(metadata, ndim)
    if names is None:
        return value
    found = mesh_and_rules(mesh, names, metadata.get("sharding_rules"))
    if found is None:
        return value
    mesh, rules = found
    return _place(value, sharding_for(names, ndim, mesh, rules))
