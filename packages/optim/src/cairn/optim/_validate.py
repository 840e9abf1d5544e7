"""Eager checks of an optimizer factory's concrete hyperparameters.

``adam(learning_rate=float("inf"))``, ``adam("0.01")``, ``adam(1e-3, b1=1.5)`` or
``adam(1e-3, eps=-1)`` build an optimizer that turns every parameter into NaN (or fails
deep inside the first update); each factory calls :func:`check` first, so they raise at
the call instead, naming the factory and the argument::

    >>> check("adam", learning_rate="0.01")
    Traceback (most recent call last):
      ...
    TypeError: adam: learning_rate must be a number or a schedule (step -> value), got '0.01' (str)
    >>> check("adam", b1=1.5)
    Traceback (most recent call last):
      ...
    ValueError: adam: b1 must be in [0, 1), got 1.5

The rule for an argument comes from its name (:data:`RULES`; a factory whose argument
means something else passes ``rules=``). Only concrete values are checked: a JAX tracer
(a hyperparameter inside ``jit``, or one ``inject_hyperparams`` feeds in while tracing)
passes untouched and ``float()`` is never called on it; a callable (a schedule) passes;
an array that is not a scalar is left alone (per-leaf values); ``None`` means "not
given". Concrete 0-d arrays (NumPy or JAX) are checked like numbers.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["RULES", "Rule", "check"]


class Rule(NamedTuple):
    """A real number in the interval ``lo .. hi`` (``None``: unbounded; ``lo_open`` /
    ``hi_open``: the end itself excluded); ``schedule``: a callable is accepted too;
    ``integer``: the value must be a whole number (``1e4`` is fine, ``2.5`` is not);
    ``inf_ok``: ``+inf`` is accepted (a clipping threshold of ``inf`` clips nothing);
    ``required``: ``None`` is refused (elsewhere ``None`` means "not given")."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    schedule: bool = False
    integer: bool = False
    inf_ok: bool = False
    required: bool = False

    def describe(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        return "finite"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


FINITE = Rule()
NONNEG = Rule(lo=0.0)
POSITIVE = Rule(lo=0.0, lo_open=True)
BETA = Rule(lo=0.0, hi=1.0, hi_open=True)  # a moment's decay: 1 would divide by 0 in debiasing
UNIT = Rule(lo=0.0, hi=1.0)  # a fraction or a decay that may be 1 (no debiasing)
LR = Rule(lo=0.0, schedule=True)  # an optional learning rate (None: no scaling, or a default)
#: A learning rate: the one rule every optimizer factory checks its ``learning_rate`` with
#: (through :func:`check`, once, at the factory; the chained step does not check again).
REQUIRED_LR = Rule(lo=0.0, schedule=True, required=True)
COUNT = Rule(lo=0.0, integer=True)
POSITIVE_COUNT = Rule(lo=1.0, integer=True)

#: The rule of each hyperparameter name; a factory whose argument of the same name means
#: something else passes ``rules={name: Rule(...)}`` to :func:`check`.
RULES: dict[str, Rule] = {
    # step sizes
    "learning_rate": REQUIRED_LR, "adam_learning_rate": LR, "step_size": FINITE,
    "slow_step_size": UNIT, "min_step_size": NONNEG, "max_step_size": POSITIVE,
    # moment decays
    "b1": BETA, "b2": BETA, "beta": BETA, "adam_b1": BETA, "adam_b2": BETA, "decay": UNIT,
    "rho": UNIT, "momentum": UNIT, "smooth_beta": POSITIVE,  # a tanh temperature
    # epsilons and floors
    "eps": NONNEG, "eps_root": NONNEG, "graft_eps": NONNEG, "adam_eps_root": NONNEG,
    "min_norm": NONNEG, "initial_accumulator_value": NONNEG, "initial_scale": NONNEG,
    # decoupled weight decay (a negative one is allowed, as in add_decayed_weights)
    "weight_decay": Rule(schedule=True), "adam_weight_decay": Rule(schedule=True),
    "weight_decay_rate": FINITE,
    # clipping thresholds
    "max_delta": Rule(lo=0.0, inf_ok=True), "max_norm": Rule(lo=0.0, inf_ok=True),
    "clipping_threshold": POSITIVE,
    # noise, trust ratios, rprop, adafactor, radam, schedule-free
    "eta": NONNEG, "gamma": NONNEG, "trust_coefficient": NONNEG, "eta_minus": POSITIVE,
    "eta_plus": POSITIVE, "decay_rate": NONNEG, "threshold": FINITE,
    "weight_lr_power": FINITE,
    # counts
    "min_dim_size_to_factor": COUNT, "decay_offset": COUNT, "block_size": POSITIVE_COUNT,
    "precondition_every": POSITIVE_COUNT, "ns_steps": COUNT, "k": POSITIVE_COUNT,
    "sync_period": POSITIVE_COUNT, "max_consecutive_errors": COUNT, "warmup_steps": COUNT,
    "every_k_schedule": Rule(lo=1.0, integer=True, schedule=True),
}


def check(factory: str, rules: dict[str, Rule] | None = None, **values: Any) -> None:
    """Raise if a concrete hyperparameter in ``values`` breaks its rule.

    ``TypeError`` for something that is not a real number (a str, a bool, a list, a
    callable where no schedule is allowed, ``None`` where the rule requires a value), ``ValueError`` for NaN, an infinity or a
    number outside the rule's range; the message names ``factory`` and the argument.
    """
    for name, value in values.items():
        rule = (rules or {}).get(name) or RULES[name]
        if value is None:
            if rule.required:
                raise TypeError(f"{factory}: {name} must be a number or a schedule (step -> value), got None")
            continue
        if isinstance(value, jax.core.Tracer):
            continue
        if callable(value) and not isinstance(value, np.ndarray | jax.Array):
            if rule.schedule:
                continue
            raise TypeError(
                f"{factory}: {name} must be a real number, got the callable {value!r}"
            )
        v = _real(factory, name, value, rule)
        if v is None:
            continue
        if math.isnan(v):
            raise ValueError(f"{factory}: {name} is NaN; expected a finite number")
        if not math.isfinite(v) and not (rule.inf_ok and v > 0):
            raise ValueError(f"{factory}: {name} must be finite, got {v}")
        if rule.integer and not v.is_integer():
            raise TypeError(f"{factory}: {name} must be a whole number, got {v}")
        if _outside(v, rule):
            raise ValueError(f"{factory}: {name} must be {rule.describe()}, got {_num(v)}")


def _real(factory: str, name: str, value: Any, rule: Rule) -> float | None:
    """``value`` as a float; None for a non-scalar array (not checked)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_):
        return float(value)
    if isinstance(value, np.ndarray | np.generic | jax.Array) and not isinstance(
        value, np.bool_
    ):
        if np.ndim(value) != 0:
            return None
        if jax.dtypes.issubdtype(value.dtype, np.integer) or jax.dtypes.issubdtype(
            value.dtype, np.floating
        ):
            return float(np.asarray(value))
    what = "a number or a schedule (step -> value)" if rule.schedule else "a real number"
    raise TypeError(f"{factory}: {name} must be {what}, got {value!r} ({type(value).__name__})")


def _outside(v: float, r: Rule) -> bool:
    if r.lo is not None and (v < r.lo or (r.lo_open and v == r.lo)):
        return True
    return r.hi is not None and (v > r.hi or (r.hi_open and v == r.hi))
