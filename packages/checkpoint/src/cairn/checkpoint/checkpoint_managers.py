"""``ocp.checkpoint_managers``: policies for when a manager saves and which steps it keeps
(``CheckpointManagerOptions(save_decision_policy=..., preservation_policy=...)``)."""

from cairn.checkpoint._manager import CheckpointManagerOptions
from cairn.checkpoint._policies import (
    AnyPreservationPolicy,
    AnySavePolicy,
    BestN,
    CheckpointInfo,
    ContinuousCheckpointingPolicy,
    CustomSteps,
    DecisionContext,
    EveryNSeconds,
    EveryNSteps,
    FixedIntervalPolicy,
    InitialSavePolicy,
    LatestN,
    PreservationPolicy,
    SaveDecisionPolicy,
    SpecificStepsPolicy,
)

__all__ = [
    "AnyPreservationPolicy",
    "AnySavePolicy",
    "BestN",
    "CheckpointInfo",
    "CheckpointManagerOptions",
    "ContinuousCheckpointingPolicy",
    "CustomSteps",
    "DecisionContext",
    "EveryNSeconds",
    "EveryNSteps",
    "FixedIntervalPolicy",
    "InitialSavePolicy",
    "LatestN",
    "PreservationPolicy",
    "SaveDecisionPolicy",
    "SpecificStepsPolicy",
]
