"""Initializers, pooling, activations and rotary embeddings against float64 NumPy.

Tolerances: float32 results within rtol=atol=1e-5 of the float64 reference; bfloat16
results within rtol=atol=2e-2 (8 mantissa bits) of the reference computed from the same
bfloat16-rounded inputs.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import nn
from cairn.nn import initializers as init
from nn._nn_helpers import DTYPES, f64, randn, same_pads, tolerances

TOL = tolerances(1e-5, 2e-2)


# --- initializers ---


@pytest.mark.parametrize(
    "fn, var",
    [
        (init.lecun_normal(), lambda fi, fo: 1 / fi),
        (init.lecun_uniform(), lambda fi, fo: 1 / fi),
        (init.glorot_normal(), lambda fi, fo: 2 / (fi + fo)),
        (init.xavier_uniform(), lambda fi, fo: 2 / (fi + fo)),
        (init.he_normal(), lambda fi, fo: 2 / fi),
        (init.kaiming_uniform(), lambda fi, fo: 2 / fi),
        (init.variance_scaling(3.0, "fan_out", "normal"), lambda fi, fo: 3 / fo),
    ],
)
def test_variance_scaling_family_has_the_stated_variance(fn, var):
    # conv kernel (3, 3, 40, 60): receptive field 9, fan_in 360, fan_out 540
    w = np.asarray(fn(jax.random.key(0), (3, 3, 40, 60)), np.float64)
    expected = var(360.0, 540.0)
    assert abs(w.mean()) < 0.05 * math.sqrt(expected)
    # 32,400 samples: the sample variance is within ~2% (4 sigma) of the true one
    assert w.var() == pytest.approx(expected, rel=0.04)


def test_uniform_variance_scaling_bounds():
    w = np.asarray(init.lecun_uniform()(jax.random.key(1), (50, 20)))
    lim = math.sqrt(3.0 / 50)
    assert w.min() >= -lim and w.max() <= lim
    tn = np.asarray(init.lecun_normal()(jax.random.key(1), (200, 20)))
    # truncated at two (rescaled) standard deviations
    assert np.abs(tn).max() <= 2 * math.sqrt(1 / 200) / 0.87962566 + 1e-6


def test_simple_initializers():
    key = jax.random.key(0)
    assert np.all(np.asarray(init.zeros(key, (2, 3))) == 0)
    assert np.all(np.asarray(init.ones(key, (2,), jnp.bfloat16)) == 1)
    assert init.ones(key, (2,), jnp.bfloat16).dtype == jnp.bfloat16
    assert np.all(np.asarray(init.constant(7.5)(key, (4,))) == 7.5)
    n = np.asarray(init.normal(0.5)(key, (20000,)), np.float64)
    assert n.std() == pytest.approx(0.5, rel=0.03)
    u = np.asarray(init.uniform(2.0)(key, (20000,)), np.float64)
    assert 0 <= u.min() and u.max() < 2.0 and u.mean() == pytest.approx(1.0, rel=0.03)
    t = np.asarray(init.truncated_normal(1.0)(key, (20000,)))
    assert np.abs(t).max() <= 2.0


@pytest.mark.parametrize("shape", [(6, 4), (3, 5, 8), pytest.param((4, 6), marks=pytest.mark.slow),
                                   pytest.param((2, 2, 3, 12), marks=pytest.mark.slow)])
def test_orthogonal_columns_or_rows_are_orthonormal(shape):
    w = np.asarray(init.orthogonal(scale=2.0)(jax.random.key(3), shape), np.float64)
    m = w.reshape(-1, shape[-1])
    if m.shape[0] >= m.shape[1]:
        np.testing.assert_allclose(m.T @ m, 4.0 * np.eye(m.shape[1]), atol=1e-5)
    else:
        np.testing.assert_allclose(m @ m.T, 4.0 * np.eye(m.shape[0]), atol=1e-5)


def test_delta_orthogonal_is_a_centred_orthogonal_tap():
    w = np.asarray(init.delta_orthogonal()(jax.random.key(0), (3, 3, 4, 6)), np.float64)
    centre = w[1, 1]
    np.testing.assert_allclose(centre @ centre.T, np.eye(4), atol=1e-5)
    w[1, 1] = 0
    assert np.all(w == 0)
    with pytest.raises(ValueError, match="in_features <= out_features"):
        init.delta_orthogonal()(jax.random.key(0), (3, 3, 6, 4))
    with pytest.raises(ValueError, match="3-, 4- or 5-D"):
        init.delta_orthogonal()(jax.random.key(0), (6, 4))


def test_initializer_errors():
    with pytest.raises(ValueError, match="mode"):
        init.variance_scaling(1.0, "fan_whatever", "normal")
    with pytest.raises(ValueError, match="distribution"):
        init.variance_scaling(1.0, "fan_in", "cauchy")
    with pytest.raises(ValueError, match="at least 2 dims"):
        init.orthogonal()(jax.random.key(0), (5,))


# --- pooling ---


def np_pool(x, window, strides, padding, op, count_include_pad=True):
    """Explicit loops over output positions (channels-last, leading batch axes)."""
    x = f64(x)
    nsp = len(window)
    sp = x.shape[-nsp - 1 : -1]
    strides = strides or (1,) * nsp
    if padding == "VALID":
        pads = [(0, 0)] * nsp
    elif padding == "SAME":
        pads = same_pads(sp, window, strides)
    else:
        pads = list(padding)
    outs = [(n + lo + hi - w) // s + 1 for n, w, s, (lo, hi) in zip(sp, window, strides, pads)]
    res = np.zeros(x.shape[: -nsp - 1] + tuple(outs) + x.shape[-1:])
    for o in itertools.product(*[range(v) for v in outs]):
        vals, count = [], 0
        for k in itertools.product(*[range(w) for w in window]):
            idx = [oi * s + ki - lo for oi, s, ki, (lo, _) in zip(o, strides, k, pads)]
            if all(0 <= i < n for i, n in zip(idx, sp)):
                vals.append(x[(Ellipsis, *idx, slice(None))])
                count += 1
        stack = np.stack(vals)
        if op == "max":
            r = stack.max(0)
        elif op == "min":
            r = stack.min(0)
        else:
            r = stack.sum(0) / (math.prod(window) if count_include_pad else count)
        res[(Ellipsis, *o, slice(None))] = r
    return res


SLOW = pytest.mark.slow
POOL_CASES = [
    pytest.param((2, 7, 3), (3,), (2,), "VALID", jnp.float32),
    pytest.param((2, 6, 5, 2), (2, 3), (1, 2), "SAME", jnp.bfloat16),
    pytest.param((2, 7, 3), (3,), (2,), "SAME", jnp.float32, marks=SLOW),
    pytest.param((1, 6, 5, 2), (3, 2), (2, 1), ((1, 1), (0, 1)), jnp.float32),
    pytest.param((2, 6, 5, 2), (2, 3), (1, 2), "SAME", jnp.float32, marks=SLOW),
    # two batch axes, 3-D
    pytest.param((2, 2, 4, 4, 4, 1), (2, 2, 2), (2, 2, 2), "VALID", jnp.float32, marks=SLOW),
    pytest.param((2, 2, 4, 4, 4, 1), (2, 2, 2), (2, 2, 2), "VALID", jnp.bfloat16, marks=SLOW),
]


@pytest.mark.parametrize("shape, window, strides, padding, dtype", POOL_CASES)
def test_pools_match_numpy_loops(shape, window, strides, padding, dtype):
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)
    np.testing.assert_allclose(
        f64(nn.max_pool(x, window, strides, padding)), np_pool(x, window, strides, padding, "max"),
        **TOL[dtype],
    )
    np.testing.assert_allclose(
        f64(nn.min_pool(x, window, strides, padding)), np_pool(x, window, strides, padding, "min"),
        **TOL[dtype],
    )
    for cip in (True, False):
        np.testing.assert_allclose(
            f64(nn.avg_pool(x, window, strides, padding, count_include_pad=cip)),
            np_pool(x, window, strides, padding, "avg", cip),
            **TOL[dtype],
        )


def test_pool_generic_reduce_and_errors():
    x = jnp.arange(12.0).reshape(1, 6, 2)
    out = nn.pool(x, 0.0, jax.lax.add, (2,), (2,), "VALID")
    np.testing.assert_allclose(out[0, :, 0], [2.0, 10.0, 18.0])
    with pytest.raises(ValueError, match="strides"):
        nn.max_pool(x, (2,), (1, 1))
    with pytest.raises(ValueError, match="padding"):
        nn.max_pool(x, (2,), padding="FULL")
    with pytest.raises(ValueError, match="at least 3 dims"):
        nn.max_pool(jnp.ones((4, 4)), (2, 2))


# --- activations ---


def test_activations_are_the_jax_functions_and_behave():
    x = jnp.linspace(-3, 3, 13)
    xn = f64(x)
    np.testing.assert_allclose(f64(nn.relu(x)), np.maximum(xn, 0), atol=1e-6)
    np.testing.assert_allclose(f64(nn.sigmoid(x)), 1 / (1 + np.exp(-xn)), atol=1e-6)
    np.testing.assert_allclose(f64(nn.silu(x)), xn / (1 + np.exp(-xn)), atol=1e-6)
    np.testing.assert_allclose(f64(nn.swish(x)), f64(nn.silu(x)))
    np.testing.assert_allclose(f64(nn.tanh(x)), np.tanh(xn), atol=1e-6)
    np.testing.assert_allclose(f64(nn.softplus(x)), np.log1p(np.exp(xn)), atol=1e-6)
    np.testing.assert_allclose(f64(nn.elu(x)), np.where(xn > 0, xn, np.expm1(xn)), atol=1e-6)
    np.testing.assert_allclose(f64(nn.leaky_relu(x, 0.1)), np.where(xn > 0, xn, 0.1 * xn), atol=1e-6)
    from scipy.special import erf

    np.testing.assert_allclose(
        f64(nn.gelu(x, approximate=False)), 0.5 * xn * (1 + erf(xn / np.sqrt(2))), atol=1e-6
    )
    sm = np.exp(xn - xn.max()) / np.exp(xn - xn.max()).sum()
    np.testing.assert_allclose(f64(nn.softmax(x)), sm, atol=1e-6)
    np.testing.assert_allclose(f64(nn.log_softmax(x)), np.log(sm), atol=1e-5)
    a, b = np.split(f64(jnp.arange(8.0)), 2)
    np.testing.assert_allclose(f64(nn.glu(jnp.arange(8.0))), a / (1 + np.exp(-b)), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(nn.one_hot(jnp.array([0, 2]), 3)), [[1, 0, 0], [0, 0, 1]])
    s = f64(nn.standardize(x))
    assert abs(s.mean()) < 1e-6 and s.std() == pytest.approx(1.0, rel=1e-4)
    assert nn.relu is jax.nn.relu and nn.gelu is jax.nn.gelu


# --- rotary ---


def np_rope(x, pos, base=10000.0, rotary_dim=None, interleaved=False):
    x = f64(x)
    d = x.shape[-1]
    rd = rotary_dim or d
    out = x.copy()
    for i in range(rd // 2):
        theta = base ** (-2.0 * i / rd)
        ang = np.asarray(pos, np.float64)[..., :, None] * theta  # (..., L, 1) over heads
        c, s = np.cos(ang), np.sin(ang)
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + rd // 2)
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


@pytest.mark.parametrize(
    "dtype, interleaved, rotary_dim",
    [
        (jnp.float32, False, None),
        (jnp.bfloat16, True, 4),
        pytest.param(jnp.float32, True, None, marks=pytest.mark.slow),
        pytest.param(jnp.float32, False, 4, marks=pytest.mark.slow),
        pytest.param(jnp.bfloat16, False, None, marks=pytest.mark.slow),
    ],
)
def test_rope_matches_numpy(dtype, interleaved, rotary_dim):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 3, 8)), dtype)
    pos = jnp.array([[0, 1, 2, 3, 4], [7, 9, 11, 13, 15]])
    got = jax.jit(
        lambda x, p: nn.apply_rotary_embedding(x, p, rotary_dim=rotary_dim, interleaved=interleaved)
    )(x, pos)
    assert got.dtype == dtype
    np.testing.assert_allclose(
        f64(got), np_rope(x, pos, rotary_dim=rotary_dim, interleaved=interleaved), **TOL[dtype]
    )
    mod = nn.RotaryEmbedding(8, rotary_dim=rotary_dim, interleaved=interleaved)
    np.testing.assert_allclose(f64(mod(x, pos)), f64(got), rtol=1e-6, atol=1e-6)


@jax.jit
def _rope_score(q, k, pq, pk):
    return jnp.sum(nn.apply_rotary_embedding(q, pq) * nn.apply_rotary_embedding(k, pk))


@settings(max_examples=12, deadline=None)
@given(m=st.integers(0, 500), n=st.integers(0, 500), shift=st.integers(0, 500))
def test_rope_scores_depend_only_on_relative_position(m, n, shift):
    rng = np.random.default_rng(m * 1000 + n)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, 16)), jnp.float32)

    def score(pq, pk):
        return float(_rope_score(q, k, jnp.array([pq]), jnp.array([pk])))

    assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=2e-3)


def test_rope_errors():
    with pytest.raises(ValueError, match="rotary_dim"):
        nn.apply_rotary_embedding(jnp.ones((1, 2, 1, 6)), rotary_dim=3)
    with pytest.raises(ValueError, match="positions"):
        nn.apply_rotary_embedding(jnp.ones((1, 2, 1, 6)), jnp.arange(3))
    with pytest.raises(ValueError, match="expected last axis 8"):
        nn.RotaryEmbedding(8)(jnp.ones((1, 2, 1, 6)))


def test_prelu():
    p = nn.PReLU(0.25)
    np.testing.assert_allclose(f64(p(jnp.array([-4.0, 0.0, 2.0]))), [-1.0, 0.0, 2.0])
    g = jax.grad(lambda m: jnp.sum(m(jnp.array([-4.0, 2.0]))))(p)
    assert float(g.negative_slope[...]) == -4.0


# --- every activation, both dtypes ---

_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _np_hard_sigmoid(x):
    return np.clip(x + 3.0, 0.0, 6.0) / 6.0


_ACTIVATIONS = {
    "relu": (nn.relu, lambda x: np.maximum(x, 0)),
    "relu6": (nn.relu6, lambda x: np.clip(x, 0, 6)),
    "sigmoid": (nn.sigmoid, _np_sigmoid),
    "silu": (nn.silu, lambda x: x * _np_sigmoid(x)),
    "swish": (nn.swish, lambda x: x * _np_sigmoid(x)),
    "tanh": (nn.tanh, np.tanh),
    "softplus": (nn.softplus, lambda x: np.logaddexp(x, 0)),
    "soft_sign": (nn.soft_sign, lambda x: x / (1 + np.abs(x))),
    "log_sigmoid": (nn.log_sigmoid, lambda x: -np.logaddexp(-x, 0)),
    "elu": (nn.elu, lambda x: np.where(x > 0, x, np.expm1(x))),
    "celu": (nn.celu, lambda x: np.maximum(x, 0) + np.minimum(0, np.expm1(x))),
    "selu": (nn.selu, lambda x: _SELU_SCALE * np.where(x > 0, x, _SELU_ALPHA * np.expm1(x))),
    "leaky_relu": (nn.leaky_relu, lambda x: np.where(x >= 0, x, 0.01 * x)),
    "gelu": (nn.gelu, _np_gelu_tanh),
    "hard_sigmoid": (nn.hard_sigmoid, _np_hard_sigmoid),
    "hard_silu": (nn.hard_silu, lambda x: x * _np_hard_sigmoid(x)),
    "hard_swish": (nn.hard_swish, lambda x: x * _np_hard_sigmoid(x)),
    "hard_tanh": (nn.hard_tanh, lambda x: np.clip(x, -1, 1)),
    "mish": (nn.mish, lambda x: x * np.tanh(np.logaddexp(x, 0))),
    "identity": (nn.identity, lambda x: x),
    "softmax": (nn.softmax, _np_softmax),
    "log_softmax": (nn.log_softmax, lambda x: np.log(_np_softmax(x))),
    "logsumexp": (
        lambda x: nn.logsumexp(x, axis=-1),
        lambda x: np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1),
    ),
    "glu": (nn.glu, lambda x: x[..., :4] * _np_sigmoid(x[..., 4:])),
    "standardize": (
        nn.standardize,
        lambda x: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5),
    ),
}
# float32: 1e-5 (a few ulps of the float64 reference); bfloat16 (computed in bfloat16
# from the same rounded inputs): 3e-2, a few bfloat16 ulps (2**-8 relative each)
_ACT_TOL = tolerances(1e-5, 3e-2)


@pytest.mark.parametrize("name", sorted(_ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_activation_matches_float64_numpy(name, dtype):
    fn, ref = _ACTIVATIONS[name]
    # values spread over [-6, 6], plus the kinks at 0 and +-3
    x = jnp.asarray(
        np.concatenate([np.linspace(-6, 6, 21), [0.0, 3.0, -3.0]]).reshape(3, 8), dtype
    )
    y = fn(x)
    assert y.dtype == dtype, (name, y.dtype)
    np.testing.assert_allclose(f64(y), ref(f64(x)), err_msg=name, **_ACT_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prelu_matches_numpy_at_both_dtypes(dtype):
    p = nn.PReLU(0.3, param_dtype=dtype)
    x = randn((4, 5), dtype, seed=7, scale=3.0)
    a = f64(p.negative_slope[...])
    ref = np.where(f64(x) >= 0, f64(x), a * f64(x))
    np.testing.assert_allclose(f64(p(x)), ref, **_ACT_TOL[dtype])
