"""cairn.core_array: the thin protocol the Cairn libraries share.

Paths in the ``a/0/b`` convention, array specs, the dtype table, quantized arrays,
logical-axis sharding rules and the duck-typed protocols. Needs NumPy and ml_dtypes; JAX
is optional and never imported by this package unless a JAX feature is asked for.
"""

from cairn.core_array._dtypes import (
    DTYPE_TABLE,
    DTypeInfo,
    as_numpy_dtype,
    bit_width,
    canonical_dtype,
    dtype_info,
)
from cairn.core_array._files import (
    CorruptFileError,
    atomic_rename,
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    dumps_checksummed_json,
    fsync_dir,
    fsync_file,
    fsync_tree,
    loads_checksummed_json,
    read_checksummed_json,
    write_checksummed_json,
    write_synced,
)
from cairn.core_array._paths import (
    SEPARATOR,
    PathError,
    compile_pattern,
    flatten_with_paths,
    join_path,
    key_name,
    map_with_path,
    match_paths,
    path_matches,
    path_of,
    tree_paths,
    unflatten,
)
from cairn.core_array._protocols import (
    Checkpointable,
    GradientTransformationLike,
    is_checkpointable,
)
from cairn.core_array._qarray import (
    LOGICAL_QTYPES,
    NF4_LEVELS,
    QArray,
    QuantLayout,
    pack_bits,
    storage_dtype,
    unpack_bits,
)
from cairn.core_array._quantize import dequantize, quantize
from cairn.core_array._sharding import LogicalAxisRules, logical_to_partition_spec, named_sharding
from cairn.core_array._specs import (
    ArraySpec,
    shape_dtype_structs,
    spec_of,
    specs_from_json,
    specs_to_json,
)

__version__ = "0.1.1"

__all__ = [
    "CorruptFileError",
    "atomic_rename",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "dumps_checksummed_json",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "loads_checksummed_json",
    "read_checksummed_json",
    "write_checksummed_json",
    "write_synced",
    "SEPARATOR",
    "PathError",
    "key_name",
    "join_path",
    "path_of",
    "compile_pattern",
    "flatten_with_paths",
    "unflatten",
    "tree_paths",
    "map_with_path",
    "match_paths",
    "path_matches",
    "ArraySpec",
    "spec_of",
    "specs_to_json",
    "specs_from_json",
    "shape_dtype_structs",
    "DTypeInfo",
    "DTYPE_TABLE",
    "dtype_info",
    "canonical_dtype",
    "as_numpy_dtype",
    "bit_width",
    "QuantLayout",
    "QArray",
    "pack_bits",
    "unpack_bits",
    "LOGICAL_QTYPES",
    "NF4_LEVELS",
    "storage_dtype",
    "quantize",
    "dequantize",
    "LogicalAxisRules",
    "logical_to_partition_spec",
    "named_sharding",
    "Checkpointable",
    "GradientTransformationLike",
    "is_checkpointable",
]
