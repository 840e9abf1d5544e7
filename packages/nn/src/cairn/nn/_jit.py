"""``nn.jit`` and ``nn.eval_shape``: compile (or trace abstractly) with modules as
arguments.

``nn.jit`` keeps the Python work per call to a few list operations: the compiled
function is keyed by the modules' cached :class:`~cairn.nn.GraphDef`, arguments go to
``jax.jit``'s C++ dispatch as flat lists, and only the variables that changed come back.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

from cairn.nn._graph import GraphDef, flat, fresh_flat, sync, tree_mode
from cairn.nn._graph_mode import check_mode, resolve_modes
from cairn.nn._jit_shardings import arg_shardings, constrain_arg, constrain_out
from cairn.nn._module import Module
from cairn.nn._nodes import MOD, VAR, SharedReferenceError
from cairn.nn._transform_plan import (
    Plan,
    call_annotated,
    check_output_aliasing,
    check_prefix,
    check_tree_args,
    reject_bound_method,
    set_raw,
    set_raw_data,
    write_module,
)
from cairn.nn._variables import EPOCH


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
    """One compiled function (``jitted(donated, kept) -> (out, donated updates, kept
    updates, new structures or None)``)."""

    __slots__ = ("jitted",)

    def __init__(self, jitted):
        self.jitted = jitted


# --- the compiled pure function: rebuild the arguments, call, collect the changes ---


def _arg_descs(args, static, donate, plans) -> list:
    """Per argument: ``("S", value)`` static, ``("M", graphdef, donated)`` module,
    ``("A", donated)`` array, ``("P", plan, donated)`` any other pytree."""
    descs: list[tuple] = []
    for i, a in enumerate(args):
        if i in static:
            descs.append(("S", a))
        elif isinstance(a, Module):
            descs.append(("M", flat(a).graphdef, i in donate))
        elif isinstance(a, jax.Array):
            descs.append(("A", i in donate))
        else:
            descs.append(("P", plans[i], i in donate))
    return descs


def _rebuild_call(descs, kwplan, don, keep) -> tuple[list, dict, list]:
    """The call arguments rebuilt from the flat donated / kept values, and one record
    ``(where, rebuilt, input values, offset, donated, graphdef or plan)`` per module or
    plan argument."""
    its = {True: iter(don), False: iter(keep)}
    offs = {True: 0, False: 0}
    call_args: list[Any] = []
    records: list[tuple] = []
    for i, d in enumerate(descs):
        if d[0] == "S":
            call_args.append(d[1])
            continue
        donated = d[-1]
        it = its[donated]
        if d[0] == "M":
            gd = d[1]
            vals = [next(it) for _ in range(gd.num_variables)]
            obj = gd.build_from_values(vals)
            records.append((i, obj, vals, offs[donated], donated, gd))
            offs[donated] += len(vals)
            call_args.append(obj)
        elif d[0] == "A":
            call_args.append(next(it))
            offs[donated] += 1
        else:
            p: Plan = d[1]
            dyn, n = p.take(it)
            tree, rebuilt = p.rebuild(dyn)
            records.append((i, rebuilt, dyn, offs[donated], donated, p))
            offs[donated] += n
            call_args.append(tree)
    kw = {}
    if kwplan is not None:
        dyn, _ = kwplan.take(its[False])
        kw, rebuilt = kwplan.rebuild(dyn)
        records.append(("kw", rebuilt, dyn, offs[False], False, kwplan))
    return call_args, kw, records


def _module_changes(obj, vals, off, donated, gd, tgt) -> tuple | None:
    """Record in ``tgt`` (flat index -> value) the values of module ``obj`` that changed
    (all of them when donated); return ``(graphdef, values)`` if its structure changed."""
    c = fresh_flat(obj)
    if c.graphdef != gd:
        return c.graphdef, [v.raw_value for v in c.variables]
    for j, v in enumerate(c.variables):
        x = v.raw_value
        if donated or x is not vals[j]:
            tgt[off + j] = x
    return None


def _plan_changes(p: Plan, rebuilt, vals, off, donated, tgt) -> tuple | None:
    """:func:`_module_changes` for a plan argument."""
    new_dyn, new_descs = p.collect(rebuilt)
    if new_descs != p.static_descs():
        return tuple(new_descs), new_dyn
    j = off
    for kind, nd, od in zip(p.kinds, new_dyn, vals):
        if kind == MOD:
            for a, b in zip(nd, od):
                if donated or a is not b:
                    tgt[j] = a
                j += 1
        else:
            if kind == VAR and (donated or nd is not od):
                tgt[j] = nd
            j += 1
    return None


def _collect_changes(records) -> tuple[dict, dict, _StructOut | None]:
    """The changed donated / kept values (flat index -> value) and the arguments whose
    structure changed."""
    ud: dict[int, Any] = {}
    uk: dict[int, Any] = {}
    graphs: list[tuple] = []
    values: list[Any] = []
    for where, obj, vals, off, donated, desc in records:
        tgt = ud if donated else uk
        if isinstance(desc, GraphDef):
            changed = _module_changes(obj, vals, off, donated, desc, tgt)
        else:
            changed = _plan_changes(desc, obj, vals, off, donated, tgt)
        if changed is not None:
            graphs.append((where, changed[0]))
            values.append(changed[1])
    return ud, uk, (_StructOut(tuple(graphs), values) if graphs else None)


def _check_disjoint(tdon, tkeep, allow: bool = False) -> bool:
    """Whether no variable is found in two arguments. With ``allow`` (graph mode, nothing
    donated) a shared one gives False; otherwise it raises."""
    seen = set()
    for v in (*tdon, *tkeep):
        if v is None:
            continue
        if id(v) in seen:
            if allow:
                return False
            raise SharedReferenceError(
                f"Inconsistent aliasing detected: the same {type(v).__name__} object is "
                f"found at paths in two arguments of an nn.jit function (Duplicate "
                f"{type(v).__name__}); arguments must not share modules or variables"
            )
        seen.add(id(v))
    return True


def _call_packed(packed: tuple, statics: tuple) -> Any:
    """The function behind :meth:`JitWrapped._shared_call`: ``fun(*args, **kwargs)``
    from the packed arguments (static ones put back at their positions)."""
    fun, dyn, kwargs = packed[0].value, list(packed[1]), packed[2]
    for i, v in statics:
        dyn[i] = v
    return fun(*dyn, **kwargs)


class _Static:
    """A hashable box that a pytree flattening treats as a leaf-free node: the user
    function travels in the packed arguments' structure (static aux data)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __hash__(self) -> int:
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and other.value is self.value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda v, _: _Static(v))


class JitWrapped:
    """The callable returned by :func:`jit`.

    Args:
      fun: the function to compile (modules allowed anywhere in its arguments).
      static_argnums: positions of the static (hashable) arguments.
      static_argnames: names of the static arguments.
      donate_argnums: positions of the donated arguments (their buffers, and donated modules'
        variables, are reused).
      donate_argnames: names of the donated arguments.
      jit_kwargs: more keyword arguments for ``jax.jit``.
    """

    def __init__(
        self,
        fun: Callable,
        *,
        static_argnums: int | Sequence[int] | None = None,
        static_argnames: str | Sequence[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        donate_argnames: str | Sequence[str] | None = None,
        **jit_kwargs: Any,
    ) -> None:
        self.fun = fun
        functools.update_wrapper(self, fun)
        static = set(_normalize_argnums(static_argnums, "static_argnums"))
        donate = set(_normalize_argnums(donate_argnums, "donate_argnums"))
        sn, dn = _names(static_argnames), _names(donate_argnames)
        self._sig: inspect.Signature | None = None
        if sn or dn:
            static |= self._argnames_positions(sn, "static_argnames")
            donate |= self._argnames_positions(dn, "donate_argnames")
        if static & donate:
            raise ValueError(f"arguments {sorted(static & donate)} are both static and donated")
        # applied as constraints inside the compiled function (module-aware)
        self._in_shardings = jit_kwargs.pop("in_shardings", None)
        self._out_shardings = jit_kwargs.pop("out_shardings", None)
        self._static = frozenset(static)
        self._donate = frozenset(donate)
        self._jit_kwargs = jit_kwargs
        self._cache: dict = {}
        self._checked: tuple | None = None
        self._graph: bool | None = jit_kwargs.pop("graph", None)
        self._graph_updates: bool | None = jit_kwargs.pop("graph_updates", None)
        self._link = bool(jit_kwargs.pop("_link", False))
        self._packed: JitWrapped | None = None  # compiles calls whose arguments share
        self._shared_sig: tuple | None = None

    def _argnames_positions(self, names: tuple[str, ...], what: str) -> set[int]:
        if self._sig is None:
            try:
                self._sig = inspect.signature(self.fun)
            except (TypeError, ValueError):
                self._sig = None
        params: list[str] = list(self._sig.parameters) if self._sig is not None else []
        for n in names:
            if n not in params:
                raise ValueError(f"{what}: {self.fun!r} has no parameter {n!r}")
        return {params.index(n) for n in names}

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self, obj)

    # --- the hot path ---
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(args, kwargs, False)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Lower for the given arguments: ``.compile()`` on the result compiles, and the
        compiled object is called with the same kind of arguments (modules included;
        their changes are written back, as by this function).

        Args:
          args: the positional arguments, as for a call.
          kwargs: the keyword arguments, as for a call.
        """
        return Lowered(self._run(args, kwargs, True), self)

    def _run(self, args: tuple, kwargs: dict, lowering: bool) -> Any:
        """The one argument preparation of a call and of ``lower``: bind keywords,
        flatten every argument into the donated / kept value lists (with the variables
        they belong to; ``plans`` holds the :class:`Plan` of each argument that is
        neither a module nor an array) and look up the compiled function by the
        arguments' structure. Then lower it, or call it and write the changes back."""
        if kwargs:
            args, kwargs = self._bind(args, kwargs)
        ep = EPOCH[0]
        static, donate = self._static, self._donate
        keyparts: list[Any] = []
        don: list = []
        keep: list = []
        tdon: list = []
        tkeep: list = []
        ids: list = []
        data = False  # a module with plain data attributes (see cairn.nn._data)
        plans: dict[Any, Plan] = {}
        for i, a in enumerate(args):
            if i in static:
                keyparts.append((type(a), a))
                continue
            if i in donate:
                values, targets = don, tdon
            else:
                values, targets = keep, tkeep
            if isinstance(a, Module):
                c = a.__dict__.get("_cairn_cache")
                if c is None or c.epoch != ep:
                    c = flat(a)
                keyparts.append(c.graphdef)
                data = data or c.graphdef.has_data
                vs = c.variables
                values.extend([v.raw_value for v in vs])
                targets.extend(vs)
                ids.append(id(a))
            elif isinstance(a, jax.Array):
                keyparts.append(None)
                values.append(a)
                targets.append(None)
            else:
                p = plans[i] = Plan(a, self._link)
                keyparts.append(p.key())
                data = data or p.has_data
                p.extend_flat(values, targets, ids)
        if kwargs:
            p = plans["kw"] = Plan(kwargs)
            keyparts.append(("kw", p.key()))
            data = data or p.has_data
            p.extend_flat(keep, tkeep, ids)
        if len(ids) > 1 and not lowering and not self._link:
            sig = (ep, tuple(ids))
            if sig != self._checked:
                if sig == self._shared_sig:
                    return self._shared_call(args, kwargs)
                allow = not donate and self._in_shardings is None and not tree_mode(self._graph)
                if not _check_disjoint(tdon, tkeep, allow):
                    self._shared_sig = sig
                    return self._shared_call(args, kwargs)
                self._checked = sig
        key = (len(args), tuple(keyparts))
        try:
            entry = self._cache[key]
        except (KeyError, TypeError):
            entry = self._miss(key, args, kwargs, plans)
        if lowering:
            return entry.jitted.lower(don, keep)
        out, ud, uk, struct = entry.jitted(don, keep)
        sr = set_raw_data if data else set_raw
        for i, x in ud.items():
            sr(tdon[i], x)
        for i, x in uk.items():
            sr(tkeep[i], x)
        if struct is not None:
            self._apply_struct(struct, args, plans)
        return out

    def _shared_call(self, args: tuple, kwargs: dict) -> Any:
        """A call whose arguments share a module or Variable (graph mode): all of them
        travel as one linked :class:`Plan`, so the shared object is one object inside
        and its new value is written back once."""
        if self._packed is None:
            self._packed = JitWrapped(
                _call_packed, static_argnums=(1,), out_shardings=self._out_shardings,
                _link=True, **self._jit_kwargs,
            )
        statics = tuple((i, args[i]) for i in sorted(self._static) if i < len(args))
        dyn = tuple(None if i in self._static else a for i, a in enumerate(args))
        return self._packed((_Static(self.fun), dyn, kwargs), statics)

    def _miss(self, key: tuple, args: tuple, kwargs: dict, plans: dict) -> _JitEntry:
        """The compiled function for ``key``, made on a cache miss."""
        try:
            entry = self._cache.get(key)
        except TypeError as e:
            raise TypeError(
                f"nn.jit: static arguments must be hashable ({e}); check static_argnums"
            ) from None
        if entry is None:
            entry = self._cache[key] = self._make(args, kwargs, plans)
        return entry

    def _bind(self, args, kwargs):
        sig = self._sig
        if sig is None:
            try:
                sig = self._sig = inspect.signature(self.fun)
            except (TypeError, ValueError):
                return args, kwargs
        try:
            ba = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"nn.jit({getattr(self.fun, '__name__', self.fun)}): {e}") from None
        return ba.args, ba.kwargs

    @staticmethod
    def _apply_struct(struct: _StructOut, args: tuple, plans: dict) -> None:
        """Write back the arguments whose structure the call changed."""
        for (where, new_descs), vals in zip(struct.graphs, struct.values):
            a = args[where] if where != "kw" else None
            if isinstance(a, Module):
                sync(a, new_descs.build_from_values(vals))
                continue
            p = plans[where]
            for i, kind in enumerate(p.kinds):
                if kind == MOD:
                    write_module(p.objs[i], p.descs[i], p.varlists[i], new_descs[i], vals[i])
                elif kind == VAR:
                    set_raw(p.objs[i], vals[i])

    def _make(self, args: tuple, kwargs: dict, plans: dict) -> _JitEntry:
        """Compile the pure function for the argument structure of ``args`` /
        ``kwargs``."""
        fun = self.fun
        kwplan = plans.get("kw") if kwargs else None
        descs = _arg_descs(args, self._static, self._donate, plans)

        in_specs = arg_shardings(self._in_shardings, len(args), self._static)
        out_specs = self._out_shardings
        no_alias = not resolve_modes(self._graph, self._graph_updates)[2]

        def pure(don, keep):
            call_args, kw, records = _rebuild_call(descs, kwplan, don, keep)
            for i, s in in_specs.items():
                call_args[i] = constrain_arg(call_args[i], s)
            out = call_annotated(fun, call_args, kw)
            if no_alias:  # Flax's tree mode / graph_updates=False: no input returned
                check_output_aliasing("jit", [r[1] for r in records], out)
            for i, s in in_specs.items():
                constrain_arg(call_args[i], s)  # the state leaves with its sharding
            if out_specs is not None:
                out = constrain_out(out, out_specs)
            ud, uk, struct = _collect_changes(records)
            return out, ud, uk, struct

        donate = (0,) if self._donate else ()
        return _JitEntry(jax.jit(pure, donate_argnums=donate, **self._jit_kwargs))


class Lowered:
    """``nn.jit(f).lower(...)``: jax's ``Lowered`` (``as_text``, ``cost_analysis``, ...
    are its), whose ``compile()`` gives a :class:`Compiled`."""

    def __init__(self, lowered: Any, wrapped: Callable) -> None:
        self._lowered = lowered
        self._wrapped = wrapped

    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        return Compiled(self._lowered.compile(*args, **kwargs), self._wrapped)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lowered, name)


class Compiled:
    """The compiled function of a :class:`Lowered`: jax's ``Compiled`` for inspection
    (``as_text``, ``cost_analysis``), and callable with the original kind of arguments,
    modules included: the call goes through the jitted function (the same program),
    so module changes are written back. Call the jax object (``.compiled``) with the
    flat value lists if you need that very executable."""

    def __init__(self, compiled: Any, wrapped: Callable) -> None:
        self._compiled = compiled
        self._wrapped = wrapped

    @property
    def compiled(self) -> Any:
        return self._compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapped(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiled, name)


def jit(
    fun: Callable | None = None,
    *,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Sequence[str] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
    **jit_kwargs: Any,
) -> Any:
    """Compile ``fun`` with ``jax.jit``; modules anywhere in its arguments are allowed
    and the changes ``fun`` makes to them are written back after each call.

    Donated module arguments (``donate_argnums``) give their variables' buffers to the
    computation: every variable of a donated module is rewritten with the new buffers.
    Non-donated arguments get back only the variables that changed. Static arguments must
    be hashable. ``in_shardings`` (one entry per non-static positional argument) and
    ``out_shardings`` may hold, for a module, one sharding for all its variables, an
    :class:`StateSharding` or a :func:`prefix` module of shardings; they are applied as
    sharding constraints, and an argument's state comes back with its ``in_shardings``.
    Other keyword arguments go to ``jax.jit``.

    Use it as ``nn.jit(f)`` or as a decorator (``@nn.jit`` or
    ``@nn.jit(donate_argnums=0)``). ``graph`` / ``graph_updates`` are Flax NNX's mode
    keywords, accepted with one behaviour (see :class:`set_graph_mode`).

    Args:
      fun: the function to compile; None returns a decorator.
      static_argnums: positions of the static (hashable) arguments.
      static_argnames: names of the static arguments.
      donate_argnums: positions of donated arguments.
      donate_argnames: names of donated arguments.
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
      graph_updates: Flax NNX's keyword, accepted for compatibility (one behaviour here).
      jit_kwargs: more keyword arguments for ``jax.jit``.

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
    check_mode("jit", graph, graph_updates)
    check_prefix(jit_kwargs.get("in_shardings"), "in_shardings", "jit", graph, graph_updates)
    check_prefix(jit_kwargs.get("out_shardings"), "out_shardings", "jit", graph, graph_updates)
    reject_bound_method(fun, "jit")
    kw = dict(
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        **jit_kwargs,
    )
    if fun is None:
        return functools.partial(jit, graph=graph, graph_updates=graph_updates, **kw)
    return JitWrapped(fun, graph=graph, graph_updates=graph_updates, **kw)


def eval_shape(
    f: Callable,
    *args: Any,
    graph: bool | None = None,
    graph_updates: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``jax.eval_shape`` of ``f(*args, **kwargs)``: nothing is computed; the output
    (modules included) holds ``jax.ShapeDtypeStruct`` values. Inputs are not changed.
    ``graph`` / ``graph_updates``: Flax NNX's mode keywords (one behaviour here).

    Args:
      f: the function.
      args: its positional arguments (modules allowed).
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
      graph_updates: Flax NNX's keyword, accepted for compatibility (one behaviour here).
      kwargs: its keyword arguments.
    """
    check_mode("eval_shape", graph, graph_updates)
    reject_bound_method(f, "eval_shape")
    plan = Plan((args, kwargs))
    no_alias = not resolve_modes(graph, graph_updates)[2]

    def pure(dyn):
        (a, kw), rebuilt = plan.rebuild(dyn)
        out = call_annotated(f, a, kw)
        if no_alias:  # Flax's tree mode / graph_updates=False: no input returned
            check_output_aliasing("eval_shape", rebuilt, out)
        return out

    return jax.eval_shape(pure, plan.dyn)


def jit_partial(
    fun: Callable,
    *partial_args: Any,
    graph: bool | None = None,
    graph_updates: bool | None = None,
    **jit_kwargs: Any,
) -> Callable:
    """:func:`jit` of ``fun`` with its first positional arguments bound to
    ``partial_args`` (a model, an optimizer): ``jit_partial(train_step, model, opt)(x,
    y)`` runs ``train_step(model, opt, x, y)`` compiled, and the changes it makes to
    ``model`` and ``opt`` are written back after each call, as with :func:`jit`.

    Args:
      fun: the function to compile.
      *partial_args: the leading positional arguments to bind.
      graph: Flax NNX's mode keyword (one behaviour here).
      graph_updates: Flax NNX's mode keyword (one behaviour here).
      **jit_kwargs: the keywords of :func:`jit` (``static_argnums`` count the bound
        arguments too).

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> m = nn.Linear(2, 1, rngs=nn.Rngs(0))
    >>> f = nn.jit_partial(lambda m, x: m(x), m)
    >>> f(jnp.ones((3, 2))).shape
    (3, 1)
    """
    check_mode("jit_partial", graph, graph_updates)
    check_tree_args("jit_partial", partial_args, graph)  # tree mode: bound args not shared
    jitted = jit(fun, graph=graph, graph_updates=graph_updates, **jit_kwargs)
    return _PartialJit(jitted, partial_args)


class _PartialJit:
    """What :func:`jit_partial` returns: the jitted function with its leading arguments
    bound; ``lower(*rest)`` lowers it, and the compiled result is called with the rest."""

    def __init__(self, jitted: JitWrapped, partial_args: tuple) -> None:
        functools.update_wrapper(self, jitted.fun)
        self._jitted = jitted
        self._partial = partial_args

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted(*self._partial, *args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Lower for the given (unbound) arguments; ``.compile()`` compiles."""
        lowered = self._jitted._run((*self._partial, *args), kwargs, True)
        return Lowered(lowered, self)
