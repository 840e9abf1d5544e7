"""process_prequantized_params: parts quantized elsewhere, checked against the template."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from cairn import quant


def _f(p, x):
    return x @ p["d"]["kernel"] + p["d"]["bias"]


P = {"d": {"kernel": jax.random.normal(jax.random.key(0), (16, 8)), "bias": np.zeros(8, np.float32)}}
X = jax.random.normal(jax.random.key(1), (3, 16))
PROVIDER = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8")])


def test_parts_become_the_template_qarrays():
    qp = quant.quantize_params(P, PROVIDER, _f, X)
    template = jax.eval_shape(lambda: qp)
    k = qp["d"]["kernel"]
    ckpt = {"d": {"kernel": {"qvalue": np.asarray(k.qvalue), "scale": np.asarray(k.scale)}, "bias": np.zeros(8, np.float32)}}
    loaded = quant.process_prequantized_params(ckpt, template)
    assert loaded["d"]["kernel"].layout == k.layout
    f = quant.quantize(_f, PROVIDER)
    np.testing.assert_array_equal(np.asarray(f(loaded, X)), np.asarray(f(qp, X)))


def test_mismatches_name_the_path():
    qp = quant.quantize_params(P, PROVIDER, _f, X)
    k = qp["d"]["kernel"]
    good = {"qvalue": np.asarray(k.qvalue), "scale": np.asarray(k.scale)}
    with pytest.raises(ValueError, match=r"d/kernel/qvalue is int8\[8, 16\]"):
        quant.process_prequantized_params({"d": {"kernel": {**good, "qvalue": np.asarray(k.qvalue).T}, "bias": P["d"]["bias"]}}, qp)
    with pytest.raises(ValueError, match="no entry for 'd/bias'"):
        quant.process_prequantized_params({"d": {"kernel": good}}, qp)
    with pytest.raises(ValueError, match="not in the template"):
        quant.process_prequantized_params({"d": {"kernel": good, "bias": P["d"]["bias"], "extra": np.ones(2)}}, qp)
    loaded = quant.process_prequantized_params({"d": {"kernel": good, "bias": P["d"]["bias"], "extra": np.ones(2)}}, qp, allow_extra_params=True)
    assert set(loaded["d"]) == {"kernel", "bias"}
    with pytest.raises(ValueError, match="must be a dict with 'qvalue' and 'scale'"):
        quant.process_prequantized_params({"d": {"kernel": np.asarray(P["d"]["kernel"]), "bias": P["d"]["bias"]}}, qp)
