"""``nn.compat``: the graph-mode defaults of Flax NNX's ``nnx.compat`` namespace.

Flax NNX 0.12.8 offers each graph-aware function twice: ``nnx.jit`` / ``nnx.split`` ...
(whose mode follows ``set_graph_mode``) and ``nnx.compat.jit`` / ``nnx.compat.split`` ...,
the same functions with ``graph=True`` (and, for the transforms, ``graph_updates=True``)
as their default. Code written against ``nnx.compat`` ports by changing the import:

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> model = nn.Linear(2, 3, rngs=nn.Rngs(0))
    >>> graphdef, state = nn.compat.split(model)
    >>> @nn.compat.jit
    ... def forward(m, x):
    ...     return m(x)
    >>> forward(model, jnp.ones((1, 2))).shape
    (1, 3)

An explicit ``graph=`` / ``graph_updates=`` keyword still wins. Flax's
``cached_partial``, ``backup_keys`` and ``get_abstract_model`` have no cairn.nn
counterpart (see the package README), so they are not here either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from cairn.nn import (
    _autodiff,
    _checkify,
    _control_flow,
    _custom_vjp,
    _graph,
    _graph_utils,
    _jit,
    _remat,
    _rng_utils,
    _traversal,
    _view,
    _vjp_jvp,
    _vmap_scan,
)

__all__ = [
    "checkify", "clone", "cond", "custom_vjp", "eval_shape", "flatten", "fori_loop",
    "fork_rngs", "grad", "graphdef", "iter_children", "iter_graph", "iter_modules", "jit",
    "jvp", "pmap", "recursive_map", "remat", "reseed", "scan", "shard_map", "split",
    "split_rngs", "state", "switch", "value_and_grad", "view", "view_info", "vjp", "vmap",
    "while_loop",
]


def _graph_default(fn: Callable[..., Any], updates: bool) -> Callable[..., Any]:
    """``fn`` with ``graph=True`` (and ``graph_updates=True`` when ``updates``) as the
    default of its keywords."""

    @functools.wraps(fn)
    def with_graph_default(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("graph", True)
        if updates:
            kwargs.setdefault("graph_updates", True)
        return fn(*args, **kwargs)

    return with_graph_default


# graph traversal: graph=True
split = _graph_default(_graph.split, False)
state = _graph_default(_graph.state, False)
clone = _graph_default(_graph.clone, False)
graphdef = _graph_default(_graph.graphdef, False)
flatten = _graph_default(_graph_utils.flatten, False)
iter_graph = _graph_default(_traversal.iter_graph, False)
recursive_map = _graph_default(_traversal.recursive_map, False)
view = _graph_default(_view.view, False)
view_info = _graph_default(_view.view_info, False)
iter_modules = _graph_default(_graph.iter_modules, False)
iter_children = _graph_default(_graph_utils.iter_children, False)
reseed = _graph_default(_rng_utils.reseed, False)

# random streams and transforms: graph=True, graph_updates=True
split_rngs = _graph_default(_rng_utils.split_rngs, True)
fork_rngs = _graph_default(_rng_utils.fork_rngs, True)
jit = _graph_default(_jit.jit, True)
shard_map = _graph_default(_vmap_scan.shard_map, True)
grad = _graph_default(_autodiff.grad, True)
value_and_grad = _graph_default(_autodiff.value_and_grad, True)
custom_vjp = _graph_default(_custom_vjp.custom_vjp, True)
vjp = _graph_default(_vjp_jvp.vjp, True)
jvp = _graph_default(_vjp_jvp.jvp, True)
remat = _graph_default(_remat.remat, True)
vmap = _graph_default(_vmap_scan.vmap, True)
scan = _graph_default(_vmap_scan.scan, True)
pmap = _graph_default(_vmap_scan.pmap, True)
while_loop = _graph_default(_control_flow.while_loop, True)
fori_loop = _graph_default(_control_flow.fori_loop, True)
eval_shape = _graph_default(_jit.eval_shape, True)
cond = _graph_default(_control_flow.cond, True)
switch = _graph_default(_control_flow.switch, True)
checkify = _graph_default(_checkify.checkify, True)
