"""``load``: a model directory back to a callable model, with nothing but JAX, TensorStore
and ``cairn.core_array`` (the model's own code, cairn.nn and cairn.quant are not needed).

Every file's size and SHA-256 are checked before anything is parsed or deserialised;
then the weights are read and put on the device once, shared by all signatures, and each
batch bucket is compiled ahead of the first request.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from cairn.core_array import ArraySpec
from cairn.serving._export import DEFAULT_SIGNATURE
from cairn.serving._genexport import (
    DECODE,
    PAGED,
    PREFILL,
    SCORE,
    GenerationInfo,
    GeneratorBase,
    exported_device_fns,
    exported_paged_fn,
    load_tokenizer,
)
from cairn.serving._hashing import MANIFEST, ModelFormatError, verify_files
from cairn.serving._manifest import check_compatible, newer_exporter, parse_specs, read_manifest
from cairn.serving._model import validate_inputs
from cairn.serving._weights import read_weights

__all__ = ["load", "load_generator", "LoadedModel", "LoadedGenerator", "LoadedSignature", "enable_compilation_cache"]


def enable_compilation_cache(cache_dir: str | os.PathLike) -> None:
    """Point JAX's persistent compilation cache at ``cache_dir`` (process-wide) and cache
    every executable, however quick to compile, so a restarted server skips XLA.

    Args:
      cache_dir: the cache directory (created if missing).
    """
    import jax

    path = os.path.abspath(os.fspath(cache_dir))
    os.makedirs(path, exist_ok=True)
    if getattr(jax.config, "jax_compilation_cache_dir", None) != path:
        jax.config.update("jax_compilation_cache_dir", path)
        try:  # a cache already opened on another directory keeps it until reset
            from jax._src import compilation_cache

            if compilation_cache.is_initialized():
                compilation_cache.reset_cache()
        except (ImportError, AttributeError):  # pragma: no cover - private API moved
            pass
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


class LoadedSignature:
    """One signature of a loaded model; a :class:`~cairn.serving.ServableModel`.

    Args:
      model_name: the model's name.
      signature_name: this signature's name.
      exported: the deserialized ``jax.export.Exported``.
      entry: the signature's manifest entry (inputs, outputs, batch dim and buckets).
      weights: ``{path: jax.Array}`` on the device, passed to every call.

    Attributes:
      name: the model's name. signature_name: this signature's. inputs / outputs:
      ``{name: ArraySpec}`` with the symbolic batch dim at axis 0 when batchable.
      max_batch_size, batch_buckets: as exported. batch_dim: the symbolic name or ``None``.

    Raises:
      ModelFormatError: ``batch_buckets`` does not end at ``max_batch_size``.
    """

    def __init__(self, model_name: str, signature_name: str, exported: Any, entry: dict, weights: dict) -> None:
        import jax

        self.name = model_name
        self.signature_name = signature_name
        self.inputs: dict[str, ArraySpec] = parse_specs(entry.get("inputs"), f"signature {signature_name!r} inputs")
        self.outputs: dict[str, ArraySpec] = parse_specs(entry.get("outputs"), f"signature {signature_name!r} outputs")
        self.batch_dim: str | None = entry.get("batch_dim")
        self.max_batch_size = int(entry.get("max_batch_size") or 0)
        self.batch_buckets: tuple[int, ...] = tuple(int(b) for b in entry.get("batch_buckets") or ())
        if self.max_batch_size and (not self.batch_buckets or self.batch_buckets[-1] != self.max_batch_size):
            raise ModelFormatError(
                f"{MANIFEST}: signature {signature_name!r}: batch_buckets {self.batch_buckets} must end at "
                f"max_batch_size {self.max_batch_size}", MANIFEST
            )
        self.exported = exported
        self._weights = weights
        self._jit = jax.jit(exported.call)
        self._compiled: dict[int, Any] = {}

    def _structs(self, n: int | None) -> dict[str, Any]:
        import jax

        bound = {} if n is None or self.batch_dim is None else {self.batch_dim: n}
        return {k: jax.ShapeDtypeStruct(s.bind(bound).shape, s.numpy_dtype) for k, s in self.inputs.items()}

    def precompile(self) -> None:
        """Compile every batch bucket (or the one concrete shape) now."""
        sizes: Iterable[int | None]
        if self.batch_dim is not None:
            sizes = self.batch_buckets
        elif not any(s.is_symbolic for s in self.inputs.values()):
            sizes = (None,)
        else:
            sizes = ()  # symbolic but unbatchable: compiled per shape on first use
        for n in sizes:
            key = 0 if n is None else n
            if key not in self._compiled:
                self._compiled[key] = self._jit.lower(self._weights, self._structs(n)).compile()

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on a batch; a batch between buckets is padded up (repeating its last row)
        and the outputs cut back.

        Raises:
          ValueError: a missing or unknown input, wrong dtype or shape, or a batch above
            ``max_batch_size``, naming the input.
        """
        arrays, env = validate_inputs(self.inputs, inputs, self.max_batch_size)
        if self.batch_dim is None:
            fn = self._compiled.get(0, self._jit)
            return {k: np.asarray(v) for k, v in fn(self._weights, arrays).items()}
        n = env[self.batch_dim]
        bucket = next(b for b in self.batch_buckets if b >= n)
        if bucket != n:
            arrays = {k: np.concatenate([a, np.repeat(a[-1:], bucket - n, axis=0)]) for k, a in arrays.items()}
        fn = self._compiled.get(bucket, self._jit)
        out = fn(self._weights, arrays)
        return {k: np.asarray(v)[:n] for k, v in out.items()}

    def __repr__(self) -> str:
        return (f"LoadedSignature({self.name!r}/{self.signature_name!r}, inputs={ {k: s.shape for k, s in self.inputs.items()} }, "
                f"buckets={self.batch_buckets})")


class LoadedModel:
    """An exported model, loaded: a :class:`~cairn.serving.ServableModel` running its
    ``"serving_default"`` signature, with every signature in :attr:`signatures`.

    Args:
      name: the model name.
      path: the model directory.
      manifest: the parsed manifest.
      signatures: ``{name: LoadedSignature}``.
      weights: ``{path: jax.Array}`` on the device.
    """

    def __init__(self, name: str, path: str, manifest: dict, signatures: dict[str, LoadedSignature], weights: dict) -> None:
        self.name = name
        self.path = path
        self.manifest = manifest
        self.signatures = signatures
        self.weights = weights
        default = signatures.get(DEFAULT_SIGNATURE) or next(iter(signatures.values()))
        self.default_signature = default
        self.inputs = default.inputs
        self.outputs = default.outputs
        self.max_batch_size = default.max_batch_size
        self.batch_buckets = default.batch_buckets

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.default_signature(inputs)

    @property
    def weights_nbytes(self) -> int:
        """Bytes the weights take on the device (int4 values packed two to a byte)."""
        return sum(int(w.nbytes) for w in self.weights.values())

    def __repr__(self) -> str:
        return f"LoadedModel({self.name!r}, path={self.path!r}, signatures={list(self.signatures)})"


class LoadedGenerator(LoadedModel, GeneratorBase):
    """An exported generative model (:func:`cairn.serving.export_generator`), loaded: a
    :class:`~cairn.serving.GenerativeModel` whose device-level ``prefill``/``decode``
    call the deserialized StableHLO with the weights held on the device (jitted; the
    cache stays on the device and is donated to each decode step).

    Attributes: those of :class:`LoadedModel`, plus ``vocab_size``, ``max_length``,
    ``eos_token_ids``, ``bos_token_id``, ``vocabulary``, ``cache_specs`` and ``tokenizer``
    (the :class:`~cairn.serving.Tokenizer` exported with the model, or ``None``).

    Args:
      name: the model name.
      path: the model directory.
      manifest: the parsed manifest (with its ``generation`` section).
      signatures: ``{name: LoadedSignature}``; must include prefill and decode.
      weights: ``{path: jax.Array}`` on the device.

    Raises:
      ModelFormatError: the prefill or decode signature is missing.
    """

    def __init__(self, name: str, path: str, manifest: dict, signatures: dict[str, LoadedSignature], weights: dict) -> None:
        super().__init__(name, path, manifest, signatures, weights)
        self._set_info(GenerationInfo.from_json(manifest.get("generation")))
        self.tokenizer = load_tokenizer(path, self.info)
        missing = [s for s in (PREFILL, DECODE) if s not in signatures]
        if missing:
            raise ModelFormatError(f"{MANIFEST}: a generator needs signatures {missing} (load them all)", MANIFEST)
        self._prefill, self._decode = exported_device_fns(
            signatures[PREFILL].exported, signatures[DECODE].exported, list(self.cache_specs))
        self.max_batch_size = min(signatures[PREFILL].max_batch_size, signatures[DECODE].max_batch_size)
        self._score = None
        if SCORE in signatures:  # exported with score=...: prompt log-probabilities
            import jax

            exp, w = signatures[SCORE].exported, self.weights
            call = jax.jit(lambda weights, tokens, lengths: exp.call(weights, {"tokens": tokens, "lengths": lengths})["logprobs"])
            self._score = lambda tokens, lengths: call(w, tokens, lengths)
        self._paged = None
        if PAGED in signatures and self.block_size is not None:  # exported with paged=...: the paged KV layout
            step, weights = exported_paged_fn(signatures[PAGED].exported, list(self.cache_specs)), self.weights
            self._paged = lambda *args: step(weights, *args)

    def prefill(self, tokens: Any, lengths: Any) -> tuple[Any, dict[str, Any]]:
        """Device-level prefill (see :class:`~cairn.serving.GenerativeModel`).

        Args:
          tokens: ``(b, p)`` int32 prompt tokens.
          lengths: ``(b,)`` int32 prompt lengths.

        Returns:
          ``(logits (b, vocab_size), cache)``.
        """
        return self._prefill(self.weights, tokens, lengths)

    def decode(self, tokens: Any, positions: Any, cache: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Device-level decode step; ``cache`` is donated.

        Args:
          tokens: ``(b,)`` int32, the last token of each row.
          positions: ``(b,)`` int32, where each token is written.
          cache: the device cache (donated).

        Returns:
          ``(logits (b, vocab_size), cache)``.
        """
        return self._decode(self.weights, tokens, positions, dict(cache))

    def __repr__(self) -> str:
        return f"LoadedGenerator({self.name!r}, path={self.path!r}, vocab_size={self.vocab_size}, max_length={self.max_length})"


def _default_name(path: str) -> str:
    base = os.path.basename(path)
    # <repo>/<model>/<version>: a numeric directory is a version, the model is its parent
    return os.path.basename(os.path.dirname(path)) if base.isdigit() else base


def _deserialize(root: str, doc: dict, name: str) -> Any:
    from jax import export

    entry = doc["signatures"][name]
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or entry["file"] not in doc["files"]:
        raise ModelFormatError(f"{MANIFEST}: signature {name!r} names no hashed file", MANIFEST)
    check_compatible(doc, name)
    with open(os.path.join(root, entry["file"]), "rb") as f:
        blob = f.read()
    try:
        return export.deserialize(bytearray(blob))
    except Exception as e:  # noqa: BLE001 - the hash matched, so this is a version problem
        newer = newer_exporter(doc)
        hint = f"; it was exported by jax {newer}, newer than this one: upgrade jax" if newer else ""
        raise ModelFormatError(f"{entry['file']}: jax.export cannot deserialize it ({e}){hint}", entry["file"]) from e


def load(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    signatures: Iterable[str] | None = None,
    compilation_cache_dir: str | os.PathLike | None = None,
    precompile: bool = True,
) -> LoadedModel:
    """Load a model directory written by :func:`cairn.serving.export`.

    Args:
      path: the model directory.
      name: the model name; default the directory name (its parent's when the
        directory is a numeric version, as in ``repo/mlp/3``).
      signatures: which signatures to load (default all).
      compilation_cache_dir: enable JAX's persistent compilation cache there
        (process-wide), so a second cold start reuses the compiled buckets.
      precompile: compile every batch bucket now (default) rather than on first use.

    Returns:
      A :class:`LoadedModel`; a :class:`LoadedGenerator` (a subclass) when the manifest
      has a ``"generation"`` section (written by :func:`cairn.serving.export_generator`).

    Raises:
      ModelIntegrityError: a file missing, truncated or altered (named).
      ModelFormatError: a malformed manifest, another format version, a calling
        convention or platform this JAX cannot run, or an unknown signature.
    """
    import jax

    root = os.path.abspath(os.fspath(path))
    doc = read_manifest(root)
    verify_files(root, doc["files"])
    wanted = list(doc["signatures"]) if signatures is None else list(signatures)
    unknown = [s for s in wanted if s not in doc["signatures"]]
    if unknown or not wanted:
        raise ModelFormatError(f"{root}: signatures {unknown or wanted} not in the model's {sorted(doc['signatures'])}")
    if compilation_cache_dir is not None:
        enable_compilation_cache(compilation_cache_dir)
    exported = {s: _deserialize(root, doc, s) for s in wanted}
    weights_doc = doc["weights"]
    if not isinstance(weights_doc, dict) or not isinstance(weights_doc.get("arrays"), list):
        raise ModelFormatError(f"{MANIFEST}: 'weights' must hold a list 'arrays'", MANIFEST)
    for e in weights_doc["arrays"]:
        if isinstance(e, dict) and isinstance(e.get("key"), str) and not any(f.startswith(e["key"] + "/") for f in doc["files"]):
            raise ModelFormatError(f"{MANIFEST}: weight {e.get('path')!r} has no hashed files under {e['key']}", MANIFEST)
    weights = jax.device_put(read_weights(root, weights_doc["arrays"]))
    model_name = name or _default_name(root)
    sigs = {s: LoadedSignature(model_name, s, exported[s], doc["signatures"][s], weights) for s in wanted}
    if "generation" in doc:  # the engine compiles its fixed shapes when it starts
        return LoadedGenerator(model_name, root, doc, sigs, weights)
    if precompile:
        for sig in sigs.values():
            sig.precompile()
    return LoadedModel(model_name, root, doc, sigs, weights)


def load_generator(path: str | os.PathLike, *, name: str | None = None,
                   compilation_cache_dir: str | os.PathLike | None = None) -> LoadedGenerator:
    """:func:`load` a directory written by :func:`cairn.serving.export_generator`.

    Args:
      path: the model directory.
      name: the model name; None uses the directory name (its parent's for a numeric version
        directory).
      compilation_cache_dir: enable JAX's persistent compilation cache there (see
        :func:`enable_compilation_cache`); None leaves it as it is.

    Raises:
      ModelFormatError: the directory holds no generator (no ``"generation"`` section),
        plus everything :func:`load` raises.
    """
    model = load(path, name=name, compilation_cache_dir=compilation_cache_dir)
    if not isinstance(model, LoadedGenerator):
        raise ModelFormatError(f"{model.path}: not a generative model (its manifest has no 'generation' section)", MANIFEST)
    return model
