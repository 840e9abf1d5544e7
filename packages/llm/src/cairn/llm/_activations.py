"""The MLP activations, by Hugging Face's ``hidden_act`` / ``hidden_activation`` names."""

from __future__ import annotations

from collections.abc import Callable

import jax

__all__ = ["ACTIVATIONS"]

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
}
