"""Both halves together: an exported model (int8 QArray weights, float32 and bfloat16
inputs) in a repository directory, served, queried with tritonclient (binary tensors,
concurrent requests of every size), each answer equal to the in-process loaded model's
and to a float64 reference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cairn.core_array import ArraySpec, QArray, QuantLayout
from cairn.serving import export, load, serve

tc = pytest.importorskip("tritonclient.http")

RNG = np.random.default_rng(3)
Q = RNG.integers(-127, 128, size=(8, 4)).astype(np.int8)
SCALE = (RNG.random((1, 4)) / 40 + 0.01).astype(np.float32)
BIAS = RNG.normal(size=4).astype(np.float32)


def _fn(params, inputs):
    import jax.numpy as jnp

    w = params["proj"]["w"].dequantize()
    x = inputs["x"] + inputs["shift"].astype(jnp.float32)
    y = x @ w + params["proj"]["b"]
    return {"y": y, "y_bf16": y.astype(jnp.bfloat16), "best": jnp.argmax(y, axis=1).astype(jnp.int32)}


def _reference(x, shift):
    w = Q.astype(np.float64) * SCALE.astype(np.float64)
    return (x.astype(np.float64) + shift.astype(np.float32).astype(np.float64)) @ w + BIAS


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    params = {"proj": {"w": QArray(Q, SCALE, qtype="int8", layout=QuantLayout.per_channel(1)), "b": BIAS}}
    specs = {"x": ArraySpec(("b", 8), "float32", constraints=("b <= 8",)), "shift": ArraySpec(("b", 8), "bfloat16")}
    export(_fn, params, specs, root / "proj" / "1", batch_buckets=(1, 4, 8))
    return root


NAMES = ("y", "y_bf16", "best")


def _send(client, x, shift):
    """Start one request (tritonclient's async_infer: its own greenlet pool, 8 at a time)."""
    a = tc.InferInput("x", list(x.shape), "FP32")
    a.set_data_from_numpy(x)
    b = tc.InferInput("shift", list(shift.shape), "BF16")
    b.set_data_from_numpy(shift)
    return client.async_infer("proj", [a, b], outputs=[tc.InferRequestedOutput(n) for n in NAMES])


def test_exported_model_served_to_tritonclient(repo):
    local = load(repo / "proj" / "1")
    with serve(str(repo)) as server:
        client = tc.InferenceServerClient(server.url.removeprefix("http://"), concurrency=8)
        meta = client.get_model_metadata("proj")
        assert {i["name"]: (i["datatype"], i["shape"]) for i in meta["inputs"]} == {
            "x": ("FP32", [-1, 8]), "shift": ("BF16", [-1, 8])}
        cases = []
        for n in [1, 2, 3, 5, 8] * 4:
            x = RNG.normal(size=(n, 8)).astype(np.float32)
            shift = RNG.normal(size=(n, 8)).astype(ml_dtypes.bfloat16)
            cases.append((x, shift))
        pending = [_send(client, *c) for c in cases]  # all in flight together: the batcher groups them
        results = [p.get_result() for p in pending]
        answers = [{n: r.as_numpy(n) for n in NAMES} for r in results]
        client.close()
    for (x, shift), got in zip(cases, answers):
        want = local({"x": x, "shift": shift})
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got["y"], _reference(x, shift), rtol=1e-4, atol=1e-4)
        assert got["y_bf16"].dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(got["y_bf16"].astype(np.float32), want["y_bf16"].astype(np.float32))
        np.testing.assert_array_equal(got["best"], np.argmax(want["y"], axis=1))
