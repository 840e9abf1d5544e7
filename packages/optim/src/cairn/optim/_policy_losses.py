r"""Policy-gradient losses for RL fine-tuning: the PPO/GRPO clipped objective, the KL
penalty estimators and group-relative advantages.

Shapes: per-token log-probabilities ``[..., T]`` (from
:func:`cairn.optim.losses.token_logprobs`), a completion mask ``[..., T]`` and
advantages per sequence ``[...]`` (broadcast over tokens) or per token
``[..., T]``. Every sequence in the leading axes counts as one sample
:math:`o_i` of the objective.

**Aggregation** (``clipped_policy_loss(..., aggregation=)``) reduces the per-token
losses :math:`\ell_{i,t}` over the masked tokens (``|o_i|`` tokens of sample
:math:`i`, :math:`G` samples, :math:`T` the padded length):

* ``"seq-mean-token-mean"`` (default): :math:`\frac1G\sum_i\frac{1}{|o_i|}\sum_t\ell_{i,t}`,
  the GRPO paper's eq. 3 (TRL's ``loss_type="grpo"``): each sample weighs the
  same, so a long sample's tokens weigh less.
* ``"token-mean"``: :math:`\frac{1}{\sum_i|o_i|}\sum_i\sum_t\ell_{i,t}`, DAPO's
  token-level loss (Yu et al., 2025, eq. 8; TRL's ``"dapo"``/``"bnpo"``): each
  token weighs the same.
* ``"seq-mean-token-sum"``: :math:`\frac1G\sum_i\sum_t\ell_{i,t}`.
* ``"seq-mean-token-sum-norm"``: :math:`\frac{1}{G\,T}\sum_i\sum_t\ell_{i,t}`, a
  constant normaliser (Dr. GRPO, Liu et al., 2025; TRL's ``"dr_grpo"``).

The "seq-mean" forms average over the sequences that have at least one masked
token; with no masked token at all every form gives 0 with gradient 0. The names
are verl's ``loss_agg_mode`` values.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cairn.optim._logprobs import bool_mask
from cairn.optim._preference_losses import _check_scalar

__all__ = [
    "PolicyLossOutput",
    "clipped_policy_loss",
    "group_relative_advantages",
    "kl_penalty",
]

KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class PolicyLossOutput(NamedTuple):
    r"""What :func:`clipped_policy_loss` returns.

    * ``loss``: the scalar objective, ``policy_loss + beta * kl``;
    * ``per_token_loss``: :math:`\ell_{i,t}`, ``[..., T]``, 0 where masked;
    * ``policy_loss``: the clipped term alone, aggregated like ``loss``;
    * ``kl``: the KL estimate, aggregated the same way (0 without a reference);
    * ``clip_fraction_low`` / ``clip_fraction_high``: the fraction of masked tokens
      whose lower clip (:math:`\rho < 1-\varepsilon_\text{low}`, :math:`\hat A < 0`)
      or upper clip (:math:`\rho > 1+\varepsilon_\text{high}`, :math:`\hat A > 0`)
      is active, i.e. that carry no policy gradient.

    ``loss`` and ``per_token_loss`` carry the gradient; the other fields are
    metrics under ``stop_gradient``.

    Args:
      loss: the scalar objective, ``policy_loss + beta * kl``.
      per_token_loss: :math:`\ell_{i,t}`, ``[..., T]``, 0 where masked.
      policy_loss: the clipped term alone, aggregated like ``loss``.
      kl: the KL estimate, aggregated the same way (0 without a reference).
      clip_fraction_low: fraction of masked tokens whose lower clip is active.
      clip_fraction_high: fraction of masked tokens whose upper clip is active.
    """

    loss: jax.Array
    per_token_loss: jax.Array
    policy_loss: jax.Array
    kl: jax.Array
    clip_fraction_low: jax.Array
    clip_fraction_high: jax.Array


def _floating(fn: str, name: str, x: Any) -> jax.Array:
    a = jnp.asarray(x)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"{fn}: `{name}` must have a floating dtype, got {a.dtype}")
    return a


def _wide(x: jax.Array) -> jax.Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def kl_penalty(
    logprobs: jax.typing.ArrayLike,
    ref_logprobs: jax.typing.ArrayLike,
    *,
    estimator: str = "k3",
) -> jax.Array:
    r"""Per-token estimate of :math:`\mathrm{KL}(\pi_\theta \,\|\, \pi_\text{ref})` from tokens
    sampled from :math:`\pi_\theta` (Schulman, "Approximating KL Divergence", 2020).

    With :math:`d = \log\pi_\text{ref}(o_t) - \log\pi_\theta(o_t)` (so
    :math:`e^d = \pi_\text{ref}/\pi_\theta`):

    .. math::

        k_1 = -d,\qquad k_2 = \tfrac12 d^2,\qquad k_3 = (e^d - 1) - d

    :math:`k_1` is unbiased but takes negative values and has high variance;
    :math:`k_2` is biased with low variance; :math:`k_3` is unbiased, never
    negative, and low-variance near :math:`\pi_\theta = \pi_\text{ref}`. GRPO
    (Shao et al., 2024, eq. 4) uses :math:`k_3`. :math:`k_3` is computed as
    ``expm1(d) - d``, and for :math:`|d| < 0.1` by its Taylor series
    :math:`\sum_{n=2}^{6} d^n/n!`, so it keeps its relative precision as
    :math:`\pi_\theta \to \pi_\text{ref}` (where ``exp(d) - 1 - d`` is all rounding).

    Args:
      logprobs: :math:`\log\pi_\theta(o_t)`, floating, any shape.
      ref_logprobs: :math:`\log\pi_\text{ref}(o_t)`, same shape.
      estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
      The per-token estimate, shaped like ``logprobs``, in the inputs' dtype
      (computed in at least float32).

    Raises:
      TypeError: non-floating inputs.
      ValueError: different shapes, or an unknown ``estimator``.

    >>> from cairn.optim import losses
    >>> lp, ref = jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25]))
    >>> k3 = losses.kl_penalty(lp, ref, estimator="k3")
    >>> print(np.asarray(k3, float).round(4))          # 0.5 - 1 + log 2
    [0.1931]
    """
    fn = "kl_penalty"
    lp, ref = _floating(fn, "logprobs", logprobs), _floating(fn, "ref_logprobs", ref_logprobs)
    if lp.shape != ref.shape:
        raise ValueError(
            f"{fn}: `logprobs` and `ref_logprobs` must have the same shape, got "
            f"logprobs.shape={lp.shape} and ref_logprobs.shape={ref.shape}"
        )
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"{fn}: `estimator` must be one of {KL_ESTIMATORS}, got {estimator!r}")
    dtype = jnp.result_type(lp, ref)
    return _kl(_wide(ref) - _wide(lp), estimator).astype(dtype)


def _kl(d: jax.Array, estimator: str) -> jax.Array:
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    # k3 = d^2/2 + d^3/6 + ...: expm1(d) - d cancels for small |d| (relative error about
    # 2 eps / |d|), so below 0.1 the Taylor series to d^6 is used (truncation < 1e-8).
    small = jnp.abs(d) < 0.1
    ds = jnp.where(small, d, 0.0)
    series = ds * ds * (0.5 + ds * (1 / 6 + ds * (1 / 24 + ds * (1 / 120 + ds / 720))))
    return jnp.where(small, series, jnp.expm1(d) - d)


def _aggregate(x: jax.Array, m: jax.Array, aggregation: str) -> jax.Array:
    """Reduce ``[..., T]`` per-token values (0 where ``m`` is unset) to a scalar."""
    xm = jnp.where(m, x, 0.0)
    if aggregation == "token-mean":
        return jnp.sum(xm) / jnp.maximum(jnp.sum(m), 1).astype(x.dtype)
    tokens = jnp.sum(m, axis=-1)
    seq_sum = jnp.sum(xm, axis=-1)
    if aggregation == "seq-mean-token-mean":
        per_seq = seq_sum / jnp.maximum(tokens, 1).astype(x.dtype)
    elif aggregation == "seq-mean-token-sum":
        per_seq = seq_sum
    else:  # seq-mean-token-sum-norm
        per_seq = seq_sum / x.shape[-1]
    present = tokens > 0
    return jnp.sum(jnp.where(present, per_seq, 0.0)) / jnp.maximum(
        jnp.sum(present), 1
    ).astype(x.dtype)


def _policy_inputs(fn, logprobs, old_logprobs, advantages, mask, ref_logprobs):
    """Checked, widened ``(logprobs, old, advantages [..., T], mask, ref or None, dtype)``."""
    lp = _floating(fn, "logprobs", logprobs)
    if lp.ndim < 1:
        raise ValueError(f"{fn}: `logprobs` must have shape [..., T], got a scalar")
    named = {"logprobs": lp}
    old = jax.lax.stop_gradient(lp) if old_logprobs is None else _floating(
        fn, "old_logprobs", old_logprobs)
    named["old_logprobs"] = old
    if ref_logprobs is not None:
        named["ref_logprobs"] = _floating(fn, "ref_logprobs", ref_logprobs)
    for name, a in named.items():
        if a.shape != lp.shape:
            raise ValueError(f"{fn}: `{name}` must have the shape of `logprobs` {lp.shape}, "
                             f"got {a.shape}")
    adv = _floating(fn, "advantages", advantages)
    if adv.shape == lp.shape[:-1]:
        adv = adv[..., None]
    elif adv.shape != lp.shape:
        raise ValueError(
            f"{fn}: `advantages` must have shape {lp.shape[:-1]} (one per sequence) or "
            f"{lp.shape} (one per token), got {adv.shape}"
        )
    m = bool_mask(fn, mask, lp.shape, "logprobs")
    dtype = jnp.result_type(*named.values(), adv)
    wide = jnp.promote_types(dtype, jnp.float32)
    ref = named.get("ref_logprobs")
    return (lp.astype(wide), old.astype(wide), adv.astype(wide), m,
            None if ref is None else ref.astype(wide), dtype)


def _check_options(fn, clip_epsilon, clip_epsilon_high, beta, ref_logprobs, kl_estimator,
                   aggregation) -> None:
    _check_scalar(fn, "clip_epsilon", clip_epsilon, 0.0, math.inf, hi_open=True)
    if clip_epsilon_high is not None:
        _check_scalar(fn, "clip_epsilon_high", clip_epsilon_high, 0.0, math.inf, hi_open=True)
    _check_scalar(fn, "beta", beta, 0.0, math.inf, hi_open=True)
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"{fn}: `kl_estimator` must be one of {KL_ESTIMATORS}, "
                         f"got {kl_estimator!r}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"{fn}: `aggregation` must be one of {AGGREGATIONS}, "
                         f"got {aggregation!r}")
    if ref_logprobs is None and not (isinstance(beta, numbers.Real) and float(beta) == 0.0):
        raise ValueError(f"{fn}: `beta`={beta!r} weighs a KL penalty to the reference, "
                         f"but no `ref_logprobs` were given (pass them, or beta=0)")


def _per_token_terms(lp, old, adv, m, ref, eps_low, eps_high, kl_estimator):
    """The clipped surrogate, the KL estimate and the low/high clip indicators per token.

    Masked positions are replaced (log-ratio 0, advantage 0) before anything is formed, so
    whatever they hold (-inf, NaN) reaches neither the value nor the gradient."""
    ratio = jnp.exp(jnp.where(m, lp - old, 0.0))
    adv = jnp.where(m, adv, 0.0)
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    surrogate = -jnp.minimum(ratio * adv, clipped * adv)
    kl = jnp.zeros_like(lp) if ref is None else _kl(jnp.where(m, ref - lp, 0.0), kl_estimator)
    low = m & (ratio < 1.0 - eps_low) & (adv < 0)
    high = m & (ratio > 1.0 + eps_high) & (adv > 0)
    return surrogate, kl, low, high


def clipped_policy_loss(
    logprobs: jax.typing.ArrayLike,
    old_logprobs: jax.typing.ArrayLike | None,
    advantages: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike | None = None,
    *,
    clip_epsilon: float = 0.2,
    clip_epsilon_high: float | None = None,
    ref_logprobs: jax.typing.ArrayLike | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "seq-mean-token-mean",
) -> PolicyLossOutput:
    r"""The PPO clipped surrogate (Schulman et al., 2017) as GRPO uses it (Shao et al., 2024),
    with an optional KL penalty to a reference policy. Per token :math:`t` of sample :math:`o_i`, with the importance ratio
    :math:`\rho_{i,t} = \exp(\log\pi_\theta(o_{i,t}) - \log\pi_\text{old}(o_{i,t}))`
    and advantage :math:`\hat A_{i,t}`:

    .. math::

        \ell_{i,t} = -\min\bigl(\rho_{i,t}\hat A_{i,t},\;
            \operatorname{clip}(\rho_{i,t}, 1-\varepsilon_\text{low}, 1+\varepsilon_\text{high})\,
            \hat A_{i,t}\bigr) + \beta\,\widehat{\mathrm{KL}}_{i,t}

    :math:`\widehat{\mathrm{KL}}` is :func:`kl_penalty` of ``ref_logprobs`` with
    ``kl_estimator`` (:math:`k_3` in GRPO). ``clip_epsilon_high`` larger than
    ``clip_epsilon`` is DAPO's "clip-higher" (Yu et al., 2025: 0.2 and 0.28).
    ``aggregation`` reduces :math:`\ell_{i,t}` to the scalar: the GRPO paper's
    per-sample mean by default, DAPO's token mean as ``"token-mean"`` (all four
    forms: module docstring). Masked positions may hold anything (-inf, NaN).

    Args:
      logprobs: :math:`\log\pi_\theta(o_{i,t})`, floating ``[..., T]`` (differentiated).
      old_logprobs: :math:`\log\pi_\text{old}` (the sampling policy), same shape;
        None: ``stop_gradient(logprobs)`` (one update per batch: every ratio is 1).
      advantages: ``[...]`` one per sequence (GRPO's outcome advantage) or
        ``[..., T]`` per token.
      mask: ``[..., T]`` bool or 0/1, the completion tokens; None: all.
      clip_epsilon: :math:`\varepsilon_\text{low} \ge 0`.
      clip_epsilon_high: :math:`\varepsilon_\text{high} \ge 0`; None: ``clip_epsilon``.
      ref_logprobs: :math:`\log\pi_\text{ref}`, same shape, for the KL term.
      beta: :math:`\beta \ge 0`, the KL weight (> 0 needs ``ref_logprobs``; 0 still reports ``kl``).
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
      aggregation: ``"seq-mean-token-mean"``, ``"token-mean"``,
        ``"seq-mean-token-sum"`` or ``"seq-mean-token-sum-norm"``.

    Returns:
      :class:`PolicyLossOutput`, in the inputs' dtype (computed in >= float32).

    Raises:
      TypeError: a non-floating input.
      ValueError: a shape unlike ``logprobs``'; a negative or non-finite epsilon or
        ``beta``; ``beta > 0`` without ``ref_logprobs``; an unknown option.

    >>> from cairn.optim import losses
    >>> lp = jnp.log(jnp.array([[0.5, 0.5], [0.2, 0.9]]))
    >>> old = jnp.log(jnp.array([[0.4, 0.5], [0.2, 0.5]]))
    >>> out = losses.clipped_policy_loss(lp, old, jnp.array([1.0, -1.0]))
    >>> print(np.asarray(out.per_token_loss, float).round(3))
    [[-1.2 -1. ]
     [ 1.   1.8]]
    >>> print(np.asarray([out.loss, out.clip_fraction_high], float).round(4))
    [0.15 0.25]
    """
    fn = "clipped_policy_loss"
    _check_options(fn, clip_epsilon, clip_epsilon_high, beta, ref_logprobs, kl_estimator,
                   aggregation)
    lp, old, adv, m, ref, dtype = _policy_inputs(fn, logprobs, old_logprobs, advantages,
                                                 mask, ref_logprobs)
    eps_high = clip_epsilon if clip_epsilon_high is None else clip_epsilon_high
    surrogate, kl, low, high = _per_token_terms(lp, old, adv, m, ref, clip_epsilon, eps_high,
                                                kl_estimator)
    per_token = jnp.where(m, surrogate + beta * kl, 0.0)
    count = jnp.maximum(jnp.sum(m), 1).astype(lp.dtype)
    metrics = jax.lax.stop_gradient((
        _aggregate(surrogate, m, aggregation), _aggregate(kl, m, aggregation),
        jnp.sum(low) / count, jnp.sum(high) / count,
    ))
    out = (_aggregate(per_token, m, aggregation), per_token, *metrics)
    return PolicyLossOutput(*(o.astype(dtype) for o in out))


def group_relative_advantages(
    rewards: jax.typing.ArrayLike,
    group_size: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-4,
    ddof: int = 1,
) -> jax.Array:
    r"""GRPO's outcome advantages: each reward against the other samples of its prompt.

    The last axis of ``rewards`` holds consecutive groups of ``group_size``
    samples of one prompt each (``[r_{1,1}..r_{1,G}, r_{2,1}..]``, the order
    ``jnp.repeat(prompts, G)`` gives). For sample :math:`i` of a group
    :math:`g`:

    .. math::

        \hat A_i = \frac{r_i - \operatorname{mean}(r_g)}{\operatorname{std}(r_g) + \epsilon}
        \qquad(\text{without } \texttt{normalize\_std}:\ \hat A_i = r_i - \operatorname{mean}(r_g))

    (Shao et al., 2024, section 4.1.2). ``std`` uses ``ddof`` (1: the sample
    standard deviation, as TRL and Tunix; 0: the population one). A group whose
    rewards are all equal gets advantages 0. Dropping the std normalisation is
    Dr. GRPO's fix for its difficulty bias (Liu et al., 2025).

    Args:
      rewards: ``[..., N]`` real rewards, ``N`` a multiple of ``group_size``;
        integer or bool rewards are converted to float32.
      group_size: :math:`G \ge 2`, the samples per prompt.
      normalize_std: divide by the group's standard deviation plus ``eps``.
      eps: :math:`\epsilon > 0`, keeps an all-equal group at 0 rather than NaN.
      ddof: 0 or 1 (``ddof < group_size``).

    Returns:
      Advantages shaped like ``rewards``, floating (at least float32).

    Raises:
      ValueError: ``group_size < 2``, ``N`` not a multiple of it, a bad ``eps`` or
        ``ddof``, or (when concrete) a reward that is NaN or infinite (naming its
        index).

    >>> from cairn.optim import losses
    >>> print(losses.group_relative_advantages(jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), 3,
    ...                                        normalize_std=False).round(4))
    [ 0.6667 -0.3333 -0.3333 -0.6667  0.3333  0.3333]
    """
    fn = "group_relative_advantages"
    r = jnp.asarray(rewards)
    if not (jnp.issubdtype(r.dtype, jnp.number) or r.dtype == jnp.bool_) or jnp.issubdtype(
            r.dtype, jnp.complexfloating):
        raise TypeError(f"{fn}: `rewards` must be real numbers, got dtype {r.dtype}")
    group_size = _check_group(fn, r, group_size, eps, ddof)
    if not isinstance(rewards, jax.core.Tracer):
        _check_finite_rewards(fn, rewards)
    r = r.astype(jnp.promote_types(r.dtype, jnp.float32)) if jnp.issubdtype(
        r.dtype, jnp.floating) else r.astype(jnp.float32)
    groups = r.reshape(r.shape[:-1] + (r.shape[-1] // group_size, group_size))
    centred = groups - jnp.mean(groups, axis=-1, keepdims=True)
    if normalize_std:
        var = jnp.sum(centred * centred, axis=-1, keepdims=True) / (group_size - ddof)
        centred = centred / (jnp.sqrt(var) + eps)
    return centred.reshape(r.shape)


def _check_group(fn: str, r: jax.Array, group_size: Any, eps: Any, ddof: Any) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise TypeError(f"{fn}: `group_size` must be an int, got {type(group_size).__name__}")
    group_size = int(group_size)
    if group_size < 2:
        raise ValueError(
            f"{fn}: `group_size` must be at least 2 (a group of one sample has no "
            f"baseline to compare with), got {group_size}"
        )
    if r.ndim < 1 or r.shape[-1] % group_size:
        raise ValueError(
            f"{fn}: the last axis of `rewards` must hold whole groups of "
            f"{group_size} samples, got rewards.shape={r.shape}"
        )
    _check_scalar(fn, "eps", eps, 0.0, math.inf, lo_open=True, hi_open=True)
    if ddof not in (0, 1):
        raise ValueError(f"{fn}: `ddof` must be 0 or 1, got {ddof!r}")
    return group_size


def _check_finite_rewards(fn: str, rewards: Any) -> None:
    v = np.asarray(rewards)
    if np.issubdtype(v.dtype, np.floating):
        bad = ~np.isfinite(v)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"{fn}: every reward must be finite; rewards{list(where)} = {v[where]}"
            )
