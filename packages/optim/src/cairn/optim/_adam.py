"""The Adam family: the ``scale_by_*`` moments (Adam, AMSGrad, AdaMax, AdaBelief, RAdam,
Yogi, Lion, NovoGrad) and the optimizers built on them (``adam``, ``adamw``, ``nadam``,
``nadamw``, ``adamax``, ``adamaxw``, ``amsgrad``, ``adabelief``, ``radam``, ``yogi``,
``lion``, ``lamb``, ``novograd``).

Every optimizer takes ``learning_rate`` as a float or a schedule ``step -> value``; the
learning rate and weight decay live in the state (traced values), so
:func:`set_hyperparams` changes them without recompiling. ``mu_dtype`` / ``nu_dtype``
select the storage dtype of the moments.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _validate
from cairn.optim._adding import add_decayed_weights
from cairn.optim._base import (
    GradientTransformation,
    ScalarOrSchedule,
    chain,
    mark_extra,
    need_params,
    packed_transformation,
)
from cairn.optim._packed_state import (
    BiasCorrection,
    abs_sq,
    check_moment,
    mu_hat,
    plus,
    safe_increment,
    state_zeros,
    step_buffers,
)
from cairn.optim._packing import Packed
from cairn.optim._placement import full_like_param, replicated_like
from cairn.optim._scaling import learning_rate_step, scale_by_trust_ratio
from cairn.optim._types import resolve_annotations

__all__ = [
    "scale_by_adam", "scale_by_amsgrad", "scale_by_adamax", "scale_by_belief", "scale_by_radam",
    "scale_by_yogi", "scale_by_lion", "scale_by_novograd", "ScaleByAdamState", "adam", "adamw",
    "nadam", "nadamw", "adamax", "adamaxw", "amsgrad", "adabelief", "radam", "yogi", "lion",
    "lamb", "novograd",
]


class ScaleByAdamState(NamedTuple):
    """The state of :func:`scale_by_adam`.

    Args:
      count: int32 scalar, steps taken (for the bias correction).
      mu: first moment :math:`m` (packed, one buffer per dtype group).
      nu: second moment :math:`v` (packed).
    """
    count: jax.Array  # type: ignore[assignment]
    mu: Packed
    nu: Packed


def _adam_family(name, mu_dtype, nu_dtype, make_step, fill=0.0):
    """A transformation whose state is :class:`ScaleByAdamState` (both moments start at
    ``fill``). ``make_step(count)`` returns the per-buffer ``step(g, m0, v0) -> (out, m, v)``
    for the incremented step ``count``."""

    def init(layout, params):
        return ScaleByAdamState(jnp.zeros([], jnp.int32),
                                state_zeros(params, layout, mu_dtype, fill, offsets=True),
                                state_zeros(params, layout, nu_dtype, fill))

    def update(u, state, p=None, **extra):
        check_moment(u, state.mu, name)
        count = safe_increment(state.count)
        out, (mu, nu) = step_buffers(u, (state.mu, state.nu), make_step(count))
        return out, ScaleByAdamState(count, mu, nu)

    return packed_transformation(init, update, name=name)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                  mu_dtype: jax.typing.DTypeLike | None = None, *,
                  nesterov: bool = False,
                  nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """Adam scaling.

    .. math::
        m_t = \\beta_1 m_{t-1} + (1-\\beta_1) g_t,\\quad
        v_t = \\beta_2 v_{t-1} + (1-\\beta_2) g_t^2,\\quad
        u_t = \\hat m_t / (\\sqrt{\\hat v_t + \\epsilon_{root}} + \\epsilon)

    with :math:`\\hat m_t = m_t/(1-\\beta_1^t)`, :math:`\\hat v_t = v_t/(1-\\beta_2^t)`;
    with ``nesterov`` :math:`\\hat m_t = \\beta_1 m_t/(1-\\beta_1^{t+1}) + (1-\\beta_1) g_t/(1-\\beta_1^t)`.

    Args:
      b1: :math:`\\beta_1`, decay of the first moment, in ``[0, 1)``.
      b2: :math:`\\beta_2`, decay of the second moment, in ``[0, 1)``.
      eps: :math:`\\epsilon`, added outside the square root.
      eps_root: :math:`\\epsilon_{root}`, added inside the square root.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      nesterov: use the Nesterov form of :math:`\\hat m_t` above.
      nu_dtype: dtype of the second moment; None keeps the parameters' dtype.
    """

    _validate.check("scale_by_adam", b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    def make_step(count):
        bc = BiasCorrection(count)
        def step(g, m0, v0):
            m = (1 - b1) * g + b1 * m0
            v = (1 - b2) * abs_sq(g) + b2 * v0
            m_hat = mu_hat(b1, m, g, bc, nesterov)
            v_hat = v / bc(b2, v.dtype)
            return m_hat / (jnp.sqrt(plus(v_hat, eps_root)) + eps), m, v

        return step

    return _adam_family("scale_by_adam", mu_dtype, nu_dtype, make_step)


class ScaleByAmsgradState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]
    mu: Packed
    nu: Packed
    nu_max: Packed


def scale_by_amsgrad(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                     mu_dtype: jax.typing.DTypeLike | None = None,
                     bias_correction_mu: bool = True, bias_correction_nu: bool = True, *,
                     nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """AMSGrad: Adam with :math:`\\hat v_t = \\max(\\hat v_{t-1}^{max}, \\hat v_t)` in the denominator.

    Args:
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, decay of the second moment.
      eps: :math:`\\epsilon`, added outside the square root.
      eps_root: :math:`\\epsilon_{root}`, added inside the square root.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      bias_correction_mu: divide the first moment by :math:`1-\\beta_1^t`.
      bias_correction_nu: divide the second moment by :math:`1-\\beta_2^t` before the running
        maximum.
      nu_dtype: dtype of the second moment and its maximum; None keeps the parameters' dtype.
    """

    _validate.check("scale_by_amsgrad", b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    def init(layout, params):
        return ScaleByAmsgradState(jnp.zeros([], jnp.int32),
                                   state_zeros(params, layout, mu_dtype, offsets=True),
                                   state_zeros(params, layout, nu_dtype),
                                   state_zeros(params, layout, nu_dtype))

    def update(u, state, p=None, **extra):
        check_moment(u, state.mu, "scale_by_amsgrad")
        count = safe_increment(state.count)
        bc = BiasCorrection(count)

        def step(g, m0, v0, x0):
            m = (1 - b1) * g + b1 * m0
            v = (1 - b2) * abs_sq(g) + b2 * v0
            m_hat = m / bc(b1, m.dtype) if bias_correction_mu else m
            v_eff = v / bc(b2, v.dtype) if bias_correction_nu else v
            vmax = jnp.maximum(x0, v_eff)
            return m_hat / (jnp.sqrt(plus(vmax, eps_root)) + eps), m, v, vmax

        out, new = step_buffers(u, (state.mu, state.nu, state.nu_max), step)
        return out, ScaleByAmsgradState(count, *new)

    return packed_transformation(init, update, name="scale_by_amsgrad")


def scale_by_adamax(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                    mu_dtype: jax.typing.DTypeLike | None = None,
                    nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """AdaMax: :math:`m_t` as Adam, :math:`v_t = \\max(|g_t| + \\epsilon, \\beta_2 v_{t-1})`,
    :math:`u_t = \\hat m_t / v_t`.

    Args:
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, decay of the infinity norm :math:`v`.
      eps: :math:`\\epsilon`, added to :math:`|g_t|`.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      nu_dtype: dtype of :math:`v`; None keeps the parameters' dtype.
    """

    _validate.check("scale_by_adamax", b1=b1, b2=b2, eps=eps)
    def make_step(count):
        bc = BiasCorrection(count)
        def step(g, m0, v0):
            m = (1 - b1) * g + b1 * m0
            v = jnp.maximum(jnp.abs(g) + eps, b2 * v0)
            return m / bc(b1, m.dtype) / v, m, v

        return step

    return _adam_family("scale_by_adamax", mu_dtype, nu_dtype, make_step)


def scale_by_belief(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-16,
                    eps_root: float = 1e-16, *, nesterov: bool = False,
                    mu_dtype: jax.typing.DTypeLike | None = None,
                    nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """AdaBelief: :math:`s_t = \\beta_2 s_{t-1} + (1-\\beta_2)(g_t - m_t)^2 + \\epsilon_{root}`,
    :math:`u_t = \\hat m_t / (\\sqrt{\\hat s_t} + \\epsilon)`.

    Args:
      b1: decay of the gradient EMA :math:`m`, in ``[0, 1)``.
      b2: decay of the EMA of :math:`(g_t - m_t)^2`, in ``[0, 1)``.
      eps: added outside the square root.
      eps_root: added inside the square root (and to the belief term).
      nesterov: use the Nesterov form of the first moment.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      nu_dtype: dtype of the second moment; None keeps the parameters' dtype.
    """

    _validate.check("scale_by_belief", b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    def make_step(count):
        bc = BiasCorrection(count)
        def step(g, m0, s0):
            m = (1 - b1) * g + b1 * m0
            s = (1 - b2) * abs_sq(g - m) + b2 * s0 + eps_root
            m_hat = mu_hat(b1, m, g, bc, nesterov)
            s_hat = s / bc(b2, s.dtype)
            return m_hat / (jnp.sqrt(s_hat) + eps), m, s

        return step

    return _adam_family("scale_by_belief", mu_dtype, nu_dtype, make_step)


def scale_by_radam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                   threshold: float = 5.0, *,
                   nesterov: bool = False, mu_dtype: jax.typing.DTypeLike | None = None,
                   nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """Rectified Adam: with :math:`\\rho_\\infty = 2/(1-\\beta_2) - 1` and
    :math:`\\rho_t = \\rho_\\infty - 2t\\beta_2^t/(1-\\beta_2^t)`, the update is
    :math:`r_t \\hat m_t/(\\sqrt{\\hat v_t+\\epsilon_{root}}+\\epsilon)` when
    :math:`\\rho_t \\ge` ``threshold`` else :math:`\\hat m_t`, where
    :math:`r_t = \\sqrt{(\\rho_t-4)(\\rho_t-2)\\rho_\\infty/((\\rho_\\infty-4)(\\rho_\\infty-2)\\rho_t)}`.

    Args:
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, decay of the second moment.
      eps: :math:`\\epsilon`, added outside the square root.
      eps_root: :math:`\\epsilon_{root}`, added inside the square root.
      threshold: the smallest :math:`\\rho_t` at which the rectified adaptive step is used.
      nesterov: use the Nesterov form of :math:`\\hat m_t`.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      nu_dtype: dtype of the second moment; None keeps the parameters' dtype.
    """
    _validate.check("scale_by_radam", b1=b1, b2=b2, eps=eps, eps_root=eps_root, threshold=threshold)
    ro_inf = 2.0 / (1.0 - b2) - 1.0

    def make_step(count):
        bc = BiasCorrection(count)
        b2t = b2 ** count
        ro = ro_inf - 2 * count * b2t / (1 - b2t)
        r = jnp.sqrt((ro - 4.0) * (ro - 2.0) * ro_inf / ((ro_inf - 4.0) * (ro_inf - 2.0) * ro))

        def step(g, m0, v0):
            m = (1 - b1) * g + b1 * m0
            v = (1 - b2) * abs_sq(g) + b2 * v0
            m_hat = mu_hat(b1, m, g, bc, nesterov)
            v_hat = v / bc(b2, v.dtype)
            rect = r.astype(m_hat.dtype) * m_hat / (jnp.sqrt(plus(v_hat, eps_root)) + eps)
            return jnp.where(ro >= threshold, rect, m_hat), m, v

        return step

    return _adam_family("scale_by_radam", mu_dtype, nu_dtype, make_step)


def scale_by_yogi(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-3, eps_root: float = 0.0,
                  initial_accumulator_value: float = 1e-6, *,
                  mu_dtype: jax.typing.DTypeLike | None = None,
                  nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """Yogi: :math:`v_t = v_{t-1} - (1-\\beta_2)\\,\\mathrm{sign}(v_{t-1} - g_t^2)\\,g_t^2`,
    :math:`u_t = \\hat m_t/(\\sqrt{\\hat v_t+\\epsilon_{root}}+\\epsilon)`; both moments start at
    ``initial_accumulator_value``.

    Args:
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, the rate of the additive second-moment update.
      eps: :math:`\\epsilon`, added outside the square root.
      eps_root: :math:`\\epsilon_{root}`, added inside the square root.
      initial_accumulator_value: the starting value of both moments.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      nu_dtype: dtype of the second moment; None keeps the parameters' dtype.
    """

    _validate.check(
        "scale_by_yogi",
        b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        initial_accumulator_value=initial_accumulator_value,
    )
    def make_step(count):
        bc = BiasCorrection(count)
        def step(g, m0, v0):
            m = (1 - b1) * g + b1 * m0
            g2 = abs_sq(g)
            v = v0 - (1 - b2) * jnp.sign(v0 - g2) * g2
            m_hat = m / bc(b1, m.dtype)
            v_hat = v / bc(b2, v.dtype)
            return m_hat / (jnp.sqrt(plus(v_hat, eps_root)) + eps), m, v

        return step

    return _adam_family("scale_by_yogi", mu_dtype, nu_dtype, make_step,
                        fill=initial_accumulator_value)


class ScaleByLionState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]
    mu: Packed


def scale_by_lion(b1: float = 0.9, b2: float = 0.99, mu_dtype: jax.typing.DTypeLike | None = None,
                  *, mode: str = "hard",
                  smooth_beta: float = 1.0) -> GradientTransformation:
    """Lion: :math:`u_t = \\mathrm{sign}((1-\\beta_1) g_t + \\beta_1 m_{t-1})`,
    :math:`m_t = \\beta_2 m_{t-1} + (1-\\beta_2) g_t`.

    ``mode`` picks the sign variant applied to :math:`x = (1-\\beta_1) g_t + \\beta_1
    m_{t-1}` (as Optax): ``"hard"`` :math:`\\mathrm{sign}(x)`, ``"smooth"``
    :math:`\\tanh(\\beta_s x)` with ``smooth_beta`` :math:`\\beta_s`, ``"refined"``
    :math:`x` where :math:`|x| < 1`, else :math:`\\mathrm{sign}(x)`.

    Args:
      b1: :math:`\\beta_1`, the momentum's weight inside the sign.
      b2: :math:`\\beta_2`, decay of the momentum :math:`m` that is kept.
      mu_dtype: dtype of the momentum; None keeps the parameters' dtype.
      mode: the sign variant: ``"hard"``, ``"smooth"`` or ``"refined"`` (above).
      smooth_beta: :math:`\\beta_s` of the ``"smooth"`` mode.

    Raises:
      ValueError: an unknown ``mode``.
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
                                state_zeros(params, layout, mu_dtype, offsets=True))

    def update(u, state, p=None, **extra):
        check_moment(u, state.mu, "scale_by_lion")

        def step(g, m0):
            return comb((1.0 - b1) * g + b1 * m0), (1 - b2) * g + b2 * m0

        out, (mu,) = step_buffers(u, (state.mu,), step)
        return out, ScaleByLionState(safe_increment(state.count), mu)

    return packed_transformation(init, update, name="scale_by_lion")


class ScaleByNovogradState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]
    mu: object
    nu: object


def scale_by_novograd(b1: float = 0.9, b2: float = 0.25, eps: float = 1e-8, eps_root: float = 0.0,
                      weight_decay: float = 0.0,
                      mu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """NovoGrad: per-leaf :math:`n_t = \\beta_2 n_{t-1} + (1-\\beta_2)\\|g_t\\|^2` (:math:`n_1 =
    \\|g_1\\|^2`), :math:`m_t = \\beta_1 m_{t-1} + g_t/(\\sqrt{n_t+\\epsilon_{root}}+\\epsilon) +
    \\lambda\\theta` (:math:`m_1` without the :math:`\\beta_1` term), :math:`u_t = m_t`.

    Args:
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, decay of the per-leaf squared-norm EMA :math:`n`.
      eps: :math:`\\epsilon`, added outside the square root.
      eps_root: :math:`\\epsilon_{root}`, added inside the square root.
      weight_decay: :math:`\\lambda`, the weight-decay term added to the normalised gradient.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
    """
    _validate.check("scale_by_novograd", b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay)

    def init(params):
        mu = jax.tree.map(lambda p: full_like_param(p, 0.0, mu_dtype), params)
        nu = jax.tree.map(lambda p: replicated_like(p, jnp.zeros([], p.dtype)), params)
        return ScaleByNovogradState(jnp.zeros([], jnp.int32), mu, nu)

    @mark_extra
    def update(updates, state, params=None, **extra):
        need_params(params, "scale_by_novograd")
        count = safe_increment(state.count)
        first = count == 1

        def per_nu(g, n):
            sq = jnp.sum(jnp.real(jnp.conj(g) * g))
            return jnp.where(first, sq, b2 * n + (1 - b2) * sq).astype(n.dtype)

        nu = jax.tree.map(per_nu, updates, state.nu)

        def per_mu(g, p, n, m):
            add = g / (jnp.sqrt(n + eps_root) + eps) + weight_decay * p
            return jnp.where(first, add, b1 * m + add).astype(m.dtype)

        mu = jax.tree.map(per_mu, updates, params, nu, state.mu)
        out = jax.tree.map(lambda m, g: m.astype(g.dtype), mu, updates)
        return out, ScaleByNovogradState(count, mu, nu)

    return GradientTransformation(init, update)


def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, mu_dtype: jax.typing.DTypeLike | None = None, *,
         nesterov: bool = False,
         nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """Adam: :math:`u = -\\eta\\,\\hat m_t/(\\sqrt{\\hat v_t + \\epsilon_{root}} + \\epsilon)`
    (see :func:`scale_by_adam`).

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule ``step -> float``.
      b1: :math:`\\beta_1`, decay of the first moment, in ``[0, 1)``.
      b2: :math:`\\beta_2`, decay of the second moment, in ``[0, 1)``.
      eps: :math:`\\epsilon`, added outside the square root.
      eps_root: :math:`\\epsilon_{root}`, added inside the square root (e.g. to keep gradients
        through the optimizer finite).
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      nesterov: use the Nesterov form of :math:`\\hat m_t` (NAdam).
      nu_dtype: dtype of the second moment; None keeps the parameters' dtype.
    """
    _validate.check("adam", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov,
                                  nu_dtype=nu_dtype), learning_rate_step(learning_rate))


def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype: jax.typing.DTypeLike | None = None,
          weight_decay: ScalarOrSchedule = 1e-4, mask: Any = None, *, nesterov: bool = False,
          nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """AdamW: :math:`u = -\\eta\\,(\\hat m_t/(\\sqrt{\\hat v_t+\\epsilon_{root}}+\\epsilon) + \\lambda\\theta)`,
    decay applied where ``mask`` is true (pytree, callable or path rules).

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule ``step -> float``.
      b1: :math:`\\beta_1`, decay of the first moment, in ``[0, 1)``.
      b2: :math:`\\beta_2`, decay of the second moment, in ``[0, 1)``.
      eps: :math:`\\epsilon`, added outside the square root.
      eps_root: :math:`\\epsilon_{root}`, added inside the square root.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      weight_decay: :math:`\\lambda`, decoupled weight decay (multiplied by the learning rate); a
        float or a schedule.
      mask: which leaves get weight decay: a pytree of bools (or a prefix), a callable ``params ->
        mask`` or path-regex rules (see :func:`add_decayed_weights`); None means all.
      nesterov: use the Nesterov form of :math:`\\hat m_t`.
      nu_dtype: dtype of the second moment; None keeps the parameters' dtype.
    """
    _validate.check(
        "adamw",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        weight_decay=weight_decay,
    )
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov,
                                  nu_dtype=nu_dtype),
                 add_decayed_weights(weight_decay, mask), learning_rate_step(learning_rate))


def nadam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype: jax.typing.DTypeLike | None = None, *,
          nesterov: bool = True,
          nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """NAdam: Adam with the Nesterov first moment (``nesterov=True``).

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, decay of the second moment.
      eps: :math:`\\epsilon`, added outside the square root.
      eps_root: :math:`\\epsilon_{root}`, added inside the square root.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      nesterov: the Nesterov first moment (False gives plain Adam).
      nu_dtype: dtype of the second moment; None keeps the parameters' dtype.
    """
    _validate.check("nadam", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov,
                                  nu_dtype=nu_dtype), learning_rate_step(learning_rate))


def nadamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
           eps_root: float = 0.0, mu_dtype: jax.typing.DTypeLike | None = None,
           weight_decay: ScalarOrSchedule = 1e-4, mask: Any = None, *, nesterov: bool = True,
           nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """NAdamW: AdamW with the Nesterov first moment.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, decay of the second moment.
      eps: :math:`\\epsilon`, added outside the square root.
      eps_root: :math:`\\epsilon_{root}`, added inside the square root.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      weight_decay: :math:`\\lambda`, decoupled weight decay; a float or a schedule.
      mask: which leaves get weight decay (see :func:`add_decayed_weights`); None means all.
      nesterov: the Nesterov first moment (False gives plain AdamW).
      nu_dtype: dtype of the second moment; None keeps the parameters' dtype.
    """
    _validate.check(
        "nadamw",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        weight_decay=weight_decay,
    )
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov,
                                  nu_dtype=nu_dtype),
                 add_decayed_weights(weight_decay, mask), learning_rate_step(learning_rate))


def adamax(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
           *, mu_dtype: jax.typing.DTypeLike | None = None,
           nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """AdaMax: :math:`u = -\\eta\\,\\hat m_t / v_t`, :math:`v_t = \\max(|g_t|+\\epsilon, \\beta_2 v_{t-1})`.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, decay of the infinity norm :math:`v`.
      eps: :math:`\\epsilon`, added to :math:`|g_t|`.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      nu_dtype: dtype of :math:`v`; None keeps the parameters' dtype.
    """
    _validate.check("adamax", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps)
    return chain(scale_by_adamax(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
                 learning_rate_step(learning_rate))


def adamaxw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
            weight_decay: ScalarOrSchedule = 1e-4, mask: Any = None, *,
            mu_dtype: jax.typing.DTypeLike | None = None,
            nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """AdaMax with decoupled weight decay.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, decay of the infinity norm.
      eps: :math:`\\epsilon`, added to :math:`|g_t|`.
      weight_decay: :math:`\\lambda`, decoupled weight decay (scaled by the learning rate); a float
        or a schedule.
      mask: which leaves get weight decay (see :func:`add_decayed_weights`); None means all.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      nu_dtype: dtype of the infinity norm; None keeps the parameters' dtype.
    """
    _validate.check(
        "adamaxw",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
    )
    return chain(scale_by_adamax(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
                 add_decayed_weights(weight_decay, mask), learning_rate_step(learning_rate))


def amsgrad(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
            eps_root: float = 0.0, mu_dtype: jax.typing.DTypeLike | None = None,
            bias_correction_mu: bool = True, bias_correction_nu: bool = True, *,
            nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """AMSGrad: Adam with the running maximum of :math:`\\hat v_t` (see :func:`scale_by_amsgrad`).

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, decay of the second moment.
      eps: :math:`\\epsilon`, added outside the square root.
      eps_root: :math:`\\epsilon_{root}`, added inside the square root.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      bias_correction_mu: divide the first moment by :math:`1-\\beta_1^t`.
      bias_correction_nu: divide the second moment by :math:`1-\\beta_2^t` (before the running
        maximum).
      nu_dtype: dtype of the second moment and its maximum; None keeps the parameters' dtype.
    """
    _validate.check(
        "amsgrad",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
    )
    return chain(scale_by_amsgrad(b1, b2, eps, eps_root, mu_dtype, bias_correction_mu,
                                     bias_correction_nu, nu_dtype=nu_dtype), learning_rate_step(learning_rate))


def adabelief(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
              eps: float = 1e-16, eps_root: float = 1e-16, *,
              nesterov: bool = False, mu_dtype: jax.typing.DTypeLike | None = None,
              nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """AdaBelief: Adam with the variance of the prediction error :math:`g_t - m_t`.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule ``step -> float``.
      b1: decay of the gradient EMA, in ``[0, 1)``.
      b2: decay of the EMA of :math:`(g_t - m_t)^2`, in ``[0, 1)``.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      nesterov: use the Nesterov form of the first moment.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      nu_dtype: dtype of the second moment; None keeps the parameters' dtype.
    """
    _validate.check(
        "adabelief",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
    )
    return chain(scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov, mu_dtype=mu_dtype,
                                    nu_dtype=nu_dtype), learning_rate_step(learning_rate))


def radam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, threshold: float = 5.0, *,
          nesterov: bool = False, mu_dtype: jax.typing.DTypeLike | None = None,
          nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """RAdam: rectified Adam (see :func:`scale_by_radam`).

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, decay of the second moment.
      eps: :math:`\\epsilon`, added outside the square root.
      eps_root: :math:`\\epsilon_{root}`, added inside the square root.
      threshold: the smallest SMA length :math:`\\rho_t` at which the rectified adaptive step is
        used (below it the step is momentum SGD).
      nesterov: use the Nesterov first moment.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      nu_dtype: dtype of the second moment; None keeps the parameters' dtype.
    """
    _validate.check(
        "radam",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        threshold=threshold,
    )
    return chain(scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov,
                                   mu_dtype=mu_dtype, nu_dtype=nu_dtype), learning_rate_step(learning_rate))


def yogi(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-3, *,
         mu_dtype: jax.typing.DTypeLike | None = None,
         nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """Yogi: additive second-moment update (see :func:`scale_by_yogi`).

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, the rate of the additive second-moment update.
      eps: :math:`\\epsilon`, added outside the square root.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      nu_dtype: dtype of the second moment; None keeps the parameters' dtype.
    """
    _validate.check("yogi", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps)
    return chain(scale_by_yogi(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
                 learning_rate_step(learning_rate))


def lion(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99,
         mu_dtype: jax.typing.DTypeLike | None = None, weight_decay: ScalarOrSchedule = 1e-3,
         mask: Any = None) -> GradientTransformation:
    """Lion: :math:`u = -\\eta(\\mathrm{sign}((1-\\beta_1)g_t + \\beta_1 m_{t-1}) + \\lambda\\theta)`.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      b1: :math:`\\beta_1`, the interpolation weight of the momentum in the sign.
      b2: :math:`\\beta_2`, decay of the momentum :math:`m` that is kept.
      mu_dtype: dtype of the momentum; None keeps the parameters' dtype.
      weight_decay: :math:`\\lambda`, decoupled weight decay; a float or a schedule.
      mask: which leaves get weight decay (see :func:`add_decayed_weights`); None means all.
    """
    _validate.check("lion", learning_rate=learning_rate, b1=b1, b2=b2, weight_decay=weight_decay)
    return chain(scale_by_lion(b1, b2, mu_dtype), add_decayed_weights(weight_decay, mask),
                 learning_rate_step(learning_rate))


def lamb(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         eps_root: float = 0.0, weight_decay: ScalarOrSchedule = 0.0, mask: Any = None,
         *, mu_dtype: jax.typing.DTypeLike | None = None,
         nu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """LAMB: Adam direction plus decay, rescaled per leaf by the trust ratio
    :math:`\\|\\theta\\|/\\|u\\|`, times :math:`-\\eta`.

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, decay of the second moment.
      eps: :math:`\\epsilon`, added outside the square root.
      eps_root: :math:`\\epsilon_{root}`, added inside the square root.
      weight_decay: :math:`\\lambda`, added to the Adam direction as :math:`\\lambda\\theta` before
        the trust ratio; a float or a schedule.
      mask: which leaves get weight decay (see :func:`add_decayed_weights`); None means all.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
      nu_dtype: dtype of the second moment; None keeps the parameters' dtype.
    """
    _validate.check(
        "lamb",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        weight_decay=weight_decay,
    )
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nu_dtype=nu_dtype),
                 add_decayed_weights(weight_decay, mask), scale_by_trust_ratio(),
                 learning_rate_step(learning_rate))


def novograd(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.25, eps: float = 1e-6,
             eps_root: float = 0.0, weight_decay: float = 0.0, *,
             mu_dtype: jax.typing.DTypeLike | None = None) -> GradientTransformation:
    """NovoGrad: layer-wise second moments (see :func:`scale_by_novograd`).

    Args:
      learning_rate: :math:`\\eta`, a float or a schedule.
      b1: :math:`\\beta_1`, decay of the first moment.
      b2: :math:`\\beta_2`, decay of the per-leaf second moment.
      eps: :math:`\\epsilon`, added outside the square root.
      eps_root: :math:`\\epsilon_{root}`, added inside the square root.
      weight_decay: :math:`\\lambda`, added to the normalised gradient as :math:`\\lambda\\theta`.
      mu_dtype: dtype of the first moment; None keeps the parameters' dtype.
    """
    _validate.check(
        "novograd",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        weight_decay=weight_decay,
    )
    return chain(scale_by_novograd(b1, b2, eps, eps_root, weight_decay, mu_dtype),
                 learning_rate_step(learning_rate))


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
