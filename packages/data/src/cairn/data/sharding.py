"""Which part of the data this process reads (Grain's ``grain.sharding``).

>>> import cairn.data as grain
>>> grain.sharding.ShardOptions(shard_index=1, shard_count=4).shard_index
1
"""

from __future__ import annotations

from cairn.data._sharding import NoSharding, ShardByJaxProcess, ShardOptions

__all__ = ["NoSharding", "ShardByJaxProcess", "ShardOptions"]
