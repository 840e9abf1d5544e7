"""cairn.nn: NNX-style object modules for JAX that are plain pytrees.

Modules are Python objects you build, call and inspect eagerly; they are registered
JAX pytrees (variables are leaves, configuration is static), and the lifted transforms
(``nn.jit``, ``nn.grad``, ``nn.vmap``, ``nn.scan``, ...) write state changes made inside
them back to your objects.
"""

from cairn.nn import metrics as metrics
from cairn.nn._filters import (
    All,
    Any,
    Everything,
    Filter,
    Not,
    Nothing,
    OfType,
    PathContains,
    PathRegex,
    to_predicate,
)
from cairn.nn._graph import (
    GraphDef,
    SharedReferenceError,
    clone,
    graphdef,
    iter_modules,
    merge,
    pop,
    split,
    state,
    update,
    variables,
)
from cairn.nn._metrics import MultiMetric
from cairn.nn._module import Dict, List, Module, Sequential
from cairn.nn._optimizer import Optimizer
from cairn.nn._rngs import Rngs, RngStream
from cairn.nn._state import State, replace_by_pure_dict, to_pure_dict
from cairn.nn._sharding import (
    abstract_model,
    current_rules,
    get_named_sharding,
    get_partition_spec,
    sharded_init,
    sharding_rules,
    with_partitioning,
)
from cairn.nn._summary import tabulate
from cairn.nn._transforms import (
    JitWrapped,
    checkpoint,
    cond,
    eval_shape,
    fori_loop,
    grad,
    jit,
    remat,
    scan,
    shard_map,
    switch,
    value_and_grad,
    vmap,
    while_loop,
)
from cairn.nn._variables import (
    BatchStat,
    Cache,
    Intermediate,
    OptState,
    Param,
    Perturbation,
    RngCount,
    RngKey,
    RngState,
    Variable,
    VariableMetadata,
    with_metadata,
)

__all__ = [
    "abstract_model",
    "All",
    "Any",
    "BatchStat",
    "Cache",
    "checkpoint",
    "clone",
    "cond",
    "current_rules",
    "Dict",
    "eval_shape",
    "Everything",
    "Filter",
    "fori_loop",
    "get_named_sharding",
    "get_partition_spec",
    "grad",
    "GraphDef",
    "graphdef",
    "Intermediate",
    "iter_modules",
    "jit",
    "JitWrapped",
    "List",
    "merge",
    "metrics",
    "Module",
    "MultiMetric",
    "Not",
    "Nothing",
    "OfType",
    "Optimizer",
    "OptState",
    "Param",
    "PathContains",
    "PathRegex",
    "Perturbation",
    "pop",
    "remat",
    "replace_by_pure_dict",
    "RngCount",
    "RngKey",
    "Rngs",
    "RngState",
    "RngStream",
    "scan",
    "Sequential",
    "shard_map",
    "sharded_init",
    "sharding_rules",
    "SharedReferenceError",
    "split",
    "State",
    "state",
    "switch",
    "tabulate",
    "to_predicate",
    "to_pure_dict",
    "update",
    "value_and_grad",
    "Variable",
    "VariableMetadata",
    "variables",
    "vmap",
    "while_loop",
    "with_metadata",
    "with_partitioning",
]

# --- layers (nn-layers helper) ---
# --- end layers ---
