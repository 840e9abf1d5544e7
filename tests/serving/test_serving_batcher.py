"""The dynamic batcher: a request's outputs are exactly those of running it alone (padded
buckets included), batches form under load and respect max_batch_size, a full queue
refuses, a raising request fails alone, and close() drains."""

import asyncio
import concurrent.futures
import threading

import numpy as np
import pytest
from serving_testlib import affine_model, mlp_model

from cairn.core_array import ArraySpec
from cairn.serving._batcher import (
    BatchingConfig,
    DynamicBatcher,
    ModelError,
    QueueFull,
    Unavailable,
)
from cairn.serving._model import PythonModel


def run(coro):
    return asyncio.run(coro)


class Recorder:
    """Wraps a model, recording the batch sizes it was called with."""

    def __init__(self, model, gate: threading.Event | None = None):
        self.model, self.gate, self.calls = model, gate, []
        self.inputs, self.outputs = model.inputs, model.outputs
        self.max_batch_size, self.batch_buckets, self.name = model.max_batch_size, model.batch_buckets, model.name

    def __call__(self, inputs):
        if self.gate is not None:
            self.gate.wait(10)
        self.calls.append(next(iter(inputs.values())).shape[0])
        return self.model(inputs)


@pytest.mark.parametrize("delay", [0.0, 0.02])
def test_outputs_equal_running_alone_with_padding(delay):
    model = mlp_model(max_batch_size=16)
    rec = Recorder(model)
    rng = np.random.default_rng(0)
    requests = [rng.normal(size=(int(n), 8)) for n in rng.integers(1, 6, size=12)]

    async def main():
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            b = DynamicBatcher(rec, BatchingConfig(max_queue_delay=delay, batch_buckets=(1, 4, 16)), pool)
            futs = [b.submit({"x": x}, len(x)) for x in requests]
            return await asyncio.gather(*futs)

    results = run(main())
    for x, (out, timing) in zip(requests, results):
        alone = model({"x": x})
        assert out["y"].shape == (len(x), 3)
        np.testing.assert_array_equal(out["y"], alone["y"])  # bit for bit
        np.testing.assert_array_equal(out["z"], alone["z"])
        np.testing.assert_allclose(out["y"], model.reference(x), rtol=1e-12)
        assert timing.padded in (1, 4, 16) and timing.padded >= timing.batch
    assert all(c in (1, 4, 16) for c in rec.calls)  # every execution is a bucket size
    assert len(rec.calls) < len(requests)  # and requests were batched
    assert sum(len(x) for x in requests) <= sum(rec.calls)


def test_batches_form_while_a_batch_runs_and_respect_max_batch_size():
    gate = threading.Event()
    rec = Recorder(affine_model(max_batch_size=8, buckets=(8,)), gate)

    async def main():
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            b = DynamicBatcher(rec, BatchingConfig(run_inline=False), pool)
            futs = [b.submit({"x": np.full((1, 4), 0, np.float32)}, 1)]
            await asyncio.sleep(0)  # dispatched alone: nothing else had arrived
            futs += [b.submit({"x": np.full((1, 4), i, np.float32)}, 1) for i in range(1, 20)]
            await asyncio.sleep(0)
            assert b.queued == 19  # the first holds the worker, the rest wait
            gate.set()
            return await asyncio.gather(*futs)

    results = run(main())
    for i, (out, _) in enumerate(results):
        np.testing.assert_array_equal(out["y"], np.full((1, 4), 2 * i + 1, np.float32))
    assert rec.calls == [8, 8, 8, 8]  # 1 alone (padded to 8), then 8, 8, and the last 3 padded to 8
    assert [t.batch for _, t in results[:1]] == [1] and results[-1][1].batch == 3


def test_queue_full_raises_and_close_drains():
    gate = threading.Event()
    rec = Recorder(affine_model(), gate)

    async def main():
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            b = DynamicBatcher(rec, BatchingConfig(max_queue_size=3, enabled=False, run_inline=False), pool)
            futs = [b.submit({"x": np.ones((1, 4), np.float32)}, 1)]
            await asyncio.sleep(0)
            futs += [b.submit({"x": np.ones((1, 4), np.float32)}, 1) for _ in range(3)]  # 1 running + 3 queued
            with pytest.raises(QueueFull, match="max_queue_size"):
                b.submit({"x": np.ones((1, 4), np.float32)}, 1)
            closing = asyncio.ensure_future(b.close())
            await asyncio.sleep(0)
            with pytest.raises(Unavailable):
                b.submit({"x": np.ones((1, 4), np.float32)}, 1)
            gate.set()
            await closing
            assert all(f.done() and f.exception() is None for f in futs)

    run(main())
    assert rec.calls == [1, 1, 1, 1]  # batching disabled: each request alone


def test_a_raising_request_fails_alone():
    def fn(d):
        if np.any(d["x"] < 0):
            raise RuntimeError("negative input")
        return {"y": d["x"] * 2}

    spec = {"x": ArraySpec(("b", 2), "float32")}
    model = PythonModel(fn, spec, {"y": ArraySpec(("b", 2), "float32")}, max_batch_size=8, name="picky")
    gate = threading.Event()
    rec = Recorder(model, gate)

    async def main():
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            b = DynamicBatcher(rec, BatchingConfig(run_inline=False), pool)
            first = b.submit({"x": np.ones((1, 2), np.float32)}, 1)
            await asyncio.sleep(0)
            futs = [b.submit({"x": np.full((1, 2), v, np.float32)}, 1) for v in (1, -1, 3)]
            gate.set()
            return await asyncio.gather(first, *futs, return_exceptions=True)

    results = run(main())
    assert isinstance(results[2], ModelError) and "negative input" in str(results[2])
    np.testing.assert_array_equal(results[1][0]["y"], [[2, 2]])
    np.testing.assert_array_equal(results[3][0]["y"], [[6, 6]])


def test_wrong_output_rows_is_a_model_error():
    model = PythonModel(
        lambda d: {"y": d["x"][:1]}, {"x": ArraySpec(("b", 2), "float32")}, {"y": ArraySpec(("b", 2), "float32")}, max_batch_size=4
    )

    async def main():
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            b = DynamicBatcher(model, BatchingConfig(batch_buckets=()), pool)
            return await asyncio.gather(b.submit({"x": np.ones((3, 2), np.float32)}, 3), return_exceptions=True)

    (err,) = run(main())
    assert isinstance(err, ModelError) and "expected 3 rows on axis 0" in str(err)


@pytest.mark.parametrize("inline", [True, False, None])
def test_inline_and_pooled_execution_agree(inline):
    model = mlp_model(max_batch_size=8)
    requests = [np.random.default_rng(i).normal(size=(1 + i % 3, 8)) for i in range(30)]

    async def main():
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            b = DynamicBatcher(model, BatchingConfig(run_inline=inline), pool)
            results = []
            for chunk in (requests[:10], requests[10:20], requests[20:]):  # three arrival waves
                results += await asyncio.gather(*(b.submit({"x": x}, len(x)) for x in chunk))
            if inline is not None:
                assert b._inline == inline
            return results

    for x, (out, timing) in zip(requests, run(main())):
        np.testing.assert_array_equal(out["y"], model({"x": x})["y"])
        assert timing.batch >= len(x)


def test_config_validation():
    with pytest.raises(ValueError, match="max_queue_delay must be >= 0"):
        BatchingConfig(max_queue_delay=-1)
    with pytest.raises(ValueError, match="max_queue_size and max_concurrent_batches must be >= 1"):
        BatchingConfig(max_queue_size=0)
    with pytest.raises(ValueError, match="batch_buckets must be positive"):
        BatchingConfig(batch_buckets=(0, 2))
    assert BatchingConfig(batch_buckets=(8, 2)).batch_buckets == (2, 8)
