"""Each optimizer minimises a quadratic and the Rosenbrock function to the known minimum.

The whole run is one ``lax.scan`` (one compile per optimizer). The default suite runs the
quadratic for every optimizer; Rosenbrock (harder, longer) runs for a representative set by
default and for every optimizer under ``-m slow``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import optim


def _decay(lr, steps):
    """Cosine decay to 1% (keeps sign-based methods from orbiting the minimum)."""
    return lambda t: lr * (0.01 + 0.99 * 0.5 * (1 + jnp.cos(jnp.pi * jnp.minimum(t, steps)
                                                             / steps)))


# name -> (factory(lr), lr for the quadratic, lr for Rosenbrock)
OPTS = {
    "sgd": (lambda lr: optim.sgd(lr), 0.1, 1e-3),
    "sgd_momentum": (lambda lr: optim.sgd(lr, momentum=0.9), 0.05, 5e-4),
    "adam": (lambda lr: optim.adam(lr), 0.05, 0.01),
    "adamw": (lambda lr: optim.adamw(lr, weight_decay=0.0), 0.05, 0.01),
    "nadam": (lambda lr: optim.nadam(lr), 0.05, 0.01),
    "nadamw": (lambda lr: optim.nadamw(lr, weight_decay=0.0), 0.05, 0.01),
    "adamax": (lambda lr: optim.adamax(lr), 0.05, 0.01),
    "adamaxw": (lambda lr: optim.adamaxw(lr, weight_decay=0.0), 0.05, 0.01),
    "amsgrad": (lambda lr: optim.amsgrad(lr), 0.05, 0.3),
    "adagrad": (lambda lr: optim.adagrad(lr), 0.5, 0.3),
    "adadelta": (lambda lr: optim.adadelta(lr), 20.0, 0.1),
    "adafactor": (lambda lr: optim.adafactor(lr, multiply_by_parameter_scale=False), 0.05, 0.01),
    "adabelief": (lambda lr: optim.adabelief(lr), 0.05, 0.01),
    "lamb": (lambda lr: optim.lamb(lr), 0.02, 0.01),
    "lars": (lambda lr: optim.lars(lr, trust_coefficient=1.0), 0.05, 0.005),
    "lion": (lambda lr: optim.lion(lr, weight_decay=0.0), 0.01, 0.003),
    "novograd": (lambda lr: optim.novograd(lr), 0.05, 0.01),
    "radam": (lambda lr: optim.radam(lr), 0.05, 0.003),
    "rmsprop": (lambda lr: optim.rmsprop(lr), 0.01, 0.003),
    "rprop": (lambda lr: optim.rprop(lr), 0.01, 0.001),
    "sm3": (lambda lr: optim.sm3(lr), 0.5, 1.0),
    "yogi": (lambda lr: optim.yogi(lr), 0.05, 0.1),
    "fromage": (lambda lr: optim.fromage(lr), 0.05, 0.01),
    "noisy_sgd": (lambda lr: optim.noisy_sgd(lr, eta=1e-4, seed=0), 0.1, 1e-3),
    "sign_sgd": (lambda lr: optim.sign_sgd(lr), 0.01, 3e-4),
    "signum": (lambda lr: optim.signum(lr), 0.01, 0.003),
    "muon": (lambda lr: optim.muon(lr), 0.05, 0.01),
    "shampoo": (lambda lr: optim.shampoo(lr, precondition_every=5), 0.05, 0.01),
    "schedule_free_adamw": (lambda lr: optim.schedule_free_adamw(lr), 0.05, 0.01),
    "schedule_free_sgd": (lambda lr: optim.schedule_free_sgd(lr), 0.1, 0.003),
}
SCHEDULE_FREE = {"schedule_free_adamw", "schedule_free_sgd"}
NO_SCHEDULE = SCHEDULE_FREE | {"rprop"}  # these take a constant step size


def _minimise(name, loss, params, lr, steps):
    factory = OPTS[name][0]
    tx = factory(lr if name in NO_SCHEDULE else _decay(lr, steps))
    state = tx.init(params)

    def body(carry, _):
        p, s = carry
        g = jax.grad(loss)(p)
        u, s = tx.update(g, s, p)
        return (optim.apply_updates(p, u), s), None

    (p, s), _ = jax.jit(lambda c: jax.lax.scan(body, c, None, length=steps))((params, state))
    if name in SCHEDULE_FREE:
        p = optim.schedule_free_eval_params(s, p)
    return p


def _quadratic(p):
    a = jnp.array([[1.0, 2.0], [3.0, 0.5]])
    return jnp.sum(a * (p["w"] - 1.0) ** 2) + jnp.sum((p["b"] + 2.0) ** 2)


def _rosenbrock(p):
    x, y = p["xy"][0], p["xy"][1]
    return (1.0 - x) ** 2 + 100.0 * (y - x ** 2) ** 2


@pytest.mark.parametrize("name", sorted(OPTS))
def test_minimises_quadratic(name):
    params = {"w": jnp.zeros((2, 2)), "b": jnp.zeros((2,))}
    p = _minimise(name, _quadratic, params, OPTS[name][1], 1500)
    np.testing.assert_allclose(np.asarray(p["w"]), np.ones((2, 2)), atol=3e-2, err_msg=name)
    np.testing.assert_allclose(np.asarray(p["b"]), -2 * np.ones(2), atol=3e-2, err_msg=name)


ROSEN_DEFAULT = ["adam", "sgd_momentum", "lion", "muon", "shampoo", "schedule_free_adamw"]


def _rosen_case(name, steps):
    params = {"xy": jnp.array([-1.0, 1.5])}
    p = _minimise(name, _rosenbrock, params, OPTS[name][2], steps)
    np.testing.assert_allclose(np.asarray(p["xy"]), [1.0, 1.0], atol=5e-2, err_msg=name)


@pytest.mark.parametrize("name", ROSEN_DEFAULT)
def test_minimises_rosenbrock(name):
    _rosen_case(name, 8000)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(OPTS) - set(ROSEN_DEFAULT)))
def test_minimises_rosenbrock_all(name):
    _rosen_case(name, 20000)
