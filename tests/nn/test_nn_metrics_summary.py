"""Metrics against NumPy; tabulate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import nn


@settings(max_examples=15, deadline=None)
@given(
    batches=st.lists(
        st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=20),
        min_size=1,
        max_size=6,
    )
)
@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_average_and_welford_match_numpy(batches):
    avg = nn.metrics.Average()
    wf = nn.metrics.Welford()
    for b in batches:
        avg.update(values=jnp.asarray(b, jnp.float32))
        wf.update(values=jnp.asarray(b, jnp.float32))
    allv = np.concatenate([np.asarray(b, np.float64) for b in batches])
    # float32 accumulation: relative 1e-5 of the scale of the data
    scale = max(1.0, float(np.abs(allv).max()))
    np.testing.assert_allclose(float(avg.compute()), allv.mean(), atol=1e-5 * scale)
    stats = wf.compute()
    np.testing.assert_allclose(float(stats.mean), allv.mean(), atol=1e-5 * scale)
    np.testing.assert_allclose(float(stats.standard_deviation), allv.std(), atol=1e-4 * scale)
    np.testing.assert_allclose(
        float(stats.standard_error_of_mean), allv.std() / np.sqrt(allv.size), atol=1e-4 * scale
    )


def test_accuracy_and_multimetric_and_reset():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 10, 5)).astype(np.float32)
    labels = rng.integers(0, 5, size=(3, 10))
    acc = nn.metrics.Accuracy()
    multi = nn.MultiMetric(accuracy=nn.metrics.Accuracy(), loss=nn.metrics.Average("loss"))
    losses = rng.uniform(size=3)
    for i in range(3):
        acc.update(logits=logits[i], labels=labels[i])
        multi.update(logits=logits[i], labels=labels[i], loss=losses[i])
    ref = (logits.argmax(-1) == labels).mean()
    np.testing.assert_allclose(float(acc.compute()), ref, rtol=1e-6)
    out = multi.compute()
    np.testing.assert_allclose(float(out["accuracy"]), ref, rtol=1e-6)
    np.testing.assert_allclose(float(out["loss"]), losses.mean(), rtol=1e-6)
    multi.reset()
    assert np.isnan(float(multi.compute()["loss"]))
    binary = nn.metrics.Accuracy(threshold=0.0)
    binary.update(logits=jnp.array([0.5, -1.0, 2.0]), labels=jnp.array([1, 1, 1]))
    np.testing.assert_allclose(float(binary.compute()), 2 / 3, rtol=1e-6)


def test_metrics_errors_and_jit():
    acc = nn.metrics.Accuracy()
    with pytest.raises(TypeError, match="expected keyword argument 'labels'"):
        acc.update(logits=jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"logits shape \(2, 3\) must be labels shape \(3,\)"):
        acc.update(logits=jnp.zeros((2, 3)), labels=jnp.zeros((3,), jnp.int32))
    with pytest.raises(TypeError, match="labels must be integers"):
        acc.update(logits=jnp.zeros((2, 3)), labels=jnp.zeros((2,)))
    with pytest.raises(TypeError, match="not a Metric"):
        nn.MultiMetric(a=3)
    avg = nn.metrics.Average()
    step = nn.jit(lambda m, v: m.update(values=v))
    for v in (1.0, 2.0, 6.0):
        step(avg, jnp.array([v]))
    np.testing.assert_allclose(float(avg.compute()), 3.0)


class Lin(nn.Module):
    def __init__(self, din, dout, rngs):
        self.kernel = nn.Param(jax.random.normal(rngs.params(), (din, dout)))
        self.bias = nn.Param(jnp.zeros((dout,)))
        self.count = nn.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        return x @ self.kernel + self.bias


class MLP(nn.Module):
    def __init__(self, rngs):
        self.l1 = Lin(4, 8, rngs)
        self.l2 = Lin(8, 2, rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def test_tabulate():
    m = MLP(nn.Rngs(0))
    table = nn.tabulate(m, jnp.ones((3, 4)))
    lines = table.splitlines()
    assert lines[0].split("|")[0].strip() == "path"
    row = next(line for line in lines if line.startswith(" l1 "))
    assert "Lin" in row and "float32[3, 8]" in row and "40" in row  # 4*8+8 params
    total = next(line for line in lines if line.startswith(" total"))
    assert "58" in total  # 40 + 18 params
    assert "2" in total  # two int32 counters
    root = next(line for line in lines if line.startswith(" <root>"))
    assert "float32[3, 2]" in root
    # the model itself was not run or changed
    assert int(m.l1.count.value) == 0
    with pytest.raises(TypeError, match="expected a Module"):
        nn.tabulate(3)
