"""Control flow with modules: ``nn.cond``, ``nn.switch``, ``nn.fori_loop`` and
``nn.while_loop`` (``jax.lax``'s, with modules allowed in the operands or the carry and
their changes written back)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from cairn.nn._graph_mode import check_mode
from cairn.nn._transform_plan import Box, Carry, Plan, check_tree_args, run_pure


def fori_loop(
    lower: Any,
    upper: Any,
    body_fun: Callable,
    init_val: Any,
    *,
    unroll: Any = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Any:
    """``jax.lax.fori_loop`` where ``init_val`` may contain modules (updated in place at
    the end and returned).

    Args:
      lower: the first index.
      upper: the end index (exclusive).
      body_fun: ``body_fun(i, val) -> val``.
      init_val: the initial loop value (modules allowed).
      unroll: ``jax.lax.fori_loop``'s unroll factor; None for none.
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
      graph_updates: Flax NNX's keyword, accepted for compatibility (one behaviour here).

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> class C(nn.Module):
    ...     def __init__(self):
    ...         self.n = nn.BatchStat(jnp.zeros(()))
    >>> def body(i, c):
    ...     c.n.value += i
    ...     return c
    >>> c = nn.fori_loop(0, 4, body, C())
    >>> float(c.n.value)
    6.0
    """
    check_mode("fori_loop", graph, graph_updates)
    check_tree_args("fori_loop", init_val, graph)
    carry = Carry(init_val, link=True)  # graph mode: a repeated object is one object

    def body(i, dyn):
        v = carry.rebuild(dyn)
        return carry.extract(body_fun(i, v), "nn.fori_loop")

    kw = {} if unroll is None else {"unroll": unroll}
    out = jax.lax.fori_loop(lower, upper, body, carry.dyn, **kw)
    return carry.finish(out)


def while_loop(
    cond_fun: Callable,
    body_fun: Callable,
    init_val: Any,
    *,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Any:
    """``jax.lax.while_loop`` where ``init_val`` may contain modules. ``cond_fun`` must
    not change state.

    Args:
      cond_fun: ``cond_fun(val) -> bool scalar``; must not change state.
      body_fun: ``body_fun(val) -> val``.
      init_val: the initial value (modules allowed).
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
      graph_updates: Flax NNX's keyword, accepted for compatibility (one behaviour here).
    """
    check_mode("while_loop", graph, graph_updates)
    check_tree_args("while_loop", init_val, graph)
    carry = Carry(init_val, link=True)  # graph mode: a repeated object is one object

    def cond(dyn):
        return cond_fun(carry.rebuild(dyn))

    def body(dyn):
        v = carry.rebuild(dyn)
        return carry.extract(body_fun(v), "nn.while_loop")

    out = jax.lax.while_loop(cond, body, carry.dyn)
    return carry.finish(out)


def _same_branch_structures(boxes: list[Box]) -> list:
    """The structures the traced branches left their operands with.

    Raises:
      ValueError: two branches left different structures.
    """
    descs = [b.value for b in boxes if b.value is not None]
    for i, d in enumerate(descs[1:], 1):
        if list(d) != list(descs[0]):
            raise ValueError(
                f"nn.cond/switch: branch {i} leaves its module arguments with a "
                f"different structure than branch 0 (added or removed variables or "
                f"changed static attributes); every branch must keep the same structure"
            )
    return descs


def _branches_call(branches, index_or_pred, operands, use_switch: bool):
    plan = Plan((operands, {}), link=True)  # tree mode was refused by check_tree_args
    boxes = [Box() for _ in branches]
    pures = [run_pure(fn, plan, b) for fn, b in zip(branches, boxes)]
    try:
        if use_switch:
            out, new_dyn = jax.lax.switch(index_or_pred, pures, plan.dyn)
        else:
            out, new_dyn = jax.lax.cond(index_or_pred, pures[0], pures[1], plan.dyn)
    except TypeError:
        _same_branch_structures(boxes)  # the clearer error when the branches differ
        raise
    descs = _same_branch_structures(boxes)
    plan.write_back(plan.fill(new_dyn), descs[0])
    return out


def cond(
    pred: Any,
    true_fun: Callable,
    false_fun: Callable,
    *operands: Any,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Any:
    """``jax.lax.cond`` where operands may contain modules; both branches must leave
    them with the same structure; their changes are written back.

    Args:
      pred: the boolean scalar.
      true_fun: called with ``operands`` when ``pred`` is true.
      false_fun: called with ``operands`` otherwise.
      operands: the arguments (modules allowed).
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
      graph_updates: Flax NNX's keyword, accepted for compatibility (one behaviour here).
    """
    check_mode("cond", graph, graph_updates)
    check_tree_args("cond", operands, graph)
    return _branches_call([true_fun, false_fun], pred, operands, False)


def switch(
    index: Any,
    branches: Sequence[Callable],
    *operands: Any,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Any:
    """``jax.lax.switch`` where operands may contain modules (see :func:`cond`).

    Args:
      index: the int branch index (clamped).
      branches: the functions, each called with ``operands``.
      operands: the arguments (modules allowed).
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
      graph_updates: Flax NNX's keyword, accepted for compatibility (one behaviour here).
    """
    check_mode("switch", graph, graph_updates)
    check_tree_args("switch", operands, graph)
    return _branches_call(list(branches), index, operands, True)
