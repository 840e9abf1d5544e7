"""AWQ: never worse than round-to-nearest on its calibration data (alpha = 0 is on the
grid and is exactly round-to-nearest), clearly better with salient input channels."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from cairn import quant
from cairn.core_array import QArray


def _f(p, x):
    return x @ p["dense"]["kernel"]


def _data(salient: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1024, 64)).astype(np.float32)
    if salient:
        x[:, :4] *= 25.0
    w = (rng.normal(size=(64, 16)) / 8).astype(np.float32)
    return x, w


def _errors(x, w, tile):
    provider = quant.PtqProvider([quant.AwqRule(weight_qtype="int4", tile_size=tile, n_grid=10)])
    qp = quant.awq_quantize_params({"dense": {"kernel": w}}, provider, _f, [(x,)])
    got = np.asarray(quant.quantize(_f, provider)(qp, x), np.float64)
    rtn = quant.quantize(_f, quant.PtqProvider([quant.QuantizationRule(weight_qtype="int4", tile_size=tile)]))({"dense": {"kernel": w}}, x)
    ref = x.astype(np.float64) @ w
    return qp, np.mean((got - ref) ** 2), np.mean((np.asarray(rtn, np.float64) - ref) ** 2)


@pytest.mark.parametrize("tile", [None, 16])
@pytest.mark.parametrize("salient", [False, True])
def test_awq_never_worse_than_round_to_nearest(tile, salient):
    x, w = _data(salient)
    qp, awq, rtn = _errors(x, w, tile)
    assert awq <= rtn * (1 + 1e-4)
    if salient:
        assert awq < 0.9 * rtn  # measured: 0.71x (per channel) and 0.85x (tiles of 16)
    assert isinstance(qp["dense"]["kernel"], QArray)
    s = np.asarray(qp["dense"]["kernel_awq_scale"])
    assert s.shape == (64,) and np.all(s > 0)
    assert np.isclose(np.sqrt(s.max() * s.min()), 1.0, rtol=1e-5)  # AWQ's normalisation


def test_the_scale_is_applied_at_the_dot():
    x, w = _data(True)
    provider = quant.PtqProvider([quant.AwqRule(weight_qtype="int8", n_grid=4)])
    qp = quant.awq_quantize_params({"dense": {"kernel": w}}, provider, _f, [(x,)])
    s = np.asarray(qp["dense"]["kernel_awq_scale"], np.float64)
    stored = np.asarray(qp["dense"]["kernel"].dequantize(), np.float64)  # ~ diag(s) W
    expect = (x / s[None, :]) @ stored
    np.testing.assert_allclose(np.asarray(quant.quantize(_f, provider)(qp, x)), expect, rtol=1e-4, atol=1e-3)
    assert quant.input_scale_path("dense/kernel") == "dense/kernel_awq_scale"


def test_awq_rule_checks():
    with pytest.raises(ValueError, match="integer weight_qtype"):
        quant.AwqRule(weight_qtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="n_grid"):
        quant.AwqRule(weight_qtype="int4", n_grid=0)
    with pytest.raises(ValueError, match="no batch"):
        quant.awq_quantize_params({"dense": {"kernel": jnp.ones((4, 2))}}, quant.PtqProvider([quant.AwqRule(weight_qtype="int4")]), _f, [])


def _f_stacked(p, x):
    for block in p["blocks"]:
        x = x @ block["dense"]["kernel"]
    return x


@pytest.mark.parametrize("method", ["awq", "smooth_quant"])
def test_params_with_dicts_inside_lists_and_tuples_are_left_unchanged(method):
    # the caller's tree must never gain the quantized weights or the *_awq_scale entries,
    # however its dicts nest (they used to be written into dicts held by a list)
    x, _ = _data(salient=True)
    rng = np.random.default_rng(1)
    for container in (list, tuple):
        blocks = container({"dense": {"kernel": (rng.normal(size=(64, 64)) / 8).astype(np.float32)}} for _ in range(2))
        params = {"blocks": blocks}
        before = [dict(b["dense"]) for b in params["blocks"]]
        if method == "awq":
            provider = quant.PtqProvider([quant.AwqRule(weight_qtype="int4", tile_size=32, n_grid=4)])
            out = quant.awq_quantize_params(params, provider, _f_stacked, [(x[:256],)])
        else:
            provider = quant.PtqProvider([quant.SmoothQuantRule(alpha=0.5)], strict=False)
            out = quant.smooth_quant_params(params, provider, _f_stacked, [(x[:256],)])
        for b, old in zip(params["blocks"], before):
            assert set(b["dense"]) == {"kernel"} and b["dense"]["kernel"] is old["kernel"]
        assert type(out["blocks"]) is container
        assert all("kernel_awq_scale" in b["dense"] for b in out["blocks"])


# --- einsum kernels (more than two axes) and int-keyed layer dicts ---

def _f_heads(p, x):  # a q projection: [tokens, d] x [d, heads, head_dim]
    return jnp.einsum("td,dnh->tnh", x, p["layers"][0]["q"]["kernel"])


def _f_flat(p, x):  # the same product with the kernel as [d, heads * head_dim]
    return x @ p["layers"][0]["q"]["kernel"]


def _f_out(p, x):  # an output projection: [tokens, heads, head_dim] x [heads, head_dim, d]
    return jnp.einsum("tnh,nhd->td", x, p["layers"][0]["o"]["kernel"])


@pytest.mark.parametrize("tile", [None, 16])
def test_awq_on_an_einsum_kernel_equals_awq_on_its_flattened_matrix(tile):
    # a pure dict of a module tree keys its layers by int ({0: ...}, as nn.State.to_pure_dict
    # gives them) while weight paths spell them "layers/0/q/kernel"
    x, w = _data(salient=True)
    w3 = w.reshape(64, 4, 4)
    provider = quant.PtqProvider([quant.AwqRule(weight_qtype="int4", tile_size=tile, n_grid=10)])
    q3 = quant.awq_quantize_params({"layers": {0: {"q": {"kernel": w3}}}}, provider, _f_heads, [(x,)])
    q2 = quant.awq_quantize_params({"layers": {0: {"q": {"kernel": w}}}}, provider, _f_flat, [(x,)])
    s3, s2 = (np.asarray(q["layers"][0]["q"]["kernel_awq_scale"]) for q in (q3, q2))
    np.testing.assert_array_equal(s3, s2)
    assert s3.shape == (64,)
    k3, k2 = q3["layers"][0]["q"]["kernel"], q2["layers"][0]["q"]["kernel"]
    assert isinstance(k3, QArray) and k3.shape == (64, 4, 4)
    np.testing.assert_array_equal(np.asarray(k3.dequantize()).reshape(64, 16), np.asarray(k2.dequantize()))
    got = np.asarray(quant.quantize(_f_heads, provider)(q3, x), np.float64)
    expect = np.einsum("td,dnh->tnh", x / s3[None, :].astype(np.float64), np.asarray(k3.dequantize(), np.float64))
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-3)  # the scale divides the inputs at the dot
    ref = x.astype(np.float64) @ w.astype(np.float64)
    rtn = quant.quantize(_f_heads, quant.PtqProvider([quant.QuantizationRule(weight_qtype="int4", tile_size=tile)]))(
        {"layers": {0: {"q": {"kernel": w3}}}}, x)
    err = np.mean((got.reshape(-1, 16) - ref) ** 2)
    assert err < 0.9 * np.mean((np.asarray(rtn, np.float64).reshape(-1, 16) - ref) ** 2)


def test_awq_on_a_kernel_contracted_on_two_axes():
    x, w = _data(salient=True)  # w [64, 16]: here [heads * head_dim, d] = [(4, 16), 16]
    x3 = x.reshape(-1, 4, 16)
    params = {"layers": [{"o": {"kernel": w.reshape(4, 16, 16)}}]}  # list-indexed layers
    provider = quant.PtqProvider([quant.AwqRule(weight_qtype="int4", n_grid=10)])
    qp = quant.awq_quantize_params(params, provider, _f_out, [(x3,)])
    flat = quant.awq_quantize_params({"layers": {0: {"q": {"kernel": w}}}}, provider, _f_flat, [(x,)])
    s = np.asarray(qp["layers"][0]["o"]["kernel_awq_scale"])
    np.testing.assert_array_equal(s, np.asarray(flat["layers"][0]["q"]["kernel_awq_scale"]))
    np.testing.assert_array_equal(np.asarray(qp["layers"][0]["o"]["kernel"].dequantize()).reshape(64, 16),
                                  np.asarray(flat["layers"][0]["q"]["kernel"].dequantize()))
    got = np.asarray(quant.quantize(_f_out, provider)(qp, x3), np.float64)
    np.testing.assert_allclose(got, (x / s[None, :]) @ np.asarray(flat["layers"][0]["q"]["kernel"].dequantize(), np.float64),
                               rtol=1e-4, atol=1e-3)
    assert "kernel_awq_scale" not in params["layers"][0]["o"]  # the caller's tree is unchanged
    tiled = quant.PtqProvider([quant.AwqRule(weight_qtype="int4", tile_size=16)])
    with pytest.raises(ValueError, match="tiles need exactly one contracted axis"):
        quant.awq_quantize_params(params, tiled, _f_out, [(x3,)])


def test_lookup_path_finds_int_keys_and_list_items_by_decimal_parts():
    from cairn.quant._recording import lookup_path

    leaf = np.ones(2)
    assert lookup_path({"layers": {0: {"mlp": {"kernel": leaf}}}}, "layers/0/mlp/kernel".split("/")) is leaf
    assert lookup_path({"layers": [{"mlp": {"kernel": leaf}}]}, "layers/0/mlp/kernel".split("/")) is leaf
    assert lookup_path({"layers": {"0": leaf, 0: None}}, ["layers", "0"]) is leaf  # a text key wins
    with pytest.raises(KeyError):
        lookup_path({"layers": {1: leaf}}, ["layers", "0"])
