"""``ocp.utils`` / ``ocp.tree``: the tree helpers Orbax users call (abstract leaves, flat dicts),
step listing and the primary-process question."""

from cairn.checkpoint._utils import (
    from_flat_dict,
    get_save_directory,
    intersect_trees,
    is_checkpoint_finalized,
    is_gcs_path,
    is_pathways_backend,
    is_primary_host,
    is_scalar,
    is_tmp_checkpoint,
    merge_trees,
    tmp_checkpoints,
    to_flat_dict,
    to_shape_dtype_struct,
)
from cairn.checkpoint._watch import committed_steps as checkpoint_steps

__all__ = [
    "checkpoint_steps",
    "from_flat_dict",
    "get_save_directory",
    "intersect_trees",
    "is_checkpoint_finalized",
    "is_gcs_path",
    "is_pathways_backend",
    "is_primary_host",
    "is_scalar",
    "is_tmp_checkpoint",
    "merge_trees",
    "tmp_checkpoints",
    "to_flat_dict",
    "to_shape_dtype_struct",
]
