"""Trace a transform's step once per argument structure.

``nn.scan`` traces its step with ``jax.lax.scan`` on every call, because the step it
hands to JAX is a fresh closure each time. :class:`TraceCache` compiles the whole
transformed call with ``jax.jit``, one compiled function per argument structure (the
modules' :class:`~cairn.nn.GraphDef`, the pytree structure and the non-array leaves),
so a second call with the same structure reuses the trace: the user's step runs once,
as it does under Flax NNX's ``nnx.scan``. Inside an outer trace the compiled function
is inlined and its jaxpr is cached by JAX the same way.

Arrays (and the values of modules' variables) are the dynamic inputs; every other leaf
(Python scalars, strings, callables) is part of the cache key and stays a Python value
inside the call, as it would without the cache. Only changed variable values come back;
modules of the arguments returned by the call are the caller's own objects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from cairn.nn._nodes import LEAF, MOD, VAR, is_node
from cairn.nn._transform_plan import Plan

_DYNAMIC = (jax.Array, np.ndarray, np.generic)


class _Aux:
    """Static results of one trace carried in a pytree's aux data (JAX keeps them with
    the cached trace, so a cache hit returns them without running the Python)."""

    __slots__ = ("static", "values")

    def __init__(self, static: Any, values: Any) -> None:
        self.static = static
        self.values = values


jax.tree_util.register_pytree_node(
    _Aux, lambda a: ((a.values,), a.static), lambda static, ch: _Aux(static, ch[0])
)


def _static_plan(plan: Plan) -> Plan:
    """A copy of ``plan`` with only its structure (no caller objects or values kept
    alive by the cache)."""
    sp = Plan.__new__(Plan)
    sp.treedef = plan.treedef
    sp.kinds = list(plan.kinds)
    sp.descs = list(plan.descs)
    sp.objs = [None] * len(plan.kinds)
    sp.varlists = [None] * len(plan.kinds)
    sp.dyn = [None] * len(plan.kinds)
    sp.links = None if plan.links is None else dict(plan.links)  # indices only
    sp._linking = plan._linking
    return sp


def _split_leaves(plan: Plan) -> tuple[list, tuple]:
    """The dynamic values of ``plan`` (module value lists, variable values, array
    leaves) and the static leaves ``((index, type, value), ...)``."""
    dyn: list = []
    static: list = []
    for i, (k, d) in enumerate(zip(plan.kinds, plan.dyn)):
        if k == LEAF and not isinstance(d, _DYNAMIC):
            static.append((i, type(d), d))
        else:
            dyn.append(d)
    return dyn, tuple(static)


def _make_pure(impl: Callable, sp: Plan, static: tuple) -> Callable:
    """The pure function of the dynamic values that rebuilds the arguments, calls
    ``impl`` on them and returns ``(output values, changed variable values, _Aux)``."""
    static_at = {i: v for i, _, v in static}

    def pure(dyn: list) -> tuple:
        it = iter(dyn)
        full = [static_at[i] if i in static_at else next(it) for i in range(len(sp.kinds))]
        (args, _), rebuilt = sp.rebuild(full)
        out = impl(*args)
        new_dyn, new_descs = sp.collect(rebuilt)
        changed: list = []
        mask: list = []
        flags: tuple[bool, ...] | bool  # per variable for an unchanged module, else one
        for k, desc, nd, od, nds in zip(sp.kinds, sp.descs, new_dyn, full, new_descs):
            if k == MOD and nds == desc:
                flags = tuple(a is not b for a, b in zip(nd, od))
                changed.append([a for a, f in zip(nd, flags) if f])
            elif k in (MOD, VAR):
                flags = True if (k == MOD or nds != desc or nd is not od) else False
                changed.append(nd if flags else None)
            else:
                flags = False
                changed.append(None)
            mask.append(flags)
        own = {id(o): i for i, (k, o) in enumerate(zip(sp.kinds, rebuilt)) if k != LEAF}
        leaves, treedef = jax.tree_util.tree_flatten(out, is_leaf=is_node)
        marks = tuple(own.get(id(x)) if is_node(x) else None for x in leaves)
        values = [x for x, m in zip(leaves, marks) if m is None]
        return values, changed, _Aux((treedef, marks, tuple(new_descs), tuple(mask)), None)

    return pure


class TraceCache:
    """``impl(*args)`` (a transform's eager implementation, modules allowed anywhere in
    ``args``) compiled once per argument structure; changes to the argument modules
    are written back after each call.

    Args:
      impl: the transform's implementation.
    """

    def __init__(self, impl: Callable) -> None:
        self.impl = impl
        self.cache: dict = {}

    def __call__(self, *args: Any) -> Any:
        plan = Plan((args, {}))
        dyn, static = _split_leaves(plan)
        key = (plan.key(), static)
        try:
            jitted = self.cache.get(key)
        except TypeError:  # an unhashable static leaf: no caching for this call
            return self.impl(*args)
        if jitted is None:
            jitted = self.cache[key] = jax.jit(_make_pure(self.impl, _static_plan(plan), static))
        values, changed, aux = jitted(dyn)
        treedef, marks, new_descs, mask = aux.static
        self._write_back(plan, changed, new_descs, mask)
        it = iter(values)
        leaves = [plan.objs[m] if m is not None else next(it) for m in marks]
        return treedef.unflatten(leaves)

    @staticmethod
    def _write_back(plan: Plan, changed: list, new_descs: tuple, mask: tuple) -> None:
        """Give the caller's objects the changed values (and new structures)."""
        full: list = []
        for k, old, ch, flags in zip(plan.kinds, plan.dyn, changed, mask):
            if k == MOD and isinstance(flags, tuple):
                it = iter(ch)
                full.append([next(it) if f else o for o, f in zip(old, flags)])
            elif k in (MOD, VAR):
                full.append(ch if flags else old)
            else:
                full.append(old)
        if any(f if isinstance(f, bool) else any(f) for f in mask):
            plan.write_back(full, new_descs)


__all__ = ["TraceCache"]
