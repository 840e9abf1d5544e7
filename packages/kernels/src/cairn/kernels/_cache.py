"""The autotune cache: the measured best (implementation, config) per device kind, op and bucket.

On disk, one JSON file per device kind, ``<device_kind>.json`` (lower case, runs of
characters other than letters and digits replaced by ``_``), validated against the
shipped ``cache_schema.json``::

    {"schema_version": 2, "device_kind": "NVIDIA H100 80GB HBM3", "jax_version": "0.10.2",
     "entries": {"dot_product_attention": {"[\\"bfloat16\\",4096,4096,32,8,128,true]":
         {"implementation": "pallas_mosaic_gpu", "config": {"block_q": 128, "block_k": 128},
          "time_ms": 1.23, "candidates": [...],
          "measured": {"date": "2026-11-27T21:03:00Z", "loadavg": [0.4, 0.3, 0.2],
                       "cpu_count": 16, "host": "gpu-7", "machine": "x86_64",
                       "jax_version": "0.10.2", "jaxlib_version": "0.10.2",
                       "device_kind": "NVIDIA H100 80GB HBM3", "platform": "gpu",
                       "mode": "fwd", "iterations": 5}}}}}

Each entry records how it was measured (``measured``: when, on which machine, with which
versions and under what load); entries written by schema 1 (before that record existed)
are read as they are, and a reader re-measures with ``cairn-kernels tune --force``.

Files are read from the package's ``data/autotune/`` directory (shipped results, read
only) and then the user cache directory (``$CAIRN_KERNELS_CACHE_DIR``, else
``$XDG_CACHE_HOME/cairn/kernels``, else ``~/.cache/cairn/kernels``), later entries
winning. A file written by a newer schema is skipped with a warning. Writes go only to
the user directory, atomically (temporary file + rename).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import pathlib
import platform
import re
import socket
import threading
from collections.abc import Mapping
from typing import Any

import jax

from cairn.core_array import atomic_write_json

SCHEMA_VERSION = 2
SCHEMA_PATH = pathlib.Path(__file__).with_name("cache_schema.json")
SHIPPED_DIR = pathlib.Path(__file__).with_name("data") / "autotune"
_LOG = logging.getLogger("cairn.kernels")

_lock = threading.Lock()
# device kind -> op -> bucket key -> entry
_MEMORY: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
_LOADED: set[str] = set()
_MISSES_LOGGED: set[str] = set()
# (device kind, op, bucket key) -> the file an entry was read from (absent: measured in this process)
_ORIGIN: dict[tuple[str, str, str], str] = {}


class CacheFileError(ValueError):
    """A cache file that is not valid JSON or does not follow ``cache_schema.json``."""


def device_kind() -> str:
    """The device kind of the default device (``"cpu"``, ``"NVIDIA H100 80GB HBM3"``, ...)."""
    return str(jax.devices()[0].device_kind)


def file_stem(kind: str) -> str:
    """The file name stem for a device kind: lower case, other runs of characters as ``_``."""
    return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "unknown"


def cache_dir() -> pathlib.Path:
    """The user cache directory (see the module docstring); not created here."""
    env = os.environ.get("CAIRN_KERNELS_CACHE_DIR")
    if env:
        return pathlib.Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache"
    return base / "cairn" / "kernels"


def measurement_context(**extra: Any) -> dict[str, Any]:
    """What a measurement ran under: date (UTC), machine, load, versions and device.

    ``loadavg`` is ``os.getloadavg()`` (``None`` where the OS has none) and ``cpu_count``
    ``os.cpu_count()``: a load near or above the CPU count means the timings competed with
    other work. ``extra`` (e.g. ``mode``, ``iterations``) is added as given.

    Args:
      extra: more fields to record (e.g. ``mode="fwd"``, ``iterations=5``).

    Example:
      >>> ctx = measurement_context(mode="fwd")
      >>> sorted(ctx)[:4], ctx["mode"]
      (['cpu_count', 'date', 'device_kind', 'host'], 'fwd')
    """
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": socket.gethostname(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count() or 0,
        "loadavg": load,
        "jax_version": jax.__version__,
        "jaxlib_version": _jaxlib_version(),
        "device_kind": str(device.device_kind),
        "platform": str(device.platform),
        **extra,
    }


def _jaxlib_version() -> str:
    try:
        import jaxlib

        return str(jaxlib.__version__)
    except (ImportError, AttributeError):
        return "unknown"


@functools.cache
def schema() -> dict[str, Any]:
    """The JSON schema of a cache file (``cache_schema.json``)."""
    return dict(json.loads(SCHEMA_PATH.read_text()))


def validate(doc: Any, *, source: str = "<cache>") -> None:
    """Check ``doc`` against the cache schema (the subset of JSON Schema it uses).

    Raises:
      CacheFileError: naming ``source`` and the JSON path of the first bad field.
    """
    _check(doc, schema(), "$", source)


_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "null": type(None),
}


def _check(value: Any, rule: Mapping[str, Any], where: str, source: str) -> None:
    def fail(why: str) -> None:
        raise CacheFileError(f"{source}: field {where}: {why}")

    if "type" in rule:
        kinds = [rule["type"]] if isinstance(rule["type"], str) else rule["type"]
        ok = any(
            isinstance(value, _TYPES[k])
            and not (k in ("integer", "number") and isinstance(value, bool))
            for k in kinds
        )
        if not ok:
            fail(f"expected {' or '.join(kinds)}, got {type(value).__name__} {value!r:.60}")
    if "enum" in rule and value not in rule["enum"]:
        fail(f"expected one of {rule['enum']}, got {value!r}")
    if "minimum" in rule and value < rule["minimum"]:
        fail(f"expected >= {rule['minimum']}, got {value!r}")
    if "minLength" in rule and len(value) < rule["minLength"]:
        fail(f"expected at least {rule['minLength']} character(s)")
    if isinstance(value, dict):
        for key in rule.get("required", ()):
            if key not in value:
                fail(f"missing required key {key!r}")
        props = rule.get("properties", {})
        extra = rule.get("additionalProperties", True)
        for key, sub in value.items():
            if key in props:
                _check(sub, props[key], f"{where}.{key}", source)
            elif extra is False:
                fail(f"unexpected key {key!r} (allowed: {sorted(props)})")
            elif isinstance(extra, dict):
                _check(sub, extra, f"{where}[{key!r}]", source)
    if isinstance(value, list) and "items" in rule:
        for i, sub in enumerate(value):
            _check(sub, rule["items"], f"{where}[{i}]", source)


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate one cache file.

    Raises:
      CacheFileError: if the file is not JSON or not valid (names the file and field).
    """
    path = pathlib.Path(path)
    doc = _read_json(path)
    validate(doc, source=str(path))
    return dict(doc)


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CacheFileError(f"{path}: not valid JSON: {e}") from e


def _ensure_loaded(kind: str) -> None:
    if kind in _LOADED:
        return
    _LOADED.add(kind)
    name = file_stem(kind) + ".json"
    for directory in (SHIPPED_DIR, cache_dir()):
        path = directory / name
        if not path.is_file():
            continue
        doc = _read_json(path)
        if _newer_schema(doc):
            _LOG.warning(
                "cairn.kernels: skipping %s: written by a newer cairn-kernels (schema_version "
                "%r, this one reads up to %d)", path, doc["schema_version"], SCHEMA_VERSION,
            )
            continue
        validate(doc, source=str(path))
        for op, es in doc["entries"].items():
            _MEMORY.setdefault(kind, {}).setdefault(op, {}).update(es)
            for key in es:
                _ORIGIN[(kind, op, key)] = str(path)


def _newer_schema(doc: Any) -> bool:
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    return isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION


def lookup_entry(kind: str, op: str, key: str) -> tuple[dict[str, Any], str | None] | None:
    """The cached entry for a bucket and where it came from, or ``None``.

    Returns:
      ``(entry, origin)``: the entry as in the file (``measured`` absent for schema-1
      entries), and the file it was read from, or ``None`` when it was measured in this
      process (:func:`cairn.kernels.autotune`).
    """
    with _lock:
        _ensure_loaded(kind)
        entry = _MEMORY.get(kind, {}).get(op, {}).get(key)
        if entry is None:
            if op not in _MISSES_LOGGED:
                _MISSES_LOGGED.add(op)
                _LOG.info(
                    "cairn.kernels: no autotuned entry for %s on %r; using the default heuristic",
                    op,
                    kind,
                )
            return None
        return dict(entry), _ORIGIN.get((kind, op, key))


def put(kind: str, op: str, key: str, entry: Mapping[str, Any]) -> None:
    """Store an entry in the in-process cache (see :func:`save` to persist it)."""
    with _lock:
        _ensure_loaded(kind)
        _MEMORY.setdefault(kind, {}).setdefault(op, {})[key] = dict(entry)
        _ORIGIN.pop((kind, op, key), None)


def entries(kind: str) -> dict[str, dict[str, dict[str, Any]]]:
    """A copy of every in-process entry for a device kind (op -> bucket key -> entry)."""
    with _lock:
        _ensure_loaded(kind)
        return {op: {k: dict(v) for k, v in es.items()} for op, es in _MEMORY.get(kind, {}).items()}


def clear() -> None:
    """Forget the in-process cache (files are re-read on the next lookup)."""
    with _lock:
        _MEMORY.clear()
        _LOADED.clear()
        _MISSES_LOGGED.clear()
        _ORIGIN.clear()


def save(kind: str | None = None, path: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Write the in-process entries of a device kind to its user cache file, atomically.

    Entries already in the file are kept unless replaced (schema-1 entries stay as they
    are, without a ``measured`` record). The document is validated before it is written.

    Args:
      kind: the device kind (default: the current device's).
      path: the file (default: ``cache_dir() / "<device kind>.json"``).

    Returns:
      The path written.

    Raises:
      CacheFileError: the file exists and is invalid, or was written by a newer schema
        (it is left alone rather than downgraded).
    """
    kind = kind or device_kind()
    target = pathlib.Path(path) if path is not None else cache_dir() / (file_stem(kind) + ".json")
    merged: dict[str, dict[str, Any]] = {}
    if target.is_file():
        old = _read_json(target)
        if _newer_schema(old):
            raise CacheFileError(
                f"{target}: written by a newer cairn-kernels (schema_version "
                f"{old['schema_version']}, this one writes {SCHEMA_VERSION}); not overwritten"
            )
        validate(old, source=str(target))
        for op, es in old["entries"].items():
            merged.setdefault(op, {}).update(es)
    for op, es in entries(kind).items():
        merged.setdefault(op, {}).update(es)
    doc = {
        "schema_version": SCHEMA_VERSION,
        "device_kind": kind,
        "jax_version": jax.__version__,
        "entries": merged,
    }
    validate(doc, source=str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(target, doc, indent=1, sort_keys=True)
    return target
