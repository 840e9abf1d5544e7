"""``cairn.optim.schedules``: schedules and hyperparameter injection under
``optax.schedules``' names (re-exports).

>>> from cairn.optim import schedules
>>> float(schedules.linear_schedule(1.0, 0.0, transition_steps=4)(1))
0.75
"""

from cairn.optim._combine import InjectHyperparamsState, inject_hyperparams
from cairn.optim._schedules import (
    constant_schedule,
    cosine_decay_schedule,
    cosine_onecycle_schedule,
    exponential_decay,
    join_schedules,
    linear_onecycle_schedule,
    linear_schedule,
    piecewise_constant_schedule,
    piecewise_interpolate_schedule,
    polynomial_schedule,
    sgdr_schedule,
    warmup_constant_schedule,
    warmup_cosine_decay_schedule,
    warmup_exponential_decay_schedule,
)
from cairn.optim._types import Schedule

__all__ = [
    "InjectHyperparamsState", "inject_hyperparams", "Schedule", "constant_schedule",
    "cosine_decay_schedule", "cosine_onecycle_schedule", "exponential_decay", "join_schedules",
    "linear_onecycle_schedule", "linear_schedule", "piecewise_constant_schedule",
    "piecewise_interpolate_schedule", "polynomial_schedule", "sgdr_schedule",
    "warmup_constant_schedule", "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
]
