"""Lifted transforms: JAX transforms that accept modules anywhere in their arguments
and write the state changes made inside (parameters, batch statistics, caches, RNG
counters, new variables) back to the caller's objects.

How it works: each module argument is replaced by the flat list of its variables'
values (cached per module while its structure is unchanged), the pure function rebuilds
fresh module objects from those values inside the transform, calls the user function,
and returns the new values. Outside, only the values are swapped into the original
Variable objects; if the function changed the structure (added a variable, ...), the
original objects are updated in place to the new structure.

``nn.jit`` keeps the Python work per call to a few list operations: the compiled
function is keyed by the modules' cached :class:`GraphDef`, arguments go to
``jax.jit``'s C++ dispatch as flat lists, and only the variables that changed come back.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from cairn.nn._graph import GraphDef, SharedReferenceError, _walk, flat, sync
from cairn.nn._module import Module, _is_node, annotate_exception
from cairn.nn._state import State
from cairn.nn._variables import EPOCH, Param, Variable, _HashableMeta

_set_raw = Variable.__dict__["raw_value"].__set__

_M, _V, _A = 0, 1, 2


# ----------------------------------------------------------------------------------
# generic decomposition of a pytree that may contain modules / variables


class _Plan:
    """A pytree split into a static description and flat dynamic values.

    ``leaves[i]`` is, per pytree leaf (modules and variables are leaves here): for a
    module the list of its variable values, for a variable its value, otherwise the leaf.
    """

    __slots__ = ("treedef", "kinds", "descs", "objs", "varlists", "dyn")

    def __init__(self, tree):
        leaves, self.treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_node)
        self.kinds = []
        self.descs = []
        self.objs = []
        self.varlists = []
        self.dyn = []
        seen: dict[int, int] = {}
        for x in leaves:
            if isinstance(x, Module):
                c = flat(x)
                self.kinds.append(_M)
                self.descs.append(c.graphdef)
                self.objs.append(x)
                self.varlists.append(c.variables)
                self.dyn.append([v.raw_value for v in c.variables])
                for v in c.variables:
                    _check_once(seen, v, x)
            elif isinstance(x, Variable):
                self.kinds.append(_V)
                self.descs.append((type(x), _HashableMeta(dict(x._meta))))
                self.objs.append(x)
                self.varlists.append(None)
                self.dyn.append(x.raw_value)
                _check_once(seen, x, x)
            else:
                self.kinds.append(_A)
                self.descs.append(None)
                self.objs.append(None)
                self.varlists.append(None)
                self.dyn.append(x)

    def key(self):
        return (self.treedef, tuple(self.kinds), tuple(self.descs))

    def rebuild(self, dyn) -> tuple[Any, list]:
        """Fresh objects from dynamic values: (tree, list of rebuilt leaves)."""
        out = []
        for kind, desc, d in zip(self.kinds, self.descs, dyn):
            if kind == _M:
                out.append(desc.build_from_values(d))
            elif kind == _V:
                var = object.__new__(desc[0])
                object.__setattr__(var, "_meta", dict(desc[1].meta))
                object.__setattr__(var, "raw_value", d)
                out.append(var)
            else:
                out.append(d)
        return self.treedef.unflatten(out), out

    def collect(self, rebuilt: list) -> tuple[list, list]:
        """New dynamic values and structure descriptors of rebuilt leaves after a call."""
        dyn, descs = [], []
        for kind, obj in zip(self.kinds, rebuilt):
            if kind == _M:
                c = _walk(obj)
                dyn.append([v.raw_value for v in c.variables])
                descs.append(c.graphdef)
            elif kind == _V:
                dyn.append(obj.raw_value)
                descs.append((type(obj), _HashableMeta(dict(obj._meta))))
            else:
                dyn.append(None)
                descs.append(None)
        return dyn, descs

    def write_back(self, dyn, descs) -> None:
        for i, kind in enumerate(self.kinds):
            if kind == _M:
                _write_module(self.objs[i], self.descs[i], self.varlists[i], descs[i], dyn[i])
            elif kind == _V:
                var = self.objs[i]
                _set_raw(var, dyn[i])
                if descs[i] != self.descs[i]:
                    object.__setattr__(var, "_meta", dict(descs[i][1].meta))
                    EPOCH[0] += 1

    def originals(self):
        """The tree with the caller's own objects (after write_back)."""
        leaves = [
            o if k != _A else d for k, o, d in zip(self.kinds, self.objs, self.dyn)
        ]
        return self.treedef.unflatten(leaves)


def _check_once(seen: dict, v: Variable, owner) -> None:
    prev = seen.get(id(v))
    if prev is not None and prev != id(owner):
        raise SharedReferenceError(
            f"the same {type(v).__name__} object is reachable from two arguments "
            f"({type(owner).__name__} and another); transform arguments must not share "
            f"variables"
        )
    if prev is not None:
        raise SharedReferenceError(
            f"the same {type(owner).__name__} object is passed twice to a transform"
        )
    seen[id(v)] = id(owner)


def _write_module(obj, old_gd, old_vars, new_gd, values) -> None:
    if new_gd is old_gd or new_gd == old_gd:
        for v, x in zip(old_vars, values):
            _set_raw(v, x)
    else:
        sync(obj, new_gd.build_from_values(values))


_annotate = annotate_exception


def _call_annotated(fun, args, kwargs):
    try:
        return fun(*args, **kwargs)
    except Exception as e:
        roots = [(str(i), a) for i, a in enumerate(args)] + [(repr(k), v) for k, v in kwargs.items()]
        _annotate(e, roots)
        raise


# ----------------------------------------------------------------------------------
# jit


def _normalize_argnums(nums, name) -> tuple[int, ...]:
    if nums is None:
        return ()
    if isinstance(nums, int):
        return (nums,)
    try:
        return tuple(int(n) for n in nums)
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints, got {nums!r}") from None


def _names(nums) -> tuple[str, ...]:
    if nums is None:
        return ()
    if isinstance(nums, str):
        return (nums,)
    return tuple(nums)


class _StructOut:
    """Carries new structures out of a jitted function: the graphdefs live in the pytree
    aux data (so jax's cache returns them per trace), the values are its children."""

    __slots__ = ("graphs", "values")

    def __init__(self, graphs, values):
        self.graphs = graphs
        self.values = values


jax.tree_util.register_pytree_node(
    _StructOut,
    lambda s: ((s.values,), s.graphs),
    lambda graphs, ch: _StructOut(graphs, ch[0]),
)


class _JitEntry:
    __slots__ = ("jitted", "descs")

    def __init__(self, jitted, descs):
        self.jitted = jitted
        self.descs = descs


class JitWrapped:
    """The callable returned by :func:`jit`."""

    def __init__(
        self,
        fun: Callable,
        *,
        static_argnums=None,
        static_argnames=None,
        donate_argnums=None,
        donate_argnames=None,
        **jit_kwargs,
    ):
        self.fun = fun
        functools.update_wrapper(self, fun)
        static = set(_normalize_argnums(static_argnums, "static_argnums"))
        donate = set(_normalize_argnums(donate_argnums, "donate_argnums"))
        sn, dn = _names(static_argnames), _names(donate_argnames)
        self._sig = None
        if sn or dn:
            try:
                self._sig = inspect.signature(fun)
            except (TypeError, ValueError):
                self._sig = None
            params = list(self._sig.parameters) if self._sig is not None else []
            for n in sn:
                if n not in params:
                    raise ValueError(f"static_argnames: {fun!r} has no parameter {n!r}")
                static.add(params.index(n))
            for n in dn:
                if n not in params:
                    raise ValueError(f"donate_argnames: {fun!r} has no parameter {n!r}")
                donate.add(params.index(n))
        if static & donate:
            raise ValueError(f"arguments {sorted(static & donate)} are both static and donated")
        for k in ("in_shardings", "out_shardings"):
            if jit_kwargs.get(k) is not None:
                raise NotImplementedError(
                    f"nn.jit: {k} is not supported; shard state with nn.with_partitioning "
                    f"(and a mesh context) or use jax.jit on nn.split state"
                )
            jit_kwargs.pop(k, None)
        self._static = frozenset(static)
        self._donate = frozenset(donate)
        self._jit_kwargs = jit_kwargs
        self._cache: dict = {}
        self._checked = None

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return functools.partial(self, obj)

    # the hot path ------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if kwargs:
            args, kwargs = self._bind(args, kwargs)
        ep = EPOCH[0]
        static = self._static
        donate = self._donate
        keyparts = []
        don: list = []
        keep: list = []
        tdon: list = []
        tkeep: list = []
        plans = None
        mod_ids = []
        for i, a in enumerate(args):
            if i in static:
                keyparts.append((type(a), a))
                continue
            if i in donate:
                leaves, targets = don, tdon
            else:
                leaves, targets = keep, tkeep
            if isinstance(a, Module):
                c = a.__dict__.get("_cairn_cache")
                if c is None or c.epoch != ep:
                    c = flat(a)
                keyparts.append(c.graphdef)
                vs = c.variables
                leaves.extend([v.raw_value for v in vs])
                targets.extend(vs)
                mod_ids.append(id(a))
            elif isinstance(a, jax.Array):
                keyparts.append(None)
                leaves.append(a)
                targets.append(None)
            else:
                p = _Plan(a)
                if plans is None:
                    plans = {}
                plans[i] = p
                keyparts.append(p.key())
                for kind, obj, d, vl in zip(p.kinds, p.objs, p.dyn, p.varlists):
                    if kind == _M:
                        leaves.extend(d)
                        targets.extend(vl)
                        mod_ids.append(id(obj))
                    elif kind == _V:
                        leaves.append(d)
                        targets.append(obj)
                        mod_ids.append(id(obj))
                    else:
                        leaves.append(d)
                        targets.append(None)
        if kwargs:
            p = _Plan(kwargs)
            if plans is None:
                plans = {}
            plans["kw"] = p
            keyparts.append(("kw", p.key()))
            for kind, obj, d, vl in zip(p.kinds, p.objs, p.dyn, p.varlists):
                if kind == _M:
                    keep.extend(d)
                    tkeep.extend(vl)
                    mod_ids.append(id(obj))
                elif kind == _V:
                    keep.append(d)
                    tkeep.append(obj)
                    mod_ids.append(id(obj))
                else:
                    keep.append(d)
                    tkeep.append(None)
        if len(mod_ids) > 1:
            sig = (ep, tuple(mod_ids))
            if sig != self._checked:
                _check_disjoint(tdon, tkeep)
                self._checked = sig
        key = (len(args), tuple(keyparts))
        try:
            entry = self._cache.get(key)
        except TypeError as e:
            raise TypeError(
                f"nn.jit: static arguments must be hashable ({e}); check static_argnums"
            ) from None
        if entry is None:
            entry = self._make(key, args, kwargs, plans)
            self._cache[key] = entry
        out, ud, uk, struct = entry.jitted(don, keep)
        for i, x in ud.items():
            _set_raw(tdon[i], x)
        for i, x in uk.items():
            _set_raw(tkeep[i], x)
        if struct is not None:
            self._apply_struct(struct, args, kwargs, plans)
        return out

    def _bind(self, args, kwargs):
        if self._sig is None:
            try:
                self._sig = inspect.signature(self.fun)
            except (TypeError, ValueError):
                return args, kwargs
        try:
            ba = self._sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"nn.jit({getattr(self.fun, '__name__', self.fun)}): {e}") from None
        return ba.args, ba.kwargs

    def _apply_struct(self, struct: _StructOut, args, kwargs, plans):
        for (where, new_descs), vals in zip(struct.graphs, struct.values):
            if where == "kw":
                p = plans["kw"]
                self._apply_plan_struct(p, new_descs, vals)
                continue
            a = args[where]
            if isinstance(a, Module):
                sync(a, new_descs.build_from_values(vals))
            else:
                self._apply_plan_struct(plans[where], new_descs, vals)

    @staticmethod
    def _apply_plan_struct(p: _Plan, new_descs, vals):
        for i, kind in enumerate(p.kinds):
            if kind == _M:
                _write_module(p.objs[i], p.descs[i], p.varlists[i], new_descs[i], vals[i])
            elif kind == _V:
                _set_raw(p.objs[i], vals[i])

    # building the pure function ----------------------------------------------------------
    def _make(self, key, args, kwargs, plans) -> _JitEntry:
        fun = self.fun
        static = self._static
        donate = self._donate
        nargs = len(args)
        # per-argument descriptions (static values, graphdefs, plans) frozen at this key
        descs = []
        for i, a in enumerate(args):
            if i in static:
                descs.append(("S", a))
            elif isinstance(a, Module):
                descs.append(("M", flat(a).graphdef, i in donate))
            elif isinstance(a, jax.Array):
                descs.append(("A", i in donate))
            else:
                descs.append(("P", plans[i], i in donate))
        kwplan = plans.get("kw") if (kwargs and plans) else None

        def pure(don, keep):
            itd, itk = iter(don), iter(keep)
            call_args = []
            records = []  # (where, kind, rebuilt, in_values, offset, donated, desc)
            offs = {True: 0, False: 0}
            for i, d in enumerate(descs):
                tag = d[0]
                if tag == "S":
                    call_args.append(d[1])
                    continue
                donated = d[-1]
                it = itd if donated else itk
                if tag == "M":
                    gd = d[1]
                    vals = [next(it) for _ in range(gd.num_variables)]
                    obj = gd.build_from_values(vals)
                    records.append((i, obj, vals, offs[donated], donated, gd))
                    offs[donated] += len(vals)
                    call_args.append(obj)
                elif tag == "A":
                    call_args.append(next(it))
                    offs[donated] += 1
                else:
                    p: _Plan = d[1]
                    dyn, start = _take_plan(p, it)
                    tree, rebuilt = p.rebuild(dyn)
                    records.append((i, rebuilt, dyn, offs[donated], donated, p))
                    offs[donated] += start
                    call_args.append(tree)
            kw = {}
            if kwplan is not None:
                dyn, start = _take_plan(kwplan, itk)
                kw, rebuilt = kwplan.rebuild(dyn)
                records.append(("kw", rebuilt, dyn, offs[False], False, kwplan))
                offs[False] += start
            out = _call_annotated(fun, call_args, kw)
            ud, uk = {}, {}
            changed_graphs, changed_vals = [], []
            for where, obj, vals, off, donated, desc in records:
                tgt = ud if donated else uk
                if isinstance(desc, GraphDef):
                    c = _walk(obj)
                    if c.graphdef == desc:
                        for j, v in enumerate(c.variables):
                            x = v.raw_value
                            if donated or x is not vals[j]:
                                tgt[off + j] = x
                    else:
                        changed_graphs.append((where, c.graphdef))
                        changed_vals.append([v.raw_value for v in c.variables])
                else:
                    p = desc
                    new_dyn, new_descs = p.collect(obj)
                    if tuple(new_descs) == tuple(
                        dd if k != _A else None for k, dd in zip(p.kinds, p.descs)
                    ):
                        j = off
                        for kind, nd, od in zip(p.kinds, new_dyn, vals):
                            if kind == _M:
                                for a_, b_ in zip(nd, od):
                                    if donated or a_ is not b_:
                                        tgt[j] = a_
                                    j += 1
                            else:
                                if kind == _V and (donated or nd is not od):
                                    tgt[j] = nd
                                j += 1
                    else:
                        changed_graphs.append((where, tuple(new_descs)))
                        changed_vals.append(new_dyn)
            struct = _StructOut(tuple(changed_graphs), changed_vals) if changed_graphs else None
            return out, ud, uk, struct

        del nargs
        jitted = jax.jit(pure, donate_argnums=(0,) if donate else (), **self._jit_kwargs)
        return _JitEntry(jitted, descs)

    # AOT helpers -----------------------------------------------------------------------
    def lower(self, *args, **kwargs):
        """Lower for the given arguments (``.compile()`` on the result compiles)."""
        entry, don, keep = self._prepare(args, kwargs)
        return entry.jitted.lower(don, keep)

    def _prepare(self, args, kwargs):
        if kwargs:
            args, kwargs = self._bind(args, kwargs)
        # run the argument processing of __call__ without calling
        keyparts, don, keep, plans = [], [], [], {}
        for i, a in enumerate(args):
            if i in self._static:
                keyparts.append((type(a), a))
                continue
            leaves = don if i in self._donate else keep
            if isinstance(a, Module):
                c = flat(a)
                keyparts.append(c.graphdef)
                leaves.extend(v.raw_value for v in c.variables)
            elif isinstance(a, jax.Array):
                keyparts.append(None)
                leaves.append(a)
            else:
                p = _Plan(a)
                plans[i] = p
                keyparts.append(p.key())
                for kind, d in zip(p.kinds, p.dyn):
                    if kind == _M:
                        leaves.extend(d)
                    else:
                        leaves.append(d)
        if kwargs:
            p = _Plan(kwargs)
            plans["kw"] = p
            keyparts.append(("kw", p.key()))
            for kind, d in zip(p.kinds, p.dyn):
                if kind == _M:
                    keep.extend(d)
                else:
                    keep.append(d)
        key = (len(args), tuple(keyparts))
        entry = self._cache.get(key)
        if entry is None:
            entry = self._make(key, args, kwargs, plans)
            self._cache[key] = entry
        return entry, don, keep


def _take_plan(p: _Plan, it) -> tuple[list, int]:
    dyn = []
    n = 0
    for kind, d in zip(p.kinds, p.dyn):
        if kind == _M:
            k = len(d)
            dyn.append([next(it) for _ in range(k)])
            n += k
        else:
            dyn.append(next(it))
            n += 1
    return dyn, n


def _check_disjoint(tdon, tkeep) -> None:
    seen = set()
    for v in (*tdon, *tkeep):
        if v is None:
            continue
        if id(v) in seen:
            raise SharedReferenceError(
                f"the same {type(v).__name__} object is reachable from two arguments of "
                f"an nn.jit function; arguments must not share modules or variables"
            )
        seen.add(id(v))


def jit(
    fun: Callable | None = None,
    *,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Sequence[str] | None = None,
    **jit_kwargs: Any,
):
    """Compile ``fun`` with ``jax.jit``; modules anywhere in its arguments are allowed
    and the changes ``fun`` makes to them are written back after each call.

    Donated module arguments (``donate_argnums``) give their variables' buffers to the
    computation: every variable of a donated module is rewritten with the new buffers.
    Non-donated arguments get back only the variables that changed. Static arguments must
    be hashable. Other keyword arguments go to ``jax.jit``.

    Use it as ``nn.jit(f)`` or as a decorator (``@nn.jit`` or
    ``@nn.jit(donate_argnums=0)``).

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> class Counter(nn.Module):
    ...     def __init__(self):
    ...         self.n = nn.BatchStat(jnp.zeros((), jnp.int32))
    >>> @nn.jit
    ... def tick(c):
    ...     c.n.value += 1
    >>> c = Counter(); tick(c); tick(c)
    >>> int(c.n.value)
    2
    """
    if fun is None:
        return functools.partial(
            jit,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
            **jit_kwargs,
        )
    return JitWrapped(
        fun,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        **jit_kwargs,
    )


# ----------------------------------------------------------------------------------
# the other transforms: trace on every call, so a side box carries the new structures


class _Box:
    __slots__ = ("value",)

    def __init__(self):
        self.value = None


def _argnums_tuple(argnums) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def grad(
    f: Callable | None = None,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    wrt: Any = Param,
    holomorphic: bool = False,
    allow_int: bool = False,
    reduce_axes=(),
):
    """Gradient of ``f`` (a scalar function) with respect to argument(s) ``argnums``.

    For a module argument, the gradient is taken with respect to its variables matching
    ``wrt`` (default: :class:`Param`) and returned as a :class:`State` of the same
    variable types holding the gradients (paths as in ``nn.state(module, wrt)``); other
    state changes made by ``f`` (batch statistics, RNG counters) are written back. Array
    arguments get array gradients, as with ``jax.grad``.
    """
    if f is None:
        return functools.partial(
            grad, argnums=argnums, has_aux=has_aux, wrt=wrt, holomorphic=holomorphic,
            allow_int=allow_int,
        )
    vg = value_and_grad(
        f, argnums=argnums, has_aux=has_aux, wrt=wrt, holomorphic=holomorphic,
        allow_int=allow_int,
    )

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        value, g = vg(*args, **kwargs)
        if has_aux:
            return g, value[1]
        return g

    return wrapper


def value_and_grad(
    f: Callable | None = None,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    wrt: Any = Param,
    holomorphic: bool = False,
    allow_int: bool = False,
    reduce_axes=(),
):
    """Like :func:`grad` but returns ``(value, grads)`` (``((value, aux), grads)`` with
    ``has_aux``)."""
    if f is None:
        return functools.partial(
            value_and_grad, argnums=argnums, has_aux=has_aux, wrt=wrt,
            holomorphic=holomorphic, allow_int=allow_int,
        )
    from cairn.nn._filters import to_predicate

    pred = to_predicate(wrt)
    nums = _argnums_tuple(argnums)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        for n in nums:
            if n >= len(args):
                raise TypeError(
                    f"nn.grad: argnums {n} is out of range for {len(args)} positional arguments"
                )
        plan = _Plan((args, kwargs))
        # which plan leaves belong to differentiated arguments
        arg_leaf_ranges = _arg_leaf_ranges(args, kwargs, plan)
        diff_sel = []  # (leaf index, [var indices] or None for the whole leaf)
        for n in nums:
            lo, hi = arg_leaf_ranges[n]
            for li in range(lo, hi):
                kind = plan.kinds[li]
                if kind == _M:
                    gd = plan.descs[li]
                    sel = [
                        j for j, (p, v) in enumerate(zip(gd.paths, plan.varlists[li]))
                        if pred(p, v)
                    ]
                    diff_sel.append((li, sel))
                elif kind == _V:
                    diff_sel.append((li, None))
                else:
                    diff_sel.append((li, None))
        box = _Box()

        def pure(diff_vals, dyn):
            dyn = list(dyn)
            for (li, sel), dv in zip(diff_sel, diff_vals):
                if sel is None:
                    dyn[li] = dv
                else:
                    vals = list(dyn[li])
                    for j, x in zip(sel, dv):
                        vals[j] = x
                    dyn[li] = vals
            tree, rebuilt = plan.rebuild(dyn)
            a, kw = tree
            out = _call_annotated(f, a, kw)
            new_dyn, new_descs = plan.collect(rebuilt)
            box.value = new_descs
            if has_aux:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise TypeError(
                        "nn.grad(has_aux=True): the function must return (value, aux)"
                    )
                loss, aux = out
            else:
                loss, aux = out, None
            return loss, (aux, new_dyn)

        diff_vals = []
        for li, sel in diff_sel:
            if sel is None:
                diff_vals.append(plan.dyn[li])
            else:
                diff_vals.append([plan.dyn[li][j] for j in sel])
        (loss, (aux, new_dyn)), g = jax.value_and_grad(
            pure, argnums=0, has_aux=True, holomorphic=holomorphic, allow_int=allow_int
        )(diff_vals, plan.dyn)
        plan.write_back(_fill_dyn(plan, new_dyn), box.value)
        # package gradients per argument
        grads_per_arg = []
        k = 0
        for n in nums:
            lo, hi = arg_leaf_ranges[n]
            a = args[n]
            items = diff_sel[k : k + (hi - lo)]
            gs = g[k : k + (hi - lo)]
            k += hi - lo
            grads_per_arg.append(_package_grads(a, plan, items, gs))
        gout = grads_per_arg[0] if isinstance(argnums, int) else tuple(grads_per_arg)
        value = (loss, aux) if has_aux else loss
        return value, gout

    return wrapper


def _fill_dyn(plan: _Plan, new_dyn):
    return [nd if k != _A else d for k, nd, d in zip(plan.kinds, new_dyn, plan.dyn)]


def _arg_leaf_ranges(args, kwargs, plan: _Plan) -> list[tuple[int, int]]:
    ranges = []
    lo = 0
    for a in args:
        n = len(jax.tree_util.tree_leaves(a, is_leaf=_is_node))
        ranges.append((lo, lo + n))
        lo += n
    return ranges


def _package_grads(arg, plan: _Plan, items, gs):
    """Gradients of one argument, shaped like the argument (modules -> State)."""
    leaves = []
    for (li, sel), gv in zip(items, gs):
        kind = plan.kinds[li]
        if kind == _M:
            gd = plan.descs[li]
            vs = plan.varlists[li]
            flat_state = {
                gd.paths[j]: vs[j].replace(value=x) for j, x in zip(sel, gv)
            }
            leaves.append(State.from_flat(flat_state))
        elif kind == _V:
            leaves.append(plan.objs[li].replace(value=gv))
        else:
            leaves.append(gv)
    if isinstance(arg, Module | Variable):
        return leaves[0]
    treedef = jax.tree_util.tree_structure(arg, is_leaf=_is_node)
    return treedef.unflatten(leaves)


def _lift(transform_name: str):
    """Decorator helper: none."""  # pragma: no cover


def _run_pure(f, plan: _Plan, box: _Box):
    """A pure function of the plan's dynamic values: (out, new_dyn)."""

    def pure(dyn):
        tree, rebuilt = plan.rebuild(dyn)
        a, kw = tree
        out = _call_annotated(f, a, kw)
        new_dyn, new_descs = plan.collect(rebuilt)
        box.value = new_descs
        return out, new_dyn

    return pure


def _prefix_axes(args, kwargs, plan: _Plan, in_axes) -> list:
    """Per plan leaf axis from a per-argument prefix ``in_axes``."""
    if not isinstance(in_axes, tuple | list):
        in_axes = (in_axes,) * len(args)
    if len(in_axes) != len(args):
        raise ValueError(
            f"in_axes has {len(in_axes)} entries for {len(args)} positional arguments"
        )
    axes = []
    for a, ax in zip(args, in_axes):
        if isinstance(a, Module | Variable):
            axes.append(ax)
            continue
        if isinstance(ax, StateAxes):
            raise TypeError(f"StateAxes can only be given for a module argument, not {type(a).__name__}")
        # expand a prefix tree over the argument's leaves (modules/variables are leaves)
        sub = jax.tree_util.tree_flatten(a, is_leaf=_is_node)[1]
        if ax is None or isinstance(ax, int):
            axes.extend([ax] * sub.num_leaves)
        else:
            expanded = jax.tree_util.tree_structure(a, is_leaf=_is_node).flatten_up_to(
                _broadcast_prefix(ax, a)
            )
            axes.extend(expanded)
    if kwargs:
        axes.extend([0] * len(jax.tree_util.tree_leaves(kwargs, is_leaf=_is_node)))
    return axes


def _broadcast_prefix(prefix, tree):
    return jax.tree_util.tree_map(
        lambda ax, sub: jax.tree_util.tree_map(lambda _: ax, sub, is_leaf=_is_node),
        prefix,
        tree,
        is_leaf=lambda x: x is None or _is_node(x),
    )


class StateAxes:
    """Per-variable axes for one module argument of :func:`vmap` / :func:`shard_map`:
    a mapping ``{filter: axis}`` (first matching filter wins; every variable must match
    one), e.g. ``nn.StateAxes({nn.Param: 0, ...: None})``."""

    def __init__(self, mapping):
        from cairn.nn._filters import to_predicate

        self.items = tuple(mapping.items())
        self.preds = tuple(to_predicate(f) for f, _ in self.items)

    def axes_for(self, graphdef, variables) -> list:
        from cairn.nn._filters import path_str

        out = []
        for p, v in zip(graphdef.paths, variables):
            for pred, (_, ax) in zip(self.preds, self.items):
                if pred(p, v):
                    out.append(ax)
                    break
            else:
                raise ValueError(
                    f"StateAxes: variable {path_str(p)!r} ({type(v).__name__}) matches none "
                    f"of the filters {[f for f, _ in self.items]!r}; add `...` last"
                )
        return out

    def __repr__(self):
        return f"StateAxes({dict(self.items)!r})"


def _leaf_axes_tree(plan: _Plan, axes):
    """Axes for the plan's dyn list (a module leaf gets its axis for every value)."""
    out = []
    for k, d, ax, desc, vl in zip(plan.kinds, plan.dyn, axes, plan.descs, plan.varlists):
        if k == _M:
            out.append(ax.axes_for(desc, vl) if isinstance(ax, StateAxes) else [ax] * len(d))
        else:
            out.append(ax)
    return out


def vmap(
    f: Callable | None = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    axis_name: Any = None,
    axis_size: int | None = None,
    spmd_axis_name: Any = None,
):
    """Vectorize ``f`` over axes of its arguments. ``in_axes`` is ``jax.vmap``'s per-
    argument prefix; for a module argument it is one int (every variable is mapped
    along that axis) or ``None`` (broadcast). Changes to a mapped module come back
    stacked along the same axis; a broadcast module must not be changed by batched
    values. Modules created inside ``f`` come out stacked (``out_axes``): this is how
    stacked layers for :func:`scan` are made.

    >>> import jax, jax.numpy as jnp
    >>> from cairn import nn
    >>> class W(nn.Module):
    ...     def __init__(self, key):
    ...         self.w = nn.Param(jax.random.normal(key, (3,)))
    >>> stacked = nn.vmap(W)(jax.random.split(jax.random.key(0), 4))
    >>> stacked.w.shape
    (4, 3)
    """
    if f is None:
        return functools.partial(
            vmap, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name,
            axis_size=axis_size, spmd_axis_name=spmd_axis_name,
        )

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        plan = _Plan((args, kwargs))
        axes = _prefix_axes(args, kwargs, plan, in_axes)
        leaf_axes = _leaf_axes_tree(plan, axes)
        _check_mapped_ranks(plan, axes)
        box = _Box()
        pure = _run_pure(f, plan, box)
        state_out_axes = leaf_axes
        out, new_dyn = jax.vmap(
            pure,
            in_axes=(leaf_axes,),
            out_axes=(out_axes, state_out_axes),
            axis_name=axis_name,
            axis_size=axis_size,
            spmd_axis_name=spmd_axis_name,
        )(plan.dyn)
        plan.write_back(_fill_dyn(plan, new_dyn), box.value)
        return out

    return wrapper


def _check_mapped_ranks(plan: _Plan, axes) -> None:
    """A clear error naming the variable when a mapped module has a variable whose rank
    is too small for its axis."""
    from cairn.nn._filters import path_str

    for kind, desc, d, ax0, vl in zip(plan.kinds, plan.descs, plan.dyn, axes, plan.varlists):
        if kind != _M:
            continue
        per_var = ax0.axes_for(desc, vl) if isinstance(ax0, StateAxes) else [ax0] * len(d)
        for p, v, ax in zip(desc.paths, d, per_var):
            if not isinstance(ax, int):
                continue
            nd = len(getattr(v, "shape", ()))
            if not (-nd <= ax < nd):
                raise ValueError(
                    f"nn.vmap: variable {path_str(p)!r} of {desc.type.__name__} has rank "
                    f"{nd} and cannot be mapped along axis {ax}; pass in_axes=None for this "
                    f"module (broadcast) or give every variable a batch axis"
                )


def _check_same(old_descs, new_descs, what: str):
    if list(old_descs) != list(new_descs):
        raise ValueError(
            f"{what}: the function changed the structure of a module in its carry (added or "
            f"removed variables or changed static attributes); create new state before "
            f"the loop"
        )


class _Carry:
    """A loop carry that may contain modules."""

    def __init__(self, tree):
        self.plan = _Plan(tree)

    @property
    def dyn(self):
        return self.plan.dyn

    def rebuild(self, dyn):
        tree, self._rebuilt = self.plan.rebuild(dyn)
        return tree

    def extract(self, tree, what: str):
        p2 = _Plan.__new__(_Plan)
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_node)
        if treedef != self.plan.treedef:
            raise ValueError(
                f"{what}: the returned carry has structure {treedef}, expected "
                f"{self.plan.treedef}"
            )
        dyn = []
        for kind, desc, x in zip(self.plan.kinds, self.plan.descs, leaves):
            if kind == _M:
                if not isinstance(x, Module):
                    raise ValueError(f"{what}: expected a module in the returned carry")
                c = _walk(x)
                _check_same([desc], [c.graphdef], what)
                dyn.append([v.raw_value for v in c.variables])
            elif kind == _V:
                dyn.append(x.raw_value if isinstance(x, Variable) else x)
            else:
                dyn.append(x)
        del p2
        return dyn

    def finish(self, dyn):
        self.plan.write_back(
            [d if k != _A else None for k, d in zip(self.plan.kinds, dyn)],
            [dd if k != _A else None for k, dd in zip(self.plan.kinds, self.plan.descs)],
        )
        leaves = [
            o if k != _A else d for k, o, d in zip(self.plan.kinds, self.plan.objs, dyn)
        ]
        return self.plan.treedef.unflatten(leaves)


def scan(
    f: Callable | None = None,
    *,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
):
    """``jax.lax.scan`` over ``f(carry, x) -> (carry, y)`` where modules may appear in
    the carry (threaded through, updated at the end) and in ``xs`` (sliced along the
    leading axis of every variable; per-step changes come back stacked). Scan over
    stacked layers: ``nn.scan(lambda h, layer: (layer(h), None))(x, stacked_layers)``.
    """
    if f is None:
        return functools.partial(scan, length=length, reverse=reverse, unroll=unroll)

    @functools.wraps(f)
    def wrapper(init, xs=None):
        carry = _Carry(init)
        xplan = _Plan(xs)
        box = _Box()

        def body(c_dyn, x_dyn):
            c = carry.rebuild(c_dyn)
            x, x_rebuilt = xplan.rebuild(x_dyn)
            new_c, y = _call_annotated(f, (c, x), {})
            new_c_dyn = carry.extract(new_c, "nn.scan")
            x_new_dyn, x_descs = xplan.collect(x_rebuilt)
            box.value = x_descs
            return new_c_dyn, (y, x_new_dyn)

        c_final, (ys, x_states) = jax.lax.scan(
            body, carry.dyn, xplan.dyn, length=length, reverse=reverse, unroll=unroll
        )
        out_carry = carry.finish(c_final)
        xplan.write_back(_fill_dyn(xplan, x_states), box.value)
        return out_carry, ys

    return wrapper


def fori_loop(lower, upper, body_fun: Callable, init_val, *, unroll=None):
    """``jax.lax.fori_loop`` where ``init_val`` may contain modules (updated in place at
    the end and returned)."""
    carry = _Carry(init_val)

    def body(i, dyn):
        v = carry.rebuild(dyn)
        return carry.extract(body_fun(i, v), "nn.fori_loop")

    kw = {} if unroll is None else {"unroll": unroll}
    out = jax.lax.fori_loop(lower, upper, body, carry.dyn, **kw)
    return carry.finish(out)


def while_loop(cond_fun: Callable, body_fun: Callable, init_val):
    """``jax.lax.while_loop`` where ``init_val`` may contain modules. ``cond_fun`` must
    not change state."""
    carry = _Carry(init_val)

    def cond(dyn):
        return cond_fun(carry.rebuild(dyn))

    def body(dyn):
        v = carry.rebuild(dyn)
        return carry.extract(body_fun(v), "nn.while_loop")

    out = jax.lax.while_loop(cond, body, carry.dyn)
    return carry.finish(out)


def _branches_call(branches, index_or_pred, operands, use_switch: bool):
    plan = _Plan((operands, {}))
    boxes = [_Box() for _ in branches]

    def make(fn, box):
        def pure(dyn):
            tree, rebuilt = plan.rebuild(dyn)
            a, _ = tree
            out = _call_annotated(fn, a, {})
            new_dyn, new_descs = plan.collect(rebuilt)
            box.value = new_descs
            return out, new_dyn

        return pure

    pures = [make(fn, b) for fn, b in zip(branches, boxes)]

    def check():
        descs = [b.value for b in boxes if b.value is not None]
        for i, d in enumerate(descs[1:], 1):
            if list(d) != list(descs[0]):
                raise ValueError(
                    f"nn.cond/switch: branch {i} leaves its module arguments with a "
                    f"different structure than branch 0 (added or removed variables or "
                    f"changed static attributes); every branch must keep the same structure"
                )
        return descs

    try:
        if use_switch:
            out, new_dyn = jax.lax.switch(index_or_pred, pures, plan.dyn)
        else:
            out, new_dyn = jax.lax.cond(index_or_pred, pures[0], pures[1], plan.dyn)
    except TypeError as e:
        check()
        raise e
    descs = check()
    plan.write_back(_fill_dyn(plan, new_dyn), descs[0])
    return out


def cond(pred, true_fun: Callable, false_fun: Callable, *operands):
    """``jax.lax.cond`` where operands may contain modules; both branches must leave
    them with the same structure; their changes are written back."""
    return _branches_call([true_fun, false_fun], pred, operands, False)


def switch(index, branches: Sequence[Callable], *operands):
    """``jax.lax.switch`` where operands may contain modules (see :func:`cond`)."""
    return _branches_call(list(branches), index, operands, True)


def remat(
    f: Callable | None = None,
    *,
    prevent_cse: bool = True,
    static_argnums: int | tuple[int, ...] = (),
    policy: Callable | None = None,
):
    """``jax.checkpoint`` (rematerialization): values and gradients are unchanged, the
    backward pass recomputes ``f``'s intermediates instead of storing them."""
    if f is None:
        return functools.partial(
            remat, prevent_cse=prevent_cse, static_argnums=static_argnums, policy=policy
        )
    statics = set(_argnums_tuple(static_argnums))

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        if statics:
            fixed = {i: args[i] for i in statics}
            dyn_args = tuple(a for i, a in enumerate(args) if i not in statics)

            def g(*da, **kw):
                it = iter(da)
                full = [fixed[i] if i in fixed else next(it) for i in range(len(args))]
                return f(*full, **kw)

            return remat(g, prevent_cse=prevent_cse, policy=policy)(*dyn_args, **kwargs)
        plan = _Plan((args, kwargs))
        box = _Box()
        pure = _run_pure(f, plan, box)
        out, new_dyn = jax.checkpoint(pure, prevent_cse=prevent_cse, policy=policy)(plan.dyn)
        plan.write_back(_fill_dyn(plan, new_dyn), box.value)
        return out

    return wrapper


checkpoint = remat


def eval_shape(f: Callable, *args, **kwargs):
    """``jax.eval_shape`` of ``f(*args, **kwargs)``: nothing is computed; the output
    (modules included) holds ``jax.ShapeDtypeStruct`` values. Inputs are not changed."""
    plan = _Plan((args, kwargs))
    box = _Box()
    pure = _run_pure(f, plan, box)
    out, _ = jax.eval_shape(pure, plan.dyn)
    return out


def shard_map(
    f: Callable,
    *,
    mesh,
    in_specs,
    out_specs,
    check_vma: bool = True,
    axis_names=None,
):
    """``jax.shard_map`` where arguments may be modules: a module's entry in
    ``in_specs`` is one ``PartitionSpec`` applied to every variable; the module's changed
    state comes back with the same spec."""
    from jax.sharding import PartitionSpec

    @functools.wraps(f)
    def wrapper(*args):
        plan = _Plan((args, {}))
        specs = in_specs
        if isinstance(specs, PartitionSpec) or specs is None:
            specs = (specs,) * len(args)
        axes = _prefix_axes(args, {}, plan, tuple(specs))
        leaf_specs = _leaf_axes_tree(plan, axes)
        box = _Box()
        pure = _run_pure(f, plan, box)
        kw = {"mesh": mesh, "in_specs": (leaf_specs,), "out_specs": (out_specs, leaf_specs)}
        if axis_names is not None:
            kw["axis_names"] = axis_names
        try:
            sm = jax.shard_map(pure, check_vma=check_vma, **kw)
        except TypeError:  # older jax spelling
            sm = jax.shard_map(pure, check_rep=check_vma, **kw)
        out, new_dyn = sm(plan.dyn)
        plan.write_back(_fill_dyn(plan, new_dyn), box.value)
        return out

    return wrapper


def _is_prefix_leaf(x):
    return x is None or isinstance(x, int)


__all__ = [
    "JitWrapped",
    "StateAxes",
    "checkpoint",
    "cond",
    "eval_shape",
    "fori_loop",
    "grad",
    "jit",
    "remat",
    "scan",
    "shard_map",
    "switch",
    "value_and_grad",
    "vmap",
    "while_loop",
]
_unused = (jnp,)
