"""GPTQ: equals round-to-nearest when the inputs are uncorrelated, and beats it when they are."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from cairn import quant


def _rtn(w: np.ndarray, qmax: int, tile: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Round to nearest, float64, symmetric, one scale per tile of rows per column."""
    k = w.shape[0]
    t = k if tile is None else tile
    groups = w.reshape(k // t, t, -1)
    hi = np.abs(groups).max(axis=1)
    s = np.where(hi > 0, hi / (qmax + 0.5), 1.0)
    q = np.clip(np.round(groups / s[:, None, :]), -qmax, qmax).reshape(w.shape)
    return q, s


@pytest.mark.parametrize("tile", [None, 8])
def test_identity_hessian_is_round_to_nearest(tile):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(32, 5))
    q, s = quant.gptq_matrix(w, np.eye(32), "int4", tile=tile, block_size=8, damping=0.0)
    rq, rs = _rtn(w, 7, tile)
    np.testing.assert_array_equal(q, rq)
    np.testing.assert_allclose(s, rs, rtol=1e-12)


def _correlated(t: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(t, 8)) @ rng.normal(size=(8, k)) + 0.05 * rng.normal(size=(t, k))).astype(np.float32)


@pytest.mark.parametrize("tile", [None, 16])
def test_gptq_beats_round_to_nearest_on_correlated_inputs(tile):
    k, n = 64, 24
    x = _correlated(512, k, 1)
    w = (np.random.default_rng(2).normal(size=(k, n)) / 8).astype(np.float32)

    def f(p, x):
        return x @ p["dense"]["kernel"]

    provider = quant.PtqProvider([quant.GptqRule(weight_qtype="int4", tile_size=tile)])
    qp = quant.gptq_quantize_params({"dense": {"kernel": w}}, provider, f, [(x[:256],), (x[256:],)])
    assert qp["dense"]["kernel"].qvalue.dtype == jnp.int4
    ref = x.astype(np.float64) @ w
    got = np.asarray(quant.quantize(f, provider)(qp, x))
    rq, rs = _rtn(w.astype(np.float64), 7, tile)
    t = k if tile is None else tile
    rtn = x.astype(np.float64) @ (rq.reshape(k // t, t, n) * rs[:, None, :]).reshape(k, n)
    err, rtn_err = np.linalg.norm(got - ref), np.linalg.norm(rtn - ref)
    assert err < 0.5 * rtn_err, (err, rtn_err)


def test_transposed_use_and_errors():
    x = _correlated(128, 16, 3)
    w = np.random.default_rng(4).normal(size=(8, 16)).astype(np.float32)  # used as w.T

    def f(p, x):
        return x @ p["w"].T

    provider = quant.PtqProvider([quant.GptqRule(weight_qtype="int8")])
    qp = quant.gptq_quantize_params({"w": w}, provider, f, [(x,)])
    assert qp["w"].layout.axes == (0,)  # one scale per output row of the stored [out, in] leaf
    got = np.asarray(quant.quantize(f, provider)(qp, x))
    ref = x @ w.T
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.01
    with pytest.raises(ValueError, match="signed integer weight_qtype"):
        quant.GptqRule(weight_qtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="no batch"):
        quant.gptq_quantize_params({"w": w}, provider, f, [])
    with pytest.raises(ValueError, match="does not match"):
        quant.gptq_matrix(np.ones((4, 2)), np.eye(3), "int4")
