"""Loop transforms: ``nn.scan`` traces its step once per argument structure, and a loop
step must return the carry objects it was given (Flax NNX's carry identity check)."""

import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn


class Acc(nn.Module):
    def __init__(self):
        self.total = nn.BatchStat(jnp.zeros((), jnp.float32))
        self.w = nn.Param(jnp.arange(3.0))


def test_scan_traces_its_step_once_per_structure():
    traces = []

    @nn.scan
    def step(c, x):
        traces.append(x.shape)
        return c + x.sum(), x * 2.0

    xs = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    c, _ = step(jnp.float32(1.0), xs)
    c2, ys2 = step(c, xs)
    assert len(traces) == 1  # the second call with the same structure reuses the trace
    assert float(c) == 1.0 + xs.sum() and float(c2) == 1.0 + 2 * xs.sum()
    np.testing.assert_array_equal(ys2, xs * 2)
    step(c, xs[:, :2])  # other shapes: traced again
    assert len(traces) == 2


def test_scan_with_a_module_carry_traces_once_and_writes_back():
    traces = [0]

    @nn.scan
    def step(acc, x):
        traces[0] += 1
        acc.total.value += x @ acc.w.value
        return acc, acc.total.value

    acc = Acc()
    xs = np.arange(15.0, dtype=np.float32).reshape(5, 3)
    out, ys = step(acc, xs)
    assert out is acc and out.total is acc.total  # the caller's objects come back
    expect = np.cumsum(xs @ np.arange(3.0))
    np.testing.assert_allclose(ys, expect, rtol=1e-6)
    out, ys = step(acc, xs)
    assert traces[0] == 1
    np.testing.assert_allclose(float(acc.total.value), 2 * expect[-1], rtol=1e-6)
    acc.extra = nn.BatchStat(jnp.ones(()))  # a new structure: traced again
    step(acc, xs)
    assert traces[0] == 2


def test_scan_keeps_python_leaves_static():
    # a broadcast Python int stays a Python value inside the step (used as a shape)
    f = nn.scan(lambda c, x, n: (c + jnp.ones(n).sum() * x, None), in_axes=(nn.Carry, 0, None),
                out_axes=(nn.Carry, 0))
    c, _ = f(jnp.float32(0.0), jnp.arange(3.0), 4)
    assert float(c) == 4 * (0 + 1 + 2)
    c, _ = f(jnp.float32(0.0), jnp.arange(3.0), 2)
    assert float(c) == 2 * (0 + 1 + 2)


def test_scan_step_returning_a_new_variable_raises():
    count = nn.Variable(jnp.array(0))

    @nn.scan
    def step(count, x):
        return nn.Variable(count.value + 1), x

    with pytest.raises(ValueError, match="scan Variable identity must be preserved"):
        step(count, jnp.arange(3))
    assert int(count.value) == 0


def test_scan_step_returning_a_new_module_raises():
    @nn.scan
    def step(acc, x):
        new = Acc()
        new.total.value = acc.total.value + x
        return new, x

    with pytest.raises(ValueError, match="Carry references must be the same between iterations"):
        step(Acc(), jnp.arange(3.0))


def test_while_and_fori_loop_reject_a_replaced_variable():
    lin = nn.Linear(2, 2, rngs=nn.Rngs(0))

    def body(val):
        m, c = val
        m.kernel = nn.Param(jnp.zeros_like(m.kernel.value))
        return m, c - 1.0

    with pytest.raises(ValueError, match="Carry references must be the same"):
        nn.while_loop(lambda v: v[1] > 0, body, (lin, 2.0))
    with pytest.raises(ValueError, match="Carry references must be the same"):
        nn.fori_loop(0, 2, lambda i, v: body(v), (lin, 2.0))
    # changing the carry's objects in place is the supported way
    out = nn.fori_loop(0, 3, lambda i, v: (v[0], v[1] + v[0].kernel.value.sum()), (lin, 0.0))
    assert out[0] is lin
    np.testing.assert_allclose(float(out[1]), 3 * float(np.asarray(lin.kernel.value).sum()), rtol=1e-6)
