"""Record orders for ``DataLoader`` (Grain's ``grain.samplers``).

A sampler is a sequence of ``RecordMetadata``: step ``i`` reads record ``record_key``.

>>> import cairn.data as grain
>>> [m.record_key for m in grain.samplers.IndexSampler(num_records=3, num_epochs=2)]
[0, 1, 2, 0, 1, 2]
"""

from __future__ import annotations

from cairn.data._data_loader import IndexSampler, RecordMetadata, Sampler, SequentialSampler

__all__ = ["IndexSampler", "RecordMetadata", "Sampler", "SequentialSampler"]
