"""Flax NNX's ``nnx.compat``: the graph-mode spelling of the transforms and graph
functions (Flax's defaults there are ``graph=True, graph_updates=True``).

Cairn has one mode, so these are the very functions of ``cairn.nn``; code written
against ``nnx.compat`` runs unchanged.
"""

from cairn.nn._autodiff import grad, value_and_grad
from cairn.nn._control_flow import cond, fori_loop, switch, while_loop
from cairn.nn._graph import clone, graphdef, iter_modules, split, state
from cairn.nn._graph_utils import flatten
from cairn.nn._jit import eval_shape, jit
from cairn.nn._remat import remat
from cairn.nn._rng_utils import fork_rngs, reseed, split_rngs
from cairn.nn._traversal import iter_graph, recursive_map
from cairn.nn._view import view, view_info
from cairn.nn._vmap_scan import scan, shard_map, vmap

__all__ = [
    "clone",
    "cond",
    "eval_shape",
    "flatten",
    "fori_loop",
    "fork_rngs",
    "grad",
    "graphdef",
    "iter_graph",
    "iter_modules",
    "jit",
    "recursive_map",
    "remat",
    "reseed",
    "scan",
    "shard_map",
    "split",
    "split_rngs",
    "state",
    "switch",
    "value_and_grad",
    "view",
    "view_info",
    "vmap",
    "while_loop",
]
