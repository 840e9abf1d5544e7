"""cairn.nn: NNX-style object modules for JAX that are plain pytrees.

Modules are Python objects you build, call and inspect eagerly; they are registered
JAX pytrees (variables are leaves, configuration is static), and the lifted transforms
(``nn.jit``, ``nn.grad``, ``nn.vmap``, ``nn.scan``, ...) write state changes made inside
them back to your objects.
"""

from cairn.nn import compat as compat
from cairn.nn import filterlib as filterlib
from cairn.nn import initializers as initializers
from cairn.nn import metrics as metrics
from cairn.nn._activations import (
    PReLU,
    celu,
    elu,
    gelu,
    glu,
    hard_sigmoid,
    hard_silu,
    hard_swish,
    hard_tanh,
    identity,
    leaky_relu,
    log_sigmoid,
    log_softmax,
    logsumexp,
    mish,
    one_hot,
    relu,
    relu6,
    selu,
    sigmoid,
    silu,
    soft_sign,
    softmax,
    softplus,
    standardize,
    swish,
    tanh,
)
from cairn.nn._attention import (
    MultiHeadAttention,
    combine_masks,
    dot_product_attention,
    dot_product_attention_weights,
    make_attention_mask,
    make_causal_mask,
)
from cairn.nn._autodiff import DiffState, grad, value_and_grad
from cairn.nn._axis_metadata import PARTITION_NAME, transform_metadata
from cairn.nn._capture import capture
from cairn.nn._checkify import checkify, make_jaxpr
from cairn.nn._control_flow import cond, fori_loop, switch, while_loop
from cairn.nn._conv import Conv, ConvTranspose
from cairn.nn._custom_vjp import CustomVjp, custom_vjp
from cairn.nn._display import display
from cairn.nn._dropout import Dropout
from cairn.nn._ema import EMA
from cairn.nn._embed import Embed
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
    WithTag,
    to_predicate,
)
from cairn.nn._graph import (
    GraphDef,
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
from cairn.nn._graph_mode import set_graph_mode, set_graph_updates, var_defaults
from cairn.nn._graph_utils import (
    flatten,
    from_flat_state,
    iter_children,
    map,
    prefix,
    set_metadata,
    to_flat_state,
    unflatten,
    unpack,
)
from cairn.nn._jit import JitWrapped, eval_shape, jit, jit_partial
from cairn.nn._linear import Einsum, Initializer, Linear, LinearGeneral
from cairn.nn._lora import LoRA, LoRALinear, LoRAParam
from cairn.nn._metrics import MultiMetric
from cairn.nn._module import Dict, List, Module, Sequential
from cairn.nn._nodes import SharedReferenceError
from cairn.nn._normalization import (
    BatchNorm,
    GroupNorm,
    InstanceNorm,
    LayerNorm,
    RMSNorm,
)
from cairn.nn._optimizer import ModelAndOptimizer, Optimizer
from cairn.nn._pooling import avg_pool, max_pool, min_pool, pool
from cairn.nn._profile import SUMMARY_FILE, Profiler, measure_peak, roofline, scope_of
from cairn.nn._pytree import (
    A,
    Data,
    Pytree,
    Static,
    data,
    dataclass,
    has_data,
    is_data,
    register_data_type,
    static,
)
from cairn.nn._recurrent import (
    RNN,
    GRUCell,
    LSTMCell,
    OptimizedLSTMCell,
    RNNCellBase,
    SimpleCell,
)
from cairn.nn._remat import checkpoint, remat
from cairn.nn._rng_utils import SplitBackups, fork_rngs, reseed, restore_rngs, split_rngs
from cairn.nn._rngs import Rngs, RngStream
from cairn.nn._rope import (
    RotaryEmbedding,
    apply_rotary_embedding,
    rotary_frequencies,
)
from cairn.nn._sharding import (
    abstract_model,
    as_abstract,
    get_named_sharding,
    get_partition_spec,
    sharded_init,
    with_partitioning,
)
from cairn.nn._sharding_rules import (
    current_rules,
    logical_axis_rules,
    sharding_rules,
    use_eager_sharding,
)
from cairn.nn._state import GraphState, State, replace_by_pure_dict, to_pure_dict
from cairn.nn._state_ops import filter_state, map_state, merge_state, split_state
from cairn.nn._summary import tabulate
from cairn.nn._train_state import TrainState
from cairn.nn._traversal import iter_graph, recursive_map
from cairn.nn._tree_names import (
    NodeStates,
    as_pure,
    find_duplicates,
    from_tree,
    restore_int_paths,
    to_tree,
)
from cairn.nn._update_context import (
    CallableProxy,
    PureState,
    call,
    current_update_context,
    merge_context,
    split_context,
    update_context,
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
from cairn.nn._view import view, view_info, with_attributes
from cairn.nn._vjp_jvp import jvp, vjp
from cairn.nn._vmap_scan import Carry, StateAxes, StateSharding, pmap, scan, shard_map, vmap
from cairn.nn._with_rngs import with_rngs

__version__ = "0.1.0"

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
    "StateAxes",
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
    # Flax NNX surface (issue 18)
    "Carry", "data", "display", "filter_state", "fork_rngs", "iter_graph", "map_state", "merge_state",
    "Pytree", "recursive_map", "reseed", "restore_rngs", "split_rngs", "split_state",
    "SplitBackups", "static", "Data", "Static", "is_data", "has_data", "register_data_type",
    "as_pure", "restore_int_paths", "find_duplicates", "to_tree", "from_tree", "NodeStates", "unflatten", "view", "with_attributes", "WithTag",
    # Flax NNX surface (issue 30)
    "capture", "compat", "DiffState", "filterlib", "flatten", "from_flat_state", "GraphState",
    "Initializer", "jit_partial", "map", "ModelAndOptimizer", "prefix", "set_graph_mode",
    "set_graph_updates", "to_flat_state", "unpack", "var_defaults", "view_info", "with_rngs",
    "dataclass", "iter_children", "set_metadata", "TrainState", "OptimizedLSTMCell",
    "checkify", "CustomVjp", "custom_vjp", "jvp", "make_jaxpr", "pmap", "StateSharding", "vjp",
    "A", "EMA", "as_abstract", "use_eager_sharding",
    "PARTITION_NAME", "transform_metadata", "logical_axis_rules",
    "current_update_context", "merge_context", "split_context", "update_context",
    "call", "CallableProxy", "PureState",
    # layers and their functions
    "initializers",
    # activations
    "celu", "elu", "gelu", "glu", "hard_sigmoid", "hard_silu", "hard_swish", "hard_tanh",
    "identity", "leaky_relu", "log_sigmoid", "log_softmax", "logsumexp", "mish", "one_hot",
    "relu", "relu6", "selu", "sigmoid", "silu", "soft_sign", "softmax", "softplus",
    "standardize", "swish", "tanh",
    # layers
    "BatchNorm", "Conv", "ConvTranspose", "PReLU", "Dropout", "Einsum", "Embed", "GRUCell",
    "GroupNorm", "InstanceNorm", "LSTMCell", "LayerNorm", "Linear", "LinearGeneral", "LoRA",
    "LoRALinear", "LoRAParam", "MultiHeadAttention", "RMSNorm", "RNN", "RNNCellBase",
    "RotaryEmbedding", "SimpleCell",
    # functions
    "apply_rotary_embedding", "avg_pool", "combine_masks", "dot_product_attention",
    "dot_product_attention_weights", "make_attention_mask", "make_causal_mask", "max_pool",
    "min_pool", "pool", "rotary_frequencies",
    "Profiler",
    "SUMMARY_FILE",
    "measure_peak",
    "roofline",
    "scope_of",
]
