"""Every optimizer against an independent float64 NumPy implementation, step by step.

Protocol: at each of 20 steps the reference (float64) and ours (float32 or bfloat16) see the
same gradient and the same params (the reference trajectory, cast to the dtype); our state
evolves on its own. Tolerances, relative to the largest reference update of the step:
  float32: every element within 1e-3 (sign-based methods: 99% of elements; RAdam and
  Shampoo 1e-2, see F32_TOL);
  bfloat16: 95% of elements within 6e-2 (bf16 has an 8-bit mantissa and the moments are
  stored in bf16, so a few elements drift further; sign methods flip near 0).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from cairn import optim
from optim import _optim_refs as R

SHAPES = {"w": (4, 3), "b": (5,), "k": (2, 3, 2)}
SIGN_BASED = {"lion", "signum", "rprop", "sign_sgd"}
# float32 cancellation: RAdam's rho_t = rho_inf - 2t b2^t/(1-b2^t) near the threshold; Shampoo's
# eigh-based inverse 4th roots of matrices with condition numbers up to 1/eps.
F32_TOL = {"radam": 1e-2, "shampoo": 1e-2}
BF16_FRAC: dict[str, float] = {}

CASES = {
    "adam": (lambda: optim.adam(0.01), lambda: R.Adam(lr=0.01)),
    "adamw": (lambda: optim.adamw(0.01, weight_decay=0.1), lambda: R.Adam(lr=0.01, wd=0.1)),
    "nadam": (lambda: optim.nadam(0.01), lambda: R.Adam(lr=0.01, nesterov=True)),
    "nadamw": (lambda: optim.nadamw(0.01, weight_decay=0.1),
               lambda: R.Adam(lr=0.01, wd=0.1, nesterov=True)),
    "amsgrad": (lambda: optim.amsgrad(0.01), lambda: R.AMSGrad(lr=0.01)),
    "adamax": (lambda: optim.adamax(0.01), lambda: R.AdaMax(lr=0.01)),
    "adabelief": (lambda: optim.adabelief(0.01), lambda: R.AdaBelief(lr=0.01)),
    "radam": (lambda: optim.radam(0.01), lambda: R.RAdam(lr=0.01)),
    "yogi": (lambda: optim.yogi(0.01), lambda: R.Yogi(lr=0.01)),
    "lion": (lambda: optim.lion(0.01), lambda: R.Lion(lr=0.01)),
    "rmsprop": (lambda: optim.rmsprop(0.01), lambda: R.RMSProp(lr=0.01)),
    "rmsprop_centered": (lambda: optim.rmsprop(0.01, centered=True),
                         lambda: R.RMSProp(lr=0.01, centered=True)),
    "adagrad": (lambda: optim.adagrad(0.1), lambda: R.Adagrad(lr=0.1)),
    "adadelta": (lambda: optim.adadelta(1.0), lambda: R.AdaDelta(lr=1.0)),
    "sgd": (lambda: optim.sgd(0.1), lambda: R.SGD(lr=0.1)),
    "sgd_momentum": (lambda: optim.sgd(0.1, momentum=0.9), lambda: R.SGD(lr=0.1, momentum=0.9)),
    "sgd_nesterov": (lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
                     lambda: R.SGD(lr=0.1, momentum=0.9, nesterov=True)),
    "signum": (lambda: optim.signum(0.01), lambda: R.Signum(lr=0.01)),
    "rprop": (lambda: optim.rprop(0.01), lambda: R.Rprop(lr=0.01)),
    "lamb": (lambda: optim.lamb(0.01, weight_decay=0.1), lambda: R.Lamb(lr=0.01, wd=0.1)),
    "lars": (lambda: optim.lars(0.1, weight_decay=0.01), lambda: R.Lars(lr=0.1, wd=0.01)),
    "novograd": (lambda: optim.novograd(0.01), lambda: R.NovoGrad(lr=0.01)),
    "sm3": (lambda: optim.sm3(0.1), lambda: R.SM3(lr=0.1)),
    "adafactor": (lambda: optim.adafactor(0.01), lambda: R.Adafactor(lr=0.01)),
    "fromage": (lambda: optim.fromage(0.01), lambda: R.Fromage(lr=0.01)),
    "muon": (lambda: optim.muon(0.01), lambda: R.Muon(lr=0.01)),
    "shampoo": (lambda: optim.shampoo(0.01, precondition_every=2, block_size=8),
                lambda: R.Shampoo(lr=0.01, every=2)),
    "schedule_free_adamw": (lambda: optim.schedule_free_adamw(0.01, state_dtype=jnp.float32),
                            lambda: R.ScheduleFreeAdamW(lr=0.01)),
    "clip_adam": (lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adam(0.01)),
                  lambda: R.ClipAdam(lr=0.01, clip=1.0)),
}


def _run(name, dtype, steps=20, shapes=SHAPES):
    ours_f, ref_f = CASES[name]
    return R.run_against(name, ours_f(), ref_f(), dtype, shapes, steps)


@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_matches_reference(name):
    errs = _run(name, jnp.float32)
    if name in SIGN_BASED:
        assert np.mean(errs <= 1e-3) >= 0.99, f"{name}: {np.mean(errs <= 1e-3):.3f} close"
    else:
        tol = F32_TOL.get(name, 1e-3)
        assert errs.max() <= tol, f"{name}: max relative error {errs.max():.2e}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_bfloat16_matches_reference(name):
    errs = _run(name, jnp.bfloat16)
    frac = np.mean(errs <= 6e-2)
    need = BF16_FRAC.get(name, 0.95)
    assert frac >= need, f"{name}: only {frac:.3f} of elements within 6e-2"


def test_adafactor_factored_path_matches_reference():
    errs = _run("adafactor", jnp.float32, steps=20, shapes={"big": (128, 130), "v": (7,)})
    assert errs.max() <= 1e-3, errs.max()
