"""``ocp.utils`` / ``ocp.tree``: the tree helpers Orbax users call (abstract leaves, flat dicts)."""

from cairn.checkpoint._utils import (
    from_flat_dict,
    get_save_directory,
    is_gcs_path,
    to_flat_dict,
    to_shape_dtype_struct,
)

__all__ = ["from_flat_dict", "get_save_directory", "is_gcs_path", "to_flat_dict", "to_shape_dtype_struct"]
