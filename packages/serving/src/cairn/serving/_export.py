"""``export``: a pure JAX function and its weights to a self-contained model directory.

The function is exported with ``jax.export`` once per signature, with the weights as
*arguments* (a flat dict keyed by core_array path), so the StableHLO stays small however
big the weights are; the weights go to TensorStore zarr3. The directory is written in a
temporary sibling and renamed into place, so a reader sees all of it or nothing.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from cairn.core_array import (
    ArraySpec,
    atomic_rename,
    dumps_checksummed_json,
    flatten_with_paths,
    fsync_tree,
    shape_dtype_structs,
)
from cairn.serving._hashing import MANIFEST, digest_files
from cairn.serving._manifest import FORMAT, SIGNATURE_NAME
from cairn.serving._model import batch_dim, normalize_buckets
from cairn.serving._weights import BOUNDARY_DTYPES, rebuild_params, split_params, write_weights

__all__ = ["export", "export_signatures", "Signature", "DEFAULT_SIGNATURE", "DEFAULT_MAX_BATCH_SIZE"]

DEFAULT_SIGNATURE = "serving_default"
DEFAULT_MAX_BATCH_SIZE = 64
SIGNATURES_DIR = "signatures"


@dataclasses.dataclass(frozen=True)
class Signature:
    """One more entry point of an exported model, sharing its weights.

    Args:
      fn: ``fn(params, inputs) -> outputs``, pure, like :func:`export`'s.
      input_specs: ``{name: ArraySpec}``; axis 0 may be a symbolic batch dim.
      max_batch_size: as in :func:`export` (``None``: the constraint's bound, else 64).
      batch_buckets: as in :func:`export`.
    """

    fn: Callable[[Any, dict[str, Any]], Any]
    input_specs: Mapping[str, ArraySpec]
    max_batch_size: int | None = None
    batch_buckets: Sequence[int] | None = None


def _named_outputs(out: Any) -> dict[str, Any]:
    if isinstance(out, Mapping):
        return flatten_with_paths(out)
    if isinstance(out, tuple | list):
        return {f"output_{i}": v for i, v in enumerate(out)}
    return {"output_0": out}


def _batching(name: str, specs: Mapping[str, ArraySpec], max_batch_size: int | None,
              buckets: Sequence[int] | None) -> tuple[dict[str, ArraySpec], str | None, int, tuple[int, ...]]:
    """The specs (with ``b <= max_batch_size`` added), batch dim, max batch and buckets."""
    b = batch_dim(specs)
    if b is None or max_batch_size == 0:
        if max_batch_size:
            raise ValueError(
                f"signature {name!r}: max_batch_size {max_batch_size} needs every input's axis 0 to be one "
                f"symbolic dim, got shapes { {k: s.shape for k, s in specs.items()} }"
            )
        return dict(specs), None, 0, normalize_buckets(buckets, 0)
    hi = next(iter(specs.values())).dim_bounds()[b][1]
    for s in specs.values():
        h = s.dim_bounds()[b][1]
        hi = h if hi is None or (h is not None and h < hi) else hi
    if max_batch_size is None:
        max_batch_size = hi if hi is not None else DEFAULT_MAX_BATCH_SIZE
    if hi is not None and max_batch_size > hi:
        raise ValueError(f"signature {name!r}: max_batch_size {max_batch_size} exceeds the constraint {b} <= {hi}")
    bound = f"{b} <= {max_batch_size}"
    specs = {k: dataclasses.replace(s, constraints=(*s.constraints, bound)) for k, s in specs.items()}
    return specs, b, int(max_batch_size), normalize_buckets(buckets, int(max_batch_size))


def _check_specs(name: str, specs: Any) -> None:
    if not isinstance(name, str) or not SIGNATURE_NAME.match(name):
        raise ValueError(f"signature name {name!r} must match {SIGNATURE_NAME.pattern} (it names a file)")
    if not isinstance(specs, Mapping) or not specs:
        raise ValueError(f"signature {name!r}: input_specs must be a non-empty dict of name -> ArraySpec")
    for k, s in specs.items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"signature {name!r}: input names must be non-empty strings, got {k!r}")
        if not isinstance(s, ArraySpec):
            raise ValueError(f"signature {name!r}: input {k!r} must be an ArraySpec, got {type(s).__name__}")


def _dim_json(d: Any, taken: set[str]) -> int | str:
    if isinstance(d, int | np.integer):
        return int(d)
    text = str(d)
    if text.isidentifier():
        return text
    # an expression of dims (``2*b``): a fresh name, the expression kept in the manifest
    i = 0
    while f"d{i}" in taken:
        i += 1
    taken.add(f"d{i}")
    return f"d{i}"


def _output_specs(exp: Any, input_specs: Mapping[str, ArraySpec]) -> tuple[dict[str, ArraySpec], dict]:
    import jax

    avals = jax.tree_util.tree_unflatten(exp.out_tree, exp.out_avals)
    taken = {n for s in input_specs.values() for n in s.symbols}
    out, exprs = {}, {}
    for k, a in avals.items():
        shape = tuple(_dim_json(d, taken) for d in a.shape)
        if any(isinstance(d, str) and d != str(a.shape[i]) for i, d in enumerate(shape)):
            exprs[k] = [str(d) for d in a.shape]
        out[k] = ArraySpec(shape, a.dtype)
    return out, exprs


def _export_signature(name: str, sig: Signature, params: Any, split: tuple, platforms: Any) -> tuple[bytes, dict]:
    import jax
    from jax import export as jexport

    _check_specs(name, sig.input_specs)
    specs, b, mbs, buckets = _batching(name, sig.input_specs, sig.max_batch_size, sig.batch_buckets)
    for k, s in specs.items():
        if s.dtype in ("float64", "int64", "uint64", "complex128") and jax.dtypes.canonicalize_dtype(np.float64) != np.float64:
            raise ValueError(f"signature {name!r}: input {k!r} is {s.dtype}, which needs jax_enable_x64")
        if s.dtype in BOUNDARY_DTYPES:
            raise ValueError(
                f"signature {name!r}: input {k!r} is {s.dtype}, which jax.export cannot serialize; "
                f"take {BOUNDARY_DTYPES[s.dtype]} and cast inside the function"
            )
    fn = sig.fn
    flat, qmeta, casts = split

    def served(weights: dict, inputs: dict) -> dict:
        return _named_outputs(fn(rebuild_params(weights, qmeta, params, casts), dict(inputs)))

    w_structs = {p: jax.ShapeDtypeStruct(a.shape, a.dtype) for p, a in flat.items()}
    # a list keeps input names out of core_array's path rules (``cache/k0`` is a name, not a path)
    in_structs = dict(zip(specs, shape_dtype_structs(list(specs.values())), strict=True))
    try:
        exp = jexport.export(jax.jit(served), platforms=platforms)(w_structs, in_structs)
    except Exception as e:
        raise ValueError(
            f"signature {name!r}: exporting fn with inputs { {k: s.shape for k, s in specs.items()} } failed: {e}"
        ) from e
    outputs, exprs = _output_specs(exp, specs)
    if b is not None:
        bad = {k: s.shape for k, s in outputs.items() if not s.ndim or s.shape[0] != b}
        if bad:
            raise ValueError(
                f"signature {name!r}: outputs {bad} are not batched along axis 0 by {b!r}; a batchable model's "
                "outputs must be (or pass max_batch_size=0 to export it unbatchable)"
            )
    entry = {
        "file": f"{SIGNATURES_DIR}/{name}.jax_exported",
        "inputs": {k: s.to_json() for k, s in specs.items()},
        "outputs": {k: s.to_json() for k, s in outputs.items()},
        "output_shape_exprs": exprs,
        "batch_dim": b,
        "max_batch_size": mbs,
        "batch_buckets": list(buckets),
        "calling_convention_version": exp.calling_convention_version,
        "nr_devices": exp.nr_devices,
        "platforms": list(exp.platforms),
    }
    try:
        blob = bytes(exp.serialize())
    except (KeyError, ValueError, NotImplementedError) as e:  # e.g. an output dtype it has no code for
        raise ValueError(
            f"signature {name!r}: jax.export cannot serialize it ({type(e).__name__}: {e}); outputs "
            f"{ {k: s.dtype for k, s in outputs.items()} } must avoid {sorted(BOUNDARY_DTYPES)}"
        ) from e
    return blob, entry


def _versions() -> dict[str, str]:
    import importlib.metadata

    import jax
    import jaxlib

    try:
        mine = importlib.metadata.version("cairn-serving")
    except importlib.metadata.PackageNotFoundError:
        mine = "unknown"
    return {"cairn_serving": mine, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": platform.python_version()}


def _place(tmp: str, final: str, overwrite: bool) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` is replaced only with
    ``overwrite`` (moved aside first, removed after)."""
    if os.path.exists(final):
        if not overwrite:
            raise FileExistsError(f"export: {final} exists; pass overwrite=True to replace it")
        old = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.old-{uuid.uuid4().hex[:8]}")
        atomic_rename(final, old)
        atomic_rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        atomic_rename(tmp, final)
    except OSError:
        raise FileExistsError(f"export: {final} appeared while exporting; pass overwrite=True to replace it") from None


def _write_dir(final: str, blobs: dict, entries: dict, split: tuple, overwrite: bool, extra: Mapping | None = None,
               files: Mapping[str, bytes] | None = None) -> None:
    """Write everything into a temporary sibling of ``final``, then rename it into place;
    ``extra`` adds top-level manifest sections (e.g. ``"generation"``), ``files`` more files
    (``{relative path: bytes}``, e.g. a tokenizer folder), hashed like the rest."""
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o755)
        os.makedirs(os.path.join(tmp, SIGNATURES_DIR))
        for name, blob in blobs.items():
            with open(os.path.join(tmp, entries[name]["file"]), "wb") as f:
                f.write(blob)
        for rel, data in (files or {}).items():
            dest = os.path.join(tmp, *rel.split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as f:
                f.write(data)
        flat, qmeta, casts = split
        arrays = write_weights(tmp, flat)
        manifest = {
            "format": FORMAT,
            "created_by": _versions(),
            "platforms": sorted({p for e in entries.values() for p in e["platforms"]}),
            "signatures": entries,
            "weights": {"arrays": arrays, "qarrays": qmeta, "casts": casts},
            "files": digest_files(tmp),
            **(extra or {}),
        }
        with open(os.path.join(tmp, MANIFEST), "wb") as f:
            f.write(dumps_checksummed_json(manifest))
        fsync_tree(tmp)
        _place(tmp, final, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export(
    fn: Callable[[Any, dict[str, Any]], Any],
    params: Any,
    input_specs: Mapping[str, ArraySpec],
    path: str | os.PathLike,
    *,
    platforms: Sequence[str] | None = None,
    max_batch_size: int | None = None,
    batch_buckets: Sequence[int] | None = None,
    signatures: Mapping[str, Signature] | None = None,
    overwrite: bool = False,
) -> str:
    """Export ``fn(params, inputs)`` and ``params`` to the model directory ``path``.

    Args:
      fn: a pure function ``fn(params, inputs) -> outputs``: ``inputs`` is a dict of
        arrays; outputs a dict (nested dicts are named by path, ``"a/b"``), a single
        array (named ``output_0``) or a tuple (``output_0``, ``output_1``, ...).
      params: the weights, any tree core_array flattens (dicts, lists, dataclasses, JAX
        pytrees); ``QArray`` leaves are stored as their parts (sub-byte values packed).
      input_specs: ``{name: ArraySpec}``. When every input's axis 0 is the same symbolic
        dim (``ArraySpec(("b", 512), "float32")``) the model is batchable.
      path: the directory to create (e.g. ``repo/my_model/1``).
      platforms: the platforms to export for (``("cpu", "cuda")``); default: this one.
      max_batch_size: the largest batch; ``None``: the batch dim's ``<=`` constraint,
        else 64; 0: export unbatchable even with a symbolic axis 0.
      batch_buckets: batch sizes precompiled at load and padded up to; default: powers
        of two up to ``max_batch_size`` (which is always a bucket).
      signatures: more entry points sharing the weights, ``{name: Signature}``; ``fn``
        is ``"serving_default"``.
      overwrite: replace an existing ``path`` (atomically); refused otherwise.

    Returns:
      The absolute path of the model directory.

    Raises:
      FileExistsError: ``path`` exists and ``overwrite`` is false.
      ValueError: bad specs or names, a leaf that is not an array, outputs that are not
        batched along axis 0, or a function JAX cannot export with these shapes (the
        message names the signature).

    >>> import tempfile
    >>> from cairn.serving import load
    >>> path = export(lambda p, i: {"y": i["x"] * p["k"]}, {"k": np.float32(3)},
    ...               {"x": ArraySpec(("b", 2), "float32", constraints=("b <= 4",))},
    ...               tempfile.mkdtemp() + "/triple/1")
    >>> m = load(path)
    >>> m.name, m.batch_buckets, m({"x": np.ones((3, 2), np.float32)})["y"].tolist()
    ('triple', (1, 2, 4), [[3.0, 3.0], [3.0, 3.0], [3.0, 3.0]])
    """
    sigs = {DEFAULT_SIGNATURE: Signature(fn, input_specs, max_batch_size, batch_buckets)}
    for k, s in (signatures or {}).items():
        if k in sigs:
            raise ValueError(f"signatures: {k!r} is the default signature's name")
        if not isinstance(s, Signature):
            raise ValueError(f"signatures[{k!r}] must be a cairn.serving.Signature, got {type(s).__name__}")
        sigs[k] = s
    return export_signatures(sigs, params, path, platforms=platforms, overwrite=overwrite)


def export_signatures(
    sigs: Mapping[str, Signature],
    params: Any,
    path: str | os.PathLike,
    *,
    platforms: Sequence[str] | None = None,
    overwrite: bool = False,
    extra: Mapping[str, Any] | None = None,
    files: Mapping[str, bytes] | None = None,
) -> str:
    """Export the named signatures (no default one required) sharing ``params`` to
    ``path``; ``extra`` adds top-level manifest sections, ``files`` more files (relative
    path -> bytes) covered by the manifest's hashes. The engine of :func:`export`.

    Raises:
      FileExistsError, ValueError: as :func:`export`.
    """
    final = os.path.abspath(os.fspath(path))
    if os.path.exists(final) and not overwrite:
        raise FileExistsError(f"export: {final} exists; pass overwrite=True to replace it")
    split = split_params(params)
    blobs, entries = {}, {}
    for name, sig in sigs.items():
        blobs[name], entries[name] = _export_signature(name, sig, params, split, platforms)
    _write_dir(final, blobs, entries, split, overwrite, extra, files)
    return final
