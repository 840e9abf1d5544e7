"""``ocp.utils``: the helpers Orbax's tutorials use (only ``to_shape_dtype_struct``)."""

from cairn.checkpoint._utils import to_shape_dtype_struct

__all__ = ["to_shape_dtype_struct"]
