"""Transformations (and the optimizers not in test_optim_reference.py) against independent
float64 NumPy implementations of their published equations, step by step for 20 steps.

Same protocol as test_optim_reference.py: at every step ours (float32 or bfloat16) and the
reference (float64) see the same gradients and params (the reference trajectory cast to the
dtype); our state evolves on its own. Tolerances relative to the largest reference update
of the step: float32 every element within 1e-4 (1e-3 for the Adam-based ones; sign-based:
99% of elements within 1e-3); bfloat16 95% of elements within 6e-2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import optim
from optim import _optim_refs as R

SHAPES = {"w": (4, 3), "b": (5,), "k": (2, 3, 2), "s": (), "c": (2, 2, 3, 2),
          "d": (2, 2, 1, 3, 2)}


# --- references ---


class Stateless:
    """``u = f(g, p)`` per step on the whole dict (f written from the equation)."""

    def __init__(self, f):
        self.f = f

    def init(self, params):
        return self

    def step(self, g, p):
        return self.f(g, p)


def _clip(delta):
    return Stateless(lambda g, p: {k: np.clip(v, -delta, delta) for k, v in g.items()})


def _clip_global(c):
    def f(g, p):
        n = np.sqrt(sum(np.sum(v * v) for v in g.values()))
        return {k: v * min(1.0, c / n) for k, v in g.items()}
    return Stateless(f)


def _clip_block_rms(c):
    def f(g, p):
        out = {}
        for k, v in g.items():
            rms = np.sqrt(np.mean(v * v))
            out[k] = v / max(1.0, rms / c)
        return out
    return Stateless(f)


def _unit_norm(x):
    # Brock et al. 2021 unit-wise norm with Optax's axis convention: the whole array for
    # scalars and vectors (also after dropping size-1 axes: (1, n) is a vector), axis 0 for
    # IO and multi-head (rank 3) kernels, all but the last axis for 2-D / 3-D conv kernels
    # (HWIO, DHWIO)
    if np.squeeze(x).ndim <= 1:
        return np.sqrt(np.sum(x * x)) * np.ones_like(x)
    axes = (0,) if x.ndim in (2, 3) else tuple(range(x.ndim - 1))
    return np.broadcast_to(np.sqrt(np.sum(x * x, axis=axes, keepdims=True)), x.shape)


def _agc(lam, eps=1e-3):
    def f(g, p):
        out = {}
        for k, v in g.items():
            gn, pn = _unit_norm(v), _unit_norm(p[k])
            mx = lam * np.maximum(pn, eps)
            out[k] = np.where(gn > mx, v * mx / np.maximum(gn, 1e-6), v)
        return out
    return Stateless(f)


def _centralize():
    def f(g, p):
        return {k: (v - v.mean(axis=tuple(range(1, v.ndim)), keepdims=True)
                    if v.ndim > 1 else v) for k, v in g.items()}
    return Stateless(f)


class Trace(R._Ref):
    def init_leaf(self, p):
        return np.zeros_like(p)

    def leaf(self, g, p, f):
        mu = self.hp["decay"]
        f = g + mu * f
        return (g + mu * f if self.hp.get("nesterov") else f), f


class Ema(R._Ref):
    def init_leaf(self, p):
        return np.zeros_like(p)

    def leaf(self, g, p, e):
        d = self.hp["decay"]
        e = d * e + (1 - d) * g
        return e / (1 - d ** self.t), e


class LionMode(R._Ref):
    def init_leaf(self, p):
        return np.zeros_like(p)

    def leaf(self, g, p, m):
        b1, b2 = 0.9, 0.99
        x = (1 - b1) * g + b1 * m
        if self.hp["mode"] == "smooth":
            c = np.tanh(self.hp["beta"] * x)
        else:
            c = np.where(np.abs(x) < 1.0, x, np.sign(x))
        return -self.hp["lr"] * (c + self.hp["wd"] * p), b2 * m + (1 - b2) * g


class AdaMaxW(R._Ref):
    def init_leaf(self, p):
        return (np.zeros_like(p), np.zeros_like(p))

    def leaf(self, g, p, s):
        lr, b1, b2, eps, wd = self.hp["lr"], 0.9, 0.999, 1e-8, self.hp["wd"]
        m, u = s
        m = b1 * m + (1 - b1) * g
        u = np.maximum(b2 * u, np.abs(g) + eps)
        return -lr * (m / (1 - b1 ** self.t) / u + wd * p), (m, u)


class ApplyEvery:
    """Emit the sum of the last k updates on every k-th step, zeros otherwise."""

    def __init__(self, k):
        self.k, self.t = k, 0

    def init(self, params):
        self.acc = {k: np.zeros_like(v) for k, v in params.items()}
        return self

    def step(self, g, p):
        self.t += 1
        self.acc = {k: self.acc[k] + g[k] for k in g}
        if self.t % self.k == 0:
            out, self.acc = self.acc, {k: np.zeros_like(v) for k, v in g.items()}
            return out
        return {k: np.zeros_like(v) for k, v in g.items()}


class MultiStepsAdam:
    """Adam run once every k mini-steps on the mean of the k gradients, zeros in between."""

    def __init__(self, k, lr):
        self.k, self.t, self.inner = k, 0, R.Adam(lr=lr)

    def init(self, params):
        self.inner.init(params)
        self.acc = {k: np.zeros_like(v) for k, v in params.items()}
        return self

    def step(self, g, p):
        self.t += 1
        self.acc = {k: self.acc[k] + g[k] / self.k for k in g}
        if self.t % self.k == 0:
            out = self.inner.step(self.acc, p)
            self.acc = {k: np.zeros_like(v) for k, v in g.items()}
            return out
        return {k: np.zeros_like(v) for k, v in g.items()}


class DecayMasked(R._Ref):
    """``g + wd * p`` on the leaves whose path matches the mask, then ``-lr``."""

    def init_leaf(self, p):
        return ()

    def step(self, grads, params):
        self.t += 1
        return {k: -self.hp["lr"] * (g + (self.hp["wd"] * params[k] if k in self.hp["on"]
                                          else 0.0)) for k, g in grads.items()}


def _schedule_ref(lr0, decay):
    class Sched(R._Ref):
        def init_leaf(self, p):
            return ()

        def step(self, grads, params):
            s = lr0 * decay ** self.t  # value at count t - 1 of exponential_decay(lr0, 1, decay)
            self.t += 1
            return {k: s * g for k, g in grads.items()}
    return Sched()


CASES = {
    "clip": (lambda: optim.clip(0.5), lambda: _clip(0.5), 1e-4),
    "clip_by_global_norm": (lambda: optim.clip_by_global_norm(1.0),
                            lambda: _clip_global(1.0), 1e-4),
    "clip_by_block_rms": (lambda: optim.clip_by_block_rms(0.5),
                          lambda: _clip_block_rms(0.5), 1e-4),
    "adaptive_grad_clip": (lambda: optim.adaptive_grad_clip(0.3),
                           lambda: _agc(0.3), 1e-4),
    "centralize": (lambda: optim.centralize(), lambda: _centralize(), 1e-4),
    "trace": (lambda: optim.trace(0.9), lambda: Trace(decay=0.9), 1e-4),
    "trace_nesterov": (lambda: optim.trace(0.9, nesterov=True),
                       lambda: Trace(decay=0.9, nesterov=True), 1e-4),
    "ema": (lambda: optim.ema(0.8), lambda: Ema(decay=0.8), 1e-4),
    "apply_every": (lambda: optim.apply_every(3), lambda: ApplyEvery(3), 1e-4),
    "scale_by_schedule": (lambda: optim.scale_by_schedule(optim.exponential_decay(0.5, 1, 0.9)),
                          lambda: _schedule_ref(0.5, 0.9), 1e-4),
    "masked_weight_decay": (
        lambda: optim.chain(optim.add_decayed_weights(0.1, mask="w|k"),
                            optim.scale_by_learning_rate(0.05)),
        lambda: DecayMasked(lr=0.05, wd=0.1, on={"w", "k"}), 1e-4),
    "lion_smooth": (lambda: optim.chain(optim.scale_by_lion(mode="smooth", smooth_beta=2.0),
                                        optim.add_decayed_weights(1e-3),
                                        optim.scale_by_learning_rate(0.01)),
                    lambda: LionMode(lr=0.01, wd=1e-3, mode="smooth", beta=2.0), 1e-4),
    "lion_refined": (lambda: optim.chain(optim.scale_by_lion(mode="refined"),
                                         optim.add_decayed_weights(1e-3),
                                         optim.scale_by_learning_rate(0.01)),
                     lambda: LionMode(lr=0.01, wd=1e-3, mode="refined"), 1e-4),
    "sign_sgd": (lambda: optim.sign_sgd(0.01),
                 lambda: Stateless(lambda g, p: {k: -0.01 * np.sign(v) for k, v in g.items()}),
                 None),
    "adamaxw": (lambda: optim.adamaxw(0.01, weight_decay=0.1),
                lambda: AdaMaxW(lr=0.01, wd=0.1), 1e-3),
    "multisteps_adam": (lambda: optim.MultiSteps(optim.adam(0.01), 3),
                        lambda: MultiStepsAdam(3, 0.01), 1e-3),
    "flatten_adam": (lambda: optim.flatten(optim.adam(0.01)), lambda: R.Adam(lr=0.01), 1e-3),
}


def _run(name, dtype, steps=20):
    ours_f, ref_f, _ = CASES[name]
    return R.run_against(name, ours_f(), ref_f(), dtype, SHAPES, steps)


@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_matches_reference(name):
    errs = _run(name, jnp.float32)
    tol = CASES[name][2]
    if tol is None:  # sign-based: elements near 0 may flip
        assert np.mean(errs <= 1e-3) >= 0.99, f"{name}: {np.mean(errs <= 1e-3):.3f} close"
    else:
        assert errs.max() <= tol, f"{name}: max relative error {errs.max():.2e}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_bfloat16_matches_reference(name):
    errs = _run(name, jnp.bfloat16)
    frac = np.mean(errs <= 6e-2)
    assert frac >= 0.95, f"{name}: only {frac:.3f} of elements within 6e-2"


def test_zero_nans_replaces_nans_and_records_them():
    tx = optim.zero_nans()
    g = {"a": jnp.asarray([1.0, jnp.nan, -2.0]), "b": jnp.asarray([[jnp.nan, 3.0]])}
    state = tx.init(g)
    u, state = jax.jit(tx.update)(g, state)
    np.testing.assert_array_equal(np.asarray(u["a"]), [1.0, 0.0, -2.0])
    np.testing.assert_array_equal(np.asarray(u["b"]), [[0.0, 3.0]])
    assert any(bool(x) for x in jax.tree.leaves(state))
    assert bool(state.found_nan["a"]) and bool(state.found_nan["b"])  # one flag per leaf
    clean = {"a": jnp.ones(3), "b": jnp.ones((1, 2))}
    u, state = jax.jit(tx.update)(clean, state)
    assert not any(bool(x) for x in jax.tree.leaves(state))


def test_scale_by_learning_rate_none_is_identity_like_optax():
    tx = optim.scale_by_learning_rate(None)
    g = {"a": jnp.arange(3.0)}
    u, _ = tx.update(g, tx.init(g))
    np.testing.assert_array_equal(np.asarray(u["a"]), [0.0, 1.0, 2.0])


def test_lion_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="mode must be one of"):
        optim.scale_by_lion(mode="soft")


def test_multisteps_accumulates_in_float32_by_default_like_optax():
    p = {"a": jnp.ones(4, jnp.bfloat16)}
    ms = optim.MultiSteps(optim.sgd(1.0), 2)
    s = ms.init(p)
    assert s.acc_grads["a"].dtype == jnp.float32
    keep = optim.MultiSteps(optim.sgd(1.0), 2, accumulator_dtype=None).init(p)
    assert keep.acc_grads["a"].dtype == jnp.bfloat16
    packed = optim.pack(ms.gradient_transformation()).init(p)
    assert packed.acc_grads.buffers[0].dtype == jnp.float32
    u, s = ms.update({"a": jnp.ones(4, jnp.bfloat16)}, s, p)
    assert u["a"].dtype == jnp.bfloat16
