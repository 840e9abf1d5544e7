"""``ocp.type_handlers``: the format question Orbax users ask of a checkpoint directory.
(Orbax's per-type handlers themselves are not covered: the format is fixed.)"""

from cairn.checkpoint._leaf_args import PLACEHOLDER
from cairn.checkpoint._utils import is_ocdbt_checkpoint

__all__ = ["PLACEHOLDER", "is_ocdbt_checkpoint"]
