"""SmoothQuant: exact in float, better w8a8 with outlier channels."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from cairn import quant


def _f(p, x):
    return x @ p["d"]["kernel"]


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 64)).astype(np.float32)
    x[:, :3] *= 40.0
    return x, (rng.normal(size=(64, 32)) / 8).astype(np.float32)


def test_smoothing_alone_is_exact_and_follows_the_formula():
    x, w = _data()
    provider = quant.PtqProvider([quant.SmoothQuantRule(alpha=0.5)], strict=False)  # no qtype: float
    sp = quant.smooth_quant_params({"d": {"kernel": w}}, provider, _f, [(x[:128],), (x[128:],)])
    s = np.asarray(sp["d"]["kernel_awq_scale"], np.float64)
    want = np.sqrt(np.abs(x).max(axis=0)) / np.sqrt(np.abs(w).max(axis=1))
    np.testing.assert_allclose(s, want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(sp["d"]["kernel"]), w * s[:, None], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(quant.quantize(_f, provider)(sp, x)), x @ w, rtol=1e-4, atol=1e-4)


def test_w8a8_error_drops_with_outlier_channels():
    x, w = _data()
    provider = quant.PtqProvider([quant.SmoothQuantRule(weight_qtype="int8", act_qtype="int8")])
    sp = quant.smooth_quant_params({"d": {"kernel": w}}, provider, _f, [(x,)])
    f = quant.quantize(_f, provider)
    assert "preferred_element_type=int32" in str(jax.make_jaxpr(f)(sp, x))
    ref = x.astype(np.float64) @ w
    smooth = np.linalg.norm(np.asarray(f(sp, x)) - ref)
    plain = np.linalg.norm(np.asarray(quant.quantize(_f, quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8", act_qtype="int8")]))({"d": {"kernel": w}}, x)) - ref)
    assert smooth < 0.6 * plain


def test_alpha_is_checked():
    with pytest.raises(ValueError, match="alpha"):
        quant.SmoothQuantRule(alpha=1.5)
