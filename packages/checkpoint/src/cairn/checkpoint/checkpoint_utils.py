"""``ocp.checkpoint_utils``: an evaluator's loop over a trainer's new checkpoints, and restore
arguments built from a target tree (Orbax's names)."""

from cairn.checkpoint._leaf_args import construct_restore_args
from cairn.checkpoint._watch import (
    _SNAPSHOTS,
    checkpoints_iterator,
    get_snapshot_dir_from_step_dir,
    wait_for_new_checkpoint,
)

__all__ = [
    "_SNAPSHOTS",
    "checkpoints_iterator",
    "construct_restore_args",
    "get_snapshot_dir_from_step_dir",
    "wait_for_new_checkpoint",
]
