"""cairn.data: deterministic, checkpointable input pipelines (Grain's names, no JAX needed).

Start from a source, chain ``MapDataset`` steps, then iterate::

    ds = MapDataset.source(src).shuffle(seed=0).map(decode).batch(64)
    it = iter(ds.to_iter_dataset().mp_prefetch(2))
    state = it.get_state()   # small JSON-able dict; it.set_state(state) resumes exactly
"""

# Grain's public submodules (grain.sources, grain.transforms, ...): thin re-exports.
from typing import Any

from cairn.data import (
    checkpoint,
    experimental,
    multiprocessing,
    samplers,
    sharding,
    sources,
    transforms,
)
from cairn.data._data_loader import (
    Batch,
    DataLoader,
    FilterTransform,
    IndexSampler,
    MapTransform,
    RandomMapTransform,
    RecordMetadata,
    Sampler,
)
from cairn.data._dataset import DatasetIterator, IterDataset, MapDataset, ReadOptions
from cairn.data._device import device_put
from cairn.data._multiprocessing import (
    MultiprocessingOptions,
    RemoteTraceback,
    WorkerDiedError,
    WorkerTimeoutError,
)
from cairn.data._packing import FirstFitPackIterDataset
from cairn.data._sharding import NoSharding, ShardByJaxProcess, ShardOptions
from cairn.data._source_arrayrecord import ArrayRecordDataSource
from cairn.data._source_memory import CorruptRecordError, InMemoryDataSource, RangeDataSource
from cairn.data._source_parquet import ParquetDataSource
from cairn.data._testing import assert_equal_output_after_checkpoint
from cairn.data._transforms.interleave import InterleaveIterDataset
from cairn.data._transforms.mix import MixIterDataset
from cairn.data._transforms.select import DatasetSelectionMap
from cairn.data._tree import StructureMismatchError, stack_records
from cairn.data._writers import (
    ArrayRecordWriter,
    ParquetWriter,
    decode_example,
    encode_example,
    write_array_record,
    write_parquet,
)
from cairn.data.checkpoint import CheckpointHandler as PyGrainCheckpointHandler

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``PyGrainCheckpointSave`` / ``PyGrainCheckpointRestore`` (``grain.python``'s names):
    ``checkpoint.CheckpointSave`` / ``CheckpointRestore``, Orbax-registered once Orbax is
    imported, so they are looked up on each access."""
    if name in ("PyGrainCheckpointSave", "PyGrainCheckpointRestore"):
        return getattr(checkpoint, name[len("PyGrain"):])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__: list[str] = [
    # --- datasets and iterators ---
    "DatasetIterator",
    "DatasetSelectionMap",
    "FirstFitPackIterDataset",
    "InterleaveIterDataset",
    "IterDataset",
    "MapDataset",
    "MixIterDataset",
    "MultiprocessingOptions",
    "ReadOptions",
    "RemoteTraceback",
    "WorkerDiedError",
    "WorkerTimeoutError",
    # --- loader, sharding, devices ---
    "Batch",
    "DataLoader",
    "FilterTransform",
    "IndexSampler",
    "MapTransform",
    "NoSharding",
    "RandomMapTransform",
    "RecordMetadata",
    "Sampler",
    "ShardByJaxProcess",
    "ShardOptions",
    "device_put",
    # --- sources and writers ---
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
    # --- Grain's grain.python names for the checkpoint arguments and handler ---
    "PyGrainCheckpointHandler",
    "PyGrainCheckpointRestore",
    "PyGrainCheckpointSave",
    # --- records and testing ---
    "StructureMismatchError",
    "assert_equal_output_after_checkpoint",
    "stack_records",
    # --- Grain's submodules ---
    "checkpoint",
    "experimental",
    "multiprocessing",
    "samplers",
    "sharding",
    "sources",
    "transforms",
]
