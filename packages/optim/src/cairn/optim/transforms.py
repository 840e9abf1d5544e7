"""``cairn.optim.transforms``: the composable transformations under ``optax.transforms``' names.

Thin re-exports of the implementations in this package (the same objects as
``cairn.optim.<name>``), plus :func:`selective_transform`.

>>> import jax.numpy as jnp
>>> from cairn.optim import transforms
>>> tx = transforms.freeze({"a": True, "b": False})
>>> g = {"a": jnp.ones(2), "b": jnp.ones(2)}
>>> tx.update(g, tx.init(g))[0]["a"].tolist()
[0.0, 0.0]
"""

from cairn.optim._adding import add_decayed_weights, add_noise
from cairn.optim._base import chain, named_chain
from cairn.optim._clipping import (
    adaptive_grad_clip,
    clip,
    clip_by_block_rms,
    clip_by_global_norm,
    per_example_global_norm_clip,
    per_example_layer_norm_clip,
    unitwise_clip,
    unitwise_norm,
    zero_nans,
)
from cairn.optim._combine import PartitionState, flatten, partition
from cairn.optim._masking import MaskedNode, MaskedState, freeze, masked
from cairn.optim._momentum import ema, trace
from cairn.optim._selective import selective_transform
from cairn.optim._wrappers import (
    ApplyIfFiniteState,
    MultiSteps,
    MultiStepsState,
    apply_if_finite,
    skip_not_finite,
)

__all__ = [
    "add_decayed_weights", "add_noise", "chain", "named_chain", "adaptive_grad_clip", "clip",
    "clip_by_block_rms", "clip_by_global_norm", "zero_nans", "PartitionState", "flatten",
    "partition", "MaskedState", "freeze", "masked", "ema", "trace", "selective_transform",
    "ApplyIfFiniteState", "MultiSteps", "MultiStepsState", "apply_if_finite", "skip_not_finite",
    "MaskedNode", "per_example_global_norm_clip", "per_example_layer_norm_clip",
    "unitwise_clip", "unitwise_norm",
]
