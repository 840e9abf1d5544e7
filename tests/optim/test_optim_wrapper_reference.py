"""add_noise / noisy_sgd, schedule_free_sgd and lookahead against independent float64 NumPy
implementations of their published equations, step by step for 24 steps.

Same protocol as test_optim_reference.py: at every step ours (float32 or bfloat16) and the
reference (float64) see the same gradients and params (the reference trajectory cast to the
dtype); our state evolves on its own. Errors are relative to the largest reference update of
the step. Tolerances:

* add_noise / noisy_sgd: the reference draws the noise the documented way (see the
  ``add_noise`` docstring: one split of the state key per step, one ``jax.random.normal``
  draw per packed buffer), converts it to float64 and applies the variance schedule
  ``eta / t**gamma`` (t = 1, 2, ...) and the update equation in float64. float32: every
  element within 1e-5; bfloat16: every element within 2e-2 (std, noise*std, g+noise and
  the learning-rate product are each rounded to 8 bits). A statistical check that does not
  depend on the key derivation: over 64 leaves the empirical std of each step is within
  5 standard errors of ``sqrt(eta / t**gamma)``.
* schedule_free_sgd (the update of the params y, the state z, and x from
  ``schedule_free_eval_params``), warmup, weight decay, b1 and weight_lr_power varied.
  float32, x and z tracked as independent sequences: every element within 1e-4 of the
  step's largest update. bfloat16 params (x re-taken from the held, rounded y each step):
  with ``state_dtype=float32`` the y update within 2e-2 and 95% of z within 6e-2 of the
  largest update, x within 1e-2 of max|y| (x is returned in bf16); with z in bf16 (the
  default) y and x within 1e-2 and z within 3e-2 of max|y| (the bf16 grid of the iterates).
* lookahead (fast and slow updates; the inner adam / sgd computed in the reference too):
  float32 every element within 1e-3 (adam) / 1e-4 (sgd); bfloat16 95% within 6e-2.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import optim
from optim import _optim_refs as R

STEPS = 24
SHAPES = {"w": (4, 3), "b": (5,), "k": (2, 3, 2), "s": ()}


def _rng(name, dtype):
    return np.random.default_rng(zlib.crc32(f"{name}/{jnp.dtype(dtype).name}".encode()))


def _cast(t, dtype):
    return {k: jnp.asarray(v, dtype) for k, v in t.items()}


def _f64(t):
    return {k: np.asarray(v, np.float64) for k, v in t.items()}


def _rel_err(ours, ref, scale):
    return np.concatenate([np.abs(np.asarray(ours[k], np.float64) - ref[k]).ravel() / scale
                           for k in ref])


def _scale(*trees):
    return max(float(np.max(np.abs(v))) for t in trees for v in t.values()) + 1e-12


# --- add_noise ---


class NoiseRef:
    """``u = sign * lr * (g + sqrt(eta / t**gamma) * n_t)`` in float64, ``n_t`` drawn the
    documented way: ``keys = split(key, B + 1)``, ``key = keys[0]``, buffer b from
    ``normal(keys[b + 1], (size_b,), dtype_b)``; ``groups`` lists the leaf names of each
    buffer, in buffer order (a leaf's values are consecutive in its buffer)."""

    def __init__(self, key, eta, gamma, groups, lr=None):
        self.key, self.eta, self.gamma, self.groups, self.lr = key, eta, gamma, groups, lr
        self.t = 0

    def noise(self, like):
        keys = jax.random.split(self.key, len(self.groups) + 1)
        self.key = keys[0]
        out = {}
        for names, k in zip(self.groups, keys[1:]):
            n = sum(int(np.prod(like[m].shape)) for m in names)
            buf = np.asarray(jax.random.normal(k, (n,), like[names[0]].dtype), np.float64)
            o = 0
            for m in names:
                size = int(np.prod(like[m].shape))
                out[m] = buf[o:o + size].reshape(like[m].shape)
                o += size
        return out

    def step(self, g64, like):
        self.t += 1
        std = np.sqrt(self.eta / self.t ** self.gamma)
        n = self.noise(like)
        u = {k: g64[k] + std * n[k] for k in g64}
        return u if self.lr is None else {k: -self.lr * v for k, v in u.items()}


def _flatten_names(tree):
    return [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _noise_case(name):
    """(ours, reference factory taking the flatten-order leaf names and their dtypes)."""
    if name == "noisy_sgd":
        return (lambda: optim.noisy_sgd(0.05, eta=0.3, gamma=0.55, key=jax.random.PRNGKey(7)),
                lambda names, dts: NoiseRef(jax.random.PRNGKey(7), 0.3, 0.55,
                                            [[n] for n in names], lr=0.05))
    if name == "add_noise":
        return (lambda: optim.add_noise(0.5, 1.0, key=11),
                lambda names, dts: NoiseRef(jax.random.PRNGKey(11), 0.5, 1.0,
                                            [[n] for n in names]))
    if name == "add_noise_in_chain":  # per-parameter state: one buffer per leaf
        return (lambda: optim.chain(optim.add_noise(0.2, 0.3, key=5), optim.trace(0.0)),
                lambda names, dts: NoiseRef(jax.random.PRNGKey(5), 0.2, 0.3,
                                            [[n] for n in names]))
    # inside a chain that keeps packed state (optim.pack): one buffer per dtype, flatten order
    def groups(names, dts):
        out: dict[str, list[str]] = {}
        for n in names:
            out.setdefault(dts[n], []).append(n)
        return list(out.values())
    return (lambda: optim.pack(optim.chain(optim.add_noise(0.2, 0.3, key=5),
                                           optim.trace(0.0))),
            lambda names, dts: NoiseRef(jax.random.PRNGKey(5), 0.2, 0.3, groups(names, dts)))


NOISE_CASES = ["noisy_sgd", "add_noise", "add_noise_in_chain", "add_noise_in_packed_chain"]


def _run_noise(name, dtype, mixed=False):
    rng = _rng(name, dtype)
    dts = {k: (jnp.bfloat16 if (mixed and k == "b") else dtype) for k in SHAPES}
    params = {k: jnp.asarray(rng.normal(size=s), dts[k]) for k, s in SHAPES.items()}
    ours_f, ref_f = _noise_case(name)
    names = _flatten_names(params)
    ref = ref_f(names, {k: jnp.dtype(v).name for k, v in dts.items()})
    tx = ours_f()
    state = tx.init(params)
    update = jax.jit(tx.update)
    errs = []
    for _ in range(STEPS):
        g = {k: jnp.asarray(rng.normal(size=s), dts[k]) for k, s in SHAPES.items()}
        u, state = update(g, state, params)
        ru = ref.step(_f64(g), g)
        errs.append(_rel_err(u, ru, _scale(ru)))
        for k in u:
            assert u[k].dtype == dts[k] and u[k].shape == SHAPES[k], k
    return np.stack(errs)


@pytest.mark.parametrize("name", NOISE_CASES)
def test_noise_float32_matches_reference(name):
    errs = _run_noise(name, jnp.float32)
    assert errs.max() <= 1e-5, f"{name}: max relative error {errs.max():.2e}"


@pytest.mark.parametrize("name", NOISE_CASES)
def test_noise_bfloat16_matches_reference(name):
    errs = _run_noise(name, jnp.bfloat16)
    assert errs.max() <= 2e-2, f"{name}: max relative error {errs.max():.2e}"


def test_noise_in_packed_chain_with_mixed_dtypes_matches_reference():
    # leaf "b" bfloat16, the rest float32: two buffers in order of first appearance in
    # flatten order (b, k, s, w): [b] then [k, s, w]
    errs = _run_noise("add_noise_in_packed_chain", jnp.float32, mixed=True)
    assert errs.max() <= 2e-2, f"max relative error {errs.max():.2e}"


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_add_noise_empirical_std_follows_schedule(dtype):
    eta, gamma, n_leaves, size = 0.7, 0.55, 64, 512
    zeros = {f"l{i:02d}": jnp.zeros((size,), dtype) for i in range(n_leaves)}
    tx = optim.add_noise(eta, gamma, key=jax.random.PRNGKey(123))
    state = tx.init(zeros)
    update = jax.jit(tx.update)
    n = n_leaves * size
    per_leaf = np.zeros((n_leaves, STEPS, size))
    prev = None
    for t in range(1, STEPS + 1):
        u, state = update(zeros, state)
        x = np.stack([np.asarray(u[k], np.float64) for k in sorted(u)])
        sigma = np.sqrt(eta / t ** gamma)
        # sample std of n normals: relative standard error 1/sqrt(2n); 5 standard errors
        assert abs(x.std() / sigma - 1) <= 5 / np.sqrt(2 * n), (t, x.std(), sigma)
        assert abs(x.mean()) <= 5 * sigma / np.sqrt(n), (t, x.mean())
        per_leaf[:, t - 1] = x / sigma
        if prev is not None:  # fresh draws every step
            assert abs(np.corrcoef(prev.ravel(), x.ravel())[0, 1]) <= 5 / np.sqrt(n)
        prev = x
    # every leaf gets its own unit-variance noise (no leaf left out or repeated)
    m = STEPS * size
    leaf_std = per_leaf.reshape(n_leaves, -1).std(axis=1)
    assert np.all(np.abs(leaf_std - 1) <= 5 / np.sqrt(2 * m)), leaf_std
    c = np.corrcoef(per_leaf.reshape(n_leaves, -1))
    off = c[~np.eye(n_leaves, dtype=bool)]
    assert np.abs(off).max() <= 5 / np.sqrt(m), np.abs(off).max()


def test_add_noise_is_reproducible_from_its_key():
    g = _cast({k: np.ones(s) for k, s in SHAPES.items()}, jnp.float32)
    outs = []
    for _ in range(2):
        tx = optim.noisy_sgd(0.1, key=jax.random.PRNGKey(3))
        s = tx.init(g)
        for _ in range(3):
            u, s = jax.jit(tx.update)(g, s, g)
        outs.append(u)
    for k in g:
        np.testing.assert_array_equal(np.asarray(outs[0][k]), np.asarray(outs[1][k]))


# --- schedule-free ---


# bf16 outputs that are O(1) iterates (x, and z when stored in bf16) are measured against
# max|y|: rounding them to 8 bits is already ~4e-3 of it. z in bf16 accumulates one such
# rounding per step.
GRID_TOL = {"y": 1e-2, "x": 1e-2, "z": 3e-2}
SF_CASES = {
    "constant": dict(lr=0.1),
    "warmup_decay": dict(lr=0.2, warmup=6, wd=0.05),
    "b1_08_power_1_warmup": dict(lr=0.1, b1=0.8, power=1.0, warmup=4),
}


def _run_schedule_free(name, dtype, state_dtype=None):
    """Per-step errors of y (the update), z and x = schedule_free_eval_params, relative to
    the largest reference update of the step ("step") and to the largest |y| ("grid")."""
    hp = SF_CASES[name]
    rng = _rng(name, dtype)
    b1 = hp.get("b1", 0.9)
    tx = optim.schedule_free_sgd(hp["lr"], warmup_steps=hp.get("warmup"), b1=b1,
                                 weight_decay=hp.get("wd"),
                                 weight_lr_power=hp.get("power", 2.0), state_dtype=state_dtype)
    params = _f64(_cast({k: rng.normal(size=s) for k, s in SHAPES.items()}, dtype))
    # float32: x and z are independent sequences. Below float32 the y the model holds is the
    # rounded one, so x is re-taken from it (x = (y - (1 - b1) z) / b1) before each step.
    anchor = dtype != jnp.float32
    ref = R.ScheduleFreeSGD(hp["lr"], b1=b1, warmup=hp.get("warmup"), wd=hp.get("wd", 0.0),
                            power=hp.get("power", 2.0), anchor_y=anchor).init(params)
    state = tx.init(_cast(params, dtype))
    update = jax.jit(tx.update)
    errs = {(what, rel): [] for what in "yzx" for rel in ("step", "grid")}
    for _ in range(STEPS):
        g = _cast({k: rng.normal(size=s) for k, s in SHAPES.items()}, dtype)
        p = _cast(ref.y(), dtype)  # the reference's y sequence, as the model holds it
        u, state = update(g, state, p)
        ru = ref.step(_f64(g), _f64(p))
        y_new = optim.apply_updates(p, u)
        x = optim.schedule_free_eval_params(state, y_new)
        for k in u:
            assert u[k].dtype == dtype and x[k].dtype == dtype, k
        rx = ref.x
        if anchor:
            rx = {k: (np.asarray(y_new[k], np.float64) - (1 - b1) * ref.z[k]) / b1 for k in rx}
        pairs = {"y": (u, ru), "z": (state.z, ref.z), "x": (x, rx)}
        if not any(np.any(v) for v in ru.values()):
            # first warmup step: the learning rate is 0, nothing moves; ours only
            # recomputes y = b1 x + (1 - b1) z, so a few ulps of |y| at most
            ulp = float(jnp.finfo(dtype).eps) * _scale(_f64(p))
            for what, (o, r) in pairs.items():
                e = _rel_err(o, r, 1.0).max()
                assert e <= 4 * ulp, f"{name} {what} at a zero-lr step: {e:.2e} > 4 ulp"
            continue
        step, grid = _scale(ru), _scale(_f64(p))
        for what, (o, r) in pairs.items():
            errs[what, "step"].append(_rel_err(o, r, step))
            errs[what, "grid"].append(_rel_err(o, r, grid))
    return {k: np.stack(v) for k, v in errs.items()}


@pytest.mark.parametrize("name", sorted(SF_CASES))
def test_schedule_free_sgd_float32_matches_reference(name):
    errs = _run_schedule_free(name, jnp.float32)
    for what in "yzx":
        e = errs[what, "step"]
        assert e.max() <= 1e-4, f"{name} {what}: max relative error {e.max():.2e}"


@pytest.mark.parametrize("name", sorted(SF_CASES))
def test_schedule_free_sgd_bfloat16_float32_state_matches_reference(name):
    errs = _run_schedule_free(name, jnp.bfloat16, state_dtype=jnp.float32)
    e = errs["y", "step"]
    assert e.max() <= 2e-2, f"{name} y: max relative error {e.max():.2e}"
    # z sums -lr*g rounded to bf16 (the sgd update's dtype) every step
    frac = np.mean(errs["z", "step"] <= 6e-2)
    assert frac >= 0.95, f"{name} z: only {frac:.3f} of elements within 6e-2"
    e = errs["x", "grid"]
    assert e.max() <= GRID_TOL["x"], f"{name} x: max error {e.max():.2e} of max|y|"


@pytest.mark.parametrize("name", sorted(SF_CASES))
def test_schedule_free_sgd_bfloat16_state_matches_reference(name):
    # z in bf16 (the default, as in Optax): z is O(1) and rounded to 8 bits every step while
    # a step moves it by O(lr), so the errors are measured on the grid of the iterates
    errs = _run_schedule_free(name, jnp.bfloat16)
    for what in "yzx":
        e = errs[what, "grid"]
        assert e.max() <= GRID_TOL[what], f"{name} {what}: max error {e.max():.2e} of max|y|"


# --- lookahead ---


LA_CASES = {
    "adam": (lambda: optim.adam(0.05), lambda: R.Adam(lr=0.05), 5, 0.5, False, 1e-3),
    "adam_reset": (lambda: optim.adam(0.05), lambda: R.Adam(lr=0.05), 4, 0.3, True, 1e-3),
    "sgd_momentum": (lambda: optim.sgd(0.05, momentum=0.9),
                     lambda: R.SGD(lr=0.05, momentum=0.9), 6, 0.8, False, 1e-4),
    "sgd_every_step": (lambda: optim.sgd(0.1), lambda: R.SGD(lr=0.1), 1, 0.5, False, 1e-4),
}


def _run_lookahead(name, dtype):
    ours_inner, ref_inner, k, alpha, reset, _ = LA_CASES[name]
    rng = _rng(name, dtype)
    p0 = _f64(_cast({n: rng.normal(size=s) for n, s in SHAPES.items()}, dtype))
    fast, slow = dict(p0), dict(p0)
    tx = optim.lookahead(ours_inner(), sync_period=k, slow_step_size=alpha, reset_state=reset)
    state = tx.init(optim.LookaheadParams.init_synced(_cast(p0, dtype)))
    ref = R.Lookahead(ref_inner, k, alpha, reset).init(p0)
    update = jax.jit(tx.update)
    errs = []
    for _ in range(STEPS):
        g = _cast({n: rng.normal(size=s) for n, s in SHAPES.items()}, dtype)
        pf, ps = _cast(fast, dtype), _cast(slow, dtype)
        u, state = update(g, state, optim.LookaheadParams(pf, ps))
        rf, rs = ref.step(_f64(g), _f64(pf), _f64(ps))
        scale = _scale(rf, rs)
        errs.append(np.concatenate([_rel_err(u.fast, rf, scale), _rel_err(u.slow, rs, scale)]))
        for n in SHAPES:
            assert u.fast[n].dtype == dtype and u.slow[n].dtype == dtype, n
        fast = {n: np.asarray(pf[n], np.float64) + rf[n] for n in fast}
        slow = {n: np.asarray(ps[n], np.float64) + rs[n] for n in slow}
    assert STEPS // k >= 3  # several sync periods
    return np.stack(errs)


@pytest.mark.parametrize("name", sorted(LA_CASES))
def test_lookahead_float32_matches_reference(name):
    errs = _run_lookahead(name, jnp.float32)
    tol = LA_CASES[name][-1]
    assert errs.max() <= tol, f"{name}: max relative error {errs.max():.2e}"


@pytest.mark.parametrize("name", sorted(LA_CASES))
def test_lookahead_bfloat16_matches_reference(name):
    errs = _run_lookahead(name, jnp.bfloat16)
    frac = np.mean(errs <= 6e-2)
    assert frac >= 0.95, f"{name}: only {frac:.3f} of elements within 6e-2"


def test_lookahead_reference_resyncs_fast_to_slow():
    # the float64 reference obeys the published invariant, so the comparison above is with
    # the right thing: after each sync the fast weights equal the new slow weights
    rng = np.random.default_rng(0)
    p = {n: rng.normal(size=s) for n, s in SHAPES.items()}
    ref = R.Lookahead(lambda: R.SGD(lr=0.1), 3, 0.5).init(p)
    fast, slow = dict(p), dict(p)
    for t in range(1, 10):
        g = {n: rng.normal(size=s) for n, s in SHAPES.items()}
        uf, us = ref.step(g, fast, slow)
        fast = {n: fast[n] + uf[n] for n in fast}
        slow = {n: slow[n] + us[n] for n in slow}
        for n in p:
            if t % 3 == 0:
                np.testing.assert_allclose(fast[n], slow[n], rtol=0, atol=1e-12)
            else:
                assert not np.allclose(fast[n], slow[n])
