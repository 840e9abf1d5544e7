"""``nn.compat``: Flax NNX's graph-mode defaults (``graph=True``, ``graph_updates=True``)."""

import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn


def _tied():
    a = nn.Linear(2, 2, rngs=nn.Rngs(0))
    return nn.Dict(enc=a, dec=a)  # one module at two places


def test_compat_graph_functions_keep_shared_references_under_tree_mode():
    model = _tied()
    with nn.set_graph_mode(False):
        with pytest.raises(nn.SharedReferenceError, match="enc"):
            nn.split(model)  # the mode's default: tree mode refuses sharing
        graphdef, state = nn.compat.split(model)  # graph=True by default
        assert len(nn.compat.state(model).flat_state()) == 2  # kernel and bias once
        rebuilt = nn.merge(graphdef, state)
        assert rebuilt.enc is rebuilt.dec
        assert nn.compat.clone(model).enc is not model.enc
        with pytest.raises(nn.SharedReferenceError):
            nn.compat.split(model, graph=False)  # an explicit keyword wins


def test_compat_transforms_default_to_graph_updates():
    model = _tied()
    x = jnp.ones((1, 2))

    def loss(m):
        return (m.dec(m.enc(x)) ** 2).sum()

    grads = nn.compat.grad(loss)(model)
    assert isinstance(grads, nn.State)  # full graph mode: the gradient is a State

    k, b = np.asarray(model.enc.kernel.value, np.float64), np.asarray(model.enc.bias.value, np.float64)
    h = np.ones((1, 2)) @ k + b
    y = h @ k + b
    # d/dk of |(x k + b) k + b|^2 over both uses of the tied kernel
    dk = 2 * (np.ones((1, 2)).T @ (2 * y @ k.T) / 2 + h.T @ y)
    np.testing.assert_allclose(np.asarray(grads["enc"]["kernel"].value), dk, rtol=1e-5)

    @nn.compat.jit
    def step(m):
        m.enc.bias.value = m.enc.bias.value + 1.0
        return loss(m)

    before = np.asarray(model.dec.bias.value)
    step(model)
    np.testing.assert_allclose(np.asarray(model.dec.bias.value), before + 1.0)  # written back once
