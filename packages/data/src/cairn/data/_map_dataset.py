"""Former home of ``MapDataset``, kept so that imports of this path keep working.

``MapDataset`` now lives in ``cairn.data._dataset`` and its transformations in
``cairn.data._transforms``; import from there.
"""

from cairn.data._arguments import int_at_least as _int_at_least
from cairn.data._dataset import MapDataset

__all__ = ["MapDataset", "_int_at_least"]
