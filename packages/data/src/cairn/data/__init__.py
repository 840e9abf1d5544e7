"""cairn.data: deterministic, checkpointable input pipelines (Grain's names, no JAX needed).

Start from a source, chain ``MapDataset`` steps, then iterate::

    ds = MapDataset.source(src).shuffle(seed=0).map(decode).batch(64)
    it = iter(ds.to_iter_dataset().mp_prefetch(2))
    state = it.get_state()   # small JSON-able dict; it.set_state(state) resumes exactly
"""

from ._data_loader import (
    Batch,
    DataLoader,
    FilterTransform,
    IndexSampler,
    MapTransform,
    RandomMapTransform,
)
from ._device import device_put
from ._iter_dataset import (
    DatasetIterator,
    InterleaveIterDataset,
    IterDataset,
    MixIterDataset,
    ReadOptions,
)
from ._map_dataset import MapDataset
from ._multiprocessing import (
    MultiprocessingOptions,
    RemoteTraceback,
    WorkerDiedError,
    WorkerTimeoutError,
)
from ._packing import FirstFitPackIterDataset
from ._sharding import NoSharding, ShardByJaxProcess, ShardOptions
from ._testing import assert_equal_output_after_checkpoint
from ._tree import StructureMismatchError, stack_records

__version__ = "0.1.0"

__all__: list[str] = [
    "Batch",
    "DataLoader",
    "DatasetIterator",
    "FilterTransform",
    "FirstFitPackIterDataset",
    "IndexSampler",
    "InterleaveIterDataset",
    "MixIterDataset",
    "IterDataset",
    "MapDataset",
    "MapTransform",
    "MultiprocessingOptions",
    "NoSharding",
    "RandomMapTransform",
    "ReadOptions",
    "RemoteTraceback",
    "ShardByJaxProcess",
    "ShardOptions",
    "StructureMismatchError",
    "WorkerDiedError",
    "WorkerTimeoutError",
    "assert_equal_output_after_checkpoint",
    "device_put",
    "stack_records",
]

# --- sources (data-sources helper) ---
from ._source_arrayrecord import ArrayRecordDataSource
from ._source_memory import CorruptRecordError, InMemoryDataSource, RangeDataSource
from ._source_parquet import ParquetDataSource
from ._writers import (
    ArrayRecordWriter,
    ParquetWriter,
    decode_example,
    encode_example,
    write_array_record,
    write_parquet,
)

__all__ += [
    "ArrayRecordDataSource",
    "ArrayRecordWriter",
    "CorruptRecordError",
    "InMemoryDataSource",
    "ParquetDataSource",
    "ParquetWriter",
    "RangeDataSource",
    "decode_example",
    "encode_example",
    "write_array_record",
    "write_parquet",
]
# --- end sources ---
