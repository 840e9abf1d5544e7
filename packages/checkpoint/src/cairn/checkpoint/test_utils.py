"""``ocp.test_utils``: the helper Orbax's tutorials start with (only ``erase_and_create_empty``)."""

from cairn.checkpoint._utils import erase_and_create_empty

__all__ = ["erase_and_create_empty"]
