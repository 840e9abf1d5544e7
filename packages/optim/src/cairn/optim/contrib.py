"""``cairn.optim.contrib``: the optimizers of ``optax.contrib`` that this package implements.

Each is implemented here from its paper and Optax's documented semantics and tested against
``optax.contrib`` over several steps (tests/optim/test_optim_contrib.py); ``muon`` and the
schedule-free family are the package's own, re-exported under Optax's contrib names.

>>> from cairn.optim import contrib
>>> sorted(n for n in contrib.__all__ if not n[0].isupper())[:4]
['cocob', 'dog', 'dowg', 'mechanize']
"""

from cairn.optim._cocob import COCOBState, cocob, scale_by_cocob
from cairn.optim._dog import DoGState, DoWGState, dog, dowg, scale_by_dog, scale_by_dowg
from cairn.optim._mechanic import MechanicState, mechanize
from cairn.optim._muon import MuonState, muon, orthogonalize_via_newton_schulz, scale_by_muon
from cairn.optim._plateau import ReduceLROnPlateauState, reduce_on_plateau
from cairn.optim._prodigy import ProdigyState, prodigy
from cairn.optim._sam import NormalizeState, SAMState, normalize, sam
from cairn.optim._schedule_free import (
    ScheduleFreeState,
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
    schedule_free_sgd,
)

__all__ = [
    "COCOBState", "cocob", "scale_by_cocob", "DoGState", "DoWGState", "dog", "dowg",
    "scale_by_dog", "scale_by_dowg", "MechanicState", "mechanize", "MuonState", "muon",
    "orthogonalize_via_newton_schulz", "scale_by_muon", "ReduceLROnPlateauState",
    "reduce_on_plateau", "ProdigyState", "prodigy", "NormalizeState", "SAMState", "normalize",
    "sam", "ScheduleFreeState", "schedule_free", "schedule_free_adamw",
    "schedule_free_eval_params", "schedule_free_sgd",
]
