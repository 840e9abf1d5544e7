"""Activation functions and ``PReLU``.

The functions are ``jax.nn``'s own, re-exported under the names Flax NNX uses, so model
code written against ``flax.nnx.relu`` etc. ports by changing the import. ``PReLU`` is a
module with a learnable negative slope.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.nn import celu as celu
from jax.nn import elu as elu
from jax.nn import gelu as gelu
from jax.nn import glu as glu
from jax.nn import hard_sigmoid as hard_sigmoid
from jax.nn import hard_silu as hard_silu
from jax.nn import hard_swish as hard_swish
from jax.nn import hard_tanh as hard_tanh
from jax.nn import identity as identity
from jax.nn import leaky_relu as leaky_relu
from jax.nn import log_sigmoid as log_sigmoid
from jax.nn import log_softmax as log_softmax
from jax.nn import logsumexp as logsumexp
from jax.nn import mish as mish
from jax.nn import one_hot as one_hot
from jax.nn import relu as relu
from jax.nn import relu6 as relu6
from jax.nn import selu as selu
from jax.nn import sigmoid as sigmoid
from jax.nn import silu as silu
from jax.nn import soft_sign as soft_sign
from jax.nn import softmax as softmax
from jax.nn import softplus as softplus
from jax.nn import standardize as standardize
from jax.nn import swish as swish

from cairn.nn._linear import DType
from cairn.nn._module import Module
from cairn.nn._variables import Param

tanh = jnp.tanh

__all__ = [
    "PReLU",
    "celu",
    "elu",
    "gelu",
    "glu",
    "hard_sigmoid",
    "hard_silu",
    "hard_swish",
    "hard_tanh",
    "identity",
    "leaky_relu",
    "log_sigmoid",
    "log_softmax",
    "logsumexp",
    "mish",
    "one_hot",
    "relu",
    "relu6",
    "selu",
    "sigmoid",
    "silu",
    "soft_sign",
    "softmax",
    "softplus",
    "standardize",
    "swish",
    "tanh",
]


class PReLU(Module):
    """``y = x`` where ``x >= 0`` else ``negative_slope * x``, with a learned scalar slope.

    Args:
      negative_slope_init: the slope's initial value.
      param_dtype: the dtype the slope is stored in.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> nn.PReLU()(jnp.array([-2.0, 3.0])).tolist()
    [-0.019999999552965164, 3.0]
    """

    def __init__(self, negative_slope_init: float = 0.01, param_dtype: DType = jnp.float32) -> None:
        self.negative_slope = Param(jnp.asarray(negative_slope_init, dtype=param_dtype))

    def __call__(self, inputs: jax.Array) -> jax.Array:
        slope = jnp.asarray(self.negative_slope[...], inputs.dtype)
        return jnp.where(inputs >= 0, inputs, slope * inputs)
