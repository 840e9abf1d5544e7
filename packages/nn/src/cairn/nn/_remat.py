"""``nn.remat`` (alias ``nn.checkpoint``): rematerialization with modules as arguments."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from cairn.nn._graph_mode import check_mode
from cairn.nn._transform_plan import Box, Plan, argnums_tuple, reject_bound_method, run_pure


def remat(
    f: Callable | None = None,
    *,
    prevent_cse: bool = True,
    static_argnums: int | tuple[int, ...] = (),
    policy: Callable | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Callable:
    """``jax.checkpoint`` (rematerialization): values and gradients are unchanged, the
    backward pass recomputes ``f``'s intermediates instead of storing them.

    Args:
      f: the function to rematerialize; None returns a decorator.
      prevent_cse: stop XLA from merging the recomputation with the forward pass
        (``jax.checkpoint``'s option).
      static_argnums: positions of static arguments.
      policy: a ``jax.checkpoint_policies`` policy saying which intermediates to save; None saves
        none.
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
      graph_updates: Flax NNX's keyword, accepted for compatibility (one behaviour here).
    """
    check_mode("remat", graph, graph_updates)
    reject_bound_method(f, "remat")
    if f is None:
        return functools.partial(
            remat, prevent_cse=prevent_cse, static_argnums=static_argnums, policy=policy
        )
    statics = set(argnums_tuple(static_argnums))

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        if statics:
            return _remat_with_statics(f, statics, prevent_cse, policy, args, kwargs)
        plan = Plan((args, kwargs))
        box = Box()
        pure = run_pure(f, plan, box)
        out, new_dyn = jax.checkpoint(pure, prevent_cse=prevent_cse, policy=policy)(plan.dyn)
        plan.write_back(plan.fill(new_dyn), box.value)
        return out

    return wrapper


def _remat_with_statics(f, statics, prevent_cse, policy, args, kwargs) -> Any:
    """``remat`` of ``f`` with the static positional arguments bound first."""
    fixed = {i: args[i] for i in statics}
    dyn_args = tuple(a for i, a in enumerate(args) if i not in statics)

    def g(*da, **kw):
        it = iter(da)
        full = [fixed[i] if i in fixed else next(it) for i in range(len(args))]
        return f(*full, **kw)

    return remat(g, prevent_cse=prevent_cse, policy=policy)(*dyn_args, **kwargs)


checkpoint = remat
