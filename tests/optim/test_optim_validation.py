"""Concrete hyperparameters are validated when the factory is called.

Issue 12, item 8: ``lr=+inf`` (which made every parameter non-finite), ``lr='0.01'``,
``b1=1.5`` and ``eps=-1`` were accepted. Now every public factory of cairn.optim that
takes such numbers checks them eagerly and raises ``TypeError`` (not a real number) or
``ValueError`` (NaN, an infinity, out of range) naming the factory and the argument.

The table below lists every factory with the arguments it needs and, per checked
argument, values that must be refused; it is written out by hand (not derived from the
rule table in ``_validate``), so a rule that drifts is caught. Traced hyperparameters
(inside ``jax.jit``, or fed by ``inject_hyperparams``) are not checked and still work,
and good values give the same updates as before.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import optim

INF, NAN = math.inf, math.nan

# bad values per kind of argument: (value, exception)
LR_BAD = [(INF, ValueError), (NAN, ValueError), (-0.1, ValueError), ("0.01", TypeError),
          (True, TypeError), ([0.1], TypeError), (np.inf, ValueError)]
BETA_BAD = [(1.5, ValueError), (1.0, ValueError), (-0.1, ValueError), (NAN, ValueError),
            ("0.9", TypeError)]
UNIT_BAD = [(1.5, ValueError), (-0.1, ValueError), (NAN, ValueError), ("0.9", TypeError)]
NONNEG_BAD = [(-1.0, ValueError), (INF, ValueError), (NAN, ValueError), ("1e-8", TypeError)]
CLIP_BAD = [(-1.0, ValueError), (-INF, ValueError), (NAN, ValueError), ("1", TypeError)]
POS_BAD = [(0.0, ValueError), (-1.0, ValueError), (INF, ValueError), ("1", TypeError)]
FINITE_BAD = [(INF, ValueError), (-INF, ValueError), (NAN, ValueError), ("0.1", TypeError)]
COUNT_BAD = [(-1, ValueError), (2.5, TypeError), ("3", TypeError), (INF, ValueError)]
SCHED_COUNT_BAD = [(-1, ValueError), (2.5, TypeError), ("3", TypeError), (INF, TypeError)]
POS_COUNT_BAD = [(0, ValueError), (-2, ValueError), (1.5, TypeError), ("2", TypeError)]

ADAM = {"b1": BETA_BAD, "b2": BETA_BAD, "eps": NONNEG_BAD, "eps_root": NONNEG_BAD}
LR = {"learning_rate": LR_BAD}
WD = {"weight_decay": FINITE_BAD}


def _sgd():
    return optim.sgd(0.1)


# factory, the arguments it needs, {argument: [(bad value, exception), ...]}
FACTORIES = [
    (optim.sgd, {"learning_rate": 0.1}, {**LR, "momentum": UNIT_BAD}),
    (optim.adam, {"learning_rate": 0.1}, {**LR, **ADAM}),
    (optim.adamw, {"learning_rate": 0.1}, {**LR, **ADAM, **WD}),
    (optim.nadam, {"learning_rate": 0.1}, {**LR, **ADAM}),
    (optim.nadamw, {"learning_rate": 0.1}, {**LR, **ADAM, **WD}),
    (optim.adamax, {"learning_rate": 0.1}, {**LR, "b1": BETA_BAD, "b2": BETA_BAD,
                                             "eps": NONNEG_BAD}),
    (optim.adamaxw, {"learning_rate": 0.1}, {**LR, "b1": BETA_BAD, "eps": NONNEG_BAD, **WD}),
    (optim.amsgrad, {"learning_rate": 0.1}, {**LR, **ADAM}),
    (optim.adagrad, {"learning_rate": 0.1}, {**LR, "initial_accumulator_value": NONNEG_BAD,
                                              "eps": NONNEG_BAD}),
    (optim.adadelta, {}, {**LR, "rho": UNIT_BAD, "eps": NONNEG_BAD, **WD}),
    (optim.adafactor, {}, {**LR, "min_dim_size_to_factor": COUNT_BAD, "decay_rate": NONNEG_BAD,
                           "decay_offset": COUNT_BAD, "clipping_threshold": POS_BAD,
                           "momentum": UNIT_BAD, "weight_decay_rate": FINITE_BAD,
                           "eps": NONNEG_BAD}),
    (optim.adabelief, {"learning_rate": 0.1}, {**LR, **ADAM}),
    (optim.lamb, {"learning_rate": 0.1}, {**LR, **ADAM, **WD}),
    (optim.lars, {"learning_rate": 0.1}, {**LR, **WD, "trust_coefficient": NONNEG_BAD,
                                           "eps": NONNEG_BAD, "momentum": UNIT_BAD}),
    (optim.lion, {"learning_rate": 0.1}, {**LR, "b1": BETA_BAD, "b2": BETA_BAD, **WD}),
    (optim.novograd, {"learning_rate": 0.1}, {**LR, **ADAM, **WD}),
    (optim.radam, {"learning_rate": 0.1}, {**LR, **ADAM, "threshold": FINITE_BAD}),
    (optim.rmsprop, {"learning_rate": 0.1}, {**LR, "decay": UNIT_BAD, "eps": NONNEG_BAD,
                                              "initial_scale": NONNEG_BAD, "momentum": UNIT_BAD}),
    (optim.rprop, {"learning_rate": 0.1}, {**LR, "eta_minus": POS_BAD, "eta_plus": POS_BAD,
                                            "min_step_size": NONNEG_BAD,
                                            "max_step_size": POS_BAD}),
    (optim.sm3, {"learning_rate": 0.1}, {**LR, "momentum": UNIT_BAD}),
    (optim.yogi, {"learning_rate": 0.1}, {**LR, "b1": BETA_BAD, "b2": BETA_BAD,
                                           "eps": NONNEG_BAD}),
    (optim.fromage, {"learning_rate": 0.1}, {**LR, "min_norm": NONNEG_BAD}),
    (optim.noisy_sgd, {"learning_rate": 0.1, "seed": 0}, {**LR, "eta": NONNEG_BAD,
                                                          "gamma": NONNEG_BAD}),
    (optim.sign_sgd, {"learning_rate": 0.1}, LR),
    (optim.signum, {"learning_rate": 0.1}, {**LR, "beta": BETA_BAD}),
    (optim.muon, {"learning_rate": 0.1}, {**LR, "ns_steps": COUNT_BAD, "beta": BETA_BAD,
                                           "eps": NONNEG_BAD, **WD, "adam_b1": BETA_BAD,
                                           "adam_b2": BETA_BAD, "adam_eps_root": NONNEG_BAD,
                                           "adam_weight_decay": FINITE_BAD,
                                           "adam_learning_rate": LR_BAD}),
    (optim.shampoo, {"learning_rate": 0.1}, {**LR, "b1": BETA_BAD, "b2": BETA_BAD,
                                              "eps": NONNEG_BAD, "block_size": POS_COUNT_BAD,
                                              "precondition_every": POS_COUNT_BAD, **WD,
                                              "graft_eps": NONNEG_BAD}),
    (optim.schedule_free, {"base_optimizer": _sgd(), "learning_rate": 0.1},
     {**LR, "b1": BETA_BAD, "weight_lr_power": FINITE_BAD}),
    (optim.schedule_free_sgd, {}, {**LR, "warmup_steps": COUNT_BAD, "b1": BETA_BAD,
                                   "weight_decay": FINITE_BAD}),
    (optim.schedule_free_adamw, {}, {**LR, "warmup_steps": COUNT_BAD, "b1": BETA_BAD,
                                     "b2": BETA_BAD, "eps": NONNEG_BAD, **WD,
                                     "weight_lr_power": FINITE_BAD}),
    # transformations
    (optim.scale, {"step_size": -0.1}, {"step_size": FINITE_BAD}),
    (optim.scale_by_learning_rate, {"learning_rate": 0.1}, LR),
    (optim.scale_by_adam, {}, ADAM),
    (optim.scale_by_amsgrad, {}, ADAM),
    (optim.scale_by_adamax, {}, {"b1": BETA_BAD, "b2": BETA_BAD, "eps": NONNEG_BAD}),
    (optim.scale_by_belief, {}, ADAM),
    (optim.scale_by_radam, {}, {**ADAM, "threshold": FINITE_BAD}),
    (optim.scale_by_yogi, {}, {**ADAM, "initial_accumulator_value": NONNEG_BAD}),
    (optim.scale_by_lion, {}, {"b1": BETA_BAD, "b2": BETA_BAD, "smooth_beta": POS_BAD}),
    (optim.scale_by_rms, {}, {"decay": UNIT_BAD, "eps": NONNEG_BAD,
                              "initial_scale": NONNEG_BAD}),
    (optim.scale_by_stddev, {}, {"decay": UNIT_BAD, "eps": NONNEG_BAD}),
    (optim.scale_by_rss, {}, {"initial_accumulator_value": NONNEG_BAD, "eps": NONNEG_BAD}),
    (optim.scale_by_adadelta, {}, {"rho": UNIT_BAD, "eps": NONNEG_BAD}),
    (optim.scale_by_rprop, {"learning_rate": 0.1}, {**LR, "eta_minus": POS_BAD,
                                                     "max_step_size": POS_BAD}),
    (optim.scale_by_muon, {}, {"ns_steps": COUNT_BAD, "beta": BETA_BAD, "eps": NONNEG_BAD}),
    (optim.scale_by_shampoo, {}, {"b2": BETA_BAD, "eps": NONNEG_BAD,
                                  "block_size": POS_COUNT_BAD,
                                  "precondition_every": POS_COUNT_BAD}),
    (optim.add_decayed_weights, {}, WD),
    (optim.scale_by_factored_rms, {}, {"decay_rate": NONNEG_BAD, "step_offset": COUNT_BAD,
                                       "min_dim_size_to_factor": COUNT_BAD,
                                       "epsilon": NONNEG_BAD}),
    (optim.scale_by_trust_ratio, {}, {"min_norm": NONNEG_BAD, "trust_coefficient": NONNEG_BAD,
                                      "eps": NONNEG_BAD}),
    (optim.scale_by_novograd, {}, {**ADAM, **WD}),
    (optim.scale_by_sm3, {}, {"b1": BETA_BAD, "b2": UNIT_BAD, "eps": NONNEG_BAD}),
    (optim.scale_by_param_block_rms, {}, {"min_scale": NONNEG_BAD}),
    (optim.scale_by_param_block_norm, {}, {"min_scale": NONNEG_BAD}),
    (optim.clip_by_block_rms, {"threshold": 1.0}, {"threshold": POS_BAD[:2] + POS_BAD[3:] + [(NAN, ValueError)]}),
    (optim.adaptive_grad_clip, {"clipping": 0.1}, {"clipping": NONNEG_BAD, "eps": NONNEG_BAD}),
    (optim.add_noise, {"eta": 0.01, "gamma": 0.55, "seed": 0}, {"eta": NONNEG_BAD,
                                                                "gamma": NONNEG_BAD}),
    (optim.trace, {"decay": 0.9}, {"decay": UNIT_BAD}),
    (optim.ema, {"decay": 0.9}, {"decay": BETA_BAD}),  # debiasing divides by 1 - decay
    (optim.clip, {"max_delta": 1.0}, {"max_delta": CLIP_BAD}),
    (optim.clip_by_global_norm, {"max_norm": 1.0}, {"max_norm": CLIP_BAD}),
    # wrappers
    (optim.apply_if_finite, {"inner": _sgd(), "max_consecutive_errors": 3},
     {"max_consecutive_errors": COUNT_BAD}),
    (optim.apply_every, {}, {"k": POS_COUNT_BAD}),
    (optim.MultiSteps, {"opt": _sgd(), "every_k_schedule": 2},
     {"every_k_schedule": POS_COUNT_BAD}),
    (optim.lookahead, {"fast_optimizer": _sgd(), "sync_period": 5, "slow_step_size": 0.5},
     {"sync_period": POS_COUNT_BAD, "slow_step_size": UNIT_BAD}),
    # schedules (validated by _schedules itself; listed so every factory is covered)
    (optim.constant_schedule, {"value": 0.1}, {"value": FINITE_BAD}),
    (optim.linear_schedule, {"init_value": 1.0, "end_value": 0.0, "transition_steps": 10},
     {"init_value": FINITE_BAD, "end_value": FINITE_BAD, "transition_steps": SCHED_COUNT_BAD}),
    (optim.cosine_decay_schedule, {"init_value": 1.0, "decay_steps": 10},
     {"init_value": FINITE_BAD, "decay_steps": POS_COUNT_BAD}),
    (optim.warmup_cosine_decay_schedule,
     {"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 2, "decay_steps": 10},
     {"peak_value": FINITE_BAD, "warmup_steps": SCHED_COUNT_BAD}),
    (optim.linear_onecycle_schedule, {"transition_steps": 10, "peak_value": 1.0},
     {"peak_value": FINITE_BAD, "pct_start": UNIT_BAD, "div_factor": POS_BAD,
      "final_div_factor": POS_BAD}),
    (optim.cosine_onecycle_schedule, {"transition_steps": 10, "peak_value": 1.0},
     {"pct_start": UNIT_BAD, "div_factor": POS_BAD, "final_div_factor": POS_BAD}),
    (optim.exponential_decay, {"init_value": 1.0, "transition_steps": 10, "decay_rate": 0.5},
     {"init_value": FINITE_BAD, "transition_steps": SCHED_COUNT_BAD}),
]

CASES = [
    pytest.param(factory, needed, arg, bad, exc,
                 id=f"{factory.__name__}-{arg}={bad!r}")
    for factory, needed, table in FACTORIES
    for arg, bads in table.items()
    for bad, exc in bads
]


@pytest.mark.parametrize("factory,needed,arg,bad,exc", CASES)
def test_bad_hyperparameter_raises_naming_factory_and_argument(factory, needed, arg, bad, exc):
    with pytest.raises(exc) as info:
        factory(**{**needed, arg: bad})
    msg = str(info.value)
    assert factory.__name__ in msg and arg in msg, msg


@pytest.mark.parametrize(
    "call",
    [
        lambda: optim.adam(float("inf")),
        lambda: optim.adam("0.01"),
        lambda: optim.adam(1e-3, b1=1.5),
        lambda: optim.adam(1e-3, eps=-1),
        lambda: optim.sgd(learning_rate=jnp.inf),
        lambda: optim.adamw(1e-3, weight_decay=float("nan")),
    ],
    ids=["lr=inf", "lr=str", "b1=1.5", "eps=-1", "sgd-lr=jnp.inf", "adamw-wd=nan"],
)
def test_the_issue_examples_raise(call):
    with pytest.raises((TypeError, ValueError)):
        call()


def test_messages_read_well():
    with pytest.raises(TypeError, match=r"adam: learning_rate must be a number or a "
                                        r"schedule \(step -> value\), got '0.01' \(str\)"):
        optim.adam("0.01")
    with pytest.raises(ValueError, match=r"adam: b1 must be in \[0, 1\), got 1.5"):
        optim.adam(1e-3, b1=1.5)
    with pytest.raises(ValueError, match=r"sgd: learning_rate must be finite, got inf"):
        optim.sgd(float("inf"))


PARAMS = {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]]), "b": jnp.array([0.1, -0.2])}
GRADS = {"w": jnp.array([[0.1, 0.2], [-0.3, 0.4]]), "b": jnp.array([0.05, -0.5])}


def _step(tx):
    updates, _ = tx.update(GRADS, tx.init(PARAMS), PARAMS)
    return updates


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.adam(0.0, b1=0.0, b2=0.0, eps=0.0, eps_root=1e-12),
        lambda: optim.adam(np.float32(1e-3), b1=np.float64(0.9)),
        lambda: optim.adam(jnp.asarray(1e-3), b1=jnp.asarray(0.9)),
        lambda: optim.sgd(1, momentum=0),
        lambda: optim.sgd(optim.linear_schedule(0.1, 0.0, 10), momentum=1.0),
        lambda: optim.adamw(1e-3, weight_decay=-1e-4),
        lambda: optim.adamw(1e-3, weight_decay=lambda step: 1e-4),
        lambda: optim.ema(1.0, debias=False),
        lambda: optim.apply_every(k=1e0),
        lambda: optim.adafactor(min_dim_size_to_factor=1e2),
        lambda: optim.clip_by_global_norm(0.0),
        lambda: optim.chain(optim.clip(INF), optim.clip_by_global_norm(INF)),
        lambda: optim.scale_by_lion(mode="smooth", smooth_beta=2.0),
    ],
    ids=["zeros", "numpy-scalars", "jax-scalars", "int-lr", "schedule-momentum-1",
         "negative-wd", "wd-schedule", "ema-1", "k-float-whole", "count-float-whole",
         "clip-0", "clip-inf", "lion-smooth-beta-2"],
)
def test_good_edge_values_are_accepted(make):
    updates = _step(make())
    assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(updates))


def test_good_values_give_the_same_updates_as_a_reference():
    """Validation only reads the values: Adam's first step is still -lr * sign-ish
    g / (|g| + eps) (bias-corrected moments of one step)."""
    lr, eps = 1e-2, 1e-8
    u = _step(optim.adam(lr, b1=0.9, b2=0.999, eps=eps))
    for k in PARAMS:
        g = np.asarray(GRADS[k], np.float64)
        np.testing.assert_allclose(np.asarray(u[k]), -lr * g / (np.abs(g) + eps), rtol=1e-5)


def test_traced_hyperparameters_inside_jit_are_not_checked_and_work():
    """Inside jit the hyperparameters are tracers: the factory must not call float() on
    them (a ConcretizationTypeError) and must not reject them."""

    @jax.jit
    def step(lr, b1, eps, wd):
        tx = optim.adamw(lr, b1=b1, eps=eps, weight_decay=wd)
        return _step(tx)

    got = step(1e-2, 0.9, 1e-8, 0.0)
    want = _step(optim.adamw(1e-2, b1=0.9, eps=1e-8, weight_decay=0.0))
    for k in PARAMS:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6)

    @jax.jit
    def sgd_step(lr, momentum, max_norm):
        tx = optim.chain(optim.clip_by_global_norm(max_norm), optim.sgd(lr, momentum=momentum))
        return _step(tx)

    sgd_step(0.1, 0.9, 1.0)


def test_inject_hyperparams_still_works():
    tx = optim.inject_hyperparams(optim.adam)(learning_rate=1e-2, b1=0.9)
    state = tx.init(PARAMS)
    updates, state = jax.jit(tx.update)(GRADS, state, PARAMS)
    want = _step(optim.adam(1e-2, b1=0.9))
    for k in PARAMS:  # injected hyperparameters are float32 arrays: float32 rounding
        np.testing.assert_allclose(updates[k], want[k], rtol=1e-4)
    # a bad concrete value given to inject_hyperparams is refused at the factory too
    with pytest.raises(ValueError, match="b1"):
        optim.inject_hyperparams(optim.adam)(learning_rate=1e-2, b1=1.5).init(PARAMS)


# --- a learning rate is validated once, in one place (issue 31) ---


def _factories_taking_a_learning_rate():
    import inspect

    from cairn.optim import contrib

    seen = {}
    for mod in (optim, contrib):
        for name in dir(mod):
            fn = getattr(mod, name)
            if name.startswith("_") or not inspect.isfunction(fn) or name in seen:
                continue
            params = inspect.signature(fn).parameters
            if "learning_rate" in params:
                seen[name] = (fn, params["learning_rate"].default)
    return seen


LR_FACTORIES = _factories_taking_a_learning_rate()
# where ``learning_rate=None`` has a meaning (no step, a step of 1)
LR_OPTIONAL = {"scale_by_learning_rate", "adafactor", "adadelta", "lbfgs"}
# the arguments a factory needs besides the learning rate
LR_NEEDS = {"schedule_free": lambda: {"base_optimizer": optim.sgd(0.1)}}


@pytest.mark.parametrize("name", sorted(LR_FACTORIES))
def test_every_learning_rate_is_checked_once_by_the_one_rule(name, monkeypatch):
    from cairn.optim import _validate

    fn, _default = LR_FACTORIES[name]
    needed = LR_NEEDS.get(name, dict)()
    real = _validate.check
    seen = []

    def counting(factory, rules=None, **values):
        if "learning_rate" in values:
            seen.append(factory)
        return real(factory, rules, **values)

    monkeypatch.setattr(_validate, "check", counting)
    fn(learning_rate=0.1, **needed)
    assert seen == [name], f"{name}: learning_rate checked by {seen}"
    with pytest.raises(ValueError, match=rf"^{name}: learning_rate must be finite, got inf"):
        fn(learning_rate=INF, **needed)
    with pytest.raises(ValueError, match=rf"^{name}: learning_rate must be >= 0, got -0.1"):
        fn(learning_rate=-0.1, **needed)
    if name in LR_OPTIONAL:
        fn(learning_rate=None, **needed)
    else:
        with pytest.raises(TypeError, match=rf"^{name}: learning_rate must be a number or a schedule .* got None"):
            fn(learning_rate=None, **needed)


def test_the_learning_rate_factories_were_found():
    assert {"adam", "sgd", "muon", "adafactor", "dog", "cocob", "prodigy", "lbfgs",
            "scale_by_learning_rate"} <= set(LR_FACTORIES)
