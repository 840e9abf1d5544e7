"""``nn.custom_vjp``: ``jax.custom_vjp`` for functions of modules.

The function's module arguments are flattened to their variables' values, which are
the primal inputs of a ``jax.custom_vjp`` function; its outputs are the function's
output and the arguments' values after the call (the state it changed), so a state
change inside the function (a counter, batch statistics) reaches the caller and its
cotangent reaches the backward rule. Plain Python values (ints, strings) are closed
over as constants instead of traced.

The backward rule sees, per differentiated argument, cotangents shaped like the
argument: in Flax's full graph mode (``graph`` and ``graph_updates``, the default) a
module's is a :class:`~cairn.nn.State` and the rule is ``bwd(*nondiff, res, (inputs_g,
out_g))``; otherwise a module's is a module of the same structure, the rule is
``bwd(*nondiff, res, out_g)`` and, when it takes one more positional parameter, also
``updates_g`` (per argument, a module whose variables changed by the call hold their
cotangents and the others None). The rule returns one cotangent per differentiated
argument (a State, a module, a Variable or arrays; a variable left out is zero).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.nn._autodiff import DiffState, _arg_leaf_ranges
from cairn.nn._graph import flat
from cairn.nn._graph_mode import check_mode, resolve_modes
from cairn.nn._module import Module
from cairn.nn._nodes import LEAF, MOD, VAR, is_node
from cairn.nn._state import State
from cairn.nn._transform_plan import Plan, call_annotated, expose_states, reject_bound_method
from cairn.nn._variables import Variable, rebuild_variable


def _traced(kind: int, value: Any) -> bool:
    """Whether a plan leaf goes through JAX (arrays, variables) or is a constant."""
    if kind != LEAF:
        return True
    return isinstance(value, jax.Array | np.ndarray | np.generic | float | complex)


def _zero_ct(x: Any) -> Any:
    """A zero cotangent for primal ``x`` (``float0`` for integer and bool values)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def _positional_count(fn: Callable) -> int | None:
    """How many positional parameters ``fn`` takes (None with ``*args``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    n = 0
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            return None
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            n += 1
    return n


class CustomVjp:
    """A function with a custom backward rule, made by :func:`custom_vjp`; call
    :meth:`defvjp` once before calling it.

    Args:
      fun: the function whose derivative the rules define.
      nondiff_argnums: positions of arguments that get no cotangent (passed to the backward
        rule first); ``DiffState`` entries are accepted and ignored.
      graph: Flax NNX's graph-mode keyword (resolved with ``graph_updates``).
      graph_updates: whether module state changes made inside come back to the caller.
    """

    def __init__(
        self, fun: Callable, nondiff_argnums: Sequence[int | DiffState], graph: bool | None,
        graph_updates: bool | None,
    ) -> None:
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.nondiff = tuple(a for a in nondiff_argnums if not isinstance(a, DiffState))
        self.graph_updates = resolve_modes(graph, graph_updates)[2]
        self.fwd: Callable | None = None
        self.bwd: Callable | None = None

    def defvjp(self, fwd: Callable, bwd: Callable, symbolic_zeros: bool = False) -> None:
        """Set the forward and backward rules.

        Args:
          fwd: ``fwd(*args) -> (out, residuals)``; may call the function itself.
          bwd: the backward rule (see :func:`custom_vjp` for its arguments).
          symbolic_zeros: must be False (JAX's symbolic-zero cotangents are not passed).

        Raises:
          NotImplementedError: ``symbolic_zeros=True``.
        """
        if symbolic_zeros:
            raise NotImplementedError("nn.custom_vjp: symbolic_zeros=True is not supported")
        self.fwd, self.bwd = fwd, bwd

    def __call__(self, *args: Any) -> Any:
        if self.fwd is None or self.bwd is None:
            raise TypeError(
                f"nn.custom_vjp: call defvjp(fwd, bwd) on {getattr(self.fun, '__name__', 'f')} "
                f"before calling it"
            )
        for n in self.nondiff:
            if not -len(args) <= n < len(args):
                raise ValueError(
                    f"nn.custom_vjp: nondiff_argnums entry {n} is out of range for "
                    f"{len(args)} positional arguments"
                )
        plan = Plan((args, {}))
        call = _Call(self, plan, args)
        out, new_dyn = call.run()
        vals, descs = plan.fill(call.full(new_dyn)), call.descs
        if not self.graph_updates:
            vals, descs = _values_only(plan, vals, descs)
        plan.write_back(vals, descs)
        return out


def _values_only(plan: Plan, vals: list, descs: list) -> tuple[list, list]:
    """Flax's ``graph_updates=False``: the new values of the arguments' variables in
    their structure before the call (a static attribute the function changed, or a
    variable it added or removed, stays inside the function)."""
    out = []
    for k, old_desc, old_dyn, new_desc, v in zip(plan.kinds, plan.descs, plan.dyn, descs, vals):
        if k == MOD and new_desc != old_desc:
            by_path = dict(zip(new_desc.paths, v))
            out.append([by_path.get(p, o) for p, o in zip(old_desc.paths, old_dyn)])
        else:
            out.append(v)
    return out, plan.static_descs()


class _Call:
    """One call of a :class:`CustomVjp`: which plan leaves are traced, which belong to
    differentiated arguments, and the ``jax.custom_vjp`` over the traced values."""

    def __init__(self, cv: CustomVjp, plan: Plan, args: tuple) -> None:
        self.cv, self.plan = cv, plan
        nargs = len(args)
        nondiff = {n % nargs for n in cv.nondiff}
        self.arg_treedefs = [
            jax.tree_util.tree_structure(expose_states(a), is_leaf=is_node) for a in args
        ]
        self.arg_of: list[int] = []
        for i, (lo, hi) in enumerate(_arg_leaf_ranges(args)):
            self.arg_of.extend([i] * (hi - lo))
        self.diff_args = [i for i in range(nargs) if i not in nondiff]
        self.nondiff_args = sorted(nondiff)
        self.traced = [_traced(k, d) for k, d in zip(plan.kinds, plan.dyn)]
        self.descs: Any = None
        self.changed: list | None = None

    def full(self, traced_vals: Sequence) -> list:
        """Plan-shaped values: ``traced_vals`` at traced leaves, the constants elsewhere."""
        it = iter(traced_vals)
        return [next(it) if t else d for t, d in zip(self.traced, self.plan.dyn)]

    def _call(self, fn: Callable, vals: Sequence) -> tuple[Any, list]:
        (a, _), rebuilt = self.plan.rebuild(self.full(vals))
        out = call_annotated(fn, a, {})
        new_dyn, self.descs = self.plan.collect(rebuilt)
        new = [nd if k != LEAF else v for k, nd, v in zip(self.plan.kinds, new_dyn, self.full(vals))]
        new = [x for x, t in zip(new, self.traced) if t]
        self.changed = [jax.tree_util.tree_map(lambda a, b: a is not b, n, v) for n, v in zip(new, vals)]
        return out, new

    def run(self) -> tuple[Any, list]:
        prim = jax.custom_vjp(lambda vals: self._call(self.cv.fun, vals))
        prim.defvjp(self._fwd, self._bwd)
        vals = [d for d, t in zip(self.plan.dyn, self.traced) if t]
        out, new = prim(vals)
        # values the call did not change stay the caller's own (not the rule's outputs)
        new = [
            jax.tree_util.tree_map(lambda n, v, ch: n if ch else v, n, v, ch)
            for n, v, ch in zip(new, vals, self.changed or [])
        ]
        return out, new

    def _fwd(self, vals):
        assert self.cv.fwd is not None
        (out, res), new = self._call(self.cv.fwd, vals)
        return (out, new), (res, vals)

    def _args_of(self, vals: Sequence) -> tuple:
        (a, _), _ = self.plan.rebuild(self.full(vals))
        return a

    def _bwd(self, saved, cts):
        assert self.cv.bwd is not None
        res, vals = saved
        out_ct, new_ct = cts
        args = self._args_of(vals)
        cargs = self._args_of(new_ct)
        nondiff = [args[i] for i in self.nondiff_args]
        if self.cv.graph_updates:
            ins = tuple(_as_state(cargs[i]) for i in self.diff_args)
            user = self.cv.bwd(*nondiff, res, (ins, out_ct))
        elif _positional_count(self.cv.bwd) == len(nondiff) + 3:
            user = self.cv.bwd(*nondiff, res, out_ct, self._updates(new_ct))
        else:
            user = self.cv.bwd(*nondiff, res, out_ct)
        return (self._to_cts(user, args, vals),)

    def _updates(self, new_ct: Sequence) -> tuple:
        """Per differentiated argument, its cotangent with None where the call left a
        variable unchanged."""
        assert self.changed is not None
        masked = iter([
            jax.tree_util.tree_map(lambda c, ch: c if ch else None, c, ch)
            for c, ch in zip(new_ct, self.changed)
        ])
        full = [next(masked) if t else None for t in self.traced]
        return tuple(self._arg_with(i, full) for i in self.diff_args)

    def _arg_with(self, i: int, vals: list) -> Any:
        """Argument ``i`` rebuilt with the plan-shaped ``vals`` (a module's None values
        give None attributes, a variable's None gives None)."""
        plan = self.plan
        leaves: list[Any] = []
        for li, (k, desc) in enumerate(zip(plan.kinds, plan.descs)):
            if self.arg_of[li] != i:
                continue
            v = vals[li]
            if k == MOD:
                leaves.append(_module_with_nones(desc, v))
            elif k == VAR:
                leaves.append(None if v is None else rebuild_variable(desc, v))
            else:
                leaves.append(v)
        return self.arg_treedefs[i].unflatten(leaves)  # type: ignore[attr-defined]

    def _to_cts(self, user: Any, args: tuple, vals: Sequence) -> list:
        """The user's cotangents (one per differentiated argument) as cotangents of the
        traced values; zeros for the rest."""
        if not isinstance(user, tuple | list) or len(user) != len(self.diff_args):
            raise ValueError(
                f"nn.custom_vjp: the backward rule must return a tuple with one cotangent per "
                f"differentiated argument ({len(self.diff_args)}), got {type(user).__name__}"
                + (f" of length {len(user)}" if isinstance(user, tuple | list) else "")
            )
        given = dict(zip(self.diff_args, user))
        full_vals = self.full(vals)
        cts = []
        per_arg: dict[int, list] = {}
        for li, (k, v) in enumerate(zip(self.plan.kinds, full_vals)):
            per_arg.setdefault(self.arg_of[li], []).append((li, k, v))
        out: dict[int, Any] = {}
        for i, items in per_arg.items():
            g = given.get(i)
            for (li, _k, _v), c in zip(items, _leaf_cts(g, items, self.plan, args[i])):
                out[li] = c
        for li, t in enumerate(self.traced):
            if t:
                c = out.get(li)
                v = full_vals[li]
                cts.append(jax.tree_util.tree_map(_zero_ct, v) if c is None else _fit(c, v))
        return cts


def _fit(c: Any, v: Any) -> Any:
    """Cotangent ``c`` for primal ``v``: zeros where None, ``float0`` for integers."""
    return jax.tree_util.tree_map(
        lambda cc, vv: _zero_ct(vv) if cc is None or not jnp.issubdtype(jnp.asarray(vv).dtype, jnp.inexact)
        else jnp.asarray(cc, jnp.asarray(vv).dtype),
        c, v, is_leaf=lambda x: x is None,
    ) if c is not None else jax.tree_util.tree_map(_zero_ct, v)


def _as_state(x: Any) -> Any:
    """A module cotangent as a State (Flax's full graph mode); others unchanged."""
    if isinstance(x, Module):
        c = flat(x)
        return State.from_flat(dict(zip(c.graphdef.paths, c.variables)))
    return x


def _module_with_nones(desc: Any, values: list) -> Module:
    """A module of structure ``desc`` whose variables hold ``values``; a None value
    leaves the attribute None."""
    m = desc.build_from_values([0 if v is None else v for v in values])
    c = flat(m)
    for p, v in zip(c.graphdef.paths, values):
        if v is None:
            _set_path(m, p, None)
    return m


def _set_path(m: Any, path: tuple, value: Any) -> None:
    obj = m
    for k in path[:-1]:
        obj = obj[k] if isinstance(k, int) else getattr(obj, k)
    last = path[-1]
    if isinstance(last, int):
        obj[last] = value
    else:
        object.__setattr__(obj, last, value)


def _leaf_cts(g: Any, items: list, plan: Plan, arg: Any) -> list:
    """Per plan leaf of one argument, the cotangent values (shaped like the leaf's
    dynamic value) from the user's cotangent ``g`` for that argument."""
    if g is None:
        return [None] * len(items)
    if len(items) == 1 and items[0][1] == MOD:
        li = items[0][0]
        return [_module_ct(g, plan.descs[li], plan.varlists[li])]
    if len(items) == 1 and items[0][1] == VAR and isinstance(arg, Variable):
        return [g.raw_value if isinstance(g, Variable) else g]
    leaves = jax.tree_util.tree_leaves(g, is_leaf=lambda x: isinstance(x, Module | Variable) or x is None)
    if len(leaves) != len(items):
        if isinstance(arg, State) and isinstance(g, State):
            leaves = [None] * len(items)
            flat_g = g.flat_state()
            for j, p in enumerate(arg.flat_state()):
                leaves[j] = flat_g.get(p)
            return [x.raw_value if isinstance(x, Variable) else x for x in leaves]
        raise ValueError(
            f"nn.custom_vjp: a cotangent of structure {jax.tree_util.tree_structure(g)} "
            f"does not match its argument {type(arg).__name__}"
        )
    out = []
    for (li, k, _), x in zip(items, leaves):
        if k == MOD:
            out.append(_module_ct(x, plan.descs[li], plan.varlists[li]))
        else:
            out.append(x.raw_value if isinstance(x, Variable) else x)
    return out


def _module_ct(g: Any, desc: Any, variables: list) -> list:
    """A module's cotangent values from a State (missing paths zero) or a module of the
    same structure."""
    if isinstance(g, State):
        d = g.flat_state()
        vals = [d.get(p) for p in desc.paths]
        return [x.raw_value if isinstance(x, Variable) else x for x in vals]
    if isinstance(g, Module):
        c = flat(g)
        idx = dict(zip(c.graphdef.paths, c.variables))
        return [idx[p].raw_value if p in idx else None for p in desc.paths]
    raise TypeError(
        f"nn.custom_vjp: the cotangent of a {desc.type.__name__} argument must be a State "
        f"or a {desc.type.__name__}, got {type(g).__name__}"
    )


def custom_vjp(
    fun: Callable | None = None,
    *,
    nondiff_argnums: Sequence[int | DiffState] = (),
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Any:
    """``jax.custom_vjp`` for functions whose arguments may be modules: define the
    backward rule with ``f.defvjp(fwd, bwd)``.

    ``fwd(*args)`` returns ``(out, residuals)`` (it may call ``f`` itself). In Flax's
    full graph mode (``graph`` and ``graph_updates``, the default) ``bwd(*nondiff_args,
    residuals, (inputs_g, out_g))`` gets, per differentiated argument, the cotangent of
    its state after the call (a :class:`State` for a module) and returns one cotangent
    per differentiated argument (a State may leave variables out: they get zero).
    Otherwise ``bwd(*nondiff_args, residuals, out_g[, updates_g])`` returns module-shaped
    cotangents. State changes the function makes are written back.

    Args:
      fun: the function; None returns a decorator.
      nondiff_argnums: positions of arguments not differentiated (passed first to
        ``bwd``). A :class:`DiffState` entry is accepted in full graph mode (its
        argument is differentiated; variables its rule leaves out get zero).
      graph: Flax NNX's graph-mode keyword.
      graph_updates: Flax NNX's graph-updates keyword.

    Raises:
      ValueError: a bound method of a module; a ``DiffState`` in ``nondiff_argnums``
        outside full graph mode.

    >>> import jax, jax.numpy as jnp
    >>> from cairn import nn
    >>> @nn.custom_vjp
    ... def f(x):
    ...     return jnp.sin(x)
    >>> f.defvjp(lambda x: (f(x), jnp.cos(x)), lambda cos_x, g: ((g[1] * cos_x * 2,)))
    >>> float(jax.grad(f)(0.0))
    2.0
    """
    check_mode("custom_vjp", graph, graph_updates)
    if fun is None:
        return functools.partial(
            custom_vjp, nondiff_argnums=nondiff_argnums, graph=graph, graph_updates=graph_updates
        )
    reject_bound_method(fun, "custom_vjp")
    if any(isinstance(a, DiffState) for a in nondiff_argnums) and not resolve_modes(graph, graph_updates)[2]:
        raise ValueError(
            "nn.custom_vjp: `nondiff_argnums` cannot contain `DiffState` objects outside full "
            "graph mode (graph=True, graph_updates=True); split the module instead"
        )
    for a in nondiff_argnums:
        if not isinstance(a, DiffState) and (not isinstance(a, int) or isinstance(a, bool)):
            raise TypeError(f"nn.custom_vjp: nondiff_argnums entries must be ints, got {a!r}")
    return CustomVjp(fun, nondiff_argnums, graph, graph_updates)
