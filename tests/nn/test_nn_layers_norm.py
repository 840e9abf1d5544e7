"""LayerNorm, RMSNorm, GroupNorm, InstanceNorm, BatchNorm and Dropout against float64 NumPy.

Tolerances: float32 within rtol=atol=1e-4 of the float64 reference (statistics are
accumulated in float32); bfloat16 inputs/parameters within rtol=atol=5e-2 (outputs of
order 1 rounded to 8 mantissa bits) of the reference computed from the same values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import nn
from nn._nn_helpers import DTYPES, f64, randn, tolerances

TOL = tolerances(1e-4, 5e-2)


def np_norm(x, axes, eps, scale=None, bias=None, center=True):
    x = f64(x)
    mean = x.mean(axes, keepdims=True) if center else 0.0
    var = ((x - mean) ** 2).mean(axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if scale is not None:
        y = y * f64(scale)
    if bias is not None:
        y = y + f64(bias)
    return y


def rand_affine(layer, dtype, seed=7):
    if getattr(layer, "scale", None) is not None:
        layer.scale[...] = randn(layer.scale.shape, dtype, seed, shift=1.0)
    if getattr(layer, "bias", None) is not None:
        layer.bias[...] = randn(layer.bias.shape, dtype, seed + 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm(dtype):
    ln = nn.LayerNorm(6, param_dtype=dtype, rngs=nn.Rngs(0))
    rand_affine(ln, dtype)
    x = randn((3, 4, 6), dtype, scale=3.0, shift=5.0)
    y = ln(x)
    assert y.dtype == dtype
    np.testing.assert_allclose(
        f64(y), np_norm(x, -1, 1e-6, ln.scale[...], ln.bias[...]), **TOL[dtype]
    )
    slow = nn.LayerNorm(6, use_fast_variance=False, param_dtype=dtype, rngs=nn.Rngs(0))
    np.testing.assert_allclose(f64(slow(x)), np_norm(x, -1, 1e-6), **TOL[dtype])


def test_layer_norm_multi_axis_and_no_affine():
    ln = nn.LayerNorm(12, reduction_axes=(-2, -1), feature_axes=(-2, -1), use_bias=False,
                      use_scale=False, rngs=nn.Rngs(0))
    assert ln.scale is None and ln.bias is None
    x = randn((2, 3, 4))
    np.testing.assert_allclose(f64(ln(x)), np_norm(x, (1, 2), 1e-6), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_rms_norm(dtype):
    rms = nn.RMSNorm(5, epsilon=1e-5, param_dtype=dtype, rngs=nn.Rngs(0))
    rand_affine(rms, dtype)
    x = randn((4, 5), dtype, scale=2.0, shift=1.0)
    xn = f64(x)
    ref = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-5) * f64(rms.scale[...])
    np.testing.assert_allclose(f64(rms(x)), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_group_norm(dtype):
    gn = nn.GroupNorm(6, num_groups=3, param_dtype=dtype, rngs=nn.Rngs(0))
    rand_affine(gn, dtype)
    x = randn((2, 5, 4, 6), dtype, scale=2.0, shift=-1.0)
    xn = f64(x).reshape(2, 5, 4, 3, 2)
    ref = np_norm(xn, (1, 2, 4), 1e-6).reshape(2, 5, 4, 6) * f64(gn.scale[...]) + f64(gn.bias[...])
    np.testing.assert_allclose(f64(gn(x)), ref, **TOL[dtype])
    by_size = nn.GroupNorm(6, num_groups=None, group_size=2, rngs=nn.Rngs(0))
    assert by_size.num_groups == 3


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_instance_norm(dtype):
    inorm = nn.InstanceNorm(3, param_dtype=dtype, rngs=nn.Rngs(0))
    rand_affine(inorm, dtype)
    x = randn((2, 5, 4, 3), dtype, scale=3.0, shift=2.0)
    ref = np_norm(x, (1, 2), 1e-6, inorm.scale[...], inorm.bias[...])
    np.testing.assert_allclose(f64(inorm(x)), ref, **TOL[dtype])


def test_norm_grad_matches_finite_differences():
    ln = nn.LayerNorm(4, rngs=nn.Rngs(0))
    x = randn((2, 4), seed=3)
    w = f64(randn((2, 4), seed=4))

    def loss(x):
        return jnp.sum(ln(x) * w)

    g = f64(jax.grad(loss)(x))
    # analytic LayerNorm backward: dx = (1/sigma) (dy - mean(dy) - xhat mean(dy xhat))
    xn = f64(x)
    mu = xn.mean(-1, keepdims=True)
    sig = np.sqrt(xn.var(-1, keepdims=True) + 1e-6)
    xhat = (xn - mu) / sig
    dy = w
    ref = (dy - dy.mean(-1, keepdims=True) - xhat * (dy * xhat).mean(-1, keepdims=True)) / sig
    np.testing.assert_allclose(g, ref, rtol=1e-3, atol=1e-4)


@settings(max_examples=10, deadline=None)
@given(
    b=st.sampled_from([1, 3]), f=st.sampled_from([2, 6]), shift=st.floats(-20, 20),
    scale=st.floats(0.5, 10),
)
def test_layer_norm_is_shift_and_scale_invariant(b, f, shift, scale):
    # exact only without epsilon: use a negligible one. The two-pass variance: the fast
    # one (E[x^2] - E[x]^2, Flax's default too) loses float32 digits when the shift is
    # large against a row's spread (shift 16, two features 0.1 apart: 1% off)
    ln = nn.LayerNorm(f, epsilon=1e-12, use_fast_variance=False, rngs=nn.Rngs(0))
    x = randn((b, f), seed=b * 10 + f)
    run = jax.jit(lambda m, x: m(x))
    np.testing.assert_allclose(f64(run(ln, x * scale + shift)), f64(run(ln, x)), rtol=2e-3, atol=2e-3)


def test_norm_errors():
    with pytest.raises(ValueError, match=r"LayerNorm expected feature axes \(1,\) of total size 6, got \(5,\)"):
        nn.LayerNorm(6, rngs=nn.Rngs(0))(jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="not divisible by num_groups"):
        nn.GroupNorm(6, num_groups=4, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="exactly one of"):
        nn.GroupNorm(6, num_groups=2, group_size=3, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="GroupNorm expected last axis 6, got 4"):
        nn.GroupNorm(6, num_groups=2, rngs=nn.Rngs(0))(jnp.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="BatchNorm expected axis -1 of size 3, got 2"):
        nn.BatchNorm(3, rngs=nn.Rngs(0))(jnp.ones((4, 2)))
    with pytest.raises(TypeError, match="numeric"):
        nn.RMSNorm(2, rngs=nn.Rngs(0))(jnp.ones((2, 2), bool))
    with pytest.raises(ValueError, match="momentum"):
        nn.BatchNorm(3, momentum=1.5, rngs=nn.Rngs(0))


# --- BatchNorm ---


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_norm_train_and_eval(dtype):
    bn = nn.BatchNorm(3, momentum=0.9, param_dtype=dtype, rngs=nn.Rngs(0))
    rand_affine(bn, dtype)
    x = randn((8, 5, 3), dtype, scale=2.0, shift=3.0)
    y = bn(x)
    xn = f64(x)
    np.testing.assert_allclose(f64(y), np_norm(x, (0, 1), 1e-5, bn.scale[...], bn.bias[...]), **TOL[dtype])
    mean, var = xn.mean((0, 1)), xn.var((0, 1))
    np.testing.assert_allclose(f64(bn.mean[...]), 0.1 * mean, **TOL[dtype])
    np.testing.assert_allclose(f64(bn.var[...]), 0.9 + 0.1 * var, **TOL[dtype])
    bn.eval()
    assert bn.use_running_average is True
    ref = (xn - f64(bn.mean[...])) / np.sqrt(f64(bn.var[...]) + 1e-5) * f64(bn.scale[...]) + f64(bn.bias[...])
    before = f64(bn.mean[...])
    np.testing.assert_allclose(f64(bn(x)), ref, **TOL[dtype])
    np.testing.assert_array_equal(f64(bn.mean[...]), before)  # eval leaves stats alone


def test_batch_norm_running_stats_update_through_jit():
    bn = nn.BatchNorm(2, momentum=0.5, rngs=nn.Rngs(0))
    xs = [randn((6, 2), seed=s, shift=s) for s in range(3)]

    @jax.jit
    def step(m, x):
        y = m(x)
        return m, y

    ra_mean, ra_var = np.zeros(2), np.ones(2)
    for x in xs:
        bn, _ = step(bn, x)
        ra_mean = 0.5 * ra_mean + 0.5 * f64(x).mean(0)
        ra_var = 0.5 * ra_var + 0.5 * f64(x).var(0)
    np.testing.assert_allclose(f64(bn.mean[...]), ra_mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f64(bn.var[...]), ra_var, rtol=1e-5, atol=1e-5)
    # nn.jit writes the update back into the caller's object
    bn2 = nn.BatchNorm(2, momentum=0.5, rngs=nn.Rngs(0))
    f = nn.jit(lambda m, x: m(x))
    for x in xs:
        f(bn2, x)
    np.testing.assert_allclose(f64(bn2.mean[...]), ra_mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f64(bn2.var[...]), ra_var, rtol=1e-5, atol=1e-5)


def test_batch_norm_mask_and_axis():
    bn = nn.BatchNorm(3, axis=1, momentum=0.0, rngs=nn.Rngs(0))
    x = randn((4, 3, 5))
    mask = np.ones((4, 3, 5), bool)
    mask[0] = False  # first example excluded from the statistics
    bn(x, mask=jnp.asarray(mask))
    np.testing.assert_allclose(f64(bn.mean[...]), f64(x)[1:].mean((0, 2)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f64(bn.var[...]), f64(x)[1:].var((0, 2)), rtol=1e-4, atol=1e-5)


# --- Dropout ---


def test_dropout_mask_statistics_and_scaling():
    drop = nn.Dropout(0.3, rngs=nn.Rngs(dropout=1))
    x = jnp.ones((20000,))
    y = f64(drop(x))
    kept = y != 0
    assert kept.mean() == pytest.approx(0.7, abs=0.015)
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-6)
    # a new call uses a new key
    assert not np.array_equal(f64(drop(x)) != 0, kept)
    assert np.array_equal(f64(drop(x, deterministic=True)), np.ones(20000))
    drop.eval()
    np.testing.assert_array_equal(f64(drop(x)), np.ones(20000))
    drop.train()
    assert (f64(drop(x)) == 0).any()


def test_dropout_broadcast_dims_and_call_rngs():
    drop = nn.Dropout(0.5, broadcast_dims=(0,))
    y = f64(drop(jnp.ones((6, 50)), rngs=nn.Rngs(dropout=0)))
    assert (y == y[0]).all()  # the same mask on every row
    y2 = f64(drop(jnp.ones((6, 50)), rngs=jax.random.key(3)))  # a raw key works too
    assert y2.shape == (6, 50)


def test_dropout_vmap_gives_independent_masks():
    drop = nn.Dropout(0.5)
    keys = jax.random.split(jax.random.key(0), 4)
    out = jax.vmap(lambda k, x: drop(x, rngs=k))(keys, jnp.ones((4, 64)))
    masks = f64(out) != 0
    for i in range(4):
        for j in range(i + 1, 4):
            assert not np.array_equal(masks[i], masks[j])
    # an Rngs split into 4 streams, mapped with nn.vmap
    model = nn.Dropout(0.5, rngs=nn.Rngs(dropout=0))
    rngs = nn.Rngs(dropout=1).split(4)
    out = nn.vmap(lambda r, x: model(x, rngs=r), in_axes=(0, 0))(rngs, jnp.ones((4, 64)))
    masks = f64(out) != 0
    assert len({m.tobytes() for m in masks}) == 4


def test_dropout_errors():
    with pytest.raises(ValueError, match="rate must be in"):
        nn.Dropout(1.5)
    with pytest.raises(ValueError, match="needs a random key"):
        nn.Dropout(0.5)(jnp.ones(3))
    with pytest.raises(ValueError, match="deterministic is None"):
        nn.Dropout(0.5, deterministic=None, rngs=nn.Rngs(0))(jnp.ones(3))
    assert np.all(f64(nn.Dropout(1.0, rngs=nn.Rngs(0))(jnp.ones(3))) == 0)
