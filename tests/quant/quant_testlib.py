"""The two-layer model the quant tests build three ways (Flax NNX, cairn.nn, a plain dict)
with the same weights, so names, paths and values can be compared across them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cairn import nn

K1 = np.asarray(jax.random.normal(jax.random.key(7), (8, 16))) / 3
B1 = np.asarray(jax.random.normal(jax.random.key(8), (16,))) / 10
K2 = np.asarray(jax.random.normal(jax.random.key(9), (16, 4))) / 4


def two_layer(kind: str, b2: np.ndarray) -> object:
    """``x -> b(relu(a(x)))`` with kernels ``K1``/``K2``, biases ``B1``/``b2``: a Flax NNX
    module (``kind="flax.nnx"``), a cairn.nn module (``"cairn.nn"``) or a dict (``"plain"``,
    for :func:`plain_forward`)."""
    if kind == "plain":
        return {"a": {"kernel": jnp.asarray(K1), "bias": jnp.asarray(B1)},
                "b": {"kernel": jnp.asarray(K2), "bias": jnp.asarray(b2)}}
    if kind == "flax.nnx":
        from flax import nnx

        lib, base = nnx, nnx.Module
    else:
        lib, base = nn, nn.Module

    class Two(base):
        def __init__(self, rngs):
            self.a = lib.Linear(8, 16, rngs=rngs)
            self.b = lib.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    m = Two(lib.Rngs(0))
    for layer, k, b in ((m.a, K1, B1), (m.b, K2, b2)):
        layer.kernel.set_value(jnp.asarray(k))
        layer.bias.set_value(jnp.asarray(b))
    return m


def plain_forward(p: dict, x: jax.Array) -> jax.Array:
    """The dict model's forward pass."""
    h = jax.nn.relu(x @ p["a"]["kernel"] + p["a"]["bias"])
    return h @ p["b"]["kernel"] + p["b"]["bias"]
