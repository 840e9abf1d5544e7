"""``nn.grad`` and ``nn.value_and_grad``: gradients with respect to modules' variables.

For a module argument the gradient is taken with respect to its variables matching a
filter (``wrt``, default :class:`~cairn.nn.Param`) and returned as a
:class:`~cairn.nn.State` of the same variable types; the other state changes the
function makes (batch statistics, RNG counters) are written back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from cairn.nn._filters import to_predicate
from cairn.nn._graph_mode import check_mode, resolve_modes
from cairn.nn._module import Module
from cairn.nn._nodes import MOD, VAR, is_node
from cairn.nn._state import State
from cairn.nn._transform_plan import (
    Box,
    Plan,
    call_annotated,
    check_consistent_prefixes,
    check_prefix,
    check_tree_args,
    expose_states,
    reject_bound_method,
)
from cairn.nn._variables import Param, Variable


def grad(
    f: Callable | None = None,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    wrt: Any = None,
    holomorphic: bool = False,
    allow_int: bool = False,
    reduce_axes: Sequence[Any] = (),
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Callable:
    """Gradient of ``f`` (a scalar function) with respect to argument(s) ``argnums``.

    For a module argument, the gradient is taken with respect to its variables matching
    ``wrt`` (default: :class:`Param`) and returned as a :class:`State` of the same
    variable types holding the gradients (paths as in ``nn.state(module, wrt)``); other
    state changes made by ``f`` (batch statistics, RNG counters) are written back. Array
    arguments get array gradients, as with ``jax.grad``. In Flax's tree mode
    (``graph=False`` or ``graph_updates=False``) a module's gradient is a module of the
    same structure and the default ``wrt`` is every floating variable. ``reduce_axes`` is
    accepted for Flax NNX compatibility and changes nothing.

    Args:
      f: the scalar function; None returns a decorator.
      argnums: the argument(s) to differentiate.
      has_aux: ``f`` returns ``(value, aux)``; the gradient function then returns ``(grads, aux)``.
      wrt: the filter of a module argument's variables to differentiate; None:
        :class:`Param` in full graph mode (the default), and in Flax's tree mode
        (``graph=False`` or ``graph_updates=False``) every variable holding floating
        values, as ``jax.grad`` of the module as a pytree would.
      holomorphic: as in ``jax.grad``.
      allow_int: as in ``jax.grad``.
      reduce_axes: accepted for Flax NNX compatibility; changes nothing.
      graph: Flax NNX's graph-mode keyword (None: the switch); with ``graph_updates`` it
        picks the result's form: a State in full graph mode, a module otherwise.
      graph_updates: Flax NNX's graph-updates keyword (None: the switch).

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> class W(nn.Module):
    ...     def __init__(self):
    ...         self.w = nn.Param(jnp.array([1.0, 2.0]))
    >>> g = nn.grad(lambda m: (m.w.value ** 2).sum())(W())
    >>> g["w"].value.tolist()
    [2.0, 4.0]
    """
    del reduce_axes  # NNX's keyword; nothing to reduce here
    check_mode("grad", graph, graph_updates)
    check_prefix(argnums, "argnums", "grad", graph, graph_updates)
    reject_bound_method(f, "grad")
    if f is None:
        return functools.partial(
            grad, argnums=argnums, has_aux=has_aux, wrt=wrt, holomorphic=holomorphic,
            allow_int=allow_int, graph=graph, graph_updates=graph_updates,
        )
    vg = value_and_grad(
        f, argnums=argnums, has_aux=has_aux, wrt=wrt, holomorphic=holomorphic,
        allow_int=allow_int, graph=graph, graph_updates=graph_updates,
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
    wrt: Any = None,
    holomorphic: bool = False,
    allow_int: bool = False,
    reduce_axes: Sequence[Any] = (),
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Callable:
    """Like :func:`grad` but returns ``(value, grads)`` (``((value, aux), grads)`` with
    ``has_aux``).

    Args:
      f: the scalar function; None returns a decorator.
      argnums: the argument(s) to differentiate.
      has_aux: ``f`` returns ``(value, aux)``.
      wrt: the filter of a module argument's variables to differentiate; None:
        :class:`Param` in full graph mode (the default), and in Flax's tree mode
        (``graph=False`` or ``graph_updates=False``) every variable holding floating
        values, as ``jax.grad`` of the module as a pytree would.
      holomorphic: as in ``jax.grad``.
      allow_int: as in ``jax.grad``.
      reduce_axes: accepted for Flax NNX compatibility; changes nothing.
      graph: Flax NNX's graph-mode keyword (None: the switch); with ``graph_updates`` it
        picks the result's form: a State in full graph mode, a module otherwise.
      graph_updates: Flax NNX's graph-updates keyword (None: the switch).
    """
    del reduce_axes  # NNX's keyword; nothing to reduce here
    check_mode("value_and_grad", graph, graph_updates)
    check_prefix(argnums, "argnums", "value_and_grad", graph, graph_updates)
    reject_bound_method(f, "value_and_grad")
    if f is None:
        return functools.partial(
            value_and_grad, argnums=argnums, has_aux=has_aux, wrt=wrt,
            holomorphic=holomorphic, allow_int=allow_int, graph=graph,
            graph_updates=graph_updates,
        )
    as_module = not resolve_modes(graph, graph_updates)[2]
    if wrt is None:
        wrt = _inexact if as_module else Param
    specs = _argnum_specs(argnums, wrt)
    nums = [n for n, _ in specs]
    single = isinstance(argnums, int | DiffState)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        for n in nums:
            if n >= len(args):
                raise TypeError(
                    f"nn.grad: argnums {n} is out of range for {len(args)} positional arguments"
                )
        check_tree_args("grad", (args, kwargs), graph)
        plan = Plan((args, kwargs), link=True)  # a shared object: one gradient, first place
        ranges = _arg_leaf_ranges(args)
        diff_sel = [x for n, pred in specs for x in _diff_selection(plan, [ranges[n]], pred)]
        if plan.links:  # a shared Variable is differentiated at all its places or none
            check_consistent_prefixes(plan, _diff_prefixes(plan, diff_sel))
        box = Box()
        pure = _diff_pure(f, plan, diff_sel, box, has_aux)
        diff_vals = [
            plan.dyn[li] if sel is None else [plan.dyn[li][j] for j in sel]
            for li, sel in diff_sel
        ]
        (loss, (aux, new_dyn)), g = jax.value_and_grad(
            pure, argnums=0, has_aux=True, holomorphic=holomorphic, allow_int=allow_int
        )(diff_vals, plan.dyn)
        plan.write_back(plan.fill(new_dyn), box.value)
        if plan.links and as_module:  # each place of a shared Variable gets its gradient
            g = _spread_grads(plan, diff_sel, g)
        grads = _grads_per_arg(args, nums, ranges, plan, diff_sel, g, as_module)
        gout = grads[0] if single else tuple(grads)
        return ((loss, aux) if has_aux else loss), gout

    return wrapper


@dataclasses.dataclass(frozen=True)
class DiffState:
    """An ``argnums`` entry of :func:`grad` / :func:`value_and_grad` that differentiates
    positional argument ``argnum`` with respect to the variables matching ``filter``
    (instead of the transform's ``wrt``), as Flax NNX's ``DiffState``.

    Args:
      argnum: the positional argument.
      filter: a filter (``nn.Param``, ``nn.LoRAParam``, ``...``, a path regex, ...).

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> m = nn.Linear(2, 1, rngs=nn.Rngs(0))
    >>> g = nn.grad(lambda m: m(jnp.ones((1, 2))).sum(), argnums=nn.DiffState(0, "bias"))(m)
    >>> g.flat_paths()
    ['bias']
    """

    argnum: int
    filter: Any

    _cairn_prefix_mapping = True  # a per-variable prefix (graph mode only, in Flax NNX)


def _inexact(path: tuple, v: Any) -> bool:
    """Flax's tree-mode ``grad`` filter: variables holding floating (or complex) values."""
    x = v.raw_value if isinstance(v, Variable) else v
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _argnum_specs(argnums: Any, wrt: Any) -> list[tuple[int, Any]]:
    """``(argnum, predicate)`` per differentiated argument; a :class:`DiffState` brings
    its own filter, a plain int uses ``wrt``."""
    items = [argnums] if isinstance(argnums, int | DiffState) else list(argnums)
    specs = []
    for a in items:
        if isinstance(a, DiffState):
            specs.append((a.argnum, to_predicate(a.filter)))
        elif isinstance(a, int) and not isinstance(a, bool):
            specs.append((a, to_predicate(wrt)))
        else:
            raise TypeError(
                f"nn.grad: argnums entries must be ints or nn.DiffState, got {a!r}"
            )
    return specs


def _arg_leaf_ranges(args) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` range of plan leaves of each positional argument."""
    ranges = []
    lo = 0
    for a in args:
        n = len(jax.tree_util.tree_leaves(expose_states(a), is_leaf=is_node))
        ranges.append((lo, lo + n))
        lo += n
    return ranges


def _diff_selection(plan: Plan, ranges, pred) -> list[tuple[int, list[int] | None]]:
    """``(leaf index, variable indices)`` per leaf of the differentiated arguments: for
    a module the indices of its variables matching ``pred``, else None (the whole
    leaf)."""
    sel: list[tuple[int, list[int] | None]] = []
    for lo, hi in ranges:
        for li in range(lo, hi):
            if plan.kinds[li] == MOD:
                gd = plan.descs[li]
                pairs = zip(gd.paths, plan.varlists[li])
                sel.append((li, [j for j, (p, v) in enumerate(pairs) if pred(p, v)]))
            else:
                sel.append((li, None))
    return sel


def _diff_pure(f: Callable, plan: Plan, diff_sel, box: Box, has_aux: bool) -> Callable:
    """``pure(diff_vals, dyn) -> (loss, (aux, new_dyn))``: ``f`` on the plan's values
    with the differentiated ones replaced by ``diff_vals``."""

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
        (a, kw), rebuilt = plan.rebuild(dyn)
        out = call_annotated(f, a, kw)
        new_dyn, box.value = plan.collect(rebuilt)
        if not has_aux:
            return out, (None, new_dyn)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("nn.grad(has_aux=True): the function must return (value, aux)")
        return out[0], (out[1], new_dyn)

    return pure


def _diff_prefixes(plan: Plan, diff_sel) -> list:
    """Per plan leaf whether it is differentiated (a module: per variable), as the
    "prefix" :func:`check_consistent_prefixes` compares at a shared Variable's places."""
    out: list[Any] = [
        [False] * len(plan.varlists[li]) if k == MOD else False for li, k in enumerate(plan.kinds)
    ]
    for li, sel in diff_sel:
        if sel is None:
            out[li] = True
        else:
            for j in sel:
                out[li][j] = True
    return out


def _spread_grads(plan: Plan, diff_sel, g) -> list:
    """``g`` with the gradient of each shared Variable (found at its first place) also
    at its other places (Flax's tree-shaped gradients show it at each)."""
    first: dict[tuple[int, int], Any] = {}
    for (li, sel), gv in zip(diff_sel, g):
        if sel is None:
            first[(li, -1)] = gv
        else:
            first.update(((li, j), x) for j, x in zip(sel, gv))
    links = plan.links or {}
    out = []
    for (li, sel), gv in zip(diff_sel, g):
        if sel is None:
            src = links.get((li, -1))
            out.append(first.get(src, gv) if src is not None else gv)
        else:
            whole = links.get((li, -1))  # the same module passed again
            out.append([
                first.get((whole[0], j), x) if whole is not None
                else first.get(links[(li, j)], x) if (li, j) in links else x
                for j, x in zip(sel, gv)
            ])
    return out


def _grads_per_arg(args: tuple, nums: list[int], ranges: list[tuple[int, int]], plan: Plan,
                   diff_sel: list, g: list, as_module: bool) -> list:
    """Each differentiated argument's gradient, in ``nums`` order: ``diff_sel`` and ``g``
    hold the arguments' selections one after another, ``hi - lo`` entries per argument."""
    grads, k = [], 0
    for n in nums:
        lo, hi = ranges[n]
        items, gs = diff_sel[k : k + hi - lo], g[k : k + hi - lo]
        k += hi - lo
        grads.append(_package_grads(args[n], plan, items, gs, as_module))
    return grads


def _package_grads(arg, plan: Plan, items, gs, as_module: bool = False):
    """Gradients of one argument, shaped like the argument: a module's are a State of
    the differentiated variables, or (``as_module``, Flax's tree mode) a module of the
    same structure whose other variables hold zeros."""
    leaves = []
    links = plan.links or {}
    for (li, sel), gv in zip(items, gs):
        kind = plan.kinds[li]
        if (li, -1) in links and not as_module:  # a repeat: its gradient is at its first place
            leaves.append(State())
        elif kind == MOD:
            gd = plan.descs[li]
            vs = plan.varlists[li]
            if links and not as_module:
                sel_gv = [(j, x) for j, x in zip(sel, gv) if (li, j) not in links]
                leaves.append(State.from_flat({gd.paths[j]: vs[j].replace(value=x) for j, x in sel_gv}))
                continue
            if as_module:
                vals = [jnp.zeros_like(v.raw_value) for v in vs]
                for j, x in zip(sel, gv):
                    vals[j] = x
                leaves.append(gd.build_from_values(vals))
                continue
            leaves.append(
                State.from_flat({gd.paths[j]: vs[j].replace(value=x) for j, x in zip(sel, gv)})
            )
        elif kind == VAR:
            leaves.append(plan.objs[li].replace(value=gv))
        else:
            leaves.append(gv)
    if isinstance(arg, Module | Variable):
        return leaves[0]
    # a State's Variables are plan leaves (see _transform_plan): unflatten them as such
    treedef: Any = jax.tree_util.tree_structure(expose_states(arg), is_leaf=is_node)
    return treedef.unflatten(leaves)
