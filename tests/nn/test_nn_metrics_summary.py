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


def _row(lines, first_cell):
    """The index of the first table line whose first cell is ``first_cell``."""
    return next(i for i, ln in enumerate(lines) if ln.startswith("│") and ln.split("│")[1].strip() == first_cell)


def test_tabulate_rows_per_call_with_counts_and_totals():
    m = MLP(nn.Rngs(0))
    lines = nn.tabulate(m, jnp.ones((3, 4))).splitlines()
    assert lines[0].strip() == "MLP Summary"
    assert lines[1].startswith("┏") and lines[3].startswith("┡") and lines[-3].startswith("└")
    header = [c.strip() for c in lines[2].split("┃")[1:-1]]
    assert header == ["path", "type", "inputs", "outputs", "BatchStat", "Param"]
    root = lines[_row(lines, "")]
    assert "MLP" in root and "float32[3,4]" in root and "float32[3,2]" in root
    # root: 4*8+8 + 8*2+2 = 58 params (232 B), two int32 counters (8 B)
    assert "58 (232 B)" in root and "2 (8 B)" in root
    i = _row(lines, "l1")
    block = lines[i:i + 4]
    assert "Lin" in block[0] and "float32[3,8]" in block[0]
    assert "kernel: float32[4,8]" in block[0] and "bias: float32[8]" in block[1]
    assert "count: int32[]" in block[0] and "40 (160 B)" in block[3]
    total = next(ln for ln in lines if "Total" in ln and ln.startswith("│"))
    assert "58 (232 B)" in total and "2 (8 B)" in total
    assert lines[-1].strip() == "Total Parameters: 60 (240 B)" and lines[-2] == ""
    # rows are the calls, in call order, separated by rules
    assert sum(ln.startswith("├─") for ln in lines) == 3  # three rows + the footer
    # the model itself was not run or changed
    assert int(m.l1.count.value) == 0
    with pytest.raises(TypeError, match="expected a Module"):
        nn.tabulate(3)


def test_tabulate_flops_against_the_matmul_count():
    lin = nn.Linear(5, 7, rngs=nn.Rngs(0))
    lines = nn.tabulate(lin, jnp.ones((3, 5)), compute_flops=True, compute_vjp_flops=True).splitlines()
    header = [c.strip() for c in lines[2].split("┃")[1:-1]]
    assert header[4:6] == ["flops", "vjp_flops"]
    cells = [c.strip() for c in lines[4].split("│")[1:-1]]
    # y = x @ W + b: 2*m*k*n multiply-adds plus m*n bias adds
    assert int(cells[4]) == 2 * 3 * 5 * 7 + 3 * 7
    assert int(cells[5]) > int(cells[4])  # the VJP holds the forward and two more matmuls
    assert "Total" in [c.strip() for c in lines[-4].split("│")[1:-1]][5]


def test_tabulate_methods_depth_inputs_and_one_trace_per_call():
    traced = []

    class Inner(nn.Module):
        def __init__(self, rngs):
            self.lin = nn.Linear(2, 2, rngs=rngs)

        def __call__(self, x, *, opts=None):
            traced.append(1)
            return self.lin(x)

    class Outer(nn.Module):
        def __init__(self, rngs):
            self.a = Inner(rngs)
            self.b = Inner(rngs)
            self.w = nn.Param(jnp.ones((2,)), description="scale", owner=Custom())

        def helper(self, cfg, x):
            return self.b(x, opts=None) * self.w[...]

        def __call__(self, x):
            return x, self.helper({}, self.a(x, opts={}))

    class Custom:
        def __repr__(self):
            return "<custom>"

    m = Outer(nn.Rngs(0))
    out = nn.tabulate(m, jnp.zeros((1, 2)), console_kwargs={"width": 80, "no_color": True})
    lines = out.splitlines()
    assert len(traced) == 2  # each call's body traced once
    paths = [ln.split("│")[1].strip() for ln in lines if ln.startswith("│")]
    firsts = [p for p in paths if p]
    assert firsts == ["a", "a/lin", "helper", "b", "b/lin"]
    assert "opts: {}" in out and "opts: None" in out and "- {}" in out
    assert "- float32[1,2]" in lines[_row(lines, "")]  # a tuple output is a list
    # a variable with metadata shows its value and the metadata (reprs)
    assert "description: scale" in out and "owner: <custom>" in out and "value: float32[2]" in out
    shallow = nn.tabulate(m, jnp.zeros((1, 2)), depth=1)
    assert "a/lin" not in shallow and "helper" in shallow
    named = nn.tabulate(m.a, jnp.zeros((1, 2)), row_filter=lambda r: r.type is not nn.Linear)
    assert "lin" not in [ln.split("│")[1].strip() for ln in named.splitlines() if ln.startswith("│")]
    with pytest.raises(ValueError, match="table_kwargs"):
        nn.tabulate(m, jnp.zeros((1, 2)), table_kwargs={"box": None})
    with pytest.raises(AttributeError, match="no method 'nope'"):
        nn.tabulate(m, jnp.zeros((1, 2)), method="nope")
