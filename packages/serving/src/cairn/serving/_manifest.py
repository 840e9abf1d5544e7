"""``manifest.json``: what a model directory holds, and the checks made before using it.

The manifest records the format version, who wrote it (cairn-serving, JAX and jaxlib
versions), the StableHLO calling convention and platforms, every signature (input and
output specs with symbolic dims, batch buckets), the weight arrays and ``QArray``
layouts and the size and SHA-256 of every other file. The file is checksummed JSON
(:func:`cairn.core_array.dumps_checksummed_json`: ``{"checksum": "sha256:...", "body": {...}}``),
so it checks itself with no second file and a changed byte is blamed on the one file it is in.
"""

from __future__ import annotations

import os
import re
from typing import Any

from cairn.core_array import ArraySpec, CorruptFileError, loads_checksummed_json
from cairn.serving._hashing import MANIFEST, ModelFormatError, ModelIntegrityError

__all__ = ["FORMAT", "read_manifest", "check_compatible", "parse_specs", "SIGNATURE_NAME", "newer_exporter"]

FORMAT = "cairn.serving.model/2"  # /1 sealed itself with a "manifest_sha256" key
SIGNATURE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")
_REQUIRED = ("format", "created_by", "platforms", "signatures", "weights", "files")


def read_manifest(root: str) -> dict:
    """Read, digest-check and validate ``root/manifest.json``.

    Raises:
      ModelIntegrityError: the manifest or its digest file is missing or they disagree.
      ModelFormatError: not JSON, another format version, or missing fields.
    """
    path = os.path.join(root, MANIFEST)
    if not os.path.isdir(root):
        raise ModelFormatError(f"{root}: not a model directory (no such directory)")
    if not os.path.isfile(path):
        raise ModelIntegrityError(f"{MANIFEST}: missing from the model directory {root}", MANIFEST)
    with open(path, "rb") as f:
        raw = f.read()
    doc = _verified(raw)
    if not isinstance(doc, dict):
        raise ModelFormatError(f"{MANIFEST}: expected a JSON object, got {type(doc).__name__}", MANIFEST)
    if doc.get("format") != FORMAT:
        raise ModelFormatError(
            f"{MANIFEST}: format {doc.get('format')!r} is not supported; this cairn-serving reads {FORMAT!r}"
            " (export the model again with this version, or load it with the version that wrote it)", MANIFEST
        )
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise ModelFormatError(f"{MANIFEST}: missing fields {missing}", MANIFEST)
    if not isinstance(doc["signatures"], dict) or not doc["signatures"]:
        raise ModelFormatError(f"{MANIFEST}: 'signatures' must be a non-empty object", MANIFEST)
    if not isinstance(doc["files"], dict):
        raise ModelFormatError(f"{MANIFEST}: 'files' must be an object", MANIFEST)
    return doc


def _verified(raw: bytes) -> Any:
    """The manifest's content, its checksum verified."""
    try:
        return loads_checksummed_json(raw, MANIFEST)[0]
    except CorruptFileError as e:
        if e.reason.startswith("not valid JSON"):
            raise ModelFormatError(f"{MANIFEST}: {e.reason}", MANIFEST) from None
        if b'"manifest_sha256"' in raw:
            raise ModelFormatError(
                f"{MANIFEST}: format 'cairn.serving.model/1' (sealed by 'manifest_sha256') is not supported; this "
                f"cairn-serving reads {FORMAT!r} (export the model again with this version)", MANIFEST
            ) from None
        raise ModelIntegrityError(
            f"{MANIFEST}: {e.reason} (the file is corrupted or was not written by cairn.serving.export)", MANIFEST
        ) from None


def parse_specs(d: Any, where: str) -> dict[str, ArraySpec]:
    """``{name: ArraySpec}`` from the manifest's ``{name: spec JSON}``.

    Raises:
      ModelFormatError: naming ``where`` when an entry is malformed.
    """
    if not isinstance(d, dict):
        raise ModelFormatError(f"{MANIFEST}: {where} must be an object", MANIFEST)
    try:
        return {str(k): ArraySpec.from_json(v) for k, v in d.items()}
    except (ValueError, TypeError) as e:
        raise ModelFormatError(f"{MANIFEST}: {where}: {e}", MANIFEST) from None


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v)[:3])


def check_compatible(doc: dict, signature: str) -> None:
    """Refuse a signature this JAX cannot run: a calling convention outside the range this
    jax supports, or a platform list without the current backend.

    Raises:
      ModelFormatError: saying which versions or platforms were expected.
    """
    import jax
    from jax import export

    sig = doc["signatures"][signature]
    ccv = sig.get("calling_convention_version")
    lo, hi = export.minimum_supported_calling_convention_version, export.maximum_supported_calling_convention_version
    made_by = doc.get("created_by", {}).get("jax", "?")
    if not isinstance(ccv, int) or not lo <= ccv <= hi:
        newer = isinstance(ccv, int) and ccv > hi
        raise ModelFormatError(
            f"signature {signature!r}: exported by jax {made_by} with calling convention version {ccv}, but "
            f"jax {jax.__version__} runs versions {lo}..{hi}"
            + ("; upgrade jax and jaxlib to load it" if newer else "; export it again with this jax"),
            MANIFEST,
        )
    backend = jax.default_backend()
    platforms = [str(p).lower() for p in doc.get("platforms") or []]
    # jax calls a GPU backend "gpu"; jax.export names the platform "cuda" or "rocm"
    names = {"cuda", "rocm", "gpu"} if backend == "gpu" else {backend}
    if platforms and not names & set(platforms):
        raise ModelFormatError(
            f"signature {signature!r}: exported for platforms {platforms}, but this process runs on {backend!r}; "
            f"export with platforms=(..., {sorted(names)[0]!r})", MANIFEST
        )


def newer_exporter(doc: dict) -> str | None:
    """The exporting jax version when it is newer than this one (JAX guarantees only a
    three-week forward window), else ``None``."""
    import jax

    made_by = str(doc.get("created_by", {}).get("jax", ""))
    try:
        return made_by if _version_tuple(jax.__version__) < _version_tuple(made_by) else None
    except ValueError:
        return None
