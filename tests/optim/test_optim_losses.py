"""Losses against independent float64 NumPy/SciPy formulas, values and gradients.

Tolerances (stated once, used throughout):
- float64 (inside ``jax.enable_x64``): rtol 1e-10 for values and analytic
  gradients, 1e-6 against central finite differences (h = 1e-6).
- float32: rtol 2e-5, atol 2e-6 against the float64 reference.
- bfloat16: inputs are rounded to bfloat16 first and the float64 reference is
  computed from the rounded inputs; the result (computed in float32 and rounded
  once) must match to rtol 1e-2 (bfloat16 keeps 8 significant bits), atol 1e-2.
"""

from __future__ import annotations

import functools
import inspect
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import scipy.special as sp
from _cairn_testlib import central_diff
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import optim

# Public once cairn.optim re-exports it; the private module is its home either way.
ctc_loss_with_forward_probs = optim.ctc_loss_with_forward_probs

HSET = settings(max_examples=15, deadline=None)
SLOW = pytest.mark.slow  # extra parameter points; the default suite keeps one or two
F32 = dict(rtol=2e-5, atol=2e-6)
F64 = dict(rtol=1e-10, atol=1e-12)
FD = dict(rtol=1e-6, atol=1e-8)
BF16 = dict(rtol=1e-2, atol=1e-2)


def rng(seed=0):
    return np.random.default_rng(seed)


# --- float64 references ---


def np_log_softmax(x, axis=-1):
    return x - sp.logsumexp(x, axis=axis, keepdims=True)


def np_softmax(x, axis=-1):
    return np.exp(np_log_softmax(x, axis))


def np_huber(e, d):
    a = np.abs(e)
    return np.where(a <= d, 0.5 * e * e, d * (a - 0.5 * d))


def np_logcosh(x):
    """log(cosh(x)) accurate to float64: a Taylor series near 0 (where cosh(x) rounds
    to 1), the textbook form in the middle, |x| - log 2 + log1p(e^{-2|x|}) far out."""
    a = np.abs(np.asarray(x, np.float64))
    series = a**2 / 2 - a**4 / 12 + a**6 / 45 - 17 * a**8 / 2520
    with np.errstate(over="ignore"):
        middle = np.log(np.cosh(a))
    far = a - np.log(2) + np.log1p(np.exp(-2 * a))
    return np.where(a < 0.05, series, np.where(a < 20, middle, far))


def np_bce(x, y):
    return -y * sp.log_expit(x) - (1 - y) * sp.log_expit(-x)


def np_focal(x, y, alpha, gamma):
    p = sp.expit(x)
    pt = y * p + (1 - y) * (1 - p)
    out = np_bce(x, y) * (1 - pt) ** gamma
    if alpha is not None:
        out = (alpha * y + (1 - alpha) * (1 - y)) * out
    return out


def np_cosine(a, b, eps=0.0, axis=-1):
    na = np.sqrt(np.maximum((a * a).sum(axis, keepdims=True), eps))
    nb = np.sqrt(np.maximum((b * b).sum(axis, keepdims=True), eps))
    return ((a / na) * (b / nb)).sum(axis)


def np_kl(lp, t, axis=-1):
    safe = np.where(t > 0, t, 1.0)
    return np.where(t > 0, t * (np.log(safe) - lp), 0.0).sum(axis)


def np_ctc_one(logits, labels, blank=0):
    """Graves' forward recursion over the blank-interleaved labels, in log space.

    Returns (loss, alpha[T, 2L+1])."""
    lp = np_log_softmax(logits.astype(np.float64))
    ext = [blank]
    for lab in labels:
        ext += [int(lab), blank]
    S, T = len(ext), lp.shape[0]
    alpha = np.full((T, S), -np.inf)
    alpha[0, 0] = lp[0, blank]
    if S > 1:
        alpha[0, 1] = lp[0, ext[1]]
    for t in range(1, T):
        for s in range(S):
            a = alpha[t - 1, s]
            if s >= 1:
                a = np.logaddexp(a, alpha[t - 1, s - 1])
            if s >= 2 and ext[s] != blank and ext[s] != ext[s - 2]:
                a = np.logaddexp(a, alpha[t - 1, s - 2])
            alpha[t, s] = a + lp[t, ext[s]]
    last = alpha[-1, -1] if S == 1 else np.logaddexp(alpha[-1, -1], alpha[-1, -2])
    return -last, alpha


def np_ctc_brute(logits, labels, blank=0):
    """Sum over every frame-wise path whose collapse equals ``labels``."""
    lp = np_log_softmax(logits.astype(np.float64))
    T, K = lp.shape
    total = -np.inf
    for path in itertools.product(range(K), repeat=T):
        collapsed = [k for i, k in enumerate(path) if k != blank and (i == 0 or path[i - 1] != k)]
        if collapsed == list(labels):
            total = np.logaddexp(total, sum(lp[t, k] for t, k in enumerate(path)))
    return -total


def np_ctc(logits, lpad, labels, ypad, blank=0):
    out = []
    for b in range(logits.shape[0]):
        frames = logits[b][lpad[b] == 0]
        labs = labels[b][ypad[b] == 0]
        out.append(np_ctc_one(frames, labs, blank)[0])
    return np.array(out)


def bf16_round(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def check_dtypes(fn, ref, *arrays, float_args=None, out_dtype=None, **kw):
    """float32 and bfloat16 results of ``fn(*arrays)`` against float64 ``ref``.

    ``float_args`` marks the positions cast to the tested dtype (default: all);
    the result must have that dtype, or ``out_dtype`` when given. Both dtypes run
    in ONE jit (eager dispatch would compile every primitive separately, and
    the fixed cost per compile dominates this suite's time)."""
    float_args = range(len(arrays)) if float_args is None else float_args
    cases = []
    for dtype, tol in ((np.float32, F32), (jnp.bfloat16, BF16)):
        args, ref_args = [], []
        for i, a in enumerate(arrays):
            if i in float_args:
                r = np.asarray(a, np.float64) if dtype == np.float32 else bf16_round(a)
                args.append(jnp.asarray(r, dtype))
                ref_args.append(np.asarray(args[-1], np.float64))
            else:
                args.append(a)
                ref_args.append(a)
        cases.append((dtype, tol, args, ref_args))
    outs = jax.jit(lambda all_args: [fn(*a, **kw) for a in all_args])([c[2] for c in cases])
    for (dtype, tol, _, ref_args), got in zip(cases, outs):
        assert got.dtype == (out_dtype or dtype), (got.dtype, dtype)
        np.testing.assert_allclose(np.asarray(got, np.float64), ref(*ref_args), **tol)


def jgrad(f):
    """jax.grad under jit (one compile instead of one per primitive)."""
    return jax.jit(jax.grad(f))


_STATIC = ("axis", "reduce_fn", "blank_id")


@functools.cache
def J(f):
    """``f`` under jit, config arguments static; cached so compiles are reused.

    The value tests run the losses the way training code does, compiled; the
    eager path is covered by the error tests and the Optax comparison."""
    names = [n for n in _STATIC if n in inspect.signature(f).parameters]
    return jax.jit(f, static_argnames=names)


# --- regression losses ---

SHAPE = (3, 4, 5)


def test_squared_and_l2_values_and_grads():
    x, t = rng().normal(size=SHAPE) * 3, rng(1).normal(size=SHAPE)
    check_dtypes(optim.squared_error, lambda a, b: (a - b) ** 2, x, t)
    check_dtypes(optim.l2_loss, lambda a, b: 0.5 * (a - b) ** 2, x, t)
    check_dtypes(optim.squared_error, lambda a: a**2, x)
    with jax.enable_x64(True):
        g = jgrad(lambda p: J(optim.squared_error)(p, t).sum())(x)
        np.testing.assert_allclose(g, 2 * (x - t), **F64)
        g = jgrad(lambda p: J(optim.l2_loss)(p, t).sum())(x)
        np.testing.assert_allclose(g, x - t, **F64)


@pytest.mark.parametrize("delta", [0.5, pytest.param(1.0, marks=SLOW), 2.5])
def test_huber_values_and_grads(delta):
    x, t = rng().normal(size=SHAPE) * 3, rng(1).normal(size=SHAPE)
    x[0, 0, :2] = t[0, 0, :2] + np.array([delta, -delta])  # exactly at the kink
    check_dtypes(lambda a, b: J(optim.huber_loss)(a, b, delta=delta), lambda a, b: np_huber(a - b, delta), x, t)
    with jax.enable_x64(True):
        g = jgrad(lambda p: J(optim.huber_loss)(p, t, delta=delta).sum())(x)
        np.testing.assert_allclose(g, np.clip(x - t, -delta, delta), **F64)


def test_log_cosh_values_grads_and_extremes():
    x = np.concatenate([rng().normal(size=40) * 3, [0.0, 1e-8, -1e-4, 0.999, 1.0, 1.001, 50.0, -300.0]])
    t = np.zeros_like(x)
    check_dtypes(optim.log_cosh, lambda a, b: np_logcosh(a - b), x, t)
    with jax.enable_x64(True):
        v = J(optim.log_cosh)(x)
        np.testing.assert_allclose(v, np_logcosh(x), rtol=1e-13, atol=1e-300)
        g = jgrad(lambda p: J(optim.log_cosh)(p).sum())(x)
        np.testing.assert_allclose(g, np.tanh(x), **F64)
    # no overflow where cosh itself overflows, and tiny errors keep precision
    big = J(optim.log_cosh)(jnp.array([1e4, -1e4], jnp.float32))
    np.testing.assert_allclose(big, 1e4 - np.log(2), rtol=1e-6)
    tiny = J(optim.log_cosh)(jnp.array(1e-3, jnp.float32))
    np.testing.assert_allclose(float(tiny), np_logcosh(1e-3), rtol=1e-5)
    gbig = jgrad(lambda p: J(optim.log_cosh)(p).sum())(jnp.array([1e4, -1e4, 0.0]))
    np.testing.assert_array_equal(gbig, [1.0, -1.0, 0.0])


@pytest.mark.parametrize("axis", [-1, 0, (1, 2)])
def test_cosine_similarity_and_distance(axis):
    a, b = rng().normal(size=SHAPE), rng(1).normal(size=SHAPE)
    check_dtypes(
        lambda p, q: J(optim.cosine_similarity)(p, q, axis=axis), lambda p, q: np_cosine(p, q, axis=axis), a, b
    )
    check_dtypes(
        lambda p, q: J(optim.cosine_distance)(p, q, axis=axis), lambda p, q: 1 - np_cosine(p, q, axis=axis), a, b
    )
    if axis == -1:
        with jax.enable_x64(True):
            g = jgrad(lambda p: J(optim.cosine_similarity)(p, b).sum())(a)
            na = np.linalg.norm(a, axis=-1, keepdims=True)
            nb = np.linalg.norm(b, axis=-1, keepdims=True)
            cos = np_cosine(a, b)[..., None]
            np.testing.assert_allclose(g, b / (na * nb) - cos * a / na**2, rtol=1e-9)


def test_cosine_epsilon_and_where():
    a, b = rng().normal(size=(4, 6)), rng(1).normal(size=(4, 6))
    a[0] = 0.0
    eps = 1e-3
    got = J(optim.cosine_similarity)(jnp.asarray(a), jnp.asarray(b), epsilon=eps)
    np.testing.assert_allclose(got, np_cosine(a, b, eps), **F32)
    g = jgrad(lambda p: J(optim.cosine_similarity)(p, b, epsilon=eps).sum())(jnp.asarray(a, jnp.float32))
    assert np.all(np.isfinite(g))
    mask = rng(2).random((4, 6)) > 0.4
    got = J(optim.cosine_similarity)(jnp.asarray(a), jnp.asarray(b), epsilon=eps, where=mask)
    np.testing.assert_allclose(got, np_cosine(a * mask, b * mask, eps), **F32)


# --- classification losses ---


def test_sigmoid_bce_values_grads_and_extremes():
    x = rng().normal(size=SHAPE) * 4
    y_hard = (rng(1).random(SHAPE) > 0.5).astype(float)
    y_soft = rng(2).random(SHAPE)
    for y in (y_hard, y_soft):
        check_dtypes(optim.sigmoid_binary_cross_entropy, np_bce, x, y)
        with jax.enable_x64(True):
            g = jgrad(lambda z, y=y: J(optim.sigmoid_binary_cross_entropy)(z, y).sum())(x)
            np.testing.assert_allclose(g, sp.expit(x) - y, **F64)
    big = jnp.array([100.0, -100.0, 100.0, -100.0], jnp.float32)
    lab = jnp.array([1.0, 0.0, 0.0, 1.0])
    np.testing.assert_allclose(optim.sigmoid_binary_cross_entropy(big, lab), [0, 0, 100, 100], atol=1e-6)
    g = jgrad(lambda z: J(optim.sigmoid_binary_cross_entropy)(z, lab).sum())(big)
    np.testing.assert_allclose(g, [0.0, 0.0, 1.0, -1.0], atol=1e-6)
    # broadcasting one label vector over a batch
    np.testing.assert_allclose(
        J(optim.sigmoid_binary_cross_entropy)(jnp.asarray(x, jnp.float32), y_soft[0, 0]),
        np_bce(x, y_soft[0, 0]), **F32,
    )


@pytest.mark.parametrize(
    "alpha,gamma",
    [(0.25, 2.0), (0.75, 0.5), pytest.param(None, 2.0, marks=SLOW), pytest.param(None, 0.0, marks=SLOW)],
)
def test_sigmoid_focal_loss(alpha, gamma):
    x = rng().normal(size=SHAPE) * 3
    for y in ((rng(1).random(SHAPE) > 0.5).astype(float), rng(2).random(SHAPE)):
        check_dtypes(
            lambda a, b: J(optim.sigmoid_focal_loss)(a, b, alpha=alpha, gamma=gamma),
            lambda a, b: np_focal(a, b, alpha, gamma), x, y,
        )
        with jax.enable_x64(True):
            xs, ys = x[0, :2], y[0, :2]
            g = jgrad(lambda z, ys=ys: J(optim.sigmoid_focal_loss)(z, ys, alpha=alpha, gamma=gamma).sum())(xs)
            fd = central_diff(lambda z, ys=ys: np_focal(z, ys, alpha, gamma).sum(), xs)
            np.testing.assert_allclose(g, fd, **FD)
    # confident, correct predictions: loss and gradient finite and ~0
    big = jnp.array([30.0, -30.0], jnp.float32)
    lab = jnp.array([1.0, 0.0])
    g = jgrad(lambda z: J(optim.sigmoid_focal_loss)(z, lab, alpha=alpha, gamma=gamma).sum())(big)
    assert np.all(np.isfinite(g)) and np.all(np.abs(g) < 1e-10)


def test_hinge_loss():
    s = rng().normal(size=SHAPE) * 2
    y = np.sign(rng(1).normal(size=SHAPE))
    check_dtypes(optim.hinge_loss, lambda a, b: np.maximum(0, 1 - a * b), s, y)
    with jax.enable_x64(True):
        g = jgrad(lambda z: J(optim.hinge_loss)(z, y).sum())(s)
        np.testing.assert_allclose(g, np.where(1 - s * y > 0, -y, 0.0), **F64)


@pytest.mark.parametrize("axis", [-1, 1, (1, 2)])
def test_softmax_cross_entropy(axis):
    x = rng().normal(size=SHAPE) * 3
    y = rng(1).random(SHAPE)
    y = y / y.sum(axis=axis, keepdims=True)
    check_dtypes(
        lambda a, b: J(optim.softmax_cross_entropy)(a, b, axis=axis),
        lambda a, b: -(b * np_log_softmax(a, axis)).sum(axis), x, y,
    )
    with jax.enable_x64(True):
        g = jgrad(lambda z: J(optim.softmax_cross_entropy)(z, y, axis=axis).sum())(x)
        np.testing.assert_allclose(g, np_softmax(x, axis) * y.sum(axis, keepdims=True) - y, **F64)


def test_softmax_cross_entropy_where_and_stability():
    x = rng().normal(size=(4, 6)) * 3
    y = np.eye(6)[[0, 3, 5, 1]]
    mask = rng(1).random((4, 6)) > 0.3
    mask[np.arange(4), [0, 3, 5, 1]] = True
    mask[3] = False  # a fully masked row
    got = J(optim.softmax_cross_entropy)(jnp.asarray(x, jnp.float32), y, where=mask)
    ref = []
    for i in range(4):
        m = mask[i]
        ref.append(0.0 if not m.any() else -(y[i][m] * np_log_softmax(x[i][m])).sum())
    np.testing.assert_allclose(got, ref, **F32)
    g = jgrad(lambda z: J(optim.softmax_cross_entropy)(z, y, where=mask).sum())(jnp.asarray(x, jnp.float32))
    assert np.all(np.isfinite(g)) and np.all(g[3] == 0) and np.all(g[~mask] == 0)
    # batch-shaped `where` drops whole rows
    rows = np.array([True, False, True, True])
    got = J(optim.softmax_cross_entropy)(jnp.asarray(x), y, where=rows)
    np.testing.assert_allclose(got, np.where(rows, -(y * np_log_softmax(x)).sum(-1), 0.0), **F32)
    # huge logits stay finite
    big = jnp.array([[1e4, -1e4, 0.0]], jnp.float32)
    v, g = jax.value_and_grad(lambda z: J(optim.softmax_cross_entropy)(z, jnp.array([[0.0, 1.0, 0.0]])).sum())(big)
    np.testing.assert_allclose(v, 2e4, rtol=1e-6)
    np.testing.assert_allclose(g, [[1.0, -1.0, 0.0]], atol=1e-6)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_integer_labels_cross_entropy(axis):
    x = rng().normal(size=SHAPE) * 3
    k = SHAPE[axis]
    batch = tuple(s for i, s in enumerate(SHAPE) if i != axis % 3)
    labels = rng(1).integers(0, k, batch)

    def ref(a, lab=labels):
        lse = sp.logsumexp(a, axis=axis)
        picked = np.take_along_axis(a, np.expand_dims(lab, axis), axis).squeeze(axis)
        return lse - picked

    check_dtypes(
        lambda a, b: J(optim.softmax_cross_entropy_with_integer_labels)(a, b, axis=axis), ref, x, labels,
        float_args=(0,),
    )
    with jax.enable_x64(True):
        g = jgrad(lambda z: J(optim.softmax_cross_entropy_with_integer_labels)(z, labels, axis=axis).sum())(x)
        onehot = np.moveaxis(np.eye(k)[labels], -1, axis)
        np.testing.assert_allclose(g, np_softmax(x, axis) - onehot, **F64)


def test_integer_labels_tuple_axis_and_where():
    x = rng().normal(size=SHAPE)
    flat = rng(1).integers(0, 20, (3,))
    got = J(optim.softmax_cross_entropy_with_integer_labels)(jnp.asarray(x, jnp.float32), flat, axis=(1, 2))
    xf = x.reshape(3, 20)
    np.testing.assert_allclose(got, sp.logsumexp(xf, -1) - xf[np.arange(3), flat], **F32)
    # tuple axis in non-trailing order flattens in the order the axes are given
    got = J(optim.softmax_cross_entropy_with_integer_labels)(jnp.asarray(x, jnp.float32), flat[:1].repeat(4) % 15, axis=(2, 0))
    xt = np.transpose(x, (1, 2, 0)).reshape(4, 15)
    lab = flat[:1].repeat(4) % 15
    np.testing.assert_allclose(got, sp.logsumexp(xt, -1) - xt[np.arange(4), lab], **F32)
    # element-wise mask: classes outside it leave the normaliser; fully masked rows give 0
    x2 = rng(2).normal(size=(5, 7))
    lab2 = np.array([0, 3, 6, 2, 1])
    mask = rng(3).random((5, 7)) > 0.4
    mask[np.arange(5), lab2] = True
    mask[4] = False
    got = J(optim.softmax_cross_entropy_with_integer_labels)(jnp.asarray(x2, jnp.float32), lab2, where=mask)
    ref = [sp.logsumexp(x2[i][mask[i]]) - x2[i, lab2[i]] if mask[i].any() else 0.0 for i in range(5)]
    np.testing.assert_allclose(got, ref, **F32)
    g = jgrad(
        lambda z: J(optim.softmax_cross_entropy_with_integer_labels)(z, lab2, where=mask).sum()
    )(jnp.asarray(x2, jnp.float32))
    assert np.all(np.isfinite(g)) and np.all(g[4] == 0) and np.all(g[~mask] == 0)
    rows = np.array([True, True, False, True, False])
    got = J(optim.softmax_cross_entropy_with_integer_labels)(jnp.asarray(x2), lab2, where=rows)
    np.testing.assert_allclose(
        got, np.where(rows, sp.logsumexp(x2, -1) - x2[np.arange(5), lab2], 0.0), **F32
    )


def test_integer_labels_out_of_range_under_jit_is_nan():
    f = jax.jit(optim.softmax_cross_entropy_with_integer_labels)
    out = f(jnp.zeros((2, 3)), jnp.array([1, 7]))
    assert np.isfinite(out[0]) and np.isnan(out[1])


def test_safe_softmax_cross_entropy_with_neg_inf_logits():
    x = rng().normal(size=(4, 5))
    y = rng(1).random((4, 5))
    x[0, 1] = x[2, [0, 4]] = -np.inf
    y[0, 1] = y[2, [0, 4]] = 0.0
    y /= y.sum(-1, keepdims=True)

    def ref(a, b):
        lsm = np_log_softmax(a)
        return -np.where(b != 0, b * np.where(b != 0, lsm, 0.0), 0.0).sum(-1)

    check_dtypes(optim.safe_softmax_cross_entropy, ref, x, y)
    assert np.all(np.isnan(np.asarray(optim.softmax_cross_entropy(jnp.asarray(x), jnp.asarray(y)))[[0, 2]]))
    with jax.enable_x64(True):
        g = jgrad(lambda z: J(optim.safe_softmax_cross_entropy)(z, y).sum())(x)
        np.testing.assert_allclose(g, np_softmax(x) - y, **F64)


@pytest.mark.parametrize("epsilon", [2.0, pytest.param(-1.0, marks=SLOW), pytest.param(0.0, marks=SLOW)])
def test_poly_loss(epsilon):
    x = rng().normal(size=SHAPE) * 2
    y = rng(1).random(SHAPE)
    y /= y.sum(-1, keepdims=True)

    def ref(a, b):
        return -(b * np_log_softmax(a)).sum(-1) + epsilon * (b * (1 - np_softmax(a))).sum(-1)

    check_dtypes(lambda a, b: J(optim.poly_loss_cross_entropy)(a, b, epsilon=epsilon), ref, x, y)
    with jax.enable_x64(True):
        xs, ys = x[0], y[0]
        g = jgrad(lambda z: J(optim.poly_loss_cross_entropy)(z, ys, epsilon=epsilon).sum())(xs)
        np.testing.assert_allclose(g, central_diff(lambda z: ref(z, ys).sum(), xs), **FD)
    mask = rng(2).random(SHAPE) > 0.3
    got = J(optim.poly_loss_cross_entropy)(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32), epsilon=epsilon, where=mask)
    want = np.zeros(SHAPE[:2])
    for i in np.ndindex(*SHAPE[:2]):
        m = mask[i]
        if m.any():
            lsm = np_log_softmax(x[i][m])
            want[i] = -(y[i][m] * lsm).sum() + epsilon * (y[i][m] * (1 - np.exp(lsm))).sum()
    np.testing.assert_allclose(got, want, **F32)


def test_kl_divergences():
    t = rng().random(SHAPE)
    t[0, 0, :2] = 0.0
    t /= t.sum(-1, keepdims=True)
    lp = np_log_softmax(rng(1).normal(size=SHAPE))
    check_dtypes(optim.kl_divergence, np_kl, lp, t)
    check_dtypes(
        optim.convex_kl_divergence, lambda a, b: np_kl(a, b) + (np.exp(a) - b).sum(-1), lp, t * 1.3
    )
    with jax.enable_x64(True):
        g = jgrad(lambda z: J(optim.kl_divergence)(z, t).sum())(lp)
        np.testing.assert_allclose(g, -t, **F64)
        g = jgrad(lambda z: J(optim.convex_kl_divergence)(z, t).sum())(lp)
        np.testing.assert_allclose(g, -t + np.exp(lp), **F64)
        gt = jgrad(lambda q: J(optim.kl_divergence)(lp, q).sum())(t)
        assert np.all(np.isfinite(gt))
        pos = t > 0
        np.testing.assert_allclose(gt[pos], np.log(t[pos]) + 1 - lp[pos], **F64)
    mask = rng(2).random(SHAPE) > 0.5
    got = J(optim.kl_divergence)(jnp.asarray(lp), jnp.asarray(t), where=mask)
    np.testing.assert_allclose(got, np_kl(np.where(mask, lp, 0), np.where(mask, t, 0)), **F32)
    got = J(optim.kl_divergence)(jnp.asarray(lp), jnp.asarray(t), axis=(1, 2))
    np.testing.assert_allclose(got, np_kl(lp, t, axis=(1, 2)), **F32)


def test_smooth_labels():
    y = np.eye(5)[rng().integers(0, 5, (3, 4))]
    check_dtypes(lambda a: J(optim.smooth_labels)(a, 0.1), lambda a: 0.9 * a + 0.1 / 5, y)
    got = J(optim.smooth_labels)(jnp.asarray(y, jnp.float32), 0.2, axis=(1, 2))
    np.testing.assert_allclose(got, 0.8 * y + 0.2 / 20, **F32)
    mask = np.ones((3, 4, 5), bool)
    mask[..., 3:] = False
    got = J(optim.smooth_labels)(jnp.asarray(y, jnp.float32), 0.3, where=mask)
    np.testing.assert_allclose(got, 0.7 * y + 0.3 / 3, **F32)
    # smoothed one-hot rows still sum to one
    np.testing.assert_allclose(optim.smooth_labels(jnp.asarray(y), 0.25).sum(-1), 1.0, rtol=1e-6)


# --- metric learning and ranking ---


@pytest.mark.parametrize("q", [1, 2, 3])
def test_triplet_margin_loss(q):
    a, p, n = (rng(i).normal(size=(6, 4)) for i in range(3))
    p[0] = a[0]  # identical pair: the eps keeps the gradient finite

    def ref(a, p, n):
        d = lambda u, v: ((np.abs(u - v) ** q).sum(-1) + 1e-6) ** (1 / q)  # noqa: E731
        return np.maximum(d(a, p) - d(a, n) + 1.0, 0.0)

    check_dtypes(lambda *z: J(optim.triplet_margin_loss)(*z, norm_degree=q), ref, a, p, n)
    with jax.enable_x64(True):
        g = jgrad(lambda z: J(optim.triplet_margin_loss)(z, p, n, norm_degree=q).sum())(a)
        assert np.all(np.isfinite(g))
        keep = np.ones_like(a, bool)
        keep[0] = q > 1  # |x|^1 is not differentiable at 0: skip that row for q = 1
        fd = central_diff(lambda z: ref(z, p, n).sum(), a)
        np.testing.assert_allclose(g[keep], fd[keep], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reduce_fn", [jnp.mean, jnp.sum, None])
def test_ranking_softmax_loss(reduce_fn):
    s = rng().normal(size=(4, 6)) * 2
    y = (rng(1).random((4, 6)) > 0.6).astype(float) * rng(2).integers(1, 4, (4, 6))
    w = rng(3).random((4, 6)) + 0.5
    mask = rng(4).random((4, 6)) > 0.3
    mask[2] = False

    def per_list(s, y, w=None, mask=None):
        out = []
        for i in range(s.shape[0]):
            m = np.ones(s.shape[1], bool) if mask is None else mask[i]
            if not m.any():
                out.append(0.0)
                continue
            yy = y[i][m] * (1 if w is None else w[i][m])
            out.append(-(yy * np_log_softmax(s[i][m])).sum())
        return np.array(out)

    def reduce(v, valid):
        if reduce_fn is None:
            return v
        if reduce_fn is jnp.sum:
            return v[valid].sum()
        return v[valid].mean() if valid.any() else 0.0

    got = J(optim.ranking_softmax_loss)(jnp.asarray(s, jnp.float32), y, reduce_fn=reduce_fn)
    np.testing.assert_allclose(got, reduce(per_list(s, y), np.ones(4, bool)), **F32)
    got = J(optim.ranking_softmax_loss)(jnp.asarray(s, jnp.float32), y, where=mask, weights=w, reduce_fn=reduce_fn)
    np.testing.assert_allclose(got, reduce(per_list(s, y, w, mask), mask.any(-1)), **F32)
    g = jgrad(
        lambda z: jnp.sum(optim.ranking_softmax_loss(z, y, where=mask, weights=w, reduce_fn=reduce_fn))
    )(jnp.asarray(s, jnp.float32))
    assert np.all(np.isfinite(g)) and np.all(g[~mask] == 0)
    with jax.enable_x64(True):
        g = jgrad(lambda z: jnp.sum(optim.ranking_softmax_loss(z, y, where=mask, weights=w, reduce_fn=reduce_fn)))(s)
        fd = central_diff(lambda z: np.sum(reduce(per_list(z, y, w, mask), mask.any(-1))), s)
        np.testing.assert_allclose(g, fd, **FD)
    allmasked = J(optim.ranking_softmax_loss)(jnp.asarray(s), y, where=np.zeros((4, 6), bool))
    assert float(allmasked) == 0.0


# --- cTC ---


def _ctc_problem(seed, B=3, T=12, K=6, N=4):
    r = rng(seed)
    logits = r.normal(size=(B, T, K)) * 2
    lpad = np.zeros((B, T))
    lpad[1, 9:] = 1
    if B > 2:
        lpad[2, 6:] = 1
    labels = r.integers(1, K, (B, N))
    labels[0, 2] = labels[0, 1]  # a repeated label needs a blank between
    ypad = np.zeros((B, N))
    ypad[1, 3:] = 1
    if B > 2:
        ypad[2, 2:] = 1
    labels[ypad == 1] = 0  # padded positions hold the blank id, as is common
    return logits, lpad, labels, ypad


def test_ctc_against_brute_force_enumeration():
    r = rng(5)
    for labels in ([1], [1, 2], [2, 2], [1, 2, 1], []):
        logits = r.normal(size=(1, 5, 3))
        lab = np.array([labels + [0] * (3 - len(labels))])  # one shape: one compile
        ypad = (np.arange(3) >= len(labels)).astype(float)[None]
        got = J(optim.ctc_loss)(jnp.asarray(logits, jnp.float32), np.zeros((1, 5)), lab, ypad)
        np.testing.assert_allclose(got[0], np_ctc_brute(logits[0], labels), rtol=1e-5)
        np.testing.assert_allclose(np_ctc_one(logits[0], labels)[0], np_ctc_brute(logits[0], labels), rtol=1e-12)


def test_ctc_against_dynamic_programming():
    logits, lpad, labels, ypad = _ctc_problem(0)
    check_dtypes(
        lambda x, *rest: J(optim.ctc_loss)(x, *rest), lambda x, *rest: np_ctc(x, *rest),
        logits, lpad, labels, ypad, float_args=(0,), out_dtype=np.float32,
    )
    # a non-zero blank id
    got = J(optim.ctc_loss)(jnp.asarray(logits, jnp.float32), lpad, labels - 1 + (labels == 0) * 3, ypad, blank_id=5)
    want = np_ctc(logits, lpad, labels - 1 + (labels == 0) * 3, ypad, blank=5)
    np.testing.assert_allclose(got, want, **F32)


def test_ctc_forward_probs_match_alpha():
    logits, _, labels, _ = _ctc_problem(1, B=2, T=7, N=3)
    lpad = np.zeros((2, 7))
    ypad = np.zeros((2, 3))
    loss, la_blank, la_label = ctc_loss_with_forward_probs(jnp.asarray(logits, jnp.float32), lpad, labels, ypad)
    assert la_blank.shape == (7, 2, 4) and la_label.shape == (7, 2, 3)
    for b in range(2):
        ref_loss, alpha = np_ctc_one(logits[b], labels[b])
        np.testing.assert_allclose(loss[b], ref_loss, **F32)
        want_blank = alpha[:, 0::2].copy()
        want_blank[-1, 1:] = np.logaddexp(alpha[-1, 2::2], alpha[-1, 1::2])
        for got, want in ((np.asarray(la_blank[:, b]), want_blank), (np.asarray(la_label[:, b]), alpha[:, 1::2])):
            ok = np.isfinite(want)
            np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-5)
            assert np.all(got[~ok] < -1e4)  # unreachable states sit at ~log_epsilon


def test_ctc_gradients_match_finite_differences():
    logits, lpad, labels, ypad = _ctc_problem(2, B=2, T=6, K=4, N=3)
    lpad = lpad[:2, :6]
    lpad[1, 4:] = 1
    with jax.enable_x64(True):
        g = jgrad(lambda z: J(optim.ctc_loss)(z, lpad, labels, ypad).sum())(logits)
        fd = central_diff(lambda z: np_ctc(z, lpad, labels, ypad).sum(), logits)
        np.testing.assert_allclose(g, fd, **FD)
        assert np.all(g[1, 4:] == 0)  # padded frames get no gradient


def test_ctc_impossible_alignment_is_large_but_finite():
    # 3 frames cannot emit "1 1 1" (needs 5 frames with the blanks between repeats).
    logits = jnp.zeros((1, 3, 3))
    loss, g = jax.value_and_grad(
        lambda z: J(optim.ctc_loss)(z, jnp.zeros((1, 3)), jnp.array([[1, 1, 1]]), jnp.zeros((1, 3))).sum()
    )(logits)
    assert float(loss) > 1e4 and np.all(np.isfinite(g))


def test_ctc_jit_and_vmap_consistency():
    logits, lpad, labels, ypad = _ctc_problem(3)
    x = jnp.asarray(logits, jnp.float32)
    eager = J(optim.ctc_loss)(x, lpad, labels, ypad)
    jitted = jax.jit(optim.ctc_loss)(x, lpad, jnp.asarray(labels), ypad)
    np.testing.assert_allclose(eager, jitted, rtol=1e-6)
    per = [J(optim.ctc_loss)(x[i : i + 1], lpad[i : i + 1], labels[i : i + 1], ypad[i : i + 1])[0] for i in range(3)]
    np.testing.assert_allclose(eager, per, rtol=1e-6)


# --- properties over shapes ---

# A few fixed shapes, so jit caches are reused across examples (each new shape
# is a new compile); the values vary freely.
batch_shapes = st.sampled_from([(), (3,), (2, 1, 3)])


@jax.jit
def _class_losses(x, labels, onehot):
    return (
        J(optim.softmax_cross_entropy_with_integer_labels)(x, labels),
        J(optim.softmax_cross_entropy)(x, onehot),
        J(optim.safe_softmax_cross_entropy)(x, onehot),
        J(optim.poly_loss_cross_entropy)(x, onehot, epsilon=0.0),
    )


@HSET
@given(batch=batch_shapes, seed=st.integers(0, 2**16))
def test_classification_losses_any_batch_shape(batch, seed):
    r = rng(seed)
    k = 5
    x = r.normal(size=batch + (k,)) * 3
    labels = r.integers(0, k, batch)
    onehot = np.eye(k)[labels]
    out = _class_losses(jnp.asarray(x, jnp.float32), jnp.asarray(labels), jnp.asarray(onehot, jnp.float32))
    want = sp.logsumexp(x, -1) - np.take_along_axis(x, labels[..., None], -1)[..., 0]
    for v in out:
        assert v.shape == batch
        np.testing.assert_allclose(v, want, **F32)
        assert np.all(np.asarray(v) >= -1e-6)
    # flattening the batch changes nothing
    flat = _class_losses(
        jnp.asarray(x.reshape(-1, k), jnp.float32), jnp.asarray(labels.reshape(-1)),
        jnp.asarray(onehot.reshape(-1, k), jnp.float32),
    )[0]
    np.testing.assert_allclose(np.asarray(flat).reshape(batch), out[0], rtol=1e-6)


@jax.jit
def _elementwise_losses(x, t, y):
    return (
        J(optim.l2_loss)(x, t), J(optim.huber_loss)(x, t), J(optim.log_cosh)(x, t),
        J(optim.sigmoid_binary_cross_entropy)(x, y), J(optim.sigmoid_focal_loss)(x, y),
        J(optim.hinge_loss)(x, 2 * y - 1),
    )


@HSET
@given(shape=batch_shapes, seed=st.integers(0, 2**16))
def test_elementwise_losses_any_shape(shape, seed):
    r = rng(seed)
    x, t = r.normal(size=shape) * 3, r.normal(size=shape)
    y = (r.random(shape) > 0.5).astype(float)
    got = _elementwise_losses(jnp.asarray(x, jnp.float32), jnp.asarray(t, jnp.float32), jnp.asarray(y, jnp.float32))
    want = (
        0.5 * (x - t) ** 2, np_huber(x - t, 1.0), np_logcosh(x - t), np_bce(x, y),
        np_focal(x, y, None, 2.0), np.maximum(0, 1 - x * (2 * y - 1)),
    )
    for g, w in zip(got, want):
        assert g.shape == shape
        np.testing.assert_allclose(np.asarray(g, np.float64), w, **F32)
        assert np.all(np.asarray(g) >= 0)
    # Huber lies below the l2 loss and equals it inside the threshold.
    h, l2 = np.asarray(got[1]), np.asarray(got[0])
    assert np.all(h <= l2 + 1e-6)
    inside = np.abs(x - t) <= 1.0
    np.testing.assert_allclose(h[inside], l2[inside], rtol=1e-6)


_ctc_jit = jax.jit(optim.ctc_loss)


@HSET
@given(seed=st.integers(0, 2**16))
def test_ctc_random_problems(seed):
    # Fixed array shapes (one compile); random label/frame lengths via the paddings.
    b, t, k, n = 4, 7, 4, 3
    r = rng(seed)
    logits = r.normal(size=(b, t, k)) * 2
    labels = r.integers(1, k, (b, n))
    lens = r.integers(0, n + 1, b)
    ypad = (np.arange(n)[None] >= lens[:, None]).astype(float)
    flens = r.integers(1, t + 1, b)
    lpad = (np.arange(t)[None] >= flens[:, None]).astype(float)
    got = np.asarray(_ctc_jit(jnp.asarray(logits, jnp.float32), lpad, labels, ypad))
    want = np_ctc(logits, lpad, labels, ypad)
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-5)
    assert np.all(got[~ok] > 1e4)  # impossible alignments: ~ -log_epsilon
    assert np.all(got[ok] >= -1e-5)  # a negative log-probability


# --- errors name what was wrong ---

Z = jnp.zeros((2, 3))


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: optim.squared_error(Z, jnp.zeros((3, 2))), ValueError, r"predictions.*targets.*\(2, 3\).*\(3, 2\)"),
        (lambda: optim.l2_loss(jnp.zeros(3, jnp.int32)), TypeError, "predictions.*floating"),
        (lambda: optim.huber_loss(Z, jnp.zeros(4)), ValueError, "do not broadcast.*targets"),
        (lambda: optim.huber_loss(Z, delta=0.0), ValueError, "delta"),
        (lambda: optim.log_cosh(Z, jnp.zeros((5,))), ValueError, "targets"),
        (lambda: optim.cosine_similarity(Z, jnp.zeros((2, 4))), ValueError, "targets"),
        (lambda: optim.cosine_similarity(Z, Z, axis=3), ValueError, "axis 3"),
        (lambda: optim.softmax_cross_entropy(jnp.zeros((2, 3), jnp.int32), Z), TypeError, "logits"),
        (lambda: optim.softmax_cross_entropy(Z, jnp.zeros((2, 4))), ValueError, "labels"),
        (lambda: optim.softmax_cross_entropy(Z, Z, where=jnp.ones((3, 3), bool)), ValueError, "where"),
        (lambda: optim.softmax_cross_entropy_with_integer_labels(Z, jnp.array([0, 3])), ValueError, r"\[0, 3\).*found 3"),
        (lambda: optim.softmax_cross_entropy_with_integer_labels(Z, jnp.array([0, -1])), ValueError, "found -1"),
        (
            lambda: jax.jit(lambda x: optim.softmax_cross_entropy_with_integer_labels(x, np.array([0, 5])))(Z),
            ValueError, "found 5",
        ),
        (lambda: optim.softmax_cross_entropy_with_integer_labels(Z, jnp.array([0.0, 1.0])), TypeError, "labels.*integer"),
        (lambda: optim.softmax_cross_entropy_with_integer_labels(Z, jnp.array([0, 1, 2])), ValueError, r"labels.*\(2,\)"),
        (lambda: optim.softmax_cross_entropy_with_integer_labels(Z, jnp.array([0, 1]), axis=2), ValueError, "axis 2"),
        (lambda: optim.softmax_cross_entropy_with_integer_labels(Z, jnp.array([0, 1]), axis="x"), ValueError, "axis"),
        (lambda: optim.softmax_cross_entropy_with_integer_labels(Z, jnp.array([0, 1]), where=jnp.ones(3, bool)), ValueError, "where"),
        (lambda: optim.sigmoid_binary_cross_entropy(Z, jnp.zeros(4)), ValueError, "labels"),
        (lambda: optim.sigmoid_focal_loss(jnp.zeros(3, jnp.int32), jnp.zeros(3)), TypeError, "logits"),
        (lambda: optim.hinge_loss(Z, jnp.zeros(5)), ValueError, "targets"),
        (lambda: optim.kl_divergence(Z, jnp.zeros((4,))), ValueError, "targets"),
        (lambda: optim.convex_kl_divergence(Z, jnp.zeros((2, 3), jnp.int32)), TypeError, "targets"),
        (lambda: optim.poly_loss_cross_entropy(Z, jnp.zeros((2, 3), jnp.int32)), TypeError, "labels"),
        (lambda: optim.smooth_labels(jnp.zeros(3, jnp.int32), 0.1), TypeError, "labels"),
        (lambda: optim.triplet_margin_loss(Z, Z, jnp.zeros((2, 5))), ValueError, "negatives"),
        (lambda: optim.ranking_softmax_loss(Z, jnp.zeros((2, 4))), ValueError, "labels"),
        (lambda: optim.ranking_softmax_loss(Z, Z, weights=jnp.zeros(3)), ValueError, "weights"),
        (lambda: optim.ranking_softmax_loss(Z, Z, where=jnp.ones(3, bool)), ValueError, "where"),
    ],
)
def test_loss_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


CTC_OK = dict(
    logits=jnp.zeros((2, 5, 4)), logit_paddings=jnp.zeros((2, 5)),
    labels=jnp.array([[1, 2], [3, 0]]), label_paddings=jnp.array([[0.0, 0.0], [0.0, 1.0]]),
)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(logits=jnp.zeros((2, 5))), "logits.*rank 3"),
        (dict(labels=jnp.array([1, 2])), "labels.*rank 2"),
        (dict(logit_paddings=jnp.zeros((2, 4))), r"logit_paddings.*\(2, 5\)"),
        (dict(label_paddings=jnp.zeros((2, 3))), "label_paddings"),
        (dict(labels=jnp.array([[1, 2]]), label_paddings=jnp.zeros((1, 2))), "batch size 2"),
        (dict(labels=jnp.array([[1, 4], [3, 0]])), r"\[0, 4\).*found 4"),
        (dict(labels=jnp.array([[1, 0], [3, 0]])), "blank id 0"),
        (dict(blank_id=4), "blank_id"),
    ],
)
def test_ctc_errors(change, match):
    kw = {**CTC_OK, **change}
    blank = kw.pop("blank_id", 0)
    with pytest.raises(ValueError, match=match):
        optim.ctc_loss(**kw, blank_id=blank)
    optim.ctc_loss(**CTC_OK)  # the unchanged problem is fine (padded label 0 is allowed)


# --- same numbers as Optax (the one-line switch) ---


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.filterwarnings("ignore:The function convex_kl_divergence is deprecated")
def test_matches_optax_on_common_calls():
    optax = pytest.importorskip("optax")
    r = rng(9)
    x = jnp.asarray(r.normal(size=SHAPE) * 3, jnp.float32)
    t = jnp.asarray(r.normal(size=SHAPE), jnp.float32)
    y = jnp.asarray(r.dirichlet(np.ones(5), size=SHAPE[:2]), jnp.float32)
    yb = jnp.asarray(r.random(SHAPE) > 0.5, jnp.float32)
    il = jnp.asarray(r.integers(0, 5, SHAPE[:2]))
    m = jnp.asarray(r.random(SHAPE[:2]) > 0.3)
    pairs = [
        ("l2_loss", (x, t), {}), ("squared_error", (x, t), {}), ("huber_loss", (x, t), dict(delta=0.7)),
        ("log_cosh", (x, t), {}), ("cosine_similarity", (x, t), {}), ("cosine_distance", (x, t), dict(axis=(1, 2))),
        ("softmax_cross_entropy", (x, y), {}), ("softmax_cross_entropy", (x, y), dict(where=m)),
        ("softmax_cross_entropy_with_integer_labels", (x, il), dict(where=m)),
        ("safe_softmax_cross_entropy", (x, y), {}), ("sigmoid_binary_cross_entropy", (x, yb), {}),
        ("sigmoid_focal_loss", (x, yb), dict(alpha=0.25)), ("hinge_loss", (x, jnp.sign(t)), {}),
        ("kl_divergence", (jnp.log(y), y[::-1]), {}), ("convex_kl_divergence", (jnp.log(y), y[::-1]), {}),
        ("smooth_labels", (yb, 0.1), {}), ("poly_loss_cross_entropy", (x, y), {}),
        ("triplet_margin_loss", (x, t, 0.5 * x), {}), ("ranking_softmax_loss", (x, yb), {}),
    ]

    def run(lib):  # all calls in one compiled function per library
        return jax.jit(lambda: [getattr(lib, name)(*args, **kw) for name, args, kw in pairs])()

    for (name, _, _), ours, theirs in zip(pairs, run(optim), run(optax.losses)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=name)
    logits, lpad, labels, ypad = _ctc_problem(4)
    np.testing.assert_allclose(
        J(optim.ctc_loss)(jnp.asarray(logits, jnp.float32), lpad, labels, ypad),
        optax.losses.ctc_loss(jnp.asarray(logits, jnp.float32), lpad, labels, ypad), rtol=1e-5,
    )
