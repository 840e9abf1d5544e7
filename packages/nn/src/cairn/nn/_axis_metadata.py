"""Axis metadata across a mapped axis: ``transform_metadata`` and the ``add_axis`` /
``remove_axis`` steps ``nn.vmap`` / ``nn.scan`` take with ``transform_metadata=``.

A variable's sharding names (``out_sharding``, ``sharding_names``, ``sharding``) describe
every axis of its value. Inside a function mapped over axis ``i`` the value has one axis
fewer, so entry ``i`` (the partition name of the mapped axis) is removed on the way in and
put back on the way out; a variable made inside gets the partition name inserted at its
output axis. Other metadata named in the transform's metadata (``{"nickname": "nick"}``)
is treated the same way when it is a tuple. A Variable's ``add_axis`` / ``remove_axis``
methods run after its metadata is changed (subclasses hook them, as in Flax NNX).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax

from cairn.nn._graph import flat
from cairn.nn._graph_mode import check_mode
from cairn.nn._nodes import Node
from cairn.nn._variables import Variable

PARTITION_NAME = "partition_name"
_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")


def _split_metadata(metadata: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    if PARTITION_NAME not in metadata:
        raise ValueError(
            f"transform metadata {dict(metadata)!r} has no {PARTITION_NAME!r} entry (the mesh "
            "axis name of the mapped axis, or None)"
        )
    return metadata[PARTITION_NAME], {k: v for k, v in metadata.items() if k != PARTITION_NAME}


def _insert(fields: tuple, index: int, value: Any) -> tuple:
    items = list(fields)
    while len(items) < index:
        items.append(None)
    items.insert(index, value)
    return tuple(items)


def _remove(fields: tuple, index: int, value: Any, key: str) -> tuple:
    items = list(fields)
    if not -len(items) <= index < len(items):
        raise ValueError(f"cannot remove axis {index} from {key}={fields!r}: out of range")
    removed = items.pop(index)
    if removed != value:
        raise ValueError(
            f"expected to remove {value!r} at index {index} from {key}={fields!r}, "
            f"but found {removed!r}"
        )
    return tuple(items)


def add_axis(variable: Variable, index: int, metadata: Mapping[str, Any]) -> None:
    """Insert the mapped axis at ``index`` into ``variable``'s axis metadata, then call
    its ``add_axis(index, partition_name)``.

    Args:
      variable: the variable (changed in place).
      index: the position of the new axis.
      metadata: the transform's metadata: ``{PARTITION_NAME: name, other_key: value}``.
    """
    name, others = _split_metadata(metadata)
    meta = variable.get_metadata()
    for key in _SHARDING_KEYS:
        if meta.get(key):
            variable.set_metadata(key, _insert(tuple(meta[key]), index, name))
    for key, value in others.items():
        if isinstance(meta.get(key), tuple) and meta[key]:
            variable.set_metadata(key, _insert(meta[key], index, value))
    variable.add_axis(index, name)


def remove_axis(variable: Variable, index: int, metadata: Mapping[str, Any]) -> None:
    """Remove the mapped axis at ``index`` from ``variable``'s axis metadata (it must
    hold the partition name there), then call its ``remove_axis(index, partition_name)``.

    Args:
      variable: the variable (changed in place).
      index: the position of the mapped axis.
      metadata: the transform's metadata: ``{PARTITION_NAME: name, other_key: value}``.

    Raises:
      ValueError: the metadata holds another name at ``index``.
    """
    name, others = _split_metadata(metadata)
    meta = variable.get_metadata()
    for key in _SHARDING_KEYS:
        if meta.get(key):
            variable.set_metadata(key, _remove(tuple(meta[key]), index, name, key))
    for key, value in others.items():
        if isinstance(meta.get(key), tuple) and meta[key]:
            variable.set_metadata(key, _remove(meta[key], index, value, key))
    variable.remove_axis(index, name)


def _variables_with_axes(tree: Any, axes: Any) -> list[tuple[Variable, int]]:
    """``(variable, axis)`` for every Variable in ``tree`` whose prefix axis is an int
    (None, ``Carry`` and other markers map nothing). ``axes`` is one axis for all of
    ``tree``, a tuple / list matching it, or a ``StateAxes`` for a module."""
    out: list[tuple[Variable, int]] = []
    if isinstance(axes, (tuple, list)) and isinstance(tree, (tuple, list)):
        if len(axes) != len(tree):
            raise ValueError(f"axes {axes!r} has {len(axes)} entries for {len(tree)} values")
        for t, a in zip(tree, axes):
            out += _variables_with_axes(t, a)
        return out
    preds = getattr(axes, "preds", None)
    if preds is not None and isinstance(tree, Node):  # StateAxes: per variable
        f = flat(tree)
        for p, v in zip(f.graphdef.paths, f.variables):
            ax = next((a for pred, (_, a) in zip(preds, axes.items) if pred(p, v)), None)
            if isinstance(ax, int) and not isinstance(ax, bool):
                out.append((v, ax))
        return out
    if not isinstance(axes, int) or isinstance(axes, bool):
        return out
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, (Variable, Node))):
        if isinstance(leaf, Variable):
            out.append((leaf, axes))
        elif isinstance(leaf, Node):
            out += [(v, axes) for v in flat(leaf).variables]
    return out


def with_axis_metadata(
    f: Callable, in_axes: Any, out_axes: Any, metadata: Mapping[str, Any], name: str
) -> Callable:
    """``f`` that, around each call, removes the mapped axis from the metadata of the
    variables its arguments map (``in_axes``), and afterwards puts it back on them and on
    every variable created under them or returned (``out_axes``).

    Args:
      f: the function.
      in_axes: the per-argument axes.
      out_axes: the output's axes.
      metadata: ``{PARTITION_NAME: name, ...}``.
      name: the transform, for messages.
    """
    _split_metadata(metadata)
    signature = _signature(f)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        if kwargs and signature is not None:
            bound = signature.bind(*args, **kwargs)
            args, kwargs = bound.args, bound.kwargs
        mapped = _variables_with_axes(tuple(args), _per_arg(in_axes, len(args), name))
        for v, ax in mapped:
            remove_axis(v, ax, metadata)
        done: set[int] = set()  # a variable returned from the arguments gets one axis
        try:
            out = f(*args, **kwargs)
        finally:
            for v, ax in _variables_with_axes(tuple(args), _per_arg(in_axes, len(args), name)):
                done.add(id(v))
                add_axis(v, ax, metadata)
        for v, ax in _variables_with_axes(out, out_axes):
            if id(v) not in done:
                done.add(id(v))
                add_axis(v, ax, metadata)
        return out

    return wrapper


def _signature(f: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(f)
    except (TypeError, ValueError):
        return None


def _per_arg(axes: Any, n: int, name: str) -> tuple:
    if isinstance(axes, (tuple, list)):
        if len(axes) != n:
            raise ValueError(f"{name}: in_axes has {len(axes)} entries for {n} positional arguments")
        return tuple(axes)
    return (axes,) * n


def transform_metadata(
    f: Callable | None = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    partition: str | None,
    graph: bool | None = None,
) -> Callable:
    """Adjust variables' axis metadata as if ``f`` ran inside a transform mapped over
    ``in_axes`` / ``out_axes`` whose axis is sharded over mesh axis ``partition``.

    Around each call the entry at the mapped axis (``partition``) is removed from the
    sharding names of the arguments' variables; after it, it is put back, and inserted
    into those of the variables ``f`` returns or creates under its arguments. Values
    changed inside stay changed. Stack it under ``nn.vmap`` / ``nn.scan`` with the same
    axes, as Flax NNX does.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> @nn.transform_metadata(in_axes=0, out_axes=1, partition="layers")
    ... def f(v):
    ...     assert v.out_sharding == ("dout",)
    ...     return nn.Param(jnp.zeros(()), out_sharding=("a", "b"), eager_sharding=False)
    >>> v = nn.Param(jnp.zeros(()), out_sharding=("layers", "dout"), eager_sharding=False)
    >>> f(v).out_sharding, v.out_sharding
    (('a', 'layers', 'b'), ('layers', 'dout'))

    Args:
      f: the function; None returns a decorator.
      in_axes: per positional argument: an int (its variables' mapped axis), None or
        ``nn.Carry`` (not mapped), or a ``StateAxes`` for a module; one value for all.
      out_axes: the same for the output.
      partition: the mesh axis name of the mapped axis (None: an unsharded axis).
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).

    Raises:
      ValueError: a variable's sharding names hold another name at the mapped axis.
    """
    check_mode("transform_metadata", graph)
    if f is None:
        return functools.partial(
            transform_metadata, in_axes=in_axes, out_axes=out_axes, partition=partition
        )
    return with_axis_metadata(
        f, in_axes, out_axes, {PARTITION_NAME: partition}, "transform_metadata"
    )
