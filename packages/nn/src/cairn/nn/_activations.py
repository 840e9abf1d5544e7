"""Activation functions.

These are ``jax.nn``'s own functions re-exported under the names Flax NNX uses, so model
code written against ``flax.nnx.relu`` etc. ports by changing the import. ``PReLU`` is a
module with a learnable negative slope.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.nn import (
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
)

tanh = jnp.tanh

ACTIVATION_NAMES = [
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

__all__ = list(ACTIVATION_NAMES)
