"""Schedules against their closed forms (float64 NumPy), under jit, and properties.

Each reference below is written from the published formula, one step at a time
in float64 Python/NumPy, independently of the implementation. The schedules are
evaluated in float32; tolerance rtol=2e-6, atol=1e-6 (a few float32 ulps).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import optim

RTOL, ATOL = 2e-6, 1e-6
HSET = settings(max_examples=25, deadline=None)


# --- float64 references, one step at a time ---


def ref_polynomial(t, init, end, power, steps, begin=0):
    if steps == 0:
        return init
    if t <= begin:
        return init
    if t >= begin + steps:
        return end
    return (init - end) * (1.0 - (t - begin) / steps) ** power + end


def ref_exponential(t, init, steps, rate, begin=0, staircase=False, end=None):
    if steps == 0 or rate == 0:
        return init
    k = max(t - begin, 0) / steps
    if staircase:
        k = math.floor(k)
    v = init * rate**k
    if end is not None:
        v = max(v, end) if rate < 1 else min(v, end)
    return v


def ref_cosine(t, init, decay_steps, alpha=0.0, exponent=1.0):
    t = min(t, decay_steps)
    c = 0.5 * (1 + math.cos(math.pi * t / decay_steps))
    return init * ((1 - alpha) * c**exponent + alpha)


def ref_piecewise_constant(t, init, bs):
    v = init
    for b in sorted(bs):
        if t >= b:
            v *= bs[b]
    return v


def ref_piecewise_interpolate(t, kind, init, bs):
    t = max(t, 0)
    bounds = sorted(bs)
    values = [init]
    for b in bounds:
        values.append(values[-1] * bs[b])
    lo = 0
    for i, hi in enumerate(bounds):
        if t < hi:
            x = (t - lo) / max(hi - lo, 1)
            a, b = values[i], values[i + 1]
            if kind == "linear":
                return a + (b - a) * x
            return b + (a - b) / 2 * (1 + math.cos(math.pi * x))
        lo = hi
    return values[-1]


def ref_warmup_cosine(t, init, peak, warmup, decay, end=0.0, exponent=1.0):
    if t < warmup:
        return init + (peak - init) * t / warmup
    d = decay - warmup
    tau = min(t - warmup, d)
    c = (0.5 * (1 + math.cos(math.pi * tau / d))) ** exponent
    if peak == 0:
        return 0.0
    return end + (peak - end) * c


def ref_onecycle_linear(t, n, peak, ps=0.3, pf=0.85, div=25.0, fdiv=1e4):
    v0 = peak / div
    knots = [(0, v0), (int(ps * n), peak), (int(pf * n), v0), (n, v0 / fdiv)]
    if t >= n:
        return v0 / fdiv
    for (t0, a), (t1, b) in zip(knots, knots[1:]):
        if t0 <= t < t1:
            return a + (b - a) * (t - t0) / max(t1 - t0, 1)
    raise AssertionError


def ref_onecycle_cosine(t, n, peak, ps=0.3, div=25.0, fdiv=1e4):
    v0 = peak / div
    knots = [(0, v0), (int(ps * n), peak), (n, v0 / fdiv)]
    if t >= n:
        return v0 / fdiv
    for (t0, a), (t1, b) in zip(knots, knots[1:]):
        if t0 <= t < t1:
            x = (t - t0) / max(t1 - t0, 1)
            return b + (a - b) * 0.5 * (1 + math.cos(math.pi * x))
    raise AssertionError


def check_all_steps(schedule, ref, steps):
    """Every step eagerly on an int32 vector, under jit with a traced step vector,
    and a few steps as Python ints and NumPy int32 scalars."""
    steps = np.asarray(steps)
    want = np.array([ref(int(t)) for t in steps], np.float64)
    vec = jnp.asarray(steps, jnp.int32)
    eager = np.broadcast_to(np.asarray(schedule(vec), np.float64), want.shape)
    np.testing.assert_allclose(eager, want, rtol=RTOL, atol=ATOL)
    traced = np.broadcast_to(np.asarray(jax.jit(schedule)(vec), np.float64), want.shape)
    np.testing.assert_allclose(traced, want, rtol=RTOL, atol=ATOL)
    few = np.unique(np.linspace(0, len(steps) - 1, 6).astype(int))
    for i in few:
        np.testing.assert_allclose(float(schedule(int(steps[i]))), want[i], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(schedule(np.int32(steps[few[1]]))), want[few[1]], rtol=RTOL, atol=ATOL)


# --- closed forms at every step over a range that covers the boundaries ---

STEPS = np.arange(0, 260)


def test_constant():
    check_all_steps(optim.constant_schedule(0.25), lambda t: 0.25, STEPS)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "power,begin",
    [(0.5, 0), (2.0, 17), pytest.param(1.0, 0, marks=SLOW), pytest.param(3.5, 17, marks=SLOW)],
)
def test_polynomial(power, begin):
    s = optim.polynomial_schedule(1.5, 0.01, power, transition_steps=100, transition_begin=begin)
    check_all_steps(s, lambda t: ref_polynomial(t, 1.5, 0.01, power, 100, begin), STEPS)


@pytest.mark.parametrize("begin", [0, 33])
def test_linear(begin):
    s = optim.linear_schedule(0.0, 2.0, transition_steps=150, transition_begin=begin)
    check_all_steps(s, lambda t: ref_polynomial(t, 0.0, 2.0, 1.0, 150, begin), STEPS)


def test_zero_transition_steps_holds_init_value():
    for s in (
        optim.linear_schedule(0.7, 0.0, transition_steps=0),
        optim.polynomial_schedule(0.7, 0.0, 2.0, transition_steps=0),
        optim.exponential_decay(0.7, transition_steps=0, decay_rate=0.5),
        optim.exponential_decay(0.7, transition_steps=10, decay_rate=0.0),
        optim.warmup_constant_schedule(0.7, 1.0, warmup_steps=0),
    ):
        check_all_steps(s, lambda t: 0.7, [0, 1, 10, 1000])


@pytest.mark.parametrize(
    "kw",
    [
        dict(transition_steps=30, decay_rate=0.7),
        dict(transition_steps=30, decay_rate=0.7, transition_begin=10, end_value=0.3),
        dict(transition_steps=25, decay_rate=0.5, staircase=True),
        dict(transition_steps=40, decay_rate=1.2, end_value=5.0),
        dict(transition_steps=40, decay_rate=1.2, staircase=True, transition_begin=7),
    ],
)
def test_exponential_decay(kw):
    s = optim.exponential_decay(2.0, **kw)
    ref_kw = dict(
        steps=kw["transition_steps"],
        rate=kw["decay_rate"],
        begin=kw.get("transition_begin", 0),
        staircase=kw.get("staircase", False),
        end=kw.get("end_value"),
    )
    check_all_steps(s, lambda t: ref_exponential(t, 2.0, **ref_kw), STEPS)


@pytest.mark.parametrize(
    "alpha,exponent",
    [(0.1, 1.0), (0.2, 0.5), pytest.param(0.0, 1.0, marks=SLOW), pytest.param(0.05, 2.0, marks=SLOW)],
)
def test_cosine_decay(alpha, exponent):
    s = optim.cosine_decay_schedule(3.0, decay_steps=200, alpha=alpha, exponent=exponent)
    check_all_steps(s, lambda t: ref_cosine(t, 3.0, 200, alpha, exponent), STEPS)


def test_piecewise_constant():
    bs = {10: 0.5, 50: 0.1, 51: 3.0, 200: 0.0}
    s = optim.piecewise_constant_schedule(1.0, bs)
    check_all_steps(s, lambda t: ref_piecewise_constant(t, 1.0, bs), STEPS)
    check_all_steps(optim.piecewise_constant_schedule(0.3), lambda t: 0.3, [0, 5, 99])


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize(
    "bs", [{4: 0.1, 8: 0.01}, {0: 2.0, 10: 0.5, 50: 0.1, 51: 3.0}, {100: 4.0, 230: 0.25}, {}]
)
def test_piecewise_interpolate(kind, bs):
    s = optim.piecewise_interpolate_schedule(kind, 1.0, bs)
    check_all_steps(s, lambda t: ref_piecewise_interpolate(t, kind, 1.0, bs), STEPS)


@pytest.mark.parametrize("warmup,end,exponent", [(17, 0.05, 1.0), (0, 0.0, 1.0), (40, 0.2, 2.0)])
def test_warmup_cosine_decay(warmup, end, exponent):
    s = optim.warmup_cosine_decay_schedule(0.1, 1.0, warmup, 150, end_value=end, exponent=exponent)
    check_all_steps(s, lambda t: ref_warmup_cosine(t, 0.1, 1.0, warmup, 150, end, exponent), STEPS)


def test_warmup_cosine_zero_peak_is_zero_after_warmup():
    s = optim.warmup_cosine_decay_schedule(0.5, 0.0, 10, 50, end_value=0.3)
    check_all_steps(s, lambda t: ref_warmup_cosine(t, 0.5, 0.0, 10, 50, 0.3), np.arange(0, 80))


def test_warmup_exponential_decay():
    s = optim.warmup_exponential_decay_schedule(
        0.1, 1.0, 17, transition_steps=20, decay_rate=0.5, transition_begin=5,
        staircase=True, end_value=0.01,
    )

    def ref(t):
        if t < 17:
            return 0.1 + 0.9 * t / 17
        return ref_exponential(t - 17, 1.0, 20, 0.5, 5, True, 0.01)

    check_all_steps(s, ref, STEPS)


def test_warmup_constant():
    s = optim.warmup_constant_schedule(0.1, 1.0, warmup_steps=30)
    check_all_steps(s, lambda t: 0.1 + 0.9 * min(t, 30) / 30, STEPS)


@pytest.mark.parametrize("n", [200, 7, 2])
def test_linear_onecycle(n):
    s = optim.linear_onecycle_schedule(n, peak_value=3.0)
    check_all_steps(s, lambda t: ref_onecycle_linear(t, n, 3.0), np.arange(0, n + 20))


@pytest.mark.parametrize("n,pct", [(200, 0.25), (10, 0.3), (50, 0.0), (50, 0.9)])
def test_cosine_onecycle(n, pct):
    s = optim.cosine_onecycle_schedule(n, peak_value=3.0, pct_start=pct)
    check_all_steps(s, lambda t: ref_onecycle_cosine(t, n, 3.0, pct), np.arange(0, n + 20))


def test_join_schedules():
    s = optim.join_schedules(
        [
            optim.constant_schedule(1.0),
            optim.linear_schedule(1.0, 0.0, 30),
            optim.cosine_decay_schedule(0.5, 40),
        ],
        [20, 60],
    )

    def ref(t):
        if t < 20:
            return 1.0
        if t < 60:
            return ref_polynomial(t - 20, 1.0, 0.0, 1.0, 30)
        return ref_cosine(t - 60, 0.5, 40)

    check_all_steps(s, ref, STEPS)
    single = optim.join_schedules([optim.linear_schedule(1.0, 0.0, 10)], [])
    check_all_steps(single, lambda t: ref_polynomial(t, 1.0, 0.0, 1.0, 10), np.arange(15))


def test_sgdr():
    cycles = [
        dict(init_value=0.0, peak_value=1.0, warmup_steps=5, decay_steps=50),
        dict(init_value=0.1, peak_value=0.5, warmup_steps=0, decay_steps=70, end_value=0.05),
        dict(init_value=0.0, peak_value=0.2, warmup_steps=10, decay_steps=30, exponent=2.0),
    ]
    s = optim.sgdr_schedule(cycles)

    def ref(t):
        start = 0
        for i, c in enumerate(cycles):
            last = i == len(cycles) - 1
            if t < start + c["decay_steps"] or last:
                return ref_warmup_cosine(
                    t - start, c["init_value"], c["peak_value"], c["warmup_steps"],
                    c["decay_steps"], c.get("end_value", 0.0), c.get("exponent", 1.0),
                )
            start += c["decay_steps"]
        raise AssertionError

    check_all_steps(s, ref, STEPS)


def test_float64_steps_and_values_under_x64():
    with jax.enable_x64(True):
        s = optim.cosine_decay_schedule(1.0, decay_steps=10**9, alpha=0.0)
        t = jnp.asarray(123_456_789, jnp.int64)
        v = jax.jit(s)(t)
        assert v.dtype == jnp.float64
        np.testing.assert_allclose(float(v), ref_cosine(123_456_789, 1.0, 10**9), rtol=1e-12)


def test_traced_step_compiles_once():
    traces = []
    s = optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 100)

    @jax.jit
    def f(step):
        traces.append(1)
        return s(step)

    vals = [float(f(jnp.asarray(t, jnp.int32))) for t in range(0, 120, 7)]
    assert len(traces) == 1
    np.testing.assert_allclose(
        vals, [ref_warmup_cosine(t, 0.0, 1.0, 10, 100) for t in range(0, 120, 7)],
        rtol=RTOL, atol=ATOL,
    )


def test_schedule_inside_scan_of_steps():
    s = optim.piecewise_constant_schedule(1.0, {3: 0.5, 6: 0.5})

    def body(c, _):
        return c + 1, s(c)

    _, out = jax.lax.scan(body, jnp.asarray(0, jnp.int32), None, length=8)
    np.testing.assert_allclose(out, [1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25])


# --- properties ---

values = st.floats(1e-4, 10.0)
nsteps = st.integers(1, 300)


_GRID = jnp.arange(512, dtype=jnp.int32)  # one shape, so eager ops hit the compile cache


def _vals(s, n):
    assert n <= 512
    return np.broadcast_to(np.asarray(s(_GRID), np.float64), (512,))[:n]


@HSET
@given(init=values, end=values, power=st.floats(0.25, 4.0), steps=nsteps, begin=st.integers(0, 50))
def test_polynomial_monotone_and_endpoints(init, end, power, steps, begin):
    s = optim.polynomial_schedule(init, end, power, steps, begin)
    v = _vals(s, begin + steps + 5)
    d = np.diff(v) * np.sign(end - init)
    assert np.all(d >= -1e-6 * max(init, end))
    np.testing.assert_allclose(v[: begin + 1], init, rtol=1e-6)
    np.testing.assert_allclose(v[begin + steps :], end, rtol=1e-5)
    assert np.all(v >= min(init, end) * (1 - 1e-6)) and np.all(v <= max(init, end) * (1 + 1e-6))


@HSET
@given(init=values, steps=nsteps, alpha=st.floats(0.0, 1.0), exponent=st.floats(0.5, 3.0))
def test_cosine_monotone_and_endpoints(init, steps, alpha, exponent):
    s = optim.cosine_decay_schedule(init, steps, alpha=alpha, exponent=exponent)
    v = _vals(s, steps + 5)
    assert np.all(np.diff(v) <= 1e-6 * init)
    np.testing.assert_allclose(v[0], init, rtol=1e-6)
    np.testing.assert_allclose(v[steps:], alpha * init, rtol=1e-5, atol=1e-6 * init)


@HSET
@given(
    init=values, peak=values, end=st.floats(0.0, 1e-4), warmup=st.integers(0, 100),
    extra=st.integers(1, 200),
)
def test_warmup_cosine_continuity_at_join(init, peak, end, warmup, extra):
    decay = warmup + extra
    s = optim.warmup_cosine_decay_schedule(init, peak, warmup, decay, end_value=end)
    v = _vals(s, decay + 3)
    np.testing.assert_allclose(v[warmup], peak, rtol=1e-5)  # the join reaches the peak
    np.testing.assert_allclose(v[0], init if warmup else peak, rtol=1e-5)
    np.testing.assert_allclose(v[decay:], end, rtol=1e-4, atol=1e-6 * peak)
    # continuity: neighbouring steps differ by at most one step of either piece
    if warmup:
        assert abs(v[warmup] - v[warmup - 1]) <= abs(peak - init) / warmup * (1 + 1e-4) + 1e-6
    inc = np.diff(v[: warmup + 1]) * np.sign(peak - init)
    assert np.all(inc >= -1e-6 * peak)
    assert np.all(np.diff(v[warmup:]) <= 1e-6 * peak)


@HSET
@given(
    init=values, rate=st.floats(0.05, 0.99), steps=st.integers(1, 100), begin=st.integers(0, 30),
    staircase=st.booleans(),
)
def test_exponential_monotone_and_bounded(init, rate, steps, begin, staircase):
    end = init * rate**3
    s = optim.exponential_decay(init, steps, rate, begin, staircase, end_value=end)
    v = _vals(s, begin + 4 * steps + 2)
    assert np.all(np.diff(v) <= 1e-6 * init)
    assert np.all(v >= end * (1 - 1e-6))
    np.testing.assert_allclose(v[: begin + 1], init, rtol=1e-6)


@HSET
@given(
    init=values,
    bs=st.dictionaries(st.integers(0, 150), st.floats(0.0, 3.0), max_size=5),
    kind=st.sampled_from(["linear", "cosine"]),
)
def test_piecewise_interpolate_hits_knots_and_stays_between(init, bs, kind):
    s = optim.piecewise_interpolate_schedule(kind, init, bs)
    v = _vals(s, 160)
    acc = init
    for b in sorted(bs):
        acc *= bs[b]
        np.testing.assert_allclose(v[b], acc, rtol=1e-5, atol=1e-7)
    knots = [init] + [init * np.prod([bs[k] for k in sorted(bs)[: i + 1]]) for i in range(len(bs))]
    assert np.all(v >= min(knots) * (1 - 1e-5) - 1e-7)
    assert np.all(v <= max(knots) * (1 + 1e-5) + 1e-7)


@HSET
@given(n=st.integers(10, 400), peak=values, ps=st.floats(0.05, 0.5), pf=st.floats(0.55, 0.95))
def test_onecycle_peak_and_final(n, peak, ps, pf):
    lin = optim.linear_onecycle_schedule(n, peak, pct_start=ps, pct_final=pf)
    cos = optim.cosine_onecycle_schedule(n, peak, pct_start=ps)
    for s in (lin, cos):
        v = _vals(s, n + 3)
        np.testing.assert_allclose(v[int(ps * n)], peak, rtol=1e-5)
        np.testing.assert_allclose(v.max(), peak, rtol=1e-5)
        if int(ps * n) > 0:
            np.testing.assert_allclose(v[0], peak / 25.0, rtol=1e-5)
        np.testing.assert_allclose(v[n:], peak / 25.0 / 1e4, rtol=1e-4)


@HSET
@given(lengths=st.lists(st.integers(2, 60), min_size=1, max_size=4), peak=values)
def test_sgdr_restarts_at_each_cycle(lengths, peak):
    cycles = [dict(init_value=peak, peak_value=peak, warmup_steps=0, decay_steps=n) for n in lengths]
    s = optim.sgdr_schedule(cycles)
    v = _vals(s, sum(lengths) + 2)
    start = 0
    for n in lengths:
        np.testing.assert_allclose(v[start], peak, rtol=1e-5)  # restart value
        assert v[start + n - 1] < peak
        start += n


@HSET
@given(
    b1=st.integers(0, 100), b2=st.integers(0, 100), c=values,
)
def test_join_is_continuous_when_pieces_meet(b1, b2, c):
    lo, hi = sorted((b1, b2))
    # piecewise linear ramp built from three pieces that meet at the joins
    s = optim.join_schedules(
        [
            optim.linear_schedule(0.0, c, max(lo, 1)) if lo else optim.constant_schedule(0.0),
            optim.constant_schedule(c if lo else 0.0),
            optim.linear_schedule(c if lo else 0.0, 0.0, 50),
        ],
        [lo, hi],
    )
    v = _vals(s, hi + 60)
    step = c / max(lo, 1) + c / 50
    assert np.all(np.abs(np.diff(v)) <= step * (1 + 1e-5) + 1e-6)


# --- eager argument checks name the argument ---


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: optim.linear_schedule(1.0, 0.0, transition_steps=-1), ValueError, "transition_steps"),
        (lambda: optim.linear_schedule(1.0, 0.0, 10, transition_begin=-3), ValueError, "transition_begin"),
        (lambda: optim.polynomial_schedule(1.0, 0.0, 2.0, transition_steps=-5), ValueError, "transition_steps"),
        (lambda: optim.polynomial_schedule(1.0, 0.0, 2.0, 10.5), TypeError, "transition_steps"),
        (lambda: optim.polynomial_schedule(float("nan"), 0.0, 2.0, 10), ValueError, "init_value"),
        (lambda: optim.exponential_decay(1.0, -1, 0.5), ValueError, "transition_steps"),
        (lambda: optim.exponential_decay(1.0, 10, -0.5), ValueError, "decay_rate"),
        (lambda: optim.exponential_decay(1.0, 10, 0.5, transition_begin=-1), ValueError, "transition_begin"),
        (lambda: optim.cosine_decay_schedule(1.0, 0), ValueError, "decay_steps"),
        (lambda: optim.cosine_decay_schedule(1.0, -10), ValueError, "decay_steps"),
        (lambda: optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 10), ValueError, "decay_steps"),
        (lambda: optim.warmup_cosine_decay_schedule(0.0, 1.0, -1, 10), ValueError, "warmup_steps"),
        (lambda: optim.warmup_constant_schedule(0.0, 1.0, -2), ValueError, "warmup_steps"),
        (lambda: optim.warmup_exponential_decay_schedule(0.0, 1.0, -1, 10, 0.5), ValueError, "warmup_steps"),
        (lambda: optim.warmup_exponential_decay_schedule(0.0, 1.0, 5, -10, 0.5), ValueError, "transition_steps"),
        (lambda: optim.piecewise_constant_schedule(1.0, {10: -0.5}), ValueError, r"boundaries_and_scales\[10\]"),
        (lambda: optim.piecewise_constant_schedule(1.0, {-10: 0.5}), ValueError, "boundary -10"),
        (lambda: optim.piecewise_constant_schedule(1.0, [(10, 0.5)]), TypeError, "boundaries_and_scales"),
        (lambda: optim.piecewise_interpolate_schedule("quadratic", 1.0, {}), ValueError, "interpolate_type"),
        (lambda: optim.piecewise_interpolate_schedule("linear", 1.0, {5: float("inf")}), ValueError, r"\[5\]"),
        (lambda: optim.linear_onecycle_schedule(0, 1.0), ValueError, "transition_steps"),
        (lambda: optim.linear_onecycle_schedule(100, 1.0, pct_start=1.5), ValueError, "pct_start"),
        (lambda: optim.linear_onecycle_schedule(100, 1.0, pct_start=0.5, pct_final=0.4), ValueError, "pct_final"),
        (lambda: optim.cosine_onecycle_schedule(-1, 1.0), ValueError, "transition_steps"),
        (lambda: optim.cosine_onecycle_schedule(100, 1.0, div_factor=0.0), ValueError, "div_factor"),
        (lambda: optim.join_schedules([optim.constant_schedule(1.0)] * 3, [5]), ValueError, "boundaries"),
        (lambda: optim.join_schedules([], []), ValueError, "schedules"),
        (lambda: optim.join_schedules([optim.constant_schedule(1.0)] * 3, [10, 5]), ValueError, r"boundaries\[1\]"),
        (lambda: optim.join_schedules([optim.constant_schedule(1.0)] * 2, [-1]), ValueError, r"boundaries\[0\]"),
        (lambda: optim.join_schedules([1.0, optim.constant_schedule(1.0)], [3]), TypeError, r"schedules\[0\]"),
        (lambda: optim.sgdr_schedule([]), ValueError, "cosine_kwargs"),
        (lambda: optim.sgdr_schedule([dict(init_value=0.0, peak_value=1.0, warmup_steps=1)]), ValueError, "decay_steps"),
        (
            lambda: optim.sgdr_schedule(
                [dict(init_value=0.0, peak_value=1.0, warmup_steps=5, decay_steps=50),
                 dict(init_value=0.0, peak_value=1.0, warmup_steps=20, decay_steps=10)]
            ),
            ValueError, r"cosine_kwargs\[1\].*decay_steps",
        ),
    ],
)
def test_bad_arguments_raise_naming_the_argument(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_traced_transition_steps_is_rejected_with_a_clear_error():
    def build(n):
        return optim.linear_schedule(1.0, 0.0, n)(3)

    with pytest.raises(TypeError, match="transition_steps.*concrete"):
        jax.jit(build)(10)


def test_traced_values_are_allowed():
    # Values (not step counts) may be traced: a learning-rate sweep under vmap.
    def at(lr, step):
        return optim.warmup_cosine_decay_schedule(0.0, lr, 10, 100, end_value=0.0)(step)

    lrs = jnp.array([0.1, 1.0, 3.0])
    got = jax.jit(jax.vmap(at, in_axes=(0, None)))(lrs, jnp.asarray(55, jnp.int32))
    np.testing.assert_allclose(
        got, [ref_warmup_cosine(55, 0.0, float(lr), 10, 100) for lr in lrs], rtol=1e-5
    )
