"""LSTMCell, GRUCell, SimpleCell and RNN against the published equations in float64 NumPy.

Tolerances: float32 within rtol=atol=1e-4 of the float64 reference (errors compound over
the time steps); bfloat16 within rtol=atol=5e-2 of the reference computed from the same
bfloat16-rounded parameters and inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cairn_testlib import central_diff
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import nn
from nn._nn_helpers import DTYPES, f64, randn, tolerances

TOL = tolerances(1e-4, 5e-2)


def sig(x):
    return 1 / (1 + np.exp(-x))


def lstm_params(cell):
    """The fused ``(in, 4H)`` kernel, ``(H, 4H)`` recurrent kernel and ``(4H,)`` bias of an
    LSTMCell (per-gate ``Linear``s ``ii..io`` / ``hi..ho``) or OptimizedLSTMCell
    (``dense_i`` / ``dense_h``), gates in the order i, f, g, o."""
    if isinstance(cell, nn.OptimizedLSTMCell):
        return (f64(cell.dense_i.kernel[...]), f64(cell.dense_h.kernel[...]),
                f64(cell.dense_h.bias[...]))
    ins = [cell.ii, cell.if_, cell.ig, cell.io]
    hid = [cell.hi, cell.hf, cell.hg, cell.ho]
    return (np.concatenate([f64(m.kernel[...]) for m in ins], axis=1),
            np.concatenate([f64(m.kernel[...]) for m in hid], axis=1),
            np.concatenate([f64(m.bias[...]) for m in hid]))


def np_lstm_step(cell, c, h, x):
    w, u, b = lstm_params(cell)
    H = cell.hidden_features
    z = x @ w + h @ u + b
    i, f, g, o = (z[..., k * H : (k + 1) * H] for k in range(4))
    c2 = sig(f) * c + sig(i) * np.tanh(g)
    return c2, sig(o) * np.tanh(c2)


def np_gru_step(cell, h, x):
    w, u, b = f64(cell.dense_i.kernel[...]), f64(cell.dense_h.kernel[...]), f64(cell.dense_i.bias[...])
    bh = f64(cell.recurrent_bias[...])
    H = cell.hidden_features
    W = [w[:, k * H : (k + 1) * H] for k in range(3)]
    U = [u[:, k * H : (k + 1) * H] for k in range(3)]
    B = [b[k * H : (k + 1) * H] for k in range(3)]
    r = sig(x @ W[0] + B[0] + h @ U[0])
    z = sig(x @ W[1] + B[1] + h @ U[1])
    n = np.tanh(x @ W[2] + B[2] + r * (h @ U[2] + bh))
    return (1 - z) * n + z * h


def _randomize(cell, dtype):
    biases = [v for p, v in nn.iter_graph(cell) if isinstance(v, nn.Param) and "bias" in str(p)]
    assert biases
    for i, v in enumerate(biases):
        v[...] = randn(v.shape, dtype, 10 + i) * 0.5


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_lstm_cell_step(dtype):
    cell = nn.LSTMCell(3, 4, param_dtype=dtype, rngs=nn.Rngs(0))
    _randomize(cell, dtype)
    c, h = randn((2, 4), dtype, 1), randn((2, 4), dtype, 2)
    x = randn((2, 3), dtype, 3)
    (c2, h2), y = cell((c, h), x)
    rc, rh = np_lstm_step(cell, f64(c), f64(h), f64(x))
    np.testing.assert_allclose(f64(c2), rc, **TOL[dtype])
    np.testing.assert_allclose(f64(h2), rh, **TOL[dtype])
    np.testing.assert_array_equal(f64(y), f64(h2))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_gru_cell_step(dtype):
    cell = nn.GRUCell(3, 4, param_dtype=dtype, rngs=nn.Rngs(0))
    _randomize(cell, dtype)
    h, x = randn((2, 4), dtype, 1), randn((2, 3), dtype, 2)
    h2, y = cell(h, x)
    np.testing.assert_allclose(f64(h2), np_gru_step(cell, f64(h), f64(x)), **TOL[dtype])
    np.testing.assert_array_equal(f64(y), f64(h2))  # the output is the new carry


def test_simple_cell_and_carry_init():
    cell = nn.SimpleCell(3, 2, rngs=nn.Rngs(0))
    h, x = randn((5, 2)), randn((5, 3), seed=1)
    h2, _ = cell(h, x)
    ref = np.tanh(f64(x) @ f64(cell.dense_i.kernel[...]) + f64(h) @ f64(cell.dense_h.kernel[...])
                  + f64(cell.dense_i.bias[...]))
    np.testing.assert_allclose(f64(h2), ref, rtol=1e-5, atol=1e-5)
    lstm = nn.LSTMCell(3, 2, rngs=nn.Rngs(0))
    c0, h0 = lstm.initialize_carry((5, 3))
    assert c0.shape == h0.shape == (5, 2) and not np.any(f64(c0))
    # recurrent kernel: each (H, H) gate block is orthogonal
    u = lstm_params(lstm)[1]
    for k in range(4):
        blk = u[:, 2 * k : 2 * k + 2]
        np.testing.assert_allclose(blk.T @ blk, np.eye(2), atol=1e-5)


def np_run(cell, x, lengths=None, reverse=False, lstm=True):
    """Batch-major (B, T, F) reference loop, per example."""
    x = f64(x)
    B, T, _ = x.shape
    H = cell.hidden_features
    ys = np.zeros((B, T, H))
    carries = []
    for bi in range(B):
        L = T if lengths is None else int(lengths[bi])
        order = list(range(L))[::-1] if reverse else list(range(L))
        c, h = np.zeros(H), np.zeros(H)
        for step, t in enumerate(order):
            if lstm:
                c, h = np_lstm_step(cell, c, h, x[bi, t])
            else:
                h = np_gru_step(cell, h, x[bi, t])
            ys[bi, step] = h
        carries.append((c, h))
    return ys, carries


def test_rnn_scan_matches_loop():
    cell = nn.LSTMCell(3, 4, rngs=nn.Rngs(0))
    _randomize(cell, jnp.float32)
    rnn = nn.RNN(cell, return_carry=True)
    x = randn((2, 6, 3))
    (_, h), ys = jax.jit(lambda m, x: m(x))(rnn, x)
    ref, carries = np_run(cell, x)
    np.testing.assert_allclose(f64(ys), ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(f64(h), np.stack([ch[1] for ch in carries]), rtol=1e-4, atol=1e-4)
    # time-major input gives the same outputs, time-major
    tm = jax.jit(lambda m, x: m(x))(nn.RNN(cell, time_major=True), jnp.swapaxes(x, 0, 1))
    np.testing.assert_allclose(f64(tm), np.swapaxes(ref, 0, 1), rtol=1e-4, atol=1e-4)


def test_rnn_seq_lengths_reverse_keep_order():
    cell = nn.GRUCell(3, 4, rngs=nn.Rngs(1))
    _randomize(cell, jnp.float32)
    x = randn((3, 5, 3))
    lengths = np.array([5, 2, 3])
    rnn = nn.RNN(cell, return_carry=True)
    run = jax.jit(lambda m, x, n: m(x, seq_lengths=n))
    h, ys = run(rnn, x, jnp.asarray(lengths))
    ref, carries = np_run(cell, x, lengths, lstm=False)
    np.testing.assert_allclose(f64(ys), ref, rtol=1e-4, atol=1e-4)  # padded steps are zero
    np.testing.assert_allclose(f64(h), np.stack([ch[1] for ch in carries]), rtol=1e-4, atol=1e-4)
    # reverse: each sequence read backwards within its length
    run_rev = jax.jit(lambda m, x, n, keep: m(x, seq_lengths=n, reverse=True, keep_order=keep), static_argnums=3)
    h, ys = run_rev(rnn, x, jnp.asarray(lengths), False)
    ref, carries = np_run(cell, x, lengths, reverse=True, lstm=False)
    np.testing.assert_allclose(f64(ys), ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(f64(h), np.stack([ch[1] for ch in carries]), rtol=1e-4, atol=1e-4)
    ys_kept = f64(run_rev(rnn, x, jnp.asarray(lengths), True)[1])
    for bi, L in enumerate(lengths):
        np.testing.assert_allclose(ys_kept[bi, :L], ref[bi, :L][::-1], rtol=1e-4, atol=1e-4)


def test_rnn_grad_matches_finite_differences():
    cell = nn.GRUCell(2, 3, rngs=nn.Rngs(0))
    rnn = nn.RNN(cell)
    x = randn((1, 4, 2))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    g = jax.jit(jax.grad(loss, argnums=1))(rnn, x)
    fd = central_diff(lambda z: (np_run(cell, z, lstm=False)[0] ** 2).sum(), np.asarray(x, np.float64), h=1e-3)
    np.testing.assert_allclose(f64(g), fd, rtol=1e-3, atol=1e-4)


@settings(max_examples=6, deadline=None)
@given(b=st.sampled_from([1, 3]), t=st.sampled_from([1, 5]), f=st.sampled_from([2, 3]),
       hsz=st.sampled_from([3, 4]))
def test_rnn_shapes_property(b, t, f, hsz):
    rnn = nn.RNN(nn.LSTMCell(f, hsz, rngs=nn.Rngs(0)))
    assert jax.eval_shape(lambda m, x: m(x), rnn, jnp.ones((b, t, f))).shape == (b, t, hsz)
    assert rnn(jnp.ones((1, 1, f))).shape == (1, 1, hsz)


def test_recurrent_errors():
    cell = nn.LSTMCell(3, 4, rngs=nn.Rngs(0))
    carry = cell.initialize_carry((2, 3))
    with pytest.raises(ValueError, match=r"LSTMCell expected last axis 3, got 5"):
        cell(carry, jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="seq_lengths"):
        nn.RNN(cell)(jnp.ones((2, 4, 3)), seq_lengths=jnp.array([1, 2, 3]))
    with pytest.raises(TypeError, match="cell must be"):
        nn.RNN(lambda c, x: (c, x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_simple_cell_matches_numpy_at_both_dtypes(dtype):
    """h' = tanh(x W + h U + b), float32 and bfloat16 (TOL above)."""
    cell = nn.SimpleCell(
        3, 4, param_dtype=dtype, bias_init=nn.initializers.normal(0.5), rngs=nn.Rngs(2)
    )
    h, x = randn((5, 4), dtype, seed=3), randn((5, 3), dtype, seed=4)
    h2, y = cell(h, x)
    assert h2.dtype == dtype and y.shape == (5, 4)
    ref = np.tanh(
        f64(x) @ f64(cell.dense_i.kernel[...]) + f64(h) @ f64(cell.dense_h.kernel[...])
        + f64(cell.dense_i.bias[...])
    )
    np.testing.assert_allclose(f64(h2), ref, **TOL[dtype])
    np.testing.assert_allclose(f64(y), f64(h2))


@pytest.mark.parametrize(
    "cls,paths",
    [
        (nn.LSTMCell, {f"{g}/kernel" for g in ("ii", "if_", "ig", "io", "hi", "hf", "hg", "ho")}
         | {f"{g}/bias" for g in ("hi", "hf", "hg", "ho")}),
        (nn.OptimizedLSTMCell, {"dense_i/kernel", "dense_h/kernel", "dense_h/bias"}),
        (nn.GRUCell, {"dense_i/kernel", "dense_i/bias", "dense_h/kernel", "recurrent_bias"}),
        (nn.SimpleCell, {"dense_i/kernel", "dense_i/bias", "dense_h/kernel"}),
    ],
)
def test_cells_keep_flax_parameter_layout_and_metadata(cls, paths):
    meta = {"kernel_metadata": {"sharding_names": ("din", "dout")},
            "recurrent_kernel_metadata": {"sharding_names": ("h", "dout")},
            "bias_metadata": {"sharding_names": ("dout",)}}
    cell = cls(3, 4, rngs=nn.Rngs(0), **meta)
    params = {"/".join(map(str, p)): v for p, v in nn.iter_graph(cell) if isinstance(v, nn.Param)}
    assert set(params) == paths
    for p, v in params.items():
        want = ("dout",) if "bias" in p else ("din", "dout") if p.startswith(("dense_i", "i")) \
            else ("h", "dout")
        assert v.sharding_names == want, p
    # the layout is Flax's; the values are those of the fused draws (same seed, same numbers)
    lstm, opt = nn.LSTMCell(3, 4, rngs=nn.Rngs(5)), nn.OptimizedLSTMCell(3, 4, rngs=nn.Rngs(5))
    for a, b in zip(lstm_params(lstm), lstm_params(opt)):
        np.testing.assert_array_equal(a, b)


def test_simple_cell_residual_matches_numpy():
    cell = nn.SimpleCell(3, 3, residual=True, bias_init=nn.initializers.normal(0.5), rngs=nn.Rngs(1))
    h, x = randn((2, 3), seed=3), randn((2, 3), seed=4)
    h2, _ = cell(h, x)
    ref = np.tanh(f64(x) @ f64(cell.dense_i.kernel[...]) + f64(h) @ f64(cell.dense_h.kernel[...])
                  + f64(cell.dense_i.bias[...]) + f64(h))
    np.testing.assert_allclose(f64(h2), ref, rtol=1e-5, atol=1e-5)


class _DropoutCell(nn.Module):
    """A cell whose step drops its carry with a mask from its own stream."""

    def __init__(self, rngs):
        self.drop = nn.Dropout(0.5, deterministic=False, rng_collection="recurrent", rngs=rngs)

    def __call__(self, carry, x):
        return carry, self.drop(jnp.ones_like(x))

    def initialize_carry(self, input_shape, rngs=None):
        return jnp.zeros(input_shape[:-1] + (1,))


def test_rnn_broadcast_rngs_share_one_mask_over_time_and_advance_once_per_call():
    cell = _DropoutCell(nn.Rngs(recurrent=1))
    x = jnp.ones((2, 6, 16))
    shared = nn.RNN(cell, broadcast_rngs="recurrent")
    masks = shared(x)  # (batch, time, features)
    assert int(cell.drop.rngs.count.value) == 1  # the stream advanced once for the call
    for t in range(1, 6):
        np.testing.assert_array_equal(masks[:, t], masks[:, 0])
    assert not np.array_equal(shared(x)[:, 0], masks[:, 0])  # a fresh mask per call
    assert int(cell.drop.rngs.count.value) == 2
    # without broadcast_rngs the stream is threaded through the steps: a new mask per step
    per_step = nn.RNN(_DropoutCell(nn.Rngs(recurrent=1)))(x)
    assert not np.array_equal(per_step[:, 1], per_step[:, 0])
    # the expected Dropout scaling: kept entries are 1 / (1 - rate)
    assert set(np.unique(np.asarray(masks)).tolist()) <= {0.0, 2.0}
