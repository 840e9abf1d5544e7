"""Dots inside a ``shard_map`` body are quantized, on 8 virtual CPU devices (a child process:
the device count is fixed when JAX starts).

Each case checks that an int8 x int8 dot is in the lowered program and that the values
equal a float64 NumPy statement of the quantized math, block by block: symmetric int8,
``scale = absmax / 127.5``, one scale per output channel of the weight and per token of the
activation (the activation's scale taken over the features its device holds). A construct
the rewrite does not enter (a Pallas kernel) is an error, or a warning with
``strict=False``, never silent.
"""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

SCRIPT = textwrap.dedent(
    r"""
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from cairn import quant
    from cairn.core_array import QArray

    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("d", "m"))
    w = jax.random.normal(jax.random.key(0), (16, 8))
    x = jax.random.normal(jax.random.key(1), (4, 16))

    def column(p, x):  # the weight's output channels split over "m", the tokens over "d"
        return jax.shard_map(lambda w, x: x @ w, mesh=mesh, in_specs=(P(None, "m"), P("d")),
                             out_specs=P("d", "m"))(p["w"], x)

    def row(p, x):  # the contracted axis split over "m": partial products summed
        return jax.shard_map(lambda w, x: jax.lax.psum(x @ w, "m"), mesh=mesh,
                             in_specs=(P("m", None), P("d", "m")), out_specs=P("d"))(p["w"], x)

    def reshaped(p, x):  # the weight reaches the body through a reshape
        return jax.shard_map(lambda w, x: x @ w, mesh=mesh, in_specs=(P(None, "m"), P("d")),
                             out_specs=P("d", "m"))(p["flat"].reshape(16, 8), x)

    rule = quant.QuantizationRule(weight_qtype="int8", act_qtype="int8")
    out = {"w": np.asarray(w).tolist(), "x": np.asarray(x).tolist()}
    for name, fn, params in [("column", column, {"w": w}), ("row", row, {"w": w}),
                             ("reshaped", reshaped, {"flat": w.reshape(-1)})]:
        provider = quant.PtqProvider([rule])
        q = quant.quantize(fn, provider)
        eager, jitted = q(params, x), jax.jit(q)(params, x)
        text = jax.jit(q).lower(params, x).as_text()
        int8_dot = any(re.search(r"xi8>.*xi8>.*->.*xi32>", ln) for ln in text.splitlines() if "dot_general" in ln)
        out[name] = {"eager": np.asarray(eager).tolist(), "jit": np.asarray(jitted).tolist(), "int8_dot": int8_dot}
    # a stored QArray split across devices: values by rows, its per-column scales replicated
    provider = quant.PtqProvider([rule])
    stored = quant.quantize_params({"w": w}, provider, row, x)
    assert isinstance(stored["w"], QArray), type(stored["w"])
    out["row_stored"] = {"eager": np.asarray(quant.quantize(row, provider)(stored, x)).tolist()}
    # the float program inside the body, unquantized: the reference of the quantization error's size
    out["float"] = np.asarray(column({"w": w}, x)).tolist()
    print("RESULT" + json.dumps(out))
    """
)


def _q(a: np.ndarray, axis: int) -> np.ndarray:
    """Symmetric int8 values and scales reduced over ``axis`` (float64)."""
    scale = np.max(np.abs(a), axis=axis, keepdims=True) / 127.5
    return np.clip(np.round(a / scale), -127, 127), scale


def _w8a8(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    qx, sx = _q(x, 1)  # one scale per token
    qw, sw = _q(w, 0)  # one scale per output channel
    return (qx @ qw) * sx * sw


@pytest.mark.slow
def test_dots_inside_shard_map_are_quantized(run_on_cpu_devices):
    proc = run_on_cpu_devices(SCRIPT, devices=8, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    w, x = np.asarray(out["w"], np.float64), np.asarray(out["x"], np.float64)
    want = _w8a8(x, w)  # tokens and output channels are split: every scale is the unsplit one
    # row-parallel: each device holds 4 of the 16 features, so each token gets a scale per block;
    # the weight's per-column scale spans all rows (on the fly from the block it is the block's)
    blocks = [slice(4 * k, 4 * k + 4) for k in range(4)]
    _, sw_full = _q(w, 0)
    row_fly = sum(_w8a8(x[:, b], w[b]) for b in blocks)
    row_stored = sum((lambda qx, sx: (qx @ np.clip(np.round(w[b] / sw_full), -127, 127)) * sx * sw_full)(*_q(x[:, b], 1)) for b in blocks)
    for name, ref in {"column": want, "reshaped": want, "row": row_fly}.items():
        assert out[name]["int8_dot"], name
        for how in ("eager", "jit"):
            np.testing.assert_allclose(np.asarray(out[name][how]), ref, rtol=1e-5, atol=1e-5, err_msg=f"{name} {how}")
    np.testing.assert_allclose(np.asarray(out["row_stored"]["eager"]), row_stored, rtol=1e-5, atol=1e-5)
    # and it is the quantized math, not the float one
    assert np.max(np.abs(np.asarray(out["float"]) - want)) > 1e-3


def test_a_construct_not_entered_is_never_silent():
    import warnings

    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from cairn import quant

    def kernel(a_ref, w_ref, o_ref):
        o_ref[...] = a_ref[...] @ w_ref[...]

    def fn(p, x):  # a Pallas kernel: its body is not rewritten, so its dot would stay float
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.float32), interpret=True)(x, p["enc"]["w"])

    p, x = {"enc": {"w": jnp.eye(8) * 0.37}}, jnp.ones((8, 8))
    rule = quant.QuantizationRule(module_path="enc", weight_qtype="int8")
    with pytest.raises(ValueError, match=r"\['enc/w'\] flow into 'pallas_call'.*strict=False"):
        quant.quantize(fn, quant.PtqProvider([rule]))(p, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = quant.quantize(fn, quant.PtqProvider([rule], strict=False))(p, x)
    assert any("'pallas_call'" in str(w.message) for w in caught)
    np.testing.assert_allclose(np.asarray(y), np.full((8, 8), 0.37), rtol=1e-6)  # float: 0.37 is not on the int8 grid
    # a rule that does not select the weight says nothing about it
    other = quant.QuantizationRule(module_path="dec", weight_qtype="int8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quant.quantize(fn, quant.PtqProvider([other], strict=False))(p, x)
