"""``nn.EMA`` (Flax NNX's ``nnx.EMA``): moving averages checked against a float64
NumPy recurrence, ``apply_to`` sharing the averages, ``only``, and errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cairn import nn


def test_ema_follows_the_recurrence_over_steps():
    model = nn.Sequential(nn.Linear(2, 3, rngs=nn.Rngs(0)), nn.Linear(3, 1, rngs=nn.Rngs(1)))
    ema = nn.EMA(model, decay=0.75)
    ref = {p: np.asarray(v[...], np.float64) for p, v in nn.state(model)._flat.items()}
    assert sorted(nn.state(ema.params).flat_paths()) == sorted(nn.state(model).flat_paths())
    rng = np.random.default_rng(0)
    for _ in range(3):
        for p, v in nn.state(model)._flat.items():
            v.value = jnp.asarray(rng.normal(size=v.shape), jnp.float32)
            ref[p] = 0.75 * ref[p] + 0.25 * np.asarray(v[...], np.float64)
        ema.update(model)
    for p, v in nn.state(ema.params)._flat.items():
        np.testing.assert_allclose(np.asarray(v[...]), ref[p], rtol=1e-6, atol=1e-7)  # float32


def test_apply_to_shares_the_averages_and_keeps_untracked_state():
    bn = nn.BatchNorm(2, rngs=nn.Rngs(0))
    ema = nn.EMA(bn, decay=0.5, only=nn.Param)
    view = ema.apply_to(bn)
    assert view.scale is ema.params.scale and view.scale is not bn.scale
    assert view.mean is bn.mean  # not tracked: the model's own
    bn.scale.value = jnp.full((2,), 3.0)
    ema.update(bn)
    np.testing.assert_allclose(np.asarray(view.scale[...]), [2.0, 2.0])


def test_ema_updates_inside_a_jitted_train_step():
    model = nn.Linear(2, 3, rngs=nn.Rngs(0))
    opt = nn.Optimizer(model, optax.sgd(0.1), wrt=nn.Param)
    ema = nn.EMA(model, decay=0.9)
    before = np.asarray(ema.params.kernel[...])
    x, y = jnp.ones((4, 2)), jnp.zeros((4, 3))

    @nn.jit
    def step(model, opt, ema):
        grads = nn.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        ema.update(model)

    step(model, opt, ema)
    expected = 0.9 * before + 0.1 * np.asarray(model.kernel[...])
    np.testing.assert_allclose(np.asarray(ema.params.kernel[...]), expected, rtol=1e-6)


def test_ema_errors():
    model = nn.Linear(2, 2, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\], got 1.5"):
        nn.EMA(model, decay=1.5)
    ema = nn.EMA(model, decay=0.9)
    other = nn.Linear(2, 2, use_bias=False, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="the updates have no variable at 'bias'"):
        ema.update(other)
    with pytest.raises(ValueError, match="the model has no variable at 'bias'"):
        ema.apply_to(other)
