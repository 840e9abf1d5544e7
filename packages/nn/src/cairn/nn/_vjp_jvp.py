"""``nn.vjp`` and ``nn.jvp``: JAX's forward- and reverse-mode primitives lifted to
module arguments.

A module argument is differentiated with respect to all of its variables: its
cotangent (``vjp``) or tangent (``jvp``) is a module of the same structure whose
variables hold the cotangent / tangent values (as ``jax.tree.map(jnp.ones_like, m)``
builds one). State changes the function makes (a counter, batch statistics, RNG
counts) are written back to the caller's modules, as with the other transforms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.nn._graph_mode import check_mode
from cairn.nn._nodes import MOD, VAR
from cairn.nn._transform_plan import Box, Plan, call_annotated
from cairn.nn._variables import rebuild_variable


def _aux_pure(f: Callable, plan: Plan, box: Box, has_aux: bool, what: str) -> Callable:
    """``pure(dyn) -> (out, (aux, new_dyn))``: ``f`` on the plan's values; the new
    structures of the arguments go to ``box``."""

    def pure(dyn):
        (a, kw), rebuilt = plan.rebuild(dyn)
        out = call_annotated(f, a, kw)
        new_dyn, box.value = plan.collect(rebuilt)
        if not has_aux:
            return out, (None, new_dyn)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"nn.{what}(has_aux=True): the function must return (output, aux)")
        return out[0], (out[1], new_dyn)

    return pure


def _shaped_like_args(plan: Plan, dyn: Sequence) -> tuple:
    """Per-leaf values ``dyn`` (cotangents, tangents) put back into the shape of the
    plan's positional arguments: a module becomes a module of the same structure, a
    variable a variable of the same type."""
    leaves = []
    for kind, desc, d in zip(plan.kinds, plan.descs, dyn):
        if kind == MOD:
            leaves.append(desc.build_from_values(d))
        elif kind == VAR:
            leaves.append(rebuild_variable(desc, d))
        else:
            leaves.append(d)
    args, _ = plan.treedef.unflatten(leaves)
    return tuple(args)


def _int_tangent(p: Any, t: Any) -> Any:
    """An integer or bool primal has no tangent space: its tangent (e.g. from
    ``jax.tree.map(jnp.ones_like, module)`` over a module with a step counter) becomes
    ``float0`` zeros, as ``jax.jvp`` requires."""
    dt = getattr(p, "dtype", None)
    if dt is None or jnp.issubdtype(dt, jnp.inexact) or getattr(t, "dtype", None) == jax.dtypes.float0:
        return t
    return np.zeros(np.shape(p), jax.dtypes.float0)


def vjp(
    f: Callable | None = None,
    *primals: Any,
    has_aux: bool = False,
    reduce_axes: Sequence[Any] = (),
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Any:
    """``jax.vjp`` for functions of modules: ``(out, vjp_fn)`` (``(out, vjp_fn, aux)``
    with ``has_aux``), where ``vjp_fn(cotangent)`` returns one cotangent per primal,
    shaped like it (a module's is a module of the same structure holding the
    cotangents of all its variables). State changes ``f`` makes are written back.

    Used as a decorator (``nn.vjp`` or ``nn.vjp(has_aux=...)`` over ``f``), calling the
    result with the primals returns the same tuple.

    Args:
      f: the function; None returns a decorator.
      *primals: its positional arguments (modules, variables, pytrees of arrays).
      has_aux: ``f`` returns ``(output, aux)``; ``aux`` is returned, not differentiated.
      reduce_axes: accepted for Flax NNX compatibility; nothing to reduce.
      graph: Flax NNX's graph-mode keyword (checked; see the README table).
      graph_updates: Flax NNX's graph-updates keyword (checked).

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> m = nn.Linear(2, 1, use_bias=False, rngs=nn.Rngs(0))
    >>> out, vjp_fn = nn.vjp(lambda m, x: m(x).sum(), m, jnp.ones((1, 2)))
    >>> m_ct, x_ct = vjp_fn(jnp.ones(()))
    >>> m_ct.kernel.value.tolist()
    [[1.0], [1.0]]
    """
    del reduce_axes
    check_mode("vjp", graph, graph_updates)
    if f is None or not primals:
        def bind(fun):
            @functools.wraps(fun)
            def call(*ps):
                return vjp(fun, *ps, has_aux=has_aux, graph=graph, graph_updates=graph_updates)
            return call
        return bind if f is None else bind(f)
    plan = Plan((primals, {}))
    box = Box()
    out, raw_vjp, (aux, new_dyn) = jax.vjp(
        _aux_pure(f, plan, box, has_aux, "vjp"), plan.dyn, has_aux=True
    )
    plan.write_back(plan.fill(new_dyn), box.value)

    def vjp_fn(cotangent: Any) -> tuple:
        (g,) = raw_vjp(cotangent)
        return _shaped_like_args(plan, g)

    return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)


def jvp(
    f: Callable | None = None,
    primals: Sequence[Any] | None = None,
    tangents: Sequence[Any] | None = None,
    *,
    has_aux: bool = False,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Any:
    """``jax.jvp`` for functions of modules: ``(out, tangent_out)`` (``(out,
    tangent_out, aux)`` with ``has_aux``). A module's tangent is a module of the same
    structure whose variables hold the tangents (``jax.tree.map(jnp.ones_like, m)``);
    the tangent of an integer or bool value (a step counter) is taken as ``float0``
    zeros. State changes ``f`` makes are written back.

    Used as a decorator, the result is called as ``g(primals, tangents)``.

    Args:
      f: the function; None returns a decorator.
      primals: a tuple or list of ``f``'s positional arguments.
      tangents: one tangent per primal, of the same structure.
      has_aux: ``f`` returns ``(output, aux)``; ``aux`` is returned, not differentiated.
      graph: Flax NNX's graph-mode keyword (checked; see the README table).
      graph_updates: Flax NNX's graph-updates keyword (checked).

    Raises:
      TypeError: ``primals`` / ``tangents`` not sequences of the same structure.

    >>> import jax, jax.numpy as jnp
    >>> from cairn import nn
    >>> m = nn.Linear(2, 1, use_bias=False, rngs=nn.Rngs(0))
    >>> t = jax.tree.map(jnp.zeros_like, m)
    >>> out, t_out = nn.jvp(lambda m, x: m(x).sum(), (m, jnp.ones((1, 2))), (t, jnp.ones((1, 2))))
    >>> bool(jnp.allclose(t_out, m.kernel.value.sum()))
    True
    """
    check_mode("jvp", graph, graph_updates)
    if f is None or primals is None:
        def bind(fun):
            @functools.wraps(fun)
            def call(ps, ts):
                return jvp(fun, ps, ts, has_aux=has_aux, graph=graph, graph_updates=graph_updates)
            return call
        return bind if f is None else bind(f)
    if not isinstance(primals, tuple | list) or not isinstance(tangents, tuple | list):
        raise TypeError(
            f"nn.jvp: primals and tangents must be tuples or lists of arguments, got "
            f"{type(primals).__name__} and {type(tangents).__name__}"
        )
    plan = Plan((tuple(primals), {}))
    tplan = Plan((tuple(tangents), {}))
    if tplan.key() != plan.key():
        raise TypeError(
            "nn.jvp: tangents must have the structure of primals (the same modules, "
            f"variables and pytrees); got {tplan.treedef} for primals {plan.treedef}"
        )
    box = Box()
    tdyn = jax.tree_util.tree_map(_int_tangent, plan.dyn, tplan.dyn)
    out, t_out, (aux, new_dyn) = jax.jvp(
        _aux_pure(f, plan, box, has_aux, "jvp"), (plan.dyn,), (tdyn,), has_aux=True
    )
    plan.write_back(plan.fill(new_dyn), box.value)
    return (out, t_out, aux) if has_aux else (out, t_out)
