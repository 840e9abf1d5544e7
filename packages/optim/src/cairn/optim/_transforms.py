"""Element-wise transformations.

Every transformation here has the update equation of its Optax namesake (see
docs/optim.md). By default each moment lives in the state per parameter: a tree with
the params' structure (``mu/layers/0/kernel``), each array in its parameter's shape and
sharding, so a sharded model's optimizer state is sharded exactly like it. Under
:func:`~cairn.optim.pack` the moments are instead :class:`Packed` flat buffers, one per
dtype group. The math is written once, on "buffers": the per-parameter arrays in the
first case, the flat buffers in the second. ``mu_dtype`` / ``nu_dtype`` select the
storage dtype of the moments.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cairn.optim import _packing as pk
from cairn.optim import _validate
from cairn.optim._base import (
    EmptyState,
    check_scalar,
    eval_schedule,
    identity,
    packed_transformation,
)
from cairn.optim._packing import Packed
from cairn.optim._placement import full_like_param
from cairn.optim._rules import resolve_per_leaf

__all__ = [
    "scale", "scale_by_learning_rate", "scale_by_schedule", "scale_by_adam",
    "scale_by_amsgrad", "scale_by_adamax", "scale_by_rms", "scale_by_stddev",
    "scale_by_belief", "scale_by_radam", "scale_by_yogi", "scale_by_lion", "scale_by_sign",
    "scale_by_rss", "scale_by_adadelta", "scale_by_rprop", "add_decayed_weights", "add_noise",
    "trace", "ema", "clip", "clip_by_global_norm", "zero_nans",
]

_I32_MAX = np.iinfo(np.int32).max


def safe_increment(count):
    return jnp.where(count < _I32_MAX, count + 1, _I32_MAX).astype(jnp.int32)


def _is_python_number(x) -> bool:
    return isinstance(x, (int, float, np.number)) and not isinstance(x, bool)


def _dt(dtype):
    return None if dtype is None else jnp.dtype(dtype)


def _state_zeros(params, layout, dtype=None, fill=0.0, offsets=False):
    """One moment of state filled with ``fill``: per parameter (the default: a tree with the
    params' structure, each array with its parameter's shape and sharding) or packed (flat
    buffers per dtype, when ``layout`` is a grouped one)."""
    if layout.shaped:
        leaves = jax.tree_util.tree_leaves(params)
        return jax.tree_util.tree_unflatten(
            layout.treedef, [full_like_param(x, fill, _dt(dtype)) for x in leaves])
    p = pk.zeros(layout, _dt(dtype), fill)
    return p.with_offsets(pk.make_offsets(layout)) if offsets else p


def _like(old, layout, bufs):
    return pk.state_like(old, layout, bufs)


def _bufs(s):
    """The buffers of a state moment already checked by :func:`_check`."""
    return s.buffers if isinstance(s, Packed) else jax.tree_util.tree_leaves(s)


def _check(u: Packed, s, name: str):
    pk.state_buffers(s, u.layout, what=f"{name}: state")


class _BiasCorrection:
    """Bias correction denominators ``1 - decay**count`` in a dtype, computed once per step
    and reused by every leaf (not once per leaf: 1,000 leaves would otherwise trace and
    compile 1,000 copies of the same scalar expression). ``next`` uses ``count + 1``."""

    def __init__(self, count):
        self.count = count
        self._next = None
        self._cache: dict = {}

    def __call__(self, decay, dtype):
        key = (id(decay), jnp.dtype(dtype))
        if key not in self._cache:
            self._cache[key] = (decay, (1 - decay ** self.count).astype(dtype))
        return self._cache[key][1]

    @property
    def next(self) -> _BiasCorrection:
        if self._next is None:
            self._next = _BiasCorrection(safe_increment(self.count))
        return self._next


def _plus(x, c):
    """``x + c``, skipped for a Python zero (the default ``eps_root``): the same numbers for
    the non-negative ``x`` it is used on, one op less per leaf to trace and compile."""
    if isinstance(c, (int, float)) and c == 0:
        return x
    return x + c


def _abs_sq(x):
    return jnp.real(jnp.conj(x) * x) if jnp.iscomplexobj(x) else x * x


def _store(x, dtype_like):
    return x.astype(dtype_like.dtype)


def _step_buffers(u: Packed, states: tuple[Packed, ...], step):
    """Run ``step(g, *olds) -> (out, *news)`` on every packed buffer.

    ``out`` is cast to the update's dtype and each new state buffer to its old
    buffer's dtype. Returns ``(updates, new_states)`` as :class:`Packed`.
    """
    outs, news = [], [[] for _ in states]
    for g, *olds in zip(u.buffers, *(_bufs(s) for s in states)):
        out, *vals = step(g, *olds)
        outs.append(out.astype(g.dtype))
        for new, val, old in zip(news, vals, olds):
            new.append(_store(val, old))
    return Packed(u.layout, outs), tuple(_like(s, u.layout, bufs)
                                         for s, bufs in zip(states, news))


def _mu_hat(b1, m, g, bc: _BiasCorrection, nesterov):
    """Bias-corrected first moment (Nesterov's look-ahead form when ``nesterov``)."""
    if nesterov:
        return (b1 * m / bc.next(b1, m.dtype)
                + (1 - b1) * g / bc(b1, g.dtype))
    return m / bc(b1, m.dtype)


# --------------------------------------------------------------------------- scaling


def _scale_updates(u: Packed, fn, arg) -> Packed:
    """``fn(buffer, arg)`` on every buffer; a pending weight-decay term stays pending
    (``fn`` is then applied after it, leaf by leaf at the unpack)."""
    if isinstance(u, pk.PendingDecay):
        return u.scaled(fn, arg)
    return u.map(lambda g: fn(g, arg))


# The scalar comes first in these products (and the decay term first in its sum): in a
# leaf's unpack kernel the compiler then numbers the scalars before the slice and its
# runtime offsets, the same way for every leaf, so same-shape leaves share one kernel.
# (Both operations are commutative in IEEE arithmetic: the values are unchanged.)


def _times_cast(g, s):
    if isinstance(s, jax.Array) and s.ndim == 0:
        # lax directly: the same two primitives as ``s.astype(g.dtype) * g`` without
        # jax.numpy's per-call dispatch (this runs once per leaf at the unpack)
        return jax.lax.mul(jax.lax.convert_element_type(s, g.dtype), g)
    return s.astype(g.dtype) * g


def _times_step_size(g, step_size):
    return (step_size * g).astype(g.dtype)


class ScaleState(NamedTuple):
    """State of :func:`scale` (empty)."""


def scale(step_size) -> Any:
    """:math:`u \\leftarrow \\alpha\\,u`.

    >>> import jax.numpy as jnp
    >>> tx = scale(-0.1)
    >>> tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))[0]["w"].tolist()
    [-0.10000000149011612, -0.10000000149011612]
    """

    _validate.check("scale", step_size=step_size)
    def update(u, state, p=None, **extra):
        return _scale_updates(u, _times_step_size, step_size), state

    return packed_transformation(lambda layout, params: EmptyState(), update, name="scale")


class ScaleByLearningRateState(NamedTuple):
    """``count`` of steps (the schedule's argument: advanced only when ``learning_rate`` is a
    schedule, so a constant costs no work per step) and the ``learning_rate`` used at the
    last step (traced)."""

    count: jax.Array
    learning_rate: jax.Array


def scale_by_learning_rate(learning_rate=None, *, flip_sign: bool = True):
    """:math:`u \\leftarrow -\\eta_t\\,u` (or :math:`+\\eta_t u` when ``flip_sign=False``).

    ``learning_rate=None`` means no scaling (an :func:`identity`, as in Optax).

    ``learning_rate`` is a float or a schedule ``step -> value``. The value lives in
    the state (``state.learning_rate``), so it is a traced value: changing it with
    :func:`set_hyperparams` does not recompile, and :func:`get_hyperparams` reads it.
    """
    _validate.check("scale_by_learning_rate", learning_rate=learning_rate)
    if learning_rate is None:
        return identity()
    check_scalar("learning_rate", learning_rate)
    sign = -1.0 if flip_sign else 1.0

    def init(layout, params):
        lr = eval_schedule("learning_rate", learning_rate, jnp.zeros([], jnp.int32))
        return ScaleByLearningRateState(jnp.zeros([], jnp.int32), lr)

    def update(u, state, p=None, **extra):
        if callable(learning_rate):
            lr = eval_schedule("learning_rate", learning_rate, state.count)
        elif _is_python_number(learning_rate):
            lr = state.learning_rate
        else:  # a traced value (e.g. from inject_hyperparams) wins over the stored one
            lr = jnp.asarray(learning_rate, jnp.float32)
        out = _scale_updates(u, _times_cast, sign * lr)
        count = safe_increment(state.count) if callable(learning_rate) else state.count
        return out, ScaleByLearningRateState(count, lr)

    return packed_transformation(init, update, name="scale_by_learning_rate")


class ScaleByScheduleState(NamedTuple):
    count: jax.Array


def scale_by_schedule(step_size_fn):
    """:math:`u \\leftarrow s(t)\\,u` with ``s`` a schedule evaluated at the step count."""
    if not callable(step_size_fn):
        raise TypeError(f"step_size_fn must be callable (step -> value), got "
                        f"{type(step_size_fn).__name__}")

    def init(layout, params):
        eval_schedule("step_size_fn", step_size_fn, jnp.zeros([], jnp.int32))
        return ScaleByScheduleState(jnp.zeros([], jnp.int32))

    def update(u, state, p=None, **extra):
        s = eval_schedule("step_size_fn", step_size_fn, state.count)
        return (_scale_updates(u, _times_cast, s),
                ScaleByScheduleState(safe_increment(state.count)))

    return packed_transformation(init, update, name="scale_by_schedule")


# --------------------------------------------------------------------------- adam family


class ScaleByAdamState(NamedTuple):
    count: jax.Array
    mu: Packed
    nu: Packed


def _adam_family(name, mu_dtype, nu_dtype, make_step, fill=0.0):
    """A transformation whose state is :class:`ScaleByAdamState` (both moments start at
    ``fill``). ``make_step(count)`` returns the per-buffer ``step(g, m0, v0) -> (out, m, v)``
    for the incremented step ``count``."""

    def init(layout, params):
        return ScaleByAdamState(jnp.zeros([], jnp.int32),
                                _state_zeros(params, layout, mu_dtype, fill, offsets=True),
                                _state_zeros(params, layout, nu_dtype, fill))

    def update(u, state, p=None, **extra):
        _check(u, state.mu, name)
        count = safe_increment(state.count)
        out, (mu, nu) = _step_buffers(u, (state.mu, state.nu), make_step(count))
        return out, ScaleByAdamState(count, mu, nu)

    return packed_transformation(init, update, name=name)


def scale_by_adam(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *,
                  nesterov: bool = False, nu_dtype=None):
    """Adam scaling.

    .. math::
        m_t = \\beta_1 m_{t-1} + (1-\\beta_1) g_t,\\quad
        v_t = \\beta_2 v_{t-1} + (1-\\beta_2) g_t^2,\\quad
        u_t = \\hat m_t / (\\sqrt{\\hat v_t + \\epsilon_{root}} + \\epsilon)

    with :math:`\\hat m_t = m_t/(1-\\beta_1^t)`, :math:`\\hat v_t = v_t/(1-\\beta_2^t)`;
    with ``nesterov`` :math:`\\hat m_t = \\beta_1 m_t/(1-\\beta_1^{t+1}) + (1-\\beta_1) g_t/(1-\\beta_1^t)`.
    """

    _validate.check("scale_by_adam", b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    def make_step(count):
        bc = _BiasCorrection(count)
        def step(g, m0, v0):
            m = (1 - b1) * g + b1 * m0
            v = (1 - b2) * _abs_sq(g) + b2 * v0
            m_hat = _mu_hat(b1, m, g, bc, nesterov)
            v_hat = v / bc(b2, v.dtype)
            return m_hat / (jnp.sqrt(_plus(v_hat, eps_root)) + eps), m, v

        return step

    return _adam_family("scale_by_adam", mu_dtype, nu_dtype, make_step)


class ScaleByAmsgradState(NamedTuple):
    count: jax.Array
    mu: Packed
    nu: Packed
    nu_max: Packed


def scale_by_amsgrad(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
                     bias_correction_mu: bool = True, bias_correction_nu: bool = True, *,
                     nu_dtype=None):
    """AMSGrad: Adam with :math:`\\hat v_t = \\max(\\hat v_{t-1}^{max}, \\hat v_t)` in the denominator."""

    _validate.check("scale_by_amsgrad", b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    def init(layout, params):
        return ScaleByAmsgradState(jnp.zeros([], jnp.int32),
                                   _state_zeros(params, layout, mu_dtype, offsets=True),
                                   _state_zeros(params, layout, nu_dtype),
                                   _state_zeros(params, layout, nu_dtype))

    def update(u, state, p=None, **extra):
        _check(u, state.mu, "scale_by_amsgrad")
        count = safe_increment(state.count)
        bc = _BiasCorrection(count)

        def step(g, m0, v0, x0):
            m = (1 - b1) * g + b1 * m0
            v = (1 - b2) * _abs_sq(g) + b2 * v0
            m_hat = m / bc(b1, m.dtype) if bias_correction_mu else m
            v_eff = v / bc(b2, v.dtype) if bias_correction_nu else v
            vmax = jnp.maximum(x0, v_eff)
            return m_hat / (jnp.sqrt(_plus(vmax, eps_root)) + eps), m, v, vmax

        out, new = _step_buffers(u, (state.mu, state.nu, state.nu_max), step)
        return out, ScaleByAmsgradState(count, *new)

    return packed_transformation(init, update, name="scale_by_amsgrad")


def scale_by_adamax(b1=0.9, b2=0.999, eps=1e-8, *, mu_dtype=None, nu_dtype=None):
    """AdaMax: :math:`m_t` as Adam, :math:`v_t = \\max(|g_t| + \\epsilon, \\beta_2 v_{t-1})`,
    :math:`u_t = \\hat m_t / v_t`."""

    _validate.check("scale_by_adamax", b1=b1, b2=b2, eps=eps)
    def make_step(count):
        bc = _BiasCorrection(count)
        def step(g, m0, v0):
            m = (1 - b1) * g + b1 * m0
            v = jnp.maximum(jnp.abs(g) + eps, b2 * v0)
            return m / bc(b1, m.dtype) / v, m, v

        return step

    return _adam_family("scale_by_adamax", mu_dtype, nu_dtype, make_step)


def scale_by_belief(b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16, *, nesterov: bool = False,
                    mu_dtype=None, nu_dtype=None):
    """AdaBelief: :math:`s_t = \\beta_2 s_{t-1} + (1-\\beta_2)(g_t - m_t)^2 + \\epsilon_{root}`,
    :math:`u_t = \\hat m_t / (\\sqrt{\\hat s_t} + \\epsilon)`."""

    _validate.check("scale_by_belief", b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    def make_step(count):
        bc = _BiasCorrection(count)
        def step(g, m0, s0):
            m = (1 - b1) * g + b1 * m0
            s = (1 - b2) * _abs_sq(g - m) + b2 * s0 + eps_root
            m_hat = _mu_hat(b1, m, g, bc, nesterov)
            s_hat = s / bc(b2, s.dtype)
            return m_hat / (jnp.sqrt(s_hat) + eps), m, s

        return step

    return _adam_family("scale_by_belief", mu_dtype, nu_dtype, make_step)


def scale_by_radam(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, threshold=5.0, *,
                   nesterov: bool = False, mu_dtype=None, nu_dtype=None):
    """Rectified Adam: with :math:`\\rho_\\infty = 2/(1-\\beta_2) - 1` and
    :math:`\\rho_t = \\rho_\\infty - 2t\\beta_2^t/(1-\\beta_2^t)`, the update is
    :math:`r_t \\hat m_t/(\\sqrt{\\hat v_t+\\epsilon_{root}}+\\epsilon)` when
    :math:`\\rho_t \\ge` ``threshold`` else :math:`\\hat m_t`, where
    :math:`r_t = \\sqrt{(\\rho_t-4)(\\rho_t-2)\\rho_\\infty/((\\rho_\\infty-4)(\\rho_\\infty-2)\\rho_t)}`."""
    _validate.check("scale_by_radam", b1=b1, b2=b2, eps=eps, eps_root=eps_root, threshold=threshold)
    ro_inf = 2.0 / (1.0 - b2) - 1.0

    def make_step(count):
        bc = _BiasCorrection(count)
        b2t = b2 ** count
        ro = ro_inf - 2 * count * b2t / (1 - b2t)
        r = jnp.sqrt((ro - 4.0) * (ro - 2.0) * ro_inf / ((ro_inf - 4.0) * (ro_inf - 2.0) * ro))

        def step(g, m0, v0):
            m = (1 - b1) * g + b1 * m0
            v = (1 - b2) * _abs_sq(g) + b2 * v0
            m_hat = _mu_hat(b1, m, g, bc, nesterov)
            v_hat = v / bc(b2, v.dtype)
            rect = r.astype(m_hat.dtype) * m_hat / (jnp.sqrt(_plus(v_hat, eps_root)) + eps)
            return jnp.where(ro >= threshold, rect, m_hat), m, v

        return step

    return _adam_family("scale_by_radam", mu_dtype, nu_dtype, make_step)


def scale_by_yogi(b1=0.9, b2=0.999, eps=1e-3, eps_root=0.0, initial_accumulator_value=1e-6, *,
                  mu_dtype=None, nu_dtype=None):
    """Yogi: :math:`v_t = v_{t-1} - (1-\\beta_2)\\,\\mathrm{sign}(v_{t-1} - g_t^2)\\,g_t^2`,
    :math:`u_t = \\hat m_t/(\\sqrt{\\hat v_t+\\epsilon_{root}}+\\epsilon)`; both moments start at
    ``initial_accumulator_value``."""

    _validate.check(
        "scale_by_yogi",
        b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        initial_accumulator_value=initial_accumulator_value,
    )
    def make_step(count):
        bc = _BiasCorrection(count)
        def step(g, m0, v0):
            m = (1 - b1) * g + b1 * m0
            g2 = _abs_sq(g)
            v = v0 - (1 - b2) * jnp.sign(v0 - g2) * g2
            m_hat = m / bc(b1, m.dtype)
            v_hat = v / bc(b2, v.dtype)
            return m_hat / (jnp.sqrt(_plus(v_hat, eps_root)) + eps), m, v

        return step

    return _adam_family("scale_by_yogi", mu_dtype, nu_dtype, make_step,
                        fill=initial_accumulator_value)


class ScaleByLionState(NamedTuple):
    count: jax.Array
    mu: Packed


def scale_by_lion(b1=0.9, b2=0.99, mu_dtype=None, *, mode: str = "hard",
                  smooth_beta: float = 1.0):
    """Lion: :math:`u_t = \\mathrm{sign}((1-\\beta_1) g_t + \\beta_1 m_{t-1})`,
    :math:`m_t = \\beta_2 m_{t-1} + (1-\\beta_2) g_t`.

    ``mode`` picks the sign variant applied to :math:`x = (1-\\beta_1) g_t + \\beta_1
    m_{t-1}` (as Optax): ``"hard"`` :math:`\\mathrm{sign}(x)`, ``"smooth"``
    :math:`\\tanh(\\beta_s x)` with ``smooth_beta`` :math:`\\beta_s`, ``"refined"``
    :math:`x` where :math:`|x| < 1`, else :math:`\\mathrm{sign}(x)`.
    """
    _validate.check("scale_by_lion", b1=b1, b2=b2, smooth_beta=smooth_beta)
    if mode not in ("hard", "smooth", "refined"):
        raise ValueError(f"scale_by_lion: mode must be one of 'hard', 'smooth', 'refined', "
                         f"got {mode!r}")

    def comb(x):
        if mode == "hard":
            return jnp.sign(x)
        if mode == "smooth":
            return jnp.tanh(smooth_beta * x)
        return jnp.where(jnp.abs(x) < 1.0, x, jnp.sign(x))

    def init(layout, params):
        return ScaleByLionState(jnp.zeros([], jnp.int32),
                                _state_zeros(params, layout, mu_dtype, offsets=True))

    def update(u, state, p=None, **extra):
        _check(u, state.mu, "scale_by_lion")

        def step(g, m0):
            return comb((1.0 - b1) * g + b1 * m0), (1 - b2) * g + b2 * m0

        out, (mu,) = _step_buffers(u, (state.mu,), step)
        return out, ScaleByLionState(safe_increment(state.count), mu)

    return packed_transformation(init, update, name="scale_by_lion")


def scale_by_sign():
    """:math:`u \\leftarrow \\mathrm{sign}(u)`."""

    def update(u, state, p=None, **extra):
        return u.map(jnp.sign), state

    return packed_transformation(lambda layout, params: EmptyState(), update, name="scale_by_sign")


# --------------------------------------------------------------------------- rms family


class ScaleByRmsState(NamedTuple):
    nu: Packed


class ScaleByRmsWithCountState(NamedTuple):
    count: jax.Array
    nu: Packed


def scale_by_rms(decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt: bool = True,
                 bias_correction: bool = False, *, nu_dtype=None):
    """RMSProp scaling: :math:`v_t = \\rho v_{t-1} + (1-\\rho) g_t^2`,
    :math:`u_t = g_t/\\sqrt{v_t+\\epsilon}` (or :math:`g_t/(\\sqrt{v_t}+\\epsilon)` when
    ``eps_in_sqrt=False``), :math:`v_t` bias-corrected when ``bias_correction``."""

    _validate.check("scale_by_rms", decay=decay, eps=eps, initial_scale=initial_scale)
    def init(layout, params):
        nu = _state_zeros(params, layout, nu_dtype, initial_scale, offsets=True)
        if bias_correction:
            return ScaleByRmsWithCountState(jnp.zeros([], jnp.int32), nu)
        return ScaleByRmsState(nu)

    def update(u, state, p=None, **extra):
        _check(u, state.nu, "scale_by_rms")
        count = safe_increment(state.count) if bias_correction else None
        bc = _BiasCorrection(count) if bias_correction else None

        def step(g, v0):
            v = (1 - decay) * _abs_sq(g) + decay * v0
            v_hat = v / bc(decay, v.dtype) if bias_correction else v
            sc = jax.lax.rsqrt(v_hat + eps) if eps_in_sqrt else 1 / (jnp.sqrt(v_hat) + eps)
            return sc * g, v

        out, (nu,) = _step_buffers(u, (state.nu,), step)
        new = ScaleByRmsWithCountState(count, nu) if bias_correction else ScaleByRmsState(nu)
        return out, new

    return packed_transformation(init, update, name="scale_by_rms")


class ScaleByRStdDevState(NamedTuple):
    mu: Packed
    nu: Packed


class ScaleByRStdDevWithCountState(NamedTuple):
    count: jax.Array
    mu: Packed
    nu: Packed


def scale_by_stddev(decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt: bool = True,
                    bias_correction: bool = False, *, mu_dtype=None, nu_dtype=None):
    """Centred RMSProp: :math:`u_t = g_t/\\sqrt{v_t - m_t^2 + \\epsilon}` with EMAs
    :math:`m_t` of :math:`g` and :math:`v_t` of :math:`g^2` (decay :math:`\\rho`)."""

    _validate.check("scale_by_stddev", decay=decay, eps=eps, initial_scale=initial_scale)
    def init(layout, params):
        mu = _state_zeros(params, layout, mu_dtype, offsets=True)
        nu = _state_zeros(params, layout, nu_dtype, initial_scale)
        if bias_correction:
            return ScaleByRStdDevWithCountState(jnp.zeros([], jnp.int32), mu, nu)
        return ScaleByRStdDevState(mu, nu)

    def update(u, state, p=None, **extra):
        _check(u, state.mu, "scale_by_stddev")
        count = safe_increment(state.count) if bias_correction else None
        bc = _BiasCorrection(count) if bias_correction else None

        def step(g, m0, v0):
            m = (1 - decay) * g + decay * m0
            v = (1 - decay) * _abs_sq(g) + decay * v0
            if bias_correction:
                mh, vh = m / bc(decay, m.dtype), v / bc(decay, v.dtype)
            else:
                mh, vh = m, v
            if eps_in_sqrt:
                sc = jax.lax.rsqrt(vh - _abs_sq(mh) + eps)
            else:
                sc = 1 / (jnp.sqrt(vh - _abs_sq(mh)) + eps)
            return sc * g, m, v

        out, (mu, nu) = _step_buffers(u, (state.mu, state.nu), step)
        new = (ScaleByRStdDevWithCountState(count, mu, nu) if bias_correction
               else ScaleByRStdDevState(mu, nu))
        return out, new

    return packed_transformation(init, update, name="scale_by_stddev")


class ScaleByRssState(NamedTuple):
    sum_of_squares: Packed


def scale_by_rss(initial_accumulator_value=0.1, eps=1e-7):
    """Adagrad scaling: :math:`s_t = s_{t-1} + g_t^2`, :math:`u_t = g_t/\\sqrt{s_t+\\epsilon}`
    (0 where :math:`s_t = 0`)."""

    _validate.check("scale_by_rss", initial_accumulator_value=initial_accumulator_value, eps=eps)
    def init(layout, params):
        return ScaleByRssState(_state_zeros(params, layout, None, initial_accumulator_value,
                                            offsets=True))

    def update(u, state, p=None, **extra):
        _check(u, state.sum_of_squares, "scale_by_rss")

        def step(g, s0):
            s = _abs_sq(g) + s0
            return jnp.where(s > 0, jax.lax.rsqrt(s + eps), 0.0) * g, s

        out, new = _step_buffers(u, (state.sum_of_squares,), step)
        return out, ScaleByRssState(*new)

    return packed_transformation(init, update, name="scale_by_rss")


class ScaleByAdaDeltaState(NamedTuple):
    e_g: Packed
    e_x: Packed


def scale_by_adadelta(rho=0.9, eps=1e-6):
    """AdaDelta: :math:`E[g^2]_t = \\rho E[g^2]_{t-1} + (1-\\rho) g_t^2`,
    :math:`u_t = \\sqrt{E[x^2]_{t-1}+\\epsilon}/\\sqrt{E[g^2]_t+\\epsilon}\\,g_t`,
    :math:`E[x^2]_t = \\rho E[x^2]_{t-1} + (1-\\rho) u_t^2`."""

    _validate.check("scale_by_adadelta", rho=rho, eps=eps)
    def init(layout, params):
        return ScaleByAdaDeltaState(_state_zeros(params, layout, offsets=True),
                                    _state_zeros(params, layout))

    def update(u, state, p=None, **extra):
        _check(u, state.e_g, "scale_by_adadelta")

        def step(g, eg0, ex0):
            eg = (1 - rho) * _abs_sq(g) + rho * eg0
            out = jnp.sqrt(ex0 + eps) / jnp.sqrt(eg + eps) * g
            ex = (1 - rho) * _abs_sq(out) + rho * ex0
            return out, eg, ex

        out, new = _step_buffers(u, (state.e_g, state.e_x), step)
        return out, ScaleByAdaDeltaState(*new)

    return packed_transformation(init, update, name="scale_by_adadelta")


class ScaleByRpropState(NamedTuple):
    step_sizes: Packed
    prev_updates: Packed


def scale_by_rprop(learning_rate, eta_minus=0.5, eta_plus=1.2, min_step_size=1e-6,
                   max_step_size=50.0):
    """Rprop: per-element step sizes grow by ``eta_plus`` when the gradient keeps its sign,
    shrink by ``eta_minus`` when it flips (clipped to [min, max]); the update is
    :math:`\\mathrm{step}\\cdot\\mathrm{sign}(g)`, and 0 right after a sign flip."""
    _validate.check(
        "scale_by_rprop",
        learning_rate=learning_rate, eta_minus=eta_minus, eta_plus=eta_plus,
        min_step_size=min_step_size, max_step_size=max_step_size,
    )
    check_scalar("learning_rate", learning_rate)

    def init(layout, params):
        return ScaleByRpropState(_state_zeros(params, layout, None, learning_rate, offsets=True),
                                 _state_zeros(params, layout))

    def update(u, state, p=None, **extra):
        _check(u, state.step_sizes, "scale_by_rprop")

        def step(g, st0, pv0):
            s = g * pv0
            st = jnp.where(s == 0, st0, jnp.clip(st0 * jnp.where(s > 0, eta_plus, eta_minus),
                                                 min_step_size, max_step_size))
            pv = jnp.where(s < 0, jnp.zeros_like(g), st * jnp.sign(g))
            return jnp.where(s < 0, jnp.zeros_like(pv0), pv0), st, pv

        out, new = _step_buffers(u, (state.step_sizes, state.prev_updates), step)
        return out, ScaleByRpropState(*new)

    return packed_transformation(init, update, name="scale_by_rprop")


# --------------------------------------------------------------------------- additive terms


class AddDecayedWeightsState(NamedTuple):
    """``count`` of steps (advanced only when ``weight_decay`` is a schedule) and the
    ``weight_decay`` used at the last step (traced)."""

    count: jax.Array
    weight_decay: jax.Array


@functools.lru_cache(maxsize=256)
def _leaf_mask(mask_key, layout):
    mask = mask_key[0]
    like = jax.tree_util.tree_unflatten(
        layout.treedef, [jax.ShapeDtypeStruct(s, d) for s, d in zip(layout.shapes, layout.dtypes)])
    return tuple(resolve_per_leaf(mask, like, what="mask", mask_mode=True))


class _HashableRef:
    """Identity-hashed wrapper so unhashable masks (dicts) can key the cache."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _HashableRef) and other.obj is self.obj

    def __getitem__(self, i):
        return self.obj


def leaf_mask(mask, layout) -> tuple[bool, ...]:
    """One bool per leaf of ``layout`` for a mask (pytree, callable or path rules)."""
    return _leaf_mask(_HashableRef(mask), layout)


def element_mask(layout, gi: int, bools: tuple[bool, ...]):
    """Per-element mask of group ``gi``: None (all True), False (none) or a bool vector."""
    g = layout.groups[gi]
    vals = [bools[i] for i in g.leaves]
    if all(vals):
        return None
    if not any(vals):
        return False
    runs, start = [], None
    for pos, v in enumerate(vals):
        if v and start is None:
            start = g.offsets[pos]
        if not v and start is not None:
            runs.append((start, g.offsets[pos]))
            start = None
    if start is not None:
        runs.append((start, g.total))
    iota = jax.lax.iota(jnp.int32, g.total)
    if len(runs) <= 16:
        m = jnp.zeros((g.total,), bool)
        for s, e in runs:
            m = m | ((iota >= s) & (iota < e))
        return m
    ends = jnp.asarray(np.cumsum(g.sizes), jnp.int32)
    idx = jnp.searchsorted(ends, iota, side="right", method="scan")
    return jnp.asarray(vals)[idx]


def add_decayed_weights(weight_decay=0.0, mask=None):
    """:math:`u \\leftarrow u + \\lambda_t\\,\\theta` on the leaves selected by ``mask``.

    ``mask`` is a pytree of bools (or a prefix), a callable ``params -> mask``, or
    path-regex rules (a regex string, or ``{pattern: bool}``; first match wins).
    The decay lives in the state (``state.weight_decay``): changing it does not recompile.
    """
    _validate.check("add_decayed_weights", weight_decay=weight_decay)
    check_scalar("weight_decay", weight_decay, minimum=None)

    def init(layout, params):
        if mask is not None:
            leaf_mask(mask, layout)  # validate early (errors name the path)
        wd = eval_schedule("weight_decay", weight_decay, jnp.zeros([], jnp.int32))
        return AddDecayedWeightsState(jnp.zeros([], jnp.int32), wd)

    def update(u, state, p=None, **extra):
        if p is None:
            raise ValueError("add_decayed_weights needs `params` in update(updates, state, params)")
        if callable(weight_decay):
            wd = eval_schedule("weight_decay", weight_decay, state.count)
        elif _is_python_number(weight_decay):
            wd = state.weight_decay
        else:
            wd = jnp.asarray(weight_decay, jnp.float32)
        bools = leaf_mask(mask, u.layout) if mask is not None else None
        count = safe_increment(state.count) if callable(weight_decay) else state.count
        new_state = AddDecayedWeightsState(count, wd)

        def decay_buffer(gi, g, w, wd):
            em = None if bools is None else element_mask(u.layout, gi, bools)
            if em is False:
                return g
            term = wd.astype(g.dtype) * w
            if em is not None:
                term = jnp.where(em, term, jnp.zeros_like(term))
            return (g + term).astype(g.dtype)

        def decay_leaf(i, x, w, wd):  # decay_buffer restricted to leaf i
            if bools is not None and not bools[i]:
                return x
            if w.dtype == x.dtype and w.shape == x.shape:  # lax: same primitives, no dispatch
                return jax.lax.add(jax.lax.mul(jax.lax.convert_element_type(wd, x.dtype), w), x)
            return (wd.astype(x.dtype) * w + x).astype(x.dtype)

        if isinstance(p, pk.LazyParams):
            # pytree params: keep the term pending; it is added per leaf when the
            # updates are unpacked (no concatenate of the params)
            return pk.PendingDecay(u.layout, u.buffers, p, decay_buffer, decay_leaf, wd,
                                   offsets=u.offsets), new_state
        outs = [decay_buffer(gi, g, w, wd) for gi, (g, w) in enumerate(zip(u.buffers, p.buffers))]
        return Packed(u.layout, outs), new_state

    return packed_transformation(init, update, needs_params=True, name="add_decayed_weights")


class AddNoiseState(NamedTuple):
    count: jax.Array
    rng_key: jax.Array


def add_noise(eta, gamma, key=None, *, seed: int | None = None):
    """:math:`u \\leftarrow u + \\mathcal N(0, \\eta/(1+t)^{\\gamma})` (one draw per element),
    :math:`t` the number of earlier steps (variance :math:`\\eta` on the first step).

    Key derivation (stable; it is what makes a run reproducible): the state holds one key,
    initially ``key`` (an int ``n`` means ``jax.random.PRNGKey(n)``). Each step splits it,
    ``keys = jax.random.split(state_key, B + 1)``; ``keys[0]`` is the next state key and
    buffer ``b`` gets ``jax.random.normal(keys[b + 1], (size_b,), dtype_b)``, scaled by the
    standard deviation cast to ``dtype_b``. The ``B`` buffers are the ones the update
    runs on: by default one buffer per leaf, in flatten order (the leaf itself); when the
    surrounding chain keeps packed state (:func:`~cairn.optim.pack`), one buffer per dtype
    (and per sharding), in order of first appearance in ``jax.tree`` flatten order, its
    leaves raveled and concatenated in that order. So the
    random numbers differ from Optax's (one split per step, then one key per leaf); the
    distribution is the same.
    """
    _validate.check("add_noise", eta=eta, gamma=gamma)
    if key is None and seed is None:
        raise ValueError("add_noise needs a `key` (jax.random key or int) or a `seed`")
    if key is None:
        key = seed
    if isinstance(key, int):
        key = jax.random.PRNGKey(key)

    def init(layout, params):
        return AddNoiseState(jnp.zeros([], jnp.int32), jnp.asarray(key))

    def update(u, state, p=None, **extra):
        count = safe_increment(state.count)
        std = jnp.sqrt(eta / count.astype(jnp.float32) ** gamma)
        keys = jax.random.split(state.rng_key, len(u.buffers) + 1)
        outs = [(g + std.astype(g.dtype) * jax.random.normal(k, g.shape, g.dtype)).astype(g.dtype)
                for g, k in zip(u.buffers, keys[1:])]
        return Packed(u.layout, outs), AddNoiseState(count, keys[0])

    return packed_transformation(init, update, name="add_noise")


# --------------------------------------------------------------------------- momentum


class TraceState(NamedTuple):
    trace: Packed


def trace(decay, nesterov: bool = False, accumulator_dtype=None):
    """Momentum: :math:`f_t = g_t + \\mu f_{t-1}`, :math:`u_t = f_t`
    (Nesterov: :math:`u_t = g_t + \\mu f_t`)."""

    _validate.check("trace", decay=decay)
    def init(layout, params):
        return TraceState(_state_zeros(params, layout, accumulator_dtype, offsets=True))

    def update(u, state, p=None, **extra):
        _check(u, state.trace, "trace")

        def step(g, t0):
            f = g + decay * t0
            return (g + decay * f if nesterov else f), f

        out, new = _step_buffers(u, (state.trace,), step)
        return out, TraceState(*new)

    return packed_transformation(init, update, name="trace")


class EmaState(NamedTuple):
    count: jax.Array
    ema: Packed


def ema(decay, debias: bool = True, accumulator_dtype=None):
    """:math:`e_t = \\delta e_{t-1} + (1-\\delta) g_t`, :math:`u_t = e_t/(1-\\delta^t)` when
    ``debias`` else :math:`e_t`."""

    _validate.check("ema", {"decay": _validate.BETA if debias else _validate.UNIT}, decay=decay)
    def init(layout, params):
        return EmaState(jnp.zeros([], jnp.int32),
                        _state_zeros(params, layout, accumulator_dtype, offsets=True))

    def update(u, state, p=None, **extra):
        _check(u, state.ema, "ema")
        count = safe_increment(state.count)
        bc = _BiasCorrection(count)

        def step(g, e0):
            e = (1 - decay) * g + decay * e0
            return (e / bc(decay, e.dtype) if debias else e), e

        out, (ema_,) = _step_buffers(u, (state.ema,), step)
        return out, EmaState(count, ema_)

    return packed_transformation(init, update, name="ema")


# --------------------------------------------------------------------------- clipping


def clip(max_delta):
    """:math:`u \\leftarrow \\mathrm{clip}(u, -\\delta, \\delta)`."""
    _validate.check("clip", max_delta=max_delta)
    check_scalar("max_delta", max_delta)

    def update(u, state, p=None, **extra):
        return u.map(lambda g: jnp.clip(g, -max_delta, max_delta).astype(g.dtype)), state

    return packed_transformation(lambda layout, params: EmptyState(), update, name="clip")


def clip_by_global_norm(max_norm):
    """:math:`u \\leftarrow u \\cdot \\min(1, c/\\|u\\|_2)` with :math:`\\|u\\|_2` the norm over
    all leaves (one reduction per packed buffer, or per dtype on one device)."""
    _validate.check("clip_by_global_norm", max_norm=max_norm)
    check_scalar("max_norm", max_norm)

    def update(u, state, p=None, **extra):
        # per-parameter leaves on one device: one reduction per dtype over a transient
        # concatenation (not stored), as packed state does; sharded leaves reduce per leaf
        sq = [jnp.sum(_abs_sq(g).astype(jnp.float32)) for g in pk.transient_flat(u)]
        g_norm = jnp.sqrt(sum(sq)) if sq else jnp.zeros([], jnp.float32)
        trigger = g_norm < max_norm

        def f(g):
            return jnp.where(trigger, g, (g / g_norm.astype(g.dtype)) * max_norm).astype(g.dtype)

        return u.map(f), state

    return packed_transformation(lambda layout, params: EmptyState(), update,
                                 name="clip_by_global_norm")


class ZeroNansState(NamedTuple):
    """``found_nan``: one flag per parameter (a tree with the params' structure, as in
    Optax); with packed state (:func:`~cairn.optim.pack`), one per packed buffer, keyed by
    group name."""

    found_nan: Any


def zero_nans():
    """Replace NaNs in the updates by 0; the state records whether a leaf had one."""

    def flags(layout, values):
        if layout.shaped:
            return jax.tree_util.tree_unflatten(layout.treedef, list(values))
        return {g.name: v for g, v in zip(layout.groups, values)}

    def init(layout, params):
        return ZeroNansState(flags(layout, [jnp.array(False)] * len(layout.groups)))

    def update(u, state, p=None, **extra):
        found = flags(u.layout, [jnp.any(jnp.isnan(b)) for b in u.buffers])
        return u.map(lambda g: jnp.where(jnp.isnan(g), jnp.zeros_like(g), g)), ZeroNansState(found)

    return packed_transformation(init, update, name="zero_nans")
