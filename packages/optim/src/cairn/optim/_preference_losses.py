r"""Preference-optimisation losses: DPO (and cDPO), IPO, ORPO, SimPO.

Each takes per-example sequence log-probabilities (from
:func:`cairn.optim.losses.sequence_logprobs`: summed for DPO/IPO, length-averaged
for ORPO/SimPO) of the chosen completion :math:`y_w` and the rejected one
:math:`y_l`, and returns a :class:`PreferenceLossOutput`:

* ``loss``: the per-example loss, shaped like the inputs (take ``.mean()``); the
  only field that carries a gradient;
* ``chosen_rewards``, ``rejected_rewards``: the implicit rewards :math:`r_w, r_l`
  each method defines (under ``stop_gradient``), for logging;
* ``margins``: :math:`r_w - r_l`;
* ``accuracies``: 1.0 where :math:`r_w > r_l`, else 0.0.

The fields are arrays, so the output is a pytree: return it as ``aux`` from
``jax.value_and_grad(..., has_aux=True)``. Inputs narrower than 32 bits are
computed in float32 and every field is returned in the inputs' dtype.

Hyperparameters are checked when concrete (a ``ValueError`` names the function
and the argument); inputs must be floating (``TypeError``) and of one shape
(``ValueError`` naming the shapes).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PreferenceLossOutput", "dpo_loss", "ipo_loss", "orpo_loss", "simpo_loss"]


class PreferenceLossOutput(NamedTuple):
    """What a preference loss returns (all per example, shaped like its inputs).

    Args:
      loss: the per-example loss (the only field that carries a gradient).
      chosen_rewards: :math:`r_w`, the implicit reward of the chosen completion as each method
        defines it (under ``stop_gradient``).
      rejected_rewards: :math:`r_l`, the same for the rejected completion.
      margins: ``chosen_rewards - rejected_rewards``.
      accuracies: 1.0 where the chosen reward is above the rejected one, else 0.0.
    """

    loss: jax.Array
    chosen_rewards: jax.Array
    rejected_rewards: jax.Array
    margins: jax.Array
    accuracies: jax.Array


def _inputs(fn: str, **named: Any) -> tuple[list[jax.Array], Any]:
    """The named inputs as floating arrays of one shape, widened to >= 32 bits, and
    their common dtype."""
    arrays = []
    for name, value in named.items():
        a = jnp.asarray(value)
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{fn}: `{name}` must have a floating dtype, got {a.dtype}")
        arrays.append(a)
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        listed = ", ".join(f"{n}.shape={a.shape}" for n, a in zip(named, arrays, strict=True))
        raise ValueError(f"{fn}: the log-probabilities must have one shape, got {listed}")
    dtype = jnp.result_type(*arrays)
    wide = jnp.promote_types(dtype, jnp.float32)
    return [a.astype(wide) for a in arrays], dtype


def _check_scalar(fn: str, name: str, value: Any, lo: float, hi: float, *,
                  lo_open: bool = False, hi_open: bool = False) -> None:
    """Concrete ``value`` must be a finite real in the interval; traced values pass."""
    if isinstance(value, jax.core.Tracer):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real | np.ndarray | jax.Array):
        raise TypeError(f"{fn}: `{name}` must be a real number, got {type(value).__name__}")
    v = float(np.asarray(value))
    ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{fn}: `{name}` must be a finite number in {interval}, got {v}")


def _logistic_loss(z: jax.Array, label_smoothing: Any) -> jax.Array:
    r""":math:`(1-\varepsilon)\,\operatorname{softplus}(-z) + \varepsilon\,\operatorname{softplus}(z)`,
    i.e. :math:`-(1-\varepsilon)\log\sigma(z) - \varepsilon\log\sigma(-z)`, overflow-free."""
    out = jnp.logaddexp(0.0, -z)
    if isinstance(label_smoothing, numbers.Real) and float(label_smoothing) == 0.0:
        return out
    return (1.0 - label_smoothing) * out + label_smoothing * jnp.logaddexp(0.0, z)


def _output(loss: jax.Array, chosen: jax.Array, rejected: jax.Array, dtype) -> PreferenceLossOutput:
    chosen = jax.lax.stop_gradient(chosen)
    rejected = jax.lax.stop_gradient(rejected)
    fields = (loss, chosen, rejected, chosen - rejected, (chosen > rejected).astype(loss.dtype))
    return PreferenceLossOutput(*(f.astype(dtype) for f in fields))


def dpo_loss(
    chosen_logps: jax.typing.ArrayLike,
    rejected_logps: jax.typing.ArrayLike,
    ref_chosen_logps: jax.typing.ArrayLike,
    ref_rejected_logps: jax.typing.ArrayLike,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> PreferenceLossOutput:
    r"""Direct Preference Optimization, sigmoid loss (Rafailov et al., 2023), with cDPO.

    With the policy :math:`\pi_\theta`, the frozen reference :math:`\pi_\text{ref}`
    and sequence log-likelihoods (summed over completion tokens):

    .. math::

        r_w = \beta\,(\log\pi_\theta(y_w) - \log\pi_\text{ref}(y_w)),\qquad
        r_l = \beta\,(\log\pi_\theta(y_l) - \log\pi_\text{ref}(y_l)),\qquad z = r_w - r_l

        \ell = -(1-\varepsilon)\log\sigma(z) - \varepsilon\log\sigma(-z)

    :math:`\varepsilon` = ``label_smoothing`` is conservative DPO (cDPO,
    Mitchell 2023): the preference label is taken to be flipped with
    probability :math:`\varepsilon`; 0 is the original DPO loss. Computed as
    ``softplus`` of :math:`\mp z`, so it neither overflows nor loses precision
    for large :math:`|z|`.

    Args:
      chosen_logps: :math:`\log\pi_\theta(y_w)`, floating, any shape ``[...]``.
      rejected_logps: :math:`\log\pi_\theta(y_l)`, same shape.
      ref_chosen_logps: :math:`\log\pi_\text{ref}(y_w)`, same shape (no gradient
        is taken through it unless the caller does).
      ref_rejected_logps: :math:`\log\pi_\text{ref}(y_l)`, same shape.
      beta: :math:`\beta > 0`, the strength of the implicit KL constraint.
      label_smoothing: :math:`\varepsilon \in [0, 0.5]`.

    Returns:
      :class:`PreferenceLossOutput` with ``loss`` :math:`\ell` and the rewards
      :math:`r_w, r_l` above, per example.

    Raises:
      TypeError: a non-floating input, or a non-numeric hyperparameter.
      ValueError: inputs of different shapes, ``beta <= 0`` or ``label_smoothing``
        outside ``[0, 0.5]`` (when concrete).

    >>> from cairn.optim import losses
    >>> out = losses.dpo_loss(jnp.array([-10.0]), jnp.array([-12.0]),
    ...                       jnp.array([-11.0]), jnp.array([-11.0]), beta=0.5)
    >>> print(np.asarray(out.loss, float).round(4), out.margins, out.accuracies)
    [0.3133] [1.] [1.]
    """
    fn = "dpo_loss"
    _check_scalar(fn, "beta", beta, 0.0, math.inf, lo_open=True, hi_open=True)
    _check_scalar(fn, "label_smoothing", label_smoothing, 0.0, 0.5)
    (c, r, rc, rr), dtype = _inputs(
        fn, chosen_logps=chosen_logps, rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
    )
    chosen, rejected = beta * (c - rc), beta * (r - rr)
    loss = _logistic_loss(chosen - rejected, label_smoothing)
    return _output(loss, chosen, rejected, dtype)


def ipo_loss(
    chosen_logps: jax.typing.ArrayLike,
    rejected_logps: jax.typing.ArrayLike,
    ref_chosen_logps: jax.typing.ArrayLike,
    ref_rejected_logps: jax.typing.ArrayLike,
    *,
    beta: float = 0.1,
) -> PreferenceLossOutput:
    r"""Identity Preference Optimisation (Azar et al., 2023, "A General Theoretical
    Paradigm to Understand Learning from Human Preferences", eq. 17).

    .. math::

        h = \bigl(\log\pi_\theta(y_w) - \log\pi_\text{ref}(y_w)\bigr)
          - \bigl(\log\pi_\theta(y_l) - \log\pi_\text{ref}(y_l)\bigr),\qquad
        \ell = \Bigl(h - \frac{1}{2\tau}\Bigr)^2

    with :math:`\tau` = ``beta`` (the name TRL uses). A squared loss regresses the
    log-likelihood-ratio gap to :math:`1/(2\tau)` instead of pushing it to
    infinity, so IPO does not overfit deterministic preferences. The paper
    writes :math:`h` with sequence log-likelihoods (``sequence_logprobs``
    summed); TRL passes length-averaged ones (``average=True``), which changes
    the scale :math:`1/(2\tau)` is compared with: pass what you mean.
    Rewards for logging are :math:`r = \tau(\log\pi_\theta - \log\pi_\text{ref})`,
    so ``margins`` is :math:`\tau h`.

    Args:
      chosen_logps: as in :func:`dpo_loss`, floating ``[...]``.
      rejected_logps: as in :func:`dpo_loss`, the same shape.
      ref_chosen_logps: as in :func:`dpo_loss`, the same shape.
      ref_rejected_logps: as in :func:`dpo_loss`, the same shape.
      beta: :math:`\tau > 0`, the regularisation strength.

    Returns:
      :class:`PreferenceLossOutput`, per example.

    Raises:
      TypeError: a non-floating input.
      ValueError: inputs of different shapes, or ``beta <= 0`` (when concrete).

    >>> from cairn.optim import losses
    >>> out = losses.ipo_loss(jnp.array([-10.0]), jnp.array([-12.0]),
    ...                       jnp.array([-11.0]), jnp.array([-11.0]), beta=0.25)
    >>> print(out.loss)                  # (2 - 1/(2 * 0.25))**2
    [0.]
    """
    fn = "ipo_loss"
    _check_scalar(fn, "beta", beta, 0.0, math.inf, lo_open=True, hi_open=True)
    (c, r, rc, rr), dtype = _inputs(
        fn, chosen_logps=chosen_logps, rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
    )
    chosen, rejected = c - rc, r - rr
    loss = jnp.square(chosen - rejected - 1.0 / (2.0 * beta))
    return _output(loss, beta * chosen, beta * rejected, dtype)


def simpo_loss(
    chosen_logps: jax.typing.ArrayLike,
    rejected_logps: jax.typing.ArrayLike,
    *,
    beta: float = 2.0,
    gamma: float = 1.0,
    label_smoothing: float = 0.0,
) -> PreferenceLossOutput:
    r"""Simple Preference Optimization (Meng et al., 2024): length-normalised, no reference.

    With length-averaged log-probabilities
    :math:`\bar\ell(y) = \frac{1}{|y|}\log\pi_\theta(y)`
    (``sequence_logprobs(..., average=True)``):

    .. math::

        r_w = \beta\,\bar\ell(y_w),\qquad r_l = \beta\,\bar\ell(y_l),\qquad
        \ell = -(1-\varepsilon)\log\sigma(r_w - r_l - \gamma)
               - \varepsilon\log\sigma(-(r_w - r_l - \gamma))

    :math:`\gamma` is the target reward margin (in reward units, not divided by
    :math:`\beta`); :math:`\varepsilon` is label smoothing as in cDPO (0 is the
    paper's loss). The defaults :math:`\beta = 2`, :math:`\gamma = 1` sit in the
    range the paper tunes over (a ratio :math:`\gamma/\beta` of about 0.5);
    tune both per model.

    Args:
      chosen_logps: :math:`\bar\ell(y_w)`, floating ``[...]``.
      rejected_logps: :math:`\bar\ell(y_l)`, same shape.
      beta: :math:`\beta > 0`.
      gamma: the margin :math:`\gamma` (finite; may be 0 or negative).
      label_smoothing: :math:`\varepsilon \in [0, 0.5]`.

    Returns:
      :class:`PreferenceLossOutput`, per example; ``margins`` is
      :math:`r_w - r_l` (without :math:`\gamma`), ``accuracies`` is
      :math:`r_w > r_l`.

    Raises:
      TypeError: a non-floating input.
      ValueError: inputs of different shapes or a hyperparameter out of range
        (when concrete).

    >>> from cairn.optim import losses
    >>> out = losses.simpo_loss(jnp.array([-0.5]), jnp.array([-1.5]), beta=2.0, gamma=1.0)
    >>> print(np.asarray(out.loss, float).round(4), out.chosen_rewards, out.rejected_rewards)
    [0.3133] [-1.] [-3.]
    """
    fn = "simpo_loss"
    _check_scalar(fn, "beta", beta, 0.0, math.inf, lo_open=True, hi_open=True)
    _check_scalar(fn, "gamma", gamma, -math.inf, math.inf, lo_open=True, hi_open=True)
    _check_scalar(fn, "label_smoothing", label_smoothing, 0.0, 0.5)
    (c, r), dtype = _inputs(fn, chosen_logps=chosen_logps, rejected_logps=rejected_logps)
    chosen, rejected = beta * c, beta * r
    loss = _logistic_loss(chosen - rejected - gamma, label_smoothing)
    return _output(loss, chosen, rejected, dtype)


def _log1mexp(x: jax.Array) -> jax.Array:
    r""":math:`\log(1 - e^{x})` for :math:`x < 0`, accurate everywhere (Mächler 2012):
    ``log(-expm1(x))`` above :math:`-\log 2`, ``log1p(-exp(x))`` below. Each branch sees
    only inputs it is accurate and finite on, so neither feeds a NaN into the gradient."""
    near = x > -math.log(2.0)
    a = jnp.log(-jnp.expm1(jnp.where(near, x, -1.0)))
    b = jnp.log1p(-jnp.exp(jnp.where(near, -1.0, x)))
    return jnp.where(near, a, b)


def _log_odds(lp: jax.Array) -> jax.Array:
    r""":math:`\log\frac{p}{1-p}` from :math:`\log p`, with :math:`\log p` held below 0 by
    the smallest normal number (a probability that rounds to 1 has finite odds)."""
    lp = jnp.minimum(lp, -jnp.finfo(lp.dtype).tiny)
    return lp - _log1mexp(lp)


def _check_nonpositive(fn: str, **named: Any) -> None:
    for name, value in named.items():
        if isinstance(value, jax.core.Tracer):
            continue
        v = np.asarray(value)
        if v.size and np.issubdtype(v.dtype, np.floating) and np.nanmax(v) > 0:
            raise ValueError(
                f"{fn}: `{name}` must be log-probabilities (<= 0), found {float(np.nanmax(v))}"
            )


def orpo_loss(
    chosen_logps: jax.typing.ArrayLike,
    rejected_logps: jax.typing.ArrayLike,
    *,
    beta: float = 0.1,
    include_nll: bool = True,
) -> PreferenceLossOutput:
    r"""Odds Ratio Preference Optimization (Hong et al., 2024): SFT plus an odds-ratio term,
    no reference model.

    With length-averaged log-probabilities :math:`\bar\ell(y)`
    (``sequence_logprobs(..., average=True)``), :math:`P(y) = e^{\bar\ell(y)}` and
    the odds :math:`\operatorname{odds}(y) = P(y) / (1 - P(y))`:

    .. math::

        \mathcal L_\text{OR} = -\log\sigma\Bigl(\log\frac{\operatorname{odds}(y_w)}
            {\operatorname{odds}(y_l)}\Bigr),\qquad
        \ell = -\bar\ell(y_w) + \lambda\,\mathcal L_\text{OR}

    :math:`\lambda` = ``beta`` (TRL's name). The first term is the SFT loss on the
    chosen completion (the paper's :math:`\mathcal L_\text{SFT}`, token-averaged
    negative log-likelihood); ``include_nll=False`` leaves it out, for a caller
    that computes its own SFT loss. :math:`\log(1 - P)` is computed as
    :math:`\log(-\operatorname{expm1}(\bar\ell))` near :math:`P = 1` and
    :math:`\operatorname{log1p}(-e^{\bar\ell})` elsewhere, and a log-probability
    that rounds to 0 is taken as the largest one below 0, so the loss and its
    gradient stay finite for every :math:`\bar\ell \le 0`. Rewards for logging
    are :math:`\lambda\bar\ell(y)`, as in TRL.

    Args:
      chosen_logps: :math:`\bar\ell(y_w) \le 0`, floating ``[...]``.
      rejected_logps: :math:`\bar\ell(y_l) \le 0`, same shape.
      beta: :math:`\lambda > 0`, the weight of the odds-ratio term.
      include_nll: add the chosen completion's negative log-likelihood.

    Returns:
      :class:`PreferenceLossOutput`, per example.

    Raises:
      TypeError: a non-floating input.
      ValueError: inputs of different shapes, ``beta <= 0``, or (when concrete) a
        log-probability above 0.

    >>> from cairn.optim import losses
    >>> out = losses.orpo_loss(jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.2])), beta=1.0)
    >>> print(np.asarray(out.loss, float).round(4))          # log 2 - log sigmoid(log 4)
    [0.9163]
    """
    fn = "orpo_loss"
    _check_scalar(fn, "beta", beta, 0.0, math.inf, lo_open=True, hi_open=True)
    _check_nonpositive(fn, chosen_logps=chosen_logps, rejected_logps=rejected_logps)
    (c, r), dtype = _inputs(fn, chosen_logps=chosen_logps, rejected_logps=rejected_logps)
    odds_ratio_term = jnp.logaddexp(0.0, -(_log_odds(c) - _log_odds(r)))
    loss = beta * odds_ratio_term
    if include_nll:
        loss = loss - c
    return _output(loss, beta * c, beta * r, dtype)
