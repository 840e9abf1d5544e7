"""Worker-process options (Grain's ``grain.multiprocessing``).

>>> import cairn.data as grain
>>> grain.multiprocessing.MultiprocessingOptions(num_workers=2).num_workers
2
"""

from __future__ import annotations

from cairn.data._multiprocessing import MultiprocessingOptions

__all__ = ["MultiprocessingOptions"]
