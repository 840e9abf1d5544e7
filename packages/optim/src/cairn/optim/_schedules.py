"""Step-size schedules: functions from a step count to a hyper-parameter value.

Every factory here has the name, signature and defaults of its Optax
counterpart and returns a plain callable ``schedule(count)``. ``count`` may be a
Python int, a NumPy integer or a (traced) JAX integer array of any shape; the
value is computed with ``jax.numpy`` only, with no Python branching on
``count``, so a schedule traces once under ``jax.jit`` and is evaluated
element-wise on an array of steps.

Arguments are validated eagerly, when the schedule is built, and a bad one
raises ``ValueError`` (or ``TypeError``) naming the argument. Where Optax
silently falls back (a negative ``transition_steps`` or ``transition_begin``
only logs a message there) we raise instead; a ``transition_steps`` of exactly
0 keeps Optax's meaning of "hold ``init_value``".
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Schedule",
    "constant_schedule",
    "cosine_decay_schedule",
    "cosine_onecycle_schedule",
    "exponential_decay",
    "join_schedules",
    "linear_onecycle_schedule",
    "linear_schedule",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
    "polynomial_schedule",
    "sgdr_schedule",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
]

Schedule = Callable[[jax.typing.ArrayLike], jax.typing.ArrayLike]
"""A function mapping a step count to a value."""


# --- eager argument checks ---


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _as_int(fn: str, name: str, value: Any) -> int:
    """Returns ``value`` as a Python int, or raises naming the argument."""
    if isinstance(value, bool) or not _is_concrete(value):
        raise TypeError(
            f"{fn}: `{name}` must be a concrete integer step count, got {value!r}"
        )
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and float(value).is_integer():
        return int(value)  # type: ignore[call-overload]
    if isinstance(value, np.ndarray | jax.Array) and np.ndim(value) == 0:
        v = np.asarray(value).item()
        if float(v).is_integer():
            return int(v)
    raise TypeError(f"{fn}: `{name}` must be an integer step count, got {value!r}")


def _steps(fn: str, name: str, value: Any, *, minimum: int) -> int:
    v = _as_int(fn, name, value)
    if v < minimum:
        cmp = "non-negative" if minimum == 0 else f">= {minimum}"
        raise ValueError(f"{fn}: `{name}` must be {cmp}, got {v}")
    return v


def _real(fn: str, name: str, value: Any) -> float | None:
    """``value`` as a float when it is concrete and scalar, else None."""
    if not _is_concrete(value):
        return None
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - anything not array-like is not checkable
        return None
    if arr.ndim != 0:
        return None
    if not np.issubdtype(arr.dtype, np.number):
        raise TypeError(f"{fn}: `{name}` must be a number, got {value!r}")
    return float(arr)


def _finite_number(fn: str, name: str, value: Any) -> None:
    v = _real(fn, name, value)
    if v is not None and not math.isfinite(v):
        raise ValueError(f"{fn}: `{name}` must be finite, got {v}")


def _boundaries_and_scales(
    fn: str, boundaries_and_scales: Mapping[Any, Any] | None
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    if boundaries_and_scales is None:
        return (), ()
    if not isinstance(boundaries_and_scales, Mapping):
        raise TypeError(
            f"{fn}: `boundaries_and_scales` must be a dict {{step: scale}}, "
            f"got {type(boundaries_and_scales).__name__}"
        )
    items = []
    for key, scale in boundaries_and_scales.items():
        b = _as_int(fn, f"boundaries_and_scales key {key!r}", key)
        if b < 0:
            raise ValueError(
                f"{fn}: `boundaries_and_scales` boundary {key!r} must be a "
                "non-negative step"
            )
        s = _real(fn, f"boundaries_and_scales[{key!r}]", scale)
        if s is None:
            raise TypeError(
                f"{fn}: `boundaries_and_scales[{key!r}]` must be a concrete scalar, "
                f"got {scale!r}"
            )
        if not (s >= 0.0) or not math.isfinite(s):
            raise ValueError(
                f"{fn}: `boundaries_and_scales[{key!r}]` must be a finite "
                f"non-negative scale factor, got {s}"
            )
        items.append((b, s))
    items.sort()
    for (b0, _), (b1, _) in zip(items, items[1:]):
        if b0 == b1:
            raise ValueError(f"{fn}: `boundaries_and_scales` has step {b0} twice")
    return tuple(b for b, _ in items), tuple(s for _, s in items)


def _count(count: jax.typing.ArrayLike) -> jax.Array:
    count = jnp.asarray(count)
    if not (
        jnp.issubdtype(count.dtype, jnp.integer)
        or jnp.issubdtype(count.dtype, jnp.floating)
    ):
        raise TypeError(f"schedule: the step count must be a number, got dtype {count.dtype}")
    return count


def _float_count(count: jax.Array) -> jax.Array:
    """``count`` as a float array: the default float for integer steps (float32,
    or float64 under ``jax_enable_x64`` for 64-bit steps), at least float32."""
    if jnp.issubdtype(count.dtype, jnp.floating) and count.dtype.itemsize < 4:
        return count.astype(jnp.float32)
    return count * 1.0


def _exact_ends(elapsed, steps, init_value, end_value, value):
    """``init_value`` before and ``end_value`` after the transition, exactly.

    Inside it, ``end + (init - end) * r`` loses the low bits of the smaller
    endpoint when they differ in magnitude; the endpoints themselves are
    returned untouched (a select, not a Python branch).
    """
    value = jnp.where(elapsed <= 0, init_value, value)
    return jnp.where(elapsed >= steps, end_value, value)


# --- schedules ---


def constant_schedule(value: jax.typing.ArrayLike) -> Schedule:
    r"""A schedule that always returns ``value``.

    .. math:: v(t) = c

    Args:
      value: the value to hold (a scalar or an array).

    Returns:
      ``schedule(count) -> value``.

    >>> from cairn import optim
    >>> sched = optim.constant_schedule(0.1)
    >>> sched(0), sched(10_000)
    (0.1, 0.1)
    """
    _finite_number("constant_schedule", "value", value)

    def schedule(count: jax.typing.ArrayLike) -> jax.typing.ArrayLike:
        del count
        return value

    return schedule


def polynomial_schedule(
    init_value: jax.typing.ArrayLike,
    end_value: jax.typing.ArrayLike,
    power: jax.typing.ArrayLike,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    r"""Polynomial transition from ``init_value`` to ``end_value``.

    With :math:`I` = ``init_value``, :math:`E` = ``end_value``, :math:`P` =
    ``power``, :math:`T` = ``transition_steps`` and :math:`B` =
    ``transition_begin``:

    .. math::
       v(t) = (I - E)\,\Bigl(1 - \frac{\operatorname{clip}(t - B, 0, T)}{T}\Bigr)^{P} + E

    i.e. :math:`I` before step :math:`B` and :math:`E` from step :math:`B+T` on.

    Args:
      init_value: value before and at the start of the transition.
      end_value: value at and after the end of the transition.
      power: exponent of the polynomial.
      transition_steps: length :math:`T` of the transition, ``>= 0``. ``0``
        means no transition at all: the schedule holds ``init_value``
        (as in Optax).
      transition_begin: step :math:`B` at which the transition starts, ``>= 0``.

    Raises:
      ValueError: if ``transition_steps`` or ``transition_begin`` is negative.

    >>> from cairn import optim
    >>> sched = optim.polynomial_schedule(1.0, 0.01, power=2, transition_steps=100)
    >>> print(f"{float(sched(0)):.4f} {float(sched(50)):.4f} {float(sched(100)):.4f}")
    1.0000 0.2575 0.0100
    """
    return _transition(
        "polynomial_schedule", init_value, end_value, transition_steps, transition_begin,
        (("power", power),),
        lambda remaining: (init_value - end_value) * remaining**power + end_value,  # type: ignore[operator]
    )


def linear_schedule(
    init_value: jax.typing.ArrayLike,
    end_value: jax.typing.ArrayLike,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    r"""Linear transition from ``init_value`` to ``end_value``.

    .. math::
       v(t) = I + (E - I)\,\frac{\operatorname{clip}(t - B, 0, T)}{T}

    This is :func:`polynomial_schedule` with ``power=1``; see it for the
    arguments (``transition_steps=0`` holds ``init_value``).

    Args:
      init_value: :math:`I`, the value up to step ``transition_begin``.
      end_value: :math:`E`, the value from step ``transition_begin + transition_steps`` on.
      transition_steps: :math:`T`, the steps the transition takes (0 holds ``init_value``).
      transition_begin: :math:`B`, the step at which the transition starts.

    >>> from cairn import optim
    >>> sched = optim.linear_schedule(1.0, 0.0, transition_steps=10, transition_begin=5)
    >>> [round(float(sched(t)), 2) for t in (0, 5, 10, 15, 20)]
    [1.0, 1.0, 0.5, 0.0, 0.0]
    """
    return _transition(
        "linear_schedule", init_value, end_value, transition_steps, transition_begin, (),
        lambda remaining: end_value + (init_value - end_value) * remaining,  # type: ignore[operator]
    )


def _transition(fn, init_value, end_value, transition_steps, transition_begin, more_numbers,
                interpolate) -> Schedule:
    """A transition from ``init_value`` to ``end_value`` over ``transition_steps`` steps
    from ``transition_begin``: ``interpolate(remaining)`` inside it, where ``remaining``
    falls from 1 to 0, and the endpoints exactly outside. ``more_numbers`` are further
    ``(name, value)`` arguments that must be finite."""
    transition_steps = _steps(fn, "transition_steps", transition_steps, minimum=0)
    transition_begin = _steps(fn, "transition_begin", transition_begin, minimum=0)
    for name, v in (("init_value", init_value), ("end_value", end_value), *more_numbers):
        _finite_number(fn, name, v)
    if transition_steps == 0:
        return constant_schedule(init_value)

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        t = _float_count(_count(count))
        elapsed = jnp.clip(t - transition_begin, 0, transition_steps)
        # (T - elapsed) / T rather than 1 - elapsed / T: XLA turns the division
        # into a multiplication by 1/T, and the latter form then misses 0 at
        # the end of the transition (which matters for power < 1).
        remaining = (transition_steps - elapsed) / transition_steps
        value = interpolate(remaining)
        return _exact_ends(elapsed, transition_steps, init_value, end_value, value)

    return schedule


def piecewise_constant_schedule(
    init_value: jax.typing.ArrayLike,
    boundaries_and_scales: Mapping[int, float] | None = None,
) -> Schedule:
    r"""A constant value multiplied by a scale at each boundary passed.

    .. math:: v(t) = I \prod_{i:\, t \ge b_i} s_i

    Args:
      init_value: value before the first boundary.
      boundaries_and_scales: ``{step b_i: scale s_i}``; from step ``b_i`` on
        the value is multiplied by ``s_i``. Steps are non-negative integers,
        scales finite and non-negative.

    Raises:
      ValueError: on a negative boundary or a negative/non-finite scale.

    >>> from cairn import optim
    >>> sched = optim.piecewise_constant_schedule(1.0, {100: 0.1, 200: 0.5})
    >>> [round(float(sched(t)), 4) for t in (0, 99, 100, 199, 200)]
    [1.0, 1.0, 0.1, 0.1, 0.05]
    """
    fn = "piecewise_constant_schedule"
    _finite_number(fn, "init_value", init_value)
    bounds, scales = _boundaries_and_scales(fn, boundaries_and_scales)

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        c = _count(count)
        v = jnp.asarray(init_value)
        v = v * jnp.ones_like(c, dtype=jnp.result_type(v, jnp.float32))
        for b, s in zip(bounds, scales):
            v = jnp.where(c >= b, v * s, v)
        return v

    return schedule


def exponential_decay(
    init_value: jax.typing.ArrayLike,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: jax.typing.ArrayLike | None = None,
) -> Schedule:
    r"""Exponential decay, continuous or in steps.

    .. math::
       p(t) = \frac{\max(t - B, 0)}{T}\ \ (\lfloor\cdot\rfloor \text{ if staircase}),\qquad
       v(t) = I\,r^{p(t)}

    clipped from below by ``end_value`` when :math:`r < 1` and from above when
    :math:`r > 1`.

    Args:
      init_value: value before ``transition_begin``.
      transition_steps: :math:`T`, the number of steps per factor of
        ``decay_rate``; ``>= 0``, and ``0`` holds ``init_value`` (as in Optax).
      decay_rate: :math:`r`, ``>= 0``; ``0`` holds ``init_value`` (as in Optax).
      transition_begin: :math:`B`, step at which decay starts, ``>= 0``.
      staircase: decay in discrete jumps every ``transition_steps`` steps.
      end_value: optional bound at which the decay stops.

    Raises:
      ValueError: if ``transition_steps``, ``transition_begin`` or
        ``decay_rate`` is negative.

    >>> from cairn import optim
    >>> sched = optim.exponential_decay(1.0, transition_steps=10, decay_rate=0.5)
    >>> [round(float(sched(t)), 4) for t in (0, 5, 10, 20)]
    [1.0, 0.7071, 0.5, 0.25]
    """
    fn = "exponential_decay"
    transition_steps = _steps(fn, "transition_steps", transition_steps, minimum=0)
    transition_begin = _steps(fn, "transition_begin", transition_begin, minimum=0)
    _finite_number(fn, "init_value", init_value)
    rate = _real(fn, "decay_rate", decay_rate)
    if rate is None:
        raise TypeError(f"{fn}: `decay_rate` must be a concrete scalar, got {decay_rate!r}")
    if not (rate >= 0.0) or not math.isfinite(rate):
        raise ValueError(f"{fn}: `decay_rate` must be finite and >= 0, got {rate}")
    if end_value is not None:
        _finite_number(fn, "end_value", end_value)
    if transition_steps == 0 or rate == 0.0:
        return constant_schedule(init_value)
    bound = None
    if end_value is not None:
        bound = jnp.maximum if rate < 1.0 else jnp.minimum

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        t = _float_count(_count(count))
        elapsed = jnp.maximum(t - transition_begin, 0)
        p = elapsed / transition_steps
        if staircase:
            p = jnp.floor(p)
        value = init_value * jnp.power(jnp.asarray(rate, p.dtype), p)
        if bound is not None:
            value = bound(value, end_value)  # type: ignore[arg-type]
        return value  # type: ignore[return-value]

    return schedule


def cosine_decay_schedule(
    init_value: jax.typing.ArrayLike,
    decay_steps: int,
    alpha: jax.typing.ArrayLike = 0.0,
    exponent: jax.typing.ArrayLike = 1.0,
) -> Schedule:
    r"""Cosine decay from ``init_value`` to ``alpha * init_value``.

    .. math::
       v(t) = I\left[(1 - \alpha)\Bigl(\tfrac12\bigl(1 + \cos\tfrac{\pi \min(t, D)}{D}\bigr)\Bigr)^{p}
       + \alpha\right]

    Args:
      init_value: :math:`I`, the value at step 0.
      decay_steps: :math:`D > 0`, the length of the decay.
      alpha: final value as a fraction of ``init_value``.
      exponent: :math:`p`, applied to the cosine factor.

    Raises:
      ValueError: if ``decay_steps <= 0``.

    >>> from cairn import optim
    >>> sched = optim.cosine_decay_schedule(1.0, decay_steps=100, alpha=0.1)
    >>> [round(float(sched(t)), 4) for t in (0, 50, 100, 150)]
    [1.0, 0.55, 0.1, 0.1]
    """
    fn = "cosine_decay_schedule"
    decay_steps = _steps(fn, "decay_steps", decay_steps, minimum=1)
    for name, v in (("init_value", init_value), ("alpha", alpha), ("exponent", exponent)):
        _finite_number(fn, name, v)

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        t = jnp.minimum(_float_count(_count(count)), decay_steps)
        cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * t / decay_steps))
        return init_value * ((1.0 - alpha) * cosine**exponent + alpha)  # type: ignore[return-value]

    return schedule


def _interpolate_linear(start, end, pct):
    return start + (end - start) * pct


def _interpolate_cosine(start, end, pct):
    return end + (start - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * pct))


def piecewise_interpolate_schedule(
    interpolate_type: str,
    init_value: jax.typing.ArrayLike,
    boundaries_and_scales: Mapping[int, float] | None = None,
) -> Schedule:
    r"""Interpolates between accumulated values at the boundaries.

    With sorted boundaries :math:`b_1 < \dots < b_n`, :math:`b_0 = 0`, values
    :math:`v_0 = I` and :math:`v_i = v_{i-1} s_i`, for
    :math:`b_i \le t < b_{i+1}`

    .. math::
       v(t) = f\!\left(v_i, v_{i+1}, \frac{t - b_i}{\max(b_{i+1} - b_i, 1)}\right)

    where :math:`f(a, b, x) = a + (b - a)x` (``'linear'``) or
    :math:`b + \tfrac{a - b}{2}(1 + \cos \pi x)` (``'cosine'``), and
    :math:`v(t) = v_n` for :math:`t \ge b_n`. (Negative steps count as step 0.)

    Args:
      interpolate_type: ``'linear'`` or ``'cosine'``.
      init_value: :math:`I`, the value at step 0.
      boundaries_and_scales: ``{step b_i: scale s_i}``, non-negative integer
        steps and finite non-negative scales.

    Raises:
      ValueError: on an unknown ``interpolate_type`` or a bad boundary/scale.

    >>> from cairn import optim
    >>> sched = optim.piecewise_interpolate_schedule('linear', 1.0, {4: 0.1, 8: 0.01})
    >>> [round(float(sched(t)), 6) for t in (0, 2, 4, 6, 8, 10)]
    [1.0, 0.55, 0.1, 0.0505, 0.001, 0.001]
    """
    fn = "piecewise_interpolate_schedule"
    if interpolate_type == "linear":
        interpolate = _interpolate_linear
    elif interpolate_type == "cosine":
        interpolate = _interpolate_cosine
    else:
        raise ValueError(
            f"{fn}: `interpolate_type` must be 'linear' or 'cosine', got {interpolate_type!r}"
        )
    _finite_number(fn, "init_value", init_value)
    bounds, scales = _boundaries_and_scales(fn, boundaries_and_scales)
    values = [init_value]
    for s in scales:
        values.append(values[-1] * s)
    starts = (0,) + bounds

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        t = jnp.maximum(_float_count(_count(count)), 0)
        # Walk the segments from the last to the first: each later segment
        # overrides once t has reached its start. No branching on t.
        out = values[-1] * jnp.ones_like(t)
        for i in range(len(bounds) - 1, -1, -1):
            lo, hi = starts[i], bounds[i]
            pct = (t - lo) / max(hi - lo, 1)
            seg = interpolate(values[i], values[i + 1], pct)
            out = jnp.where(t < hi, seg, out)
        return out  # type: ignore[return-value]

    return schedule


def linear_onecycle_schedule(
    transition_steps: int,
    peak_value: jax.typing.ArrayLike,
    pct_start: float = 0.3,
    pct_final: float = 0.85,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    r"""The one-cycle policy with three linear phases (Smith, 2017).

    With :math:`N` = ``transition_steps``, :math:`P` = ``peak_value``,
    :math:`v_0 = P / \text{div\_factor}`: linear from :math:`v_0` to :math:`P`
    over :math:`[0, \lfloor p_s N\rfloor]`, back to :math:`v_0` by
    :math:`\lfloor p_f N\rfloor`, then to :math:`v_0/\text{final\_div\_factor}`
    by :math:`N`, held afterwards. (It is :func:`piecewise_interpolate_schedule`
    ``('linear', v0, {⌊p_s N⌋: div, ⌊p_f N⌋: 1/div, N: 1/final_div})``.)

    Args:
      transition_steps: :math:`N > 0`, the length of the cycle in steps.
      peak_value: :math:`P`, the value at the top of the cycle.
      pct_start: :math:`p_s`, the fraction of the cycle spent rising.
      pct_final: :math:`p_f \ge p_s`, the fraction at which the value is back at :math:`v_0`.
      div_factor: the start value is :math:`v_0 = P/\text{div\_factor}`.
      final_div_factor: the final value is :math:`v_0/\text{final\_div\_factor}`.

    Raises:
      ValueError: if ``transition_steps <= 0``, the percentages are not
        ``0 <= pct_start <= pct_final <= 1`` or a factor is not positive.

    >>> from cairn import optim
    >>> sched = optim.linear_onecycle_schedule(100, peak_value=1.0)
    >>> [round(float(sched(t)), 4) for t in (0, 30, 85, 100)]
    [0.04, 1.0, 0.04, 0.0]
    """
    fn = "linear_onecycle_schedule"
    transition_steps = _check_onecycle(fn, transition_steps, peak_value, pct_start, div_factor,
                                       final_div_factor)
    if not (pct_start <= pct_final <= 1.0):
        raise ValueError(
            f"{fn}: `pct_final` must be in [pct_start, 1] = [{pct_start}, 1], got {pct_final}"
        )
    return piecewise_interpolate_schedule(
        "linear",
        peak_value / div_factor,
        {
            int(pct_start * transition_steps): div_factor,
            int(pct_final * transition_steps): 1.0 / div_factor,
            transition_steps: 1.0 / final_div_factor,
        },
    )


def _check_onecycle(fn, transition_steps, peak_value, pct_start, div_factor, final_div_factor):
    """Checks the arguments the one-cycle schedules share; returns ``transition_steps``."""
    transition_steps = _steps(fn, "transition_steps", transition_steps, minimum=1)
    _finite_number(fn, "peak_value", peak_value)
    pct = _real(fn, "pct_start", pct_start)  # a str raises naming it, not a bare TypeError
    if pct is not None and not (0.0 <= pct <= 1.0):
        raise ValueError(f"{fn}: `pct_start` must be in [0, 1], got {pct_start}")
    for name, v in (("div_factor", div_factor), ("final_div_factor", final_div_factor)):
        v = _real(fn, name, v)
        if v is not None and (not (v > 0) or not math.isfinite(v)):
            raise ValueError(f"{fn}: `{name}` must be finite and > 0, got {v}")
    return transition_steps


def cosine_onecycle_schedule(
    transition_steps: int,
    peak_value: jax.typing.ArrayLike,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    r"""The one-cycle policy with two cosine phases (Smith, 2017).

    Cosine from :math:`P/\text{div\_factor}` up to :math:`P` over
    :math:`[0, \lfloor p_s N\rfloor]`, then cosine down to
    :math:`P/(\text{div\_factor}\cdot\text{final\_div\_factor})` by :math:`N`.
    (It is :func:`piecewise_interpolate_schedule`
    ``('cosine', P/div, {⌊p_s N⌋: div, N: 1/(div·final_div)})``.)

    Args:
      transition_steps: :math:`N > 0`, the length of the whole cycle in steps.
      peak_value: :math:`P`, the value at the top of the cycle.
      pct_start: :math:`p_s \in [0, 1]`, the fraction of the cycle spent rising.
      div_factor: the start value is :math:`P/\text{div\_factor}`.
      final_div_factor: the final value is
        :math:`P/(\text{div\_factor}\cdot\text{final\_div\_factor})`.

    Raises:
      ValueError: if ``transition_steps <= 0``, ``pct_start`` is outside
        ``[0, 1]`` or a factor is not positive.

    >>> from cairn import optim
    >>> sched = optim.cosine_onecycle_schedule(100, peak_value=1.0)
    >>> [round(float(sched(t)), 4) for t in (0, 15, 30, 100)]
    [0.04, 0.52, 1.0, 0.0]
    """
    fn = "cosine_onecycle_schedule"
    transition_steps = _check_onecycle(fn, transition_steps, peak_value, pct_start, div_factor,
                                       final_div_factor)
    return piecewise_interpolate_schedule(
        "cosine",
        peak_value / div_factor,
        {
            int(pct_start * transition_steps): div_factor,
            transition_steps: 1.0 / (div_factor * final_div_factor),
        },
    )


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    r"""Runs ``schedules`` one after another.

    For :math:`b_{i} \le t < b_{i+1}` (with :math:`b_0 = -\infty`,
    :math:`b_n = \infty`) the value is :math:`s_i(t - b_i)` (and :math:`s_0(t)`
    for the first): each schedule sees the steps since its own start.

    Args:
      schedules: ``n`` schedules.
      boundaries: ``n - 1`` non-decreasing, non-negative integer steps.

    Raises:
      ValueError: if the lengths do not match or the boundaries are negative
        or decreasing.

    >>> from cairn import optim
    >>> sched = optim.join_schedules(
    ...     [optim.constant_schedule(1.0), optim.linear_schedule(1.0, 0.0, 10)], [5])
    >>> [round(float(sched(t)), 2) for t in (0, 4, 5, 10, 15)]
    [1.0, 1.0, 1.0, 0.5, 0.0]
    """
    fn = "join_schedules"
    schedules = list(schedules)
    boundaries = list(boundaries)
    if not schedules:
        raise ValueError(f"{fn}: `schedules` must not be empty")
    for i, s in enumerate(schedules):
        if not callable(s):
            raise TypeError(f"{fn}: `schedules[{i}]` is not callable: {s!r}")
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"{fn}: `boundaries` must have len(schedules) - 1 = {len(schedules) - 1} "
            f"entries, got {len(boundaries)}"
        )
    bounds = [
        _steps(fn, f"boundaries[{i}]", b, minimum=0) for i, b in enumerate(boundaries)
    ]
    for i in range(1, len(bounds)):
        if bounds[i] < bounds[i - 1]:
            raise ValueError(
                f"{fn}: `boundaries` must be non-decreasing, but boundaries[{i}]="
                f"{bounds[i]} < boundaries[{i - 1}]={bounds[i - 1]}"
            )

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        c = _count(count)
        out = jnp.asarray(schedules[0](c))
        for b, s in zip(bounds, schedules[1:]):
            out = jnp.where(c < b, out, s(c - b))
        return out

    return schedule


def warmup_constant_schedule(
    init_value: jax.typing.ArrayLike,
    peak_value: jax.typing.ArrayLike,
    warmup_steps: int,
) -> Schedule:
    r"""Linear warm-up from ``init_value`` to ``peak_value``, then constant.

    .. math:: v(t) = I + (P - I)\,\min(t, W)/W

    Args:
      init_value: :math:`I`, the value at step 0.
      peak_value: :math:`P`, the value from step ``warmup_steps`` on.
      warmup_steps: :math:`W \ge 0`, the length of the warm-up.

    Raises:
      ValueError: if ``warmup_steps`` is negative (``0`` holds ``init_value``, as
        in Optax).

    >>> from cairn import optim
    >>> sched = optim.warmup_constant_schedule(0.0, 1.0, warmup_steps=4)
    >>> [float(sched(t)) for t in (0, 2, 4, 8)]
    [0.0, 0.5, 1.0, 1.0]
    """
    fn = "warmup_constant_schedule"
    warmup_steps = _steps(fn, "warmup_steps", warmup_steps, minimum=0)
    return linear_schedule(init_value, peak_value, transition_steps=warmup_steps)


def warmup_cosine_decay_schedule(
    init_value: jax.typing.ArrayLike,
    peak_value: jax.typing.ArrayLike,
    warmup_steps: int,
    decay_steps: int,
    end_value: jax.typing.ArrayLike = 0.0,
    exponent: jax.typing.ArrayLike = 1.0,
) -> Schedule:
    r"""Linear warm-up to ``peak_value``, then cosine decay to ``end_value``.

    For :math:`t < W`: :math:`v(t) = I + (P - I)t/W`. Then, with
    :math:`\tau = \min(t - W, D - W)` and :math:`\alpha = E/P` (``0`` when
    :math:`P = 0`):

    .. math::
       v(t) = P\left[(1 - \alpha)\Bigl(\tfrac12\bigl(1 + \cos\tfrac{\pi\tau}{D - W}\bigr)\Bigr)^{p}
       + \alpha\right]

    Args:
      init_value: :math:`I`, the value at step 0.
      peak_value: :math:`P`, the value at the end of warm-up.
      warmup_steps: :math:`W \ge 0`.
      decay_steps: :math:`D`, the TOTAL length including warm-up; ``D > W``.
      end_value: :math:`E`, the final value.
      exponent: :math:`p`, applied to the cosine factor.

    Raises:
      ValueError: if ``warmup_steps`` is negative or ``decay_steps <= warmup_steps``.

    >>> from cairn import optim
    >>> sched = optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 110, end_value=0.1)
    >>> [round(float(sched(t)), 4) for t in (0, 5, 10, 60, 110, 200)]
    [0.0, 0.5, 1.0, 0.55, 0.1, 0.1]
    """
    fn = "warmup_cosine_decay_schedule"
    warmup_steps = _steps(fn, "warmup_steps", warmup_steps, minimum=0)
    decay_steps = _as_int(fn, "decay_steps", decay_steps)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"{fn}: `decay_steps` (the total length, including warm-up) must be "
            f"greater than `warmup_steps`={warmup_steps}, got {decay_steps}"
        )
    for name, v in (("init_value", init_value), ("peak_value", peak_value),
                    ("end_value", end_value), ("exponent", exponent)):
        _finite_number(fn, name, v)
    peak = _real(fn, "peak_value", peak_value)
    if peak is not None:
        alpha = 0.0 if peak == 0.0 else end_value / peak_value
    else:  # traced peak value: the same rule without branching
        safe = jnp.where(peak_value == 0, 1.0, peak_value)
        alpha = jnp.where(peak_value == 0, 0.0, end_value / safe)
    return _after_warmup(
        init_value, peak_value, warmup_steps,
        lambda: cosine_decay_schedule(
            peak_value, decay_steps - warmup_steps, alpha=alpha, exponent=exponent
        ),
    )


def _after_warmup(init_value, peak_value, warmup_steps: int,
                  make_then: Callable[[], Schedule]) -> Schedule:
    """Linear warm-up from ``init_value`` to ``peak_value`` over ``warmup_steps``, then the
    schedule ``make_then()`` counted from the end of the warm-up (built after the warm-up,
    so the warm-up's argument errors come first)."""
    warmup = linear_schedule(init_value, peak_value, transition_steps=warmup_steps)
    return join_schedules([warmup, make_then()], [warmup_steps])


def warmup_exponential_decay_schedule(
    init_value: jax.typing.ArrayLike,
    peak_value: jax.typing.ArrayLike,
    warmup_steps: int,
    transition_steps: int,
    decay_rate: jax.typing.ArrayLike,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: jax.typing.ArrayLike | None = None,
) -> Schedule:
    r"""Linear warm-up to ``peak_value``, then :func:`exponential_decay`.

    For :math:`t < W`: :math:`v(t) = I + (P - I)t/W`; afterwards
    :math:`v(t) = \text{exponential\_decay}(P, T, r, B, \text{staircase},
    E)(t - W)`.

    Args:
      init_value: :math:`I`, the value at step 0.
      peak_value: :math:`P`, the value at the end of the warm-up (the decay's start).
      warmup_steps: :math:`W`, the length of the warm-up.
      transition_steps: :math:`T`, the decay's time scale (see :func:`exponential_decay`).
      decay_rate: :math:`r`, the factor per ``transition_steps``.
      transition_begin: :math:`B`, steps after the warm-up before the decay starts.
      staircase: decay in jumps every ``transition_steps`` steps.
      end_value: :math:`E`, a bound at which the decay stops; None for none.

    Raises:
      ValueError: if ``warmup_steps``, ``transition_steps``,
        ``transition_begin`` or ``decay_rate`` is negative.

    >>> from cairn import optim
    >>> sched = optim.warmup_exponential_decay_schedule(0.0, 1.0, 10, 10, 0.5)
    >>> [round(float(sched(t)), 4) for t in (0, 5, 10, 20, 30)]
    [0.0, 0.5, 1.0, 0.5, 0.25]
    """
    fn = "warmup_exponential_decay_schedule"
    warmup_steps = _steps(fn, "warmup_steps", warmup_steps, minimum=0)
    return _after_warmup(
        init_value, peak_value, warmup_steps,
        lambda: exponential_decay(
            peak_value,
            transition_steps=transition_steps,
            decay_rate=decay_rate,  # type: ignore[arg-type]
            transition_begin=transition_begin,
            staircase=staircase,
            end_value=end_value,
        ),
    )


def sgdr_schedule(cosine_kwargs: Iterable[Mapping[str, Any]]) -> Schedule:
    r"""SGD with warm restarts (Loshchilov & Hutter, 2017).

    Joins one :func:`warmup_cosine_decay_schedule` per entry of
    ``cosine_kwargs``; cycle :math:`k` lasts its own ``decay_steps`` and
    starts where the previous one ended:
    :math:`v(t) = c_k(t - \sum_{j<k} D_j)` for
    :math:`\sum_{j<k} D_j \le t < \sum_{j\le k} D_j`.

    Args:
      cosine_kwargs: one dict of :func:`warmup_cosine_decay_schedule`
        keyword arguments per cycle; each must have ``decay_steps``.

    Raises:
      ValueError: if there is no cycle or a cycle lacks ``decay_steps``.

    >>> from cairn import optim
    >>> cycle = dict(init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=10)
    >>> sched = optim.sgdr_schedule([cycle, cycle])
    >>> [round(float(sched(t)), 4) for t in (0, 2, 9, 10, 12)]
    [0.0, 1.0, 0.0381, 0.0, 1.0]
    """
    fn = "sgdr_schedule"
    cycles = [dict(kw) for kw in cosine_kwargs]
    if not cycles:
        raise ValueError(f"{fn}: `cosine_kwargs` must hold at least one cycle")
    schedules, boundaries, step = [], [], 0
    for i, kw in enumerate(cycles):
        if "decay_steps" not in kw:
            raise ValueError(f"{fn}: `cosine_kwargs[{i}]` has no 'decay_steps'")
        try:
            schedules.append(warmup_cosine_decay_schedule(**kw))
        except TypeError as e:
            raise TypeError(f"{fn}: `cosine_kwargs[{i}]`: {e}") from e
        except ValueError as e:
            raise ValueError(f"{fn}: `cosine_kwargs[{i}]`: {e}") from e
        step += _as_int(fn, f"cosine_kwargs[{i}]['decay_steps']", kw["decay_steps"])
        boundaries.append(step)
    return join_schedules(schedules, boundaries[:-1])
