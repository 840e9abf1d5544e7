"""``in_shardings`` / ``out_shardings`` of ``nn.jit`` for module arguments and outputs.

A module's entry is one sharding for every variable, a
:class:`~cairn.nn.StateSharding` or a module made by :func:`~cairn.nn.prefix` holding
shardings. They are applied inside the compiled function as sharding constraints: an
argument's variables are constrained on the way in and, after the call, on the way out
(so the caller's state ends up with that sharding, also when the function did not
touch it); outputs are constrained by ``out_shardings``.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec, Sharding

from cairn.nn._graph import flat
from cairn.nn._module import Module
from cairn.nn._transform_plan import set_raw, set_raw_data
from cairn.nn._variables import Variable
from cairn.nn._vmap_scan import StateAxes, _expand_out_axes, _module_axes


def _is_leaf(x: Any) -> bool:
    return x is None or isinstance(x, Sharding | PartitionSpec | StateAxes | Module | Variable)


def arg_shardings(in_shardings: Any, nargs: int, static: frozenset) -> dict[int, Any]:
    """Per positional argument index, its sharding entry (static arguments have none,
    as in ``jax.jit``).

    Raises:
      ValueError: a tuple of the wrong length.
    """
    if in_shardings is None:
        return {}
    positions = [i for i in range(nargs) if i not in static]
    if _is_leaf(in_shardings):
        return {i: in_shardings for i in positions}
    entries = tuple(in_shardings)
    if len(entries) != len(positions):
        raise ValueError(
            f"nn.jit: in_shardings has {len(entries)} entries for {len(positions)} non-static "
            f"positional arguments"
        )
    return {i: s for i, s in zip(positions, entries) if s is not None}


def _constrain(x: Any, s: Any) -> Any:
    return x if s is None else jax.lax.with_sharding_constraint(x, s)


def _constrain_module(m: Module, spec: Any) -> None:
    c = flat(m)
    for v, s in zip(c.variables, _module_axes(spec, c.graphdef, c.variables, c.variables)):
        if s is not None:
            set_raw_data(v, _constrain(v.raw_value, s))


def constrain_arg(a: Any, spec: Any) -> Any:
    """Argument ``a`` with sharding entry ``spec`` applied: a module's and a variable's
    values are constrained in place (the same objects are returned), arrays by value."""
    if isinstance(a, Module):
        _constrain_module(a, spec)
        return a
    if isinstance(a, Variable):
        set_raw(a, _constrain(a.raw_value, spec.raw_value if isinstance(spec, Variable) else spec))
        return a
    if _is_leaf(spec):
        return jax.tree_util.tree_map(lambda x: _constrain(x, spec), a)

    def one(s, sub):
        return constrain_arg(sub, s)

    return jax.tree_util.tree_map(one, spec, a, is_leaf=_is_leaf)


def constrain_out(out: Any, out_shardings: Any) -> Any:
    """The output ``out`` constrained by ``out_shardings`` (a prefix of it; a module
    output's entry may be a StateSharding or a prefix module)."""
    spec = _expand_out_axes(out_shardings, out)

    def one(s, x):
        if isinstance(s, Module):
            for vs, vx in zip(flat(s).variables, flat(x).variables):
                if vs.raw_value is not None:
                    set_raw_data(vx, _constrain(vx.raw_value, vs.raw_value))
            return x
        if isinstance(s, Variable):
            return _constrain(x, s.raw_value)
        return jax.tree_util.tree_map(lambda y: _constrain(y, s), x)

    if _is_leaf(spec):
        return one(spec, out)
    return jax.tree_util.tree_map(one, spec, out, is_leaf=_is_leaf)
