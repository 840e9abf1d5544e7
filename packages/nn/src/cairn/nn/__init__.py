"""cairn.nn: NNX-style object modules for JAX that are plain pytrees.

Modules are Python objects you build, call and inspect eagerly; they are registered
JAX pytrees (variables are leaves, configuration is static), and the lifted transforms
(``nn.jit``, ``nn.grad``, ``nn.vmap``, ``nn.scan``, ...) write state changes made inside
them back to your objects.
"""

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
from cairn.nn._module import Dict, List, Module, Sequential
from cairn.nn._rngs import Rngs, RngStream
from cairn.nn._state import State, replace_by_pure_dict, to_pure_dict
from cairn.nn._summary import tabulate
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
    "All",
    "Any",
    "BatchStat",
    "Cache",
    "Dict",
    "Everything",
    "Filter",
    "GraphDef",
    "Intermediate",
    "List",
    "Module",
    "Not",
    "Nothing",
    "OfType",
    "OptState",
    "Param",
    "PathContains",
    "PathRegex",
    "Perturbation",
    "RngCount",
    "RngKey",
    "RngState",
    "RngStream",
    "Rngs",
    "Sequential",
    "SharedReferenceError",
    "State",
    "Variable",
    "VariableMetadata",
    "clone",
    "graphdef",
    "iter_modules",
    "merge",
    "pop",
    "replace_by_pure_dict",
    "split",
    "state",
    "tabulate",
    "to_predicate",
    "to_pure_dict",
    "update",
    "variables",
    "with_metadata",
]

# --- layers (nn-layers helper) ---
# --- end layers ---
