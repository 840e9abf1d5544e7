"""Same numbers as Optax: every shared optimizer name, 10 steps on a random problem (float32).

This is a compatibility check in addition to the independent NumPy references
(test_optim_reference.py): `from cairn import optim as optax` must give Optax's trajectory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import optim

optax = pytest.importorskip("optax")

NAMES = ["sgd", "adam", "adamw", "nadam", "nadamw", "adamax", "adamaxw", "amsgrad", "adagrad",
         "adadelta", "adafactor", "adabelief", "lamb", "lars", "lion", "novograd", "radam",
         "rmsprop", "rprop", "sm3", "yogi", "fromage", "sign_sgd", "signum"]


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    return {"a": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
            "b": [jnp.asarray(rng.normal(size=(5,)), jnp.float32),
                  jnp.asarray(rng.normal(size=(2, 3, 2)), jnp.float32)]}


def _compare(ours, theirs, steps=10, atol=2e-5):
    params = _problem()
    rng = np.random.default_rng(1)
    s1, s2, p1, p2 = ours.init(params), theirs.init(params), params, params
    for _ in range(steps):
        g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
        u1, s1 = ours.update(g, s1, p1)
        u2, s2 = theirs.update(g, s2, p2)
        p1, p2 = optim.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_matches_optax(name):
    lr = 1.0 if name == "adadelta" else 0.01
    _compare(getattr(optim, name)(lr), getattr(optax, name)(lr))


@pytest.mark.slow
def test_contrib_and_wrappers_match_optax():
    from optax import contrib

    _compare(optim.muon(0.01), contrib.muon(0.01))
    _compare(optim.schedule_free_adamw(0.01, warmup_steps=3),
             contrib.schedule_free_adamw(0.01, warmup_steps=3))
    _compare(optim.MultiSteps(optim.adam(0.1), 3), optax.MultiSteps(optax.adam(0.1), 3))
    _compare(optim.chain(optim.clip(0.5), optim.centralize(), optim.sgd(0.1, 0.9, True)),
             optax.chain(optax.clip(0.5), optax.centralize(), optax.sgd(0.1, 0.9, True)))
    _compare(optim.chain(optim.adaptive_grad_clip(0.1), optim.clip_by_block_rms(0.5),
                         optim.apply_every(2), optim.sgd(0.1)),
             optax.chain(optax.adaptive_grad_clip(0.1), optax.clip_by_block_rms(0.5),
                         optax.apply_every(2), optax.sgd(0.1)))
    mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    _compare(optim.adamw(lambda c: 0.01 / (1 + c), weight_decay=0.1, mask=mask),
             optax.adamw(lambda c: 0.01 / (1 + c), weight_decay=0.1, mask=mask))
    _compare(optim.inject_hyperparams(optim.adam)(learning_rate=0.1, b1=0.8),
             optax.inject_hyperparams(optax.adam)(learning_rate=0.1, b1=0.8), atol=5e-5)
    _compare(optim.flatten(optim.adam(0.1)), optax.flatten(optax.adam(0.1)), atol=5e-5)
