"""End to end: an MLP of cairn.nn layers learns scikit-learn's digits (bundled, no download).

Training uses a tiny hand-written SGD with momentum through nn.jit / nn.value_and_grad
(no cairn.optim); the held-out accuracy must reach 95%.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from cairn import nn


class MLP(nn.Module):
    def __init__(self, rngs):
        self.l1 = nn.Linear(64, 128, rngs=rngs)
        self.norm = nn.LayerNorm(128, rngs=rngs)
        self.drop = nn.Dropout(0.1, rngs=rngs)
        self.l2 = nn.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nn.gelu(self.norm(self.l1(x)))))


def test_mlp_learns_digits_to_95_percent():
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    model = MLP(nn.Rngs(params=0, dropout=1))

    def loss_fn(model, xb, yb):
        logits = model(xb)
        return -jnp.mean(jnp.sum(nn.log_softmax(logits) * nn.one_hot(yb, 10), -1))

    @nn.jit
    def step(model, mom, xb, yb):
        # gradients w.r.t. the Params only; the dropout RNG counter advances in place
        loss, g = nn.value_and_grad(loss_fn)(model, xb, yb)
        mom = jax.tree.map(lambda m, gi: 0.9 * m + gi, mom, g)
        params = nn.state(model, nn.Param)
        nn.update(model, jax.tree.map(lambda p, m: p - 0.05 * m, params, mom))
        return mom, loss

    mom = jax.tree.map(jnp.zeros_like, nn.state(model, nn.Param))
    rng = np.random.default_rng(0)
    n = len(xtr)
    losses = []
    for _epoch in range(15):
        perm = rng.permutation(n)
        for i in range(0, n - 63, 64):
            idx = perm[i : i + 64]
            mom, loss = step(model, mom, xtr[idx], ytr[idx])
            losses.append(float(loss))
    assert losses[-1] < losses[0]
    model.eval()
    acc = float(jnp.mean(jnp.argmax(jax.jit(lambda m, x: m(x))(model, xte), -1) == yte))
    assert acc >= 0.95, f"test accuracy {acc:.3f}"
