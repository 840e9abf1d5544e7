"""Conv and ConvTranspose against explicit-loop float64 NumPy convolutions.

Tolerances: float32 within rtol=atol=1e-4 of the float64 reference (sums of up to ~100
products); bfloat16 (inputs and kernel in bfloat16) within rtol=atol=5e-2 of the
reference computed from the same bfloat16-rounded values.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import nn
from nn._nn_helpers import f64, randn, same_pads, tolerances

TOL = tolerances(1e-4, 5e-2)


def np_conv(x, w, b, strides, padding, lhs_dil, rhs_dil, groups):
    """Channels-last N-D cross-correlation with explicit loops; x (N, *sp, C)."""
    x, w = f64(x), f64(w)
    nsp = x.ndim - 2
    ks = w.shape[:nsp]
    kd = [(k - 1) * d + 1 for k, d in zip(ks, rhs_dil)]
    # input dilation
    sp = [(n - 1) * d + 1 for n, d in zip(x.shape[1:-1], lhs_dil)]
    xd = np.zeros((x.shape[0], *sp, x.shape[-1]))
    xd[(slice(None), *[slice(None, None, d) for d in lhs_dil], slice(None))] = x
    if padding == "SAME":
        xp = np.pad(xd, [(0, 0), *same_pads(sp, kd, strides), (0, 0)])
    elif padding == "VALID":
        xp = xd
    elif padding == "CIRCULAR":
        xp = np.pad(xd, [(0, 0), *[((k - 1) // 2, k // 2) for k in kd], (0, 0)], mode="wrap")
    elif padding == "CAUSAL":
        xp = np.pad(xd, [(0, 0), (kd[0] - 1, 0), (0, 0)])
    else:
        xp = np.pad(xd, [(0, 0), *padding, (0, 0)])
    outs = [(n - k) // s + 1 for n, k, s in zip(xp.shape[1:-1], kd, strides)]
    cin_g = w.shape[-2]
    cout = w.shape[-1]
    cout_g = cout // groups
    y = np.zeros((x.shape[0], *outs, cout))
    for o in itertools.product(*[range(v) for v in outs]):
        acc = np.zeros((x.shape[0], cout))
        for k in itertools.product(*[range(v) for v in ks]):
            pos = tuple(oi * s + ki * d for oi, s, ki, d in zip(o, strides, k, rhs_dil))
            patch = xp[(slice(None), *pos, slice(None))]  # (N, C)
            for g in range(groups):
                acc[:, g * cout_g : (g + 1) * cout_g] += (
                    patch[:, g * cin_g : (g + 1) * cin_g] @ w[k][:, g * cout_g : (g + 1) * cout_g]
                )
        y[(slice(None), *o, slice(None))] = acc
    if b is not None:
        y = y + f64(b)
    return y


F32, BF16, SLOW = jnp.float32, jnp.bfloat16, pytest.mark.slow
CONV_CASES = [
    # (spatial, kernel, strides, padding, input_dilation, kernel_dilation, groups, dtype)
    pytest.param((9,), (3,), (1,), "SAME", (1,), (1,), 1, F32),
    pytest.param((9,), (3,), (1,), "CAUSAL", (1,), (2,), 1, F32),
    pytest.param((8,), (3,), (2,), "CIRCULAR", (1,), (1,), 2, BF16),
    pytest.param((6, 6), (3, 3), (1, 1), ((1, 2), (0, 1)), (1, 1), (1, 1), 2, F32),
    pytest.param((5, 5), (2, 2), (1, 1), "VALID", (2, 1), (1, 1), 1, F32),
    pytest.param((9,), (4,), (2,), "VALID", (1,), (1,), 1, F32, marks=SLOW),
    pytest.param((9,), (3,), (1,), "SAME", (1,), (1,), 1, BF16, marks=SLOW),
    pytest.param((8,), (3,), (2,), "CIRCULAR", (1,), (1,), 2, F32, marks=SLOW),
    pytest.param((7, 6), (3, 2), (2, 1), "SAME", (1, 1), (1, 2), 1, F32, marks=SLOW),
    pytest.param((7, 6), (3, 2), (2, 1), "SAME", (1, 1), (1, 2), 1, BF16, marks=SLOW),
    pytest.param((6, 5), (3, 3), (1, 2), "CIRCULAR", (1, 1), (1, 1), 1, F32, marks=SLOW),
    pytest.param((4, 5, 4), (2, 3, 2), (1, 2, 1), "SAME", (1, 1, 1), (1, 1, 1), 1, F32, marks=SLOW),
    pytest.param((4, 5, 4), (2, 3, 2), (1, 2, 1), "SAME", (1, 1, 1), (1, 1, 1), 1, BF16, marks=SLOW),
]


@pytest.mark.parametrize("spatial, ks, strides, padding, ldil, rdil, groups, dtype", CONV_CASES)
def test_conv_matches_numpy(spatial, ks, strides, padding, ldil, rdil, groups, dtype):
    cin, cout = 4, 6
    conv = nn.Conv(
        cin, cout, ks, strides, padding=padding, input_dilation=ldil, kernel_dilation=rdil,
        feature_group_count=groups, param_dtype=dtype, bias_init=nn.initializers.normal(1.0),
        rngs=nn.Rngs(0),
    )
    assert conv.kernel.shape == (*ks, cin // groups, cout)
    x = randn((2, *spatial, cin), dtype)
    y = conv(x)
    assert y.dtype == dtype
    ref = np_conv(x, conv.kernel[...], conv.bias[...], strides, padding, ldil, rdil, groups)
    assert y.shape == ref.shape
    np.testing.assert_allclose(f64(y), ref, **TOL[dtype])


def test_conv_batch_axes_no_bias_int_padding_and_mask():
    conv = nn.Conv(3, 2, 3, padding=1, use_bias=False, rngs=nn.Rngs(0))
    assert conv.bias is None
    x = randn((2, 3, 7, 3))  # two batch axes
    y = conv(x)
    ref = np_conv(x.reshape(6, 7, 3), conv.kernel[...], None, (1,), ((1, 1),), (1,), (1,), 1)
    np.testing.assert_allclose(f64(y), ref.reshape(2, 3, 7, 2), rtol=1e-4, atol=1e-4)
    # unbatched input (spatial, features)
    np.testing.assert_allclose(f64(conv(x[0, 0])), ref[0], rtol=1e-4, atol=1e-4)
    mask = np.zeros((3, 3, 2))
    mask[1] = 1  # only the centre tap
    masked = nn.Conv(3, 2, 3, mask=mask, rngs=nn.Rngs(0))
    ref = f64(x) @ f64(masked.kernel[...])[1] + f64(masked.bias[...])
    np.testing.assert_allclose(f64(masked(x)), ref, rtol=1e-4, atol=1e-4)


def test_conv_grad_equals_numpy_formula():
    conv = nn.Conv(2, 3, (3,), padding="VALID", rngs=nn.Rngs(0))
    x = randn((1, 6, 2), seed=1)

    def loss(m):
        return jnp.sum(m(x) ** 2)

    g = jax.grad(loss)(conv)
    y = np_conv(x, conv.kernel[...], conv.bias[...], (1,), "VALID", (1,), (1,), 1)  # (1, 4, 3)
    xn = f64(x)
    gk = np.zeros((3, 2, 3))
    for o in range(4):
        for k in range(3):
            gk[k] += np.outer(xn[0, o + k], 2 * y[0, o])
    np.testing.assert_allclose(f64(g.kernel[...]), gk, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(f64(g.bias[...]), (2 * y).sum((0, 1)), rtol=1e-4, atol=1e-4)


@settings(max_examples=8, deadline=None)
@given(
    n=st.sampled_from([3, 8]), k=st.integers(1, 3), s=st.integers(1, 3),
    padding=st.sampled_from(["SAME", "VALID", "CIRCULAR"]),
)
def test_conv_output_length_property(n, k, s, padding):
    conv = nn.Conv(1, 1, (k,), (s,), padding=padding, rngs=nn.Rngs(0))
    y = conv(jnp.ones((1, n, 1)))
    expected = -(-n // s) if padding in ("SAME", "CIRCULAR") else (n - k) // s + 1
    assert y.shape == (1, expected, 1)


def test_conv_errors():
    conv = nn.Conv(4, 2, (3, 3), rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match=r"Conv expected last axis \(features\) 4, got 3"):
        conv(jnp.ones((1, 5, 5, 3)))
    with pytest.raises(ValueError, match="at least 3 axes"):
        conv(jnp.ones((5, 4)))
    with pytest.raises(ValueError, match="divisible by feature_group_count"):
        nn.Conv(3, 4, 3, feature_group_count=2, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="CAUSAL"):
        nn.Conv(3, 4, (3, 3), padding="CAUSAL", rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="padding must be one of"):
        nn.Conv(3, 4, 3, padding="FULL", rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="strides"):
        nn.Conv(3, 4, (3, 3), strides=(1, 1, 1), rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match="mask shape"):
        nn.Conv(3, 4, 3, mask=np.ones((2, 3, 4)), rngs=nn.Rngs(0))


# --- ConvTranspose ---


def np_conv_transpose(x, w, b, strides, padding, rhs_dil, transpose_kernel):
    """Scatter form: input element i adds x[i] * tap k at output i*s + (kd-1) - k*d - lo.

    Derived from lax.conv_transpose's definition (dilate the input by s, pad, and
    cross-correlate with the kernel); padding lo follows the 'SAME'/'VALID' rules
    stated in the ConvTranspose docstring; CIRCULAR wraps the VALID output onto n*s.
    """
    x, w = f64(x), f64(w)
    nsp = x.ndim - 2
    ks = w.shape[:nsp]
    if transpose_kernel:
        # flip spatially and swap the feature axes: (k, out, in) -> (k, in, out)
        w = np.flip(w, axis=tuple(range(nsp))).swapaxes(-1, -2)
    kd = [(k - 1) * d + 1 for k, d in zip(ks, rhs_dil)]
    ns = x.shape[1:-1]
    los, sizes = [], []
    for n, k, s in zip(ns, kd, strides):
        if padding == "SAME":
            pad_len = k + s - 2
            lo = k - 1 if s > k - 1 else -(-pad_len // 2)
            hi = pad_len - lo
        elif padding in ("VALID", "CIRCULAR"):
            pad_len = k + s - 2 + max(k - s, 0)
            lo = k - 1
            hi = pad_len - lo
        full_lo = k - 1
        los.append(full_lo - lo)  # how far the kept window starts inside the full output
        sizes.append((n - 1) * s + 1 + lo + hi - k + 1)
    y = np.zeros((x.shape[0], *sizes, w.shape[-1]))
    for i in itertools.product(*[range(v) for v in ns]):
        for k in itertools.product(*[range(v) for v in ks]):
            pos = [ii * s + (kk_d - 1) - kk * d - off for ii, s, kk_d, kk, d, off in
                   zip(i, strides, kd, k, rhs_dil, los)]
            if all(0 <= p < sz for p, sz in zip(pos, sizes)):
                y[(slice(None), *pos, slice(None))] += x[(slice(None), *i, slice(None))] @ w[k]
    if padding == "CIRCULAR":
        periods = [n * s for n, s in zip(ns, strides)]
        for ax, period in enumerate(periods, start=1):
            diff = -(y.shape[ax] - period) % (2 * period)
            lo = diff // 2 if transpose_kernel else (diff + 1) // 2
            out = np.zeros(y.shape[:ax] + (period,) + y.shape[ax + 1 :])
            for j in range(y.shape[ax]):
                idx = [slice(None)] * y.ndim
                idx[ax] = j
                tgt = [slice(None)] * y.ndim
                tgt[ax] = (j + lo) % period
                out[tuple(tgt)] += y[tuple(idx)]
            y = out
    if b is not None:
        y = y + f64(b)
    return y


TCASES = [
    pytest.param((5,), (3,), (2,), "SAME", (1,), False, F32),
    pytest.param((4,), (3,), (2,), "CIRCULAR", (1,), False, F32),
    pytest.param((4,), (4,), (3,), "VALID", (1,), True, BF16),
    pytest.param((4, 3), (3, 2), (2, 1), "SAME", (1, 2), False, F32),
    pytest.param((5,), (3,), (2,), "VALID", (1,), False, F32, marks=SLOW),
    pytest.param((4,), (3,), (2,), "CIRCULAR", (1,), True, F32, marks=SLOW),
    pytest.param((4,), (3,), (2,), "CIRCULAR", (1,), True, BF16, marks=SLOW),
    pytest.param((3, 4), (2, 3), (2, 2), "VALID", (1, 1), True, F32, marks=SLOW),
    pytest.param((4, 3), (3, 2), (2, 1), "SAME", (1, 2), False, BF16, marks=SLOW),
]


@pytest.mark.parametrize("spatial, ks, strides, padding, rdil, tk, dtype", TCASES)
def test_conv_transpose_matches_numpy(spatial, ks, strides, padding, rdil, tk, dtype):
    ct = nn.ConvTranspose(
        3, 2, ks, strides, padding=padding, kernel_dilation=rdil, transpose_kernel=tk,
        param_dtype=dtype, bias_init=nn.initializers.normal(1.0), rngs=nn.Rngs(0),
    )
    x = randn((2, *spatial, 3), dtype)
    y = ct(x)
    ref = np_conv_transpose(x, ct.kernel[...], ct.bias[...], strides, padding, rdil, tk)
    assert y.shape == ref.shape
    if padding in ("SAME", "CIRCULAR"):
        assert y.shape[1:-1] == tuple(n * s for n, s in zip(spatial, strides))
    np.testing.assert_allclose(f64(y), ref, **TOL[dtype])


def test_conv_transpose_with_transpose_kernel_is_the_conv_gradient():
    conv = nn.Conv(3, 2, (3, 3), strides=(2, 2), padding="SAME", use_bias=False, rngs=nn.Rngs(0))
    ct = nn.ConvTranspose(2, 3, (3, 3), (2, 2), padding="SAME", use_bias=False, transpose_kernel=True,
                          rngs=nn.Rngs(1))
    ct.kernel[...] = conv.kernel[...]
    x = randn((1, 8, 8, 3))
    g = randn((1, 4, 4, 2), seed=5)
    _, vjp = jax.vjp(conv, x)
    np.testing.assert_allclose(f64(vjp(g)[0]), f64(ct(g)), rtol=1e-4, atol=1e-4)


def test_conv_transpose_errors():
    with pytest.raises(ValueError, match="not supported"):
        nn.ConvTranspose(3, 2, 3, padding="CAUSAL", rngs=nn.Rngs(0))
    ct = nn.ConvTranspose(3, 2, (3,), rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match=r"ConvTranspose expected last axis \(features\) 3, got 4"):
        ct(jnp.ones((1, 5, 4)))
