"""Optimizers: chains of transformations with Optax's names, defaults and equations.

Every optimizer takes ``learning_rate`` as a float or a schedule ``step -> value``.
The learning rate and weight decay live in the state (traced values), so
:func:`set_hyperparams` changes them without recompiling and :func:`get_hyperparams`
reads them. Adam-family optimizers take ``mu_dtype`` and ``nu_dtype``.
"""

from __future__ import annotations

from cairn.optim import _leafwise as lw
from cairn.optim import _transforms as tr
from cairn.optim import _validate
from cairn.optim._base import chain, check_scalar, identity
from cairn.optim._combine import masked

__all__ = [
    "sgd", "adam", "adamw", "nadam", "nadamw", "adamax", "adamaxw", "amsgrad", "adagrad",
    "adadelta", "adafactor", "adabelief", "lamb", "lars", "lion", "novograd", "radam", "rmsprop",
    "rprop", "sm3", "yogi", "fromage", "noisy_sgd", "sign_sgd", "signum",
]


def _lr(learning_rate):
    check_scalar("learning_rate", learning_rate)
    return tr.scale_by_learning_rate(learning_rate)


def sgd(learning_rate, momentum=None, nesterov: bool = False, accumulator_dtype=None):
    """SGD: :math:`u = -\\eta g`; with momentum :math:`f_t = g_t + \\mu f_{t-1}`, :math:`u = -\\eta f_t`
    (Nesterov: :math:`u = -\\eta (g_t + \\mu f_t)`).

    >>> import jax.numpy as jnp
    >>> tx = sgd(0.1)
    >>> u, _ = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.zeros(2)}))
    >>> u["w"].tolist()
    [-0.10000000149011612, -0.10000000149011612]
    """
    _validate.check("sgd", learning_rate=learning_rate, momentum=momentum)
    head = (tr.trace(momentum, nesterov, accumulator_dtype) if momentum is not None
            else identity())
    return chain(head, _lr(learning_rate))


def adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *,
         nesterov: bool = False, nu_dtype=None):
    """Adam: :math:`u = -\\eta\\,\\hat m_t/(\\sqrt{\\hat v_t + \\epsilon_{root}} + \\epsilon)`
    (see :func:`scale_by_adam`)."""
    _validate.check("adam", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    return chain(tr.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov,
                                  nu_dtype=nu_dtype), _lr(learning_rate))


def adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
          weight_decay=1e-4, mask=None, *, nesterov: bool = False, nu_dtype=None):
    """AdamW: :math:`u = -\\eta\\,(\\hat m_t/(\\sqrt{\\hat v_t+\\epsilon_{root}}+\\epsilon) + \\lambda\\theta)`,
    decay applied where ``mask`` is true (pytree, callable or path rules)."""
    _validate.check(
        "adamw",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        weight_decay=weight_decay,
    )
    return chain(tr.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov,
                                  nu_dtype=nu_dtype),
                 tr.add_decayed_weights(weight_decay, mask), _lr(learning_rate))


def nadam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *,
          nesterov: bool = True, nu_dtype=None):
    """NAdam: Adam with the Nesterov first moment (``nesterov=True``)."""
    _validate.check("nadam", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    return adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov,
                nu_dtype=nu_dtype)


def nadamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
           weight_decay=1e-4, mask=None, *, nesterov: bool = True, nu_dtype=None):
    """NAdamW: AdamW with the Nesterov first moment."""
    _validate.check(
        "nadamw",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        weight_decay=weight_decay,
    )
    return adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask,
                 nesterov=nesterov, nu_dtype=nu_dtype)


def adamax(learning_rate, b1=0.9, b2=0.999, eps=1e-8, *, mu_dtype=None, nu_dtype=None):
    """AdaMax: :math:`u = -\\eta\\,\\hat m_t / v_t`, :math:`v_t = \\max(|g_t|+\\epsilon, \\beta_2 v_{t-1})`."""
    _validate.check("adamax", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps)
    return chain(tr.scale_by_adamax(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
                 _lr(learning_rate))


def adamaxw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, mask=None, *,
            mu_dtype=None, nu_dtype=None):
    """AdaMax with decoupled weight decay."""
    _validate.check(
        "adamaxw",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
    )
    return chain(tr.scale_by_adamax(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
                 tr.add_decayed_weights(weight_decay, mask), _lr(learning_rate))


def amsgrad(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
            bias_correction_mu: bool = True, bias_correction_nu: bool = True, *, nu_dtype=None):
    """AMSGrad: Adam with the running maximum of :math:`\\hat v_t` (see :func:`scale_by_amsgrad`)."""
    _validate.check(
        "amsgrad",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
    )
    return chain(tr.scale_by_amsgrad(b1, b2, eps, eps_root, mu_dtype, bias_correction_mu,
                                     bias_correction_nu, nu_dtype=nu_dtype), _lr(learning_rate))


def adagrad(learning_rate, initial_accumulator_value=0.1, eps=1e-7):
    """Adagrad: :math:`s_t = s_{t-1} + g_t^2`, :math:`u = -\\eta g_t/\\sqrt{s_t+\\epsilon}`."""
    _validate.check(
        "adagrad",
        learning_rate=learning_rate, initial_accumulator_value=initial_accumulator_value, eps=eps,
    )
    return chain(tr.scale_by_rss(initial_accumulator_value, eps), _lr(learning_rate))


def adadelta(learning_rate=None, rho=0.9, eps=1e-6, weight_decay=0.0, weight_decay_mask=None):
    """AdaDelta (Zeiler 2012), with optional weight decay added to the gradient first;
    ``learning_rate=None`` means 1."""
    _validate.check(
        "adadelta",
        learning_rate=learning_rate, rho=rho, eps=eps, weight_decay=weight_decay,
    )
    return chain(tr.add_decayed_weights(weight_decay, weight_decay_mask),
                 tr.scale_by_adadelta(rho, eps),
                 _lr(1.0 if learning_rate is None else learning_rate))


def adafactor(learning_rate=None, min_dim_size_to_factor: int = 128, decay_rate=0.8,
              decay_offset=0, multiply_by_parameter_scale: bool = True, clipping_threshold=1.0,
              momentum=None, dtype_momentum="float32", weight_decay_rate=None, eps=1e-30,
              factored: bool = True, weight_decay_mask=None):
    """Adafactor: factored RMS scaling (:func:`scale_by_factored_rms`), block-RMS clipping,
    learning rate, scaling by the parameter RMS, optional momentum and weight decay, then
    :math:`u \\leftarrow -u`."""
    _validate.check(
        "adafactor",
        learning_rate=learning_rate, min_dim_size_to_factor=min_dim_size_to_factor,
        decay_rate=decay_rate, decay_offset=decay_offset, clipping_threshold=clipping_threshold,
        momentum=momentum, weight_decay_rate=weight_decay_rate, eps=eps,
    )
    txs = [lw.scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor,
                                    eps)]
    if clipping_threshold is not None:
        txs.append(lw.clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        check_scalar("learning_rate", learning_rate)
        txs.append(tr.scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        txs.append(lw.scale_by_param_block_rms())
    if momentum is not None:
        txs.append(tr.ema(momentum, debias=False, accumulator_dtype=dtype_momentum))
    if weight_decay_rate is not None:
        txs.append(tr.add_decayed_weights(weight_decay_rate, weight_decay_mask))
    txs.append(tr.scale(-1))
    return chain(*txs)


def adabelief(learning_rate, b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16, *,
              nesterov: bool = False, mu_dtype=None, nu_dtype=None):
    """AdaBelief: Adam with the variance of the prediction error :math:`g_t - m_t`."""
    _validate.check(
        "adabelief",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
    )
    return chain(tr.scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov, mu_dtype=mu_dtype,
                                    nu_dtype=nu_dtype), _lr(learning_rate))


def lamb(learning_rate, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay=0.0, mask=None,
         *, mu_dtype=None, nu_dtype=None):
    """LAMB: Adam direction plus decay, rescaled per leaf by the trust ratio
    :math:`\\|\\theta\\|/\\|u\\|`, times :math:`-\\eta`."""
    _validate.check(
        "lamb",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        weight_decay=weight_decay,
    )
    return chain(tr.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nu_dtype=nu_dtype),
                 tr.add_decayed_weights(weight_decay, mask), lw.scale_by_trust_ratio(),
                 _lr(learning_rate))


def lars(learning_rate, weight_decay=0.0, weight_decay_mask=True, trust_coefficient=0.001,
         eps=0.0, trust_ratio_mask=True, momentum=0.9, nesterov: bool = False):
    """LARS: decay, per-leaf trust ratio :math:`c\\|\\theta\\|/(\\|u\\|+\\epsilon)`, :math:`-\\eta`,
    then momentum."""
    _validate.check(
        "lars",
        learning_rate=learning_rate, weight_decay=weight_decay,
        trust_coefficient=trust_coefficient, eps=eps, momentum=momentum,
    )
    return chain(tr.add_decayed_weights(weight_decay, weight_decay_mask),
                 masked(lw.scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps),
                        trust_ratio_mask),
                 _lr(learning_rate), tr.trace(momentum, nesterov))


def lion(learning_rate, b1=0.9, b2=0.99, mu_dtype=None, weight_decay=1e-3, mask=None):
    """Lion: :math:`u = -\\eta(\\mathrm{sign}((1-\\beta_1)g_t + \\beta_1 m_{t-1}) + \\lambda\\theta)`."""
    _validate.check("lion", learning_rate=learning_rate, b1=b1, b2=b2, weight_decay=weight_decay)
    return chain(tr.scale_by_lion(b1, b2, mu_dtype), tr.add_decayed_weights(weight_decay, mask),
                 _lr(learning_rate))


def novograd(learning_rate, b1=0.9, b2=0.25, eps=1e-6, eps_root=0.0, weight_decay=0.0, *,
             mu_dtype=None):
    """NovoGrad: layer-wise second moments (see :func:`scale_by_novograd`)."""
    _validate.check(
        "novograd",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        weight_decay=weight_decay,
    )
    return chain(lw.scale_by_novograd(b1, b2, eps, eps_root, weight_decay, mu_dtype),
                 _lr(learning_rate))


def radam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, threshold=5.0, *,
          nesterov: bool = False, mu_dtype=None, nu_dtype=None):
    """RAdam: rectified Adam (see :func:`scale_by_radam`)."""
    _validate.check(
        "radam",
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        threshold=threshold,
    )
    return chain(tr.scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov,
                                   mu_dtype=mu_dtype, nu_dtype=nu_dtype), _lr(learning_rate))


def rmsprop(learning_rate, decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt: bool = True,
            centered: bool = False, momentum=None, nesterov: bool = False,
            bias_correction: bool = False):
    """RMSProp (optionally centred, with momentum)."""
    _validate.check(
        "rmsprop",
        learning_rate=learning_rate, decay=decay, eps=eps, initial_scale=initial_scale,
        momentum=momentum,
    )
    if centered:
        head = tr.scale_by_stddev(decay, eps, initial_scale, eps_in_sqrt, bias_correction)
    else:
        head = tr.scale_by_rms(decay, eps, initial_scale, eps_in_sqrt, bias_correction)
    tail = tr.trace(momentum, nesterov) if momentum is not None else identity()
    return chain(head, _lr(learning_rate), tail)


def rprop(learning_rate, eta_minus=0.5, eta_plus=1.2, min_step_size=1e-6, max_step_size=50.0):
    """Rprop (sign-based adaptive step sizes), :math:`u = -\\mathrm{step}\\cdot\\mathrm{sign}(g)`."""
    _validate.check(
        "rprop",
        learning_rate=learning_rate, eta_minus=eta_minus, eta_plus=eta_plus,
        min_step_size=min_step_size, max_step_size=max_step_size,
    )
    return chain(tr.scale_by_rprop(learning_rate, eta_minus, eta_plus, min_step_size,
                                   max_step_size), tr.scale(-1.0))


def sm3(learning_rate, momentum=0.9):
    """SM3 with momentum, times :math:`-\\eta`."""
    _validate.check("sm3", learning_rate=learning_rate, momentum=momentum)
    return chain(lw.scale_by_sm3(momentum), _lr(learning_rate))


def yogi(learning_rate, b1=0.9, b2=0.999, eps=1e-3, *, mu_dtype=None, nu_dtype=None):
    """Yogi: additive second-moment update (see :func:`scale_by_yogi`)."""
    _validate.check("yogi", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps)
    return chain(tr.scale_by_yogi(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
                 _lr(learning_rate))


def fromage(learning_rate, min_norm=1e-6):
    """Fromage: trust-ratio step :math:`-\\eta/\\sqrt{1+\\eta^2}`, weights shrunk by
    :math:`1/\\sqrt{1+\\eta^2}`."""
    _validate.check("fromage", learning_rate=learning_rate, min_norm=min_norm)
    check_scalar("learning_rate", learning_rate)
    if callable(learning_rate):
        def mult(c):
            return 1 / (1 + learning_rate(c) ** 2) ** 0.5

        return chain(lw.scale_by_trust_ratio(min_norm),
                     tr.scale_by_learning_rate(lambda c: mult(c) * learning_rate(c)),
                     tr.add_decayed_weights(lambda c: mult(c) - 1))
    m = 1 / (1 + learning_rate ** 2) ** 0.5
    return chain(lw.scale_by_trust_ratio(min_norm), tr.scale_by_learning_rate(learning_rate * m),
                 tr.add_decayed_weights(m - 1))


def noisy_sgd(learning_rate, eta=0.01, gamma=0.55, key=None, *, seed: int | None = None):
    """Noisy SGD: :math:`u = -\\eta(g + \\mathcal N(0, \\eta_n/(1+t)^\\gamma))`."""
    _validate.check("noisy_sgd", learning_rate=learning_rate, eta=eta, gamma=gamma)
    if key is None and seed is None:
        seed = 0
    return chain(tr.add_noise(eta, gamma, key, seed=seed), _lr(learning_rate))


def sign_sgd(learning_rate):
    """signSGD: :math:`u = -\\eta\\,\\mathrm{sign}(g)`."""
    _validate.check("sign_sgd", learning_rate=learning_rate)
    return chain(tr.scale_by_sign(), _lr(learning_rate))


def signum(learning_rate, beta=0.9, accumulator_dtype=None):
    """Signum: :math:`u = -\\eta\\,\\mathrm{sign}(m_t)` with :math:`m_t` an EMA of gradients."""
    _validate.check("signum", learning_rate=learning_rate, beta=beta)
    return chain(tr.ema(beta, debias=False, accumulator_dtype=accumulator_dtype),
                 tr.scale_by_sign(), _lr(learning_rate))
