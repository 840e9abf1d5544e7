"""cairn.kernels: several implementations per op (XLA, Pallas Triton, Pallas Mosaic GPU), the fastest chosen by measurement.

Names follow Tokamax: one function per op (``dot_product_attention``, ...) with an
``implementation=`` argument; :func:`autotune` measures every implementation and config
available on the device and caches the winner per (device kind, op, shape bucket);
:func:`override` picks implementation and config for a block of code.
"""

from cairn.kernels._attention.api import dot_product_attention
from cairn.kernels._autotune import (
    AutotuneEntry,
    AutotuneResult,
    Measurement,
    autotune,
    autotune_op,
)
from cairn.kernels._cache import measurement_context
from cairn.kernels._cross_entropy.api import linear_softmax_cross_entropy_loss
from cairn.kernels._glu.api import gated_linear_unit
from cairn.kernels._norms.api import layer_norm, rms_norm
from cairn.kernels._override import active_override, override
from cairn.kernels._paged_attention.api import paged_attention, paged_kv_write
from cairn.kernels._quantized.api import quantized_dot_general
from cairn.kernels._ragged_dot.api import ragged_dot, ragged_dot_general
from cairn.kernels._registry import (
    Implementation,
    call,
    cross_compile,
    deferred,
    implementations,
    register,
    register_op,
)
from cairn.kernels._trace import KernelCall, describe_source, ops_in, recording

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "dot_product_attention",
    "autotune",
    "autotune_op",
    "AutotuneResult",
    "AutotuneEntry",
    "Measurement",
    "Implementation",
    "register",
    "register_op",
    "deferred",
    "implementations",
    "call",
    "cross_compile",
    "override",
    "active_override",
    "KernelCall",
    "ops_in",
    "recording",
    "describe_source",
    "measurement_context",
    "ragged_dot",
    "ragged_dot_general",
    "linear_softmax_cross_entropy_loss",
    "layer_norm",
    "rms_norm",
    "gated_linear_unit",
    "quantized_dot_general",
    "paged_attention",
    "paged_kv_write",
]
