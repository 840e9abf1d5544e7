"""Model repositories: ``<repo>/<model>/<version>/`` directories and their version policies.

A model directory holds numeric version directories (each an export directory written
by :func:`cairn.serving.export`; non-numeric names and names with a leading zero are
ignored, as in Triton) and an optional ``config.json``, Triton's ``config.pbtxt`` in
JSON::

    {"version_policy": {"latest": {"num_versions": 2}},      # or {"all": {}},
                                                             # or {"specific": {"versions": [1, 3]}}
     "max_batch_size": 32,                                   # cap on the model's own
     "dynamic_batching": {"max_queue_delay_microseconds": 2000, "max_queue_size": 256,
                          "batch_buckets": [1, 4, 16, 32], "max_concurrent_batches": 1,
                          "enabled": true},
     "generation": {"num_slots": 16, "prefill_batch": 4, "max_queue": 256,   # generators only
                    "max_new_tokens_limit": 512, "scheduler": "continuous"}}

The default policy serves the latest version only. ``generation`` holds the
:class:`GenerationConfig` of a generative model's engine (fields not given keep the
server's defaults: ``cairn-serve --num-slots/--prefill-batch/--max-queue``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cairn.serving._batcher import BatchingConfig
from cairn.serving._generate import GenerationConfig


@dataclasses.dataclass(frozen=True)
class VersionPolicy:
    """Which of a model's versions to serve (Triton's ``version_policy``).

    Args:
      kind: ``"latest"``, ``"all"`` or ``"specific"``.
      num_versions: how many of the newest versions ``"latest"`` serves.
      versions: the versions ``"specific"`` serves.

    >>> VersionPolicy.latest(2).select([1, 2, 3]), VersionPolicy.specific(1, 3).select([1, 2, 3])
    ([2, 3], [1, 3])
    """

    kind: str = "latest"
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("latest", "all", "specific"):
            raise ValueError(f"VersionPolicy kind must be 'latest', 'all' or 'specific', got {self.kind!r}")
        if self.kind == "latest" and self.num_versions < 1:
            raise ValueError(f"VersionPolicy.latest needs num_versions >= 1, got {self.num_versions}")
        if self.kind == "specific" and not self.versions:
            raise ValueError("VersionPolicy.specific needs at least one version")

    @classmethod
    def latest(cls, num_versions: int = 1) -> VersionPolicy:
        """Serve the ``num_versions`` newest versions.

        Args:
          num_versions: how many of the newest versions to serve.
        """
        return cls("latest", num_versions=num_versions)

    @classmethod
    def all(cls) -> VersionPolicy:
        """Serve every version."""
        return cls("all")

    @classmethod
    def specific(cls, *versions: int) -> VersionPolicy:
        """Serve exactly these versions (those present).

        Args:
          versions: the version numbers to serve.
        """
        return cls("specific", versions=tuple(sorted(int(v) for v in versions)))

    def select(self, available: Sequence[int]) -> list[int]:
        """The versions to serve out of ``available``, ascending.

        Args:
          available: the version numbers present.
        """
        ordered = sorted(available)
        if self.kind == "all":
            return ordered
        if self.kind == "latest":
            return ordered[-self.num_versions :]
        return [v for v in ordered if v in self.versions]

    def to_json(self) -> dict[str, Any]:
        """Triton's JSON form: ``{"latest": {"num_versions": 1}}`` etc."""
        if self.kind == "latest":
            return {"latest": {"num_versions": self.num_versions}}
        if self.kind == "all":
            return {"all": {}}
        return {"specific": {"versions": list(self.versions)}}

    @classmethod
    def from_json(cls, obj: Any) -> VersionPolicy:
        """Parse :meth:`to_json`'s form.

        Args:
          obj: ``{"latest": {"num_versions": n}}``, ``{"all": {}}`` or ``{"specific": {"versions":
            [...]}}``.

        Raises:
          ValueError: not exactly one of latest/all/specific, or a malformed body.
        """
        if not isinstance(obj, dict) or len(obj) != 1:
            raise ValueError(f"version_policy must be one of {{'latest': ...}}, {{'all': {{}}}}, {{'specific': ...}}, got {obj!r}")
        ((kind, body),) = obj.items()
        if not isinstance(body, dict):
            raise ValueError(f"version_policy.{kind} must be a JSON object, got {body!r}")
        if kind == "latest":
            return cls.latest(int(body.get("num_versions", 1)))
        if kind == "all":
            return cls.all()
        if kind == "specific":
            return cls.specific(*body.get("versions", ()))
        raise ValueError(f"version_policy kind must be 'latest', 'all' or 'specific', got {kind!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A model's serving configuration (from its ``config.json``)."""

    version_policy: VersionPolicy = VersionPolicy()
    batching: BatchingConfig = BatchingConfig()
    generation: GenerationConfig = GenerationConfig()


_BATCHING_KEYS = {"max_queue_delay_microseconds", "max_queue_size", "batch_buckets", "max_concurrent_batches", "enabled"}


def parse_config(obj: Any, where: str, default: BatchingConfig, generation: GenerationConfig | None = None) -> ModelConfig:
    """Parse a model's ``config.json`` content (see the module docstring).

    Args:
      obj: the parsed JSON.
      where: the file's name, for error messages.
      default: the batching defaults the file overrides.
      generation: the generation defaults its ``"generation"`` key overrides.

    Raises:
      ValueError: an unknown key or a malformed value, naming ``where`` (and the key).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: must be a JSON object")
    gen = _parse_generation(obj.get("generation"), where, generation or GenerationConfig())
    unknown = set(obj) - {"version_policy", "max_batch_size", "dynamic_batching", "name", "generation"}
    dyn = obj.get("dynamic_batching", {})
    if not isinstance(dyn, dict):
        raise ValueError(f"{where}: dynamic_batching must be a JSON object")
    unknown |= {f"dynamic_batching.{k}" for k in set(dyn) - _BATCHING_KEYS}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    try:
        policy = VersionPolicy.from_json(obj["version_policy"]) if "version_policy" in obj else VersionPolicy()
        fields: dict[str, Any] = {}
        if "max_batch_size" in obj:
            fields["max_batch_size"] = int(obj["max_batch_size"])
        if "max_queue_delay_microseconds" in dyn:
            fields["max_queue_delay"] = float(dyn["max_queue_delay_microseconds"]) / 1e6
        for key in ("max_queue_size", "max_concurrent_batches"):
            if key in dyn:
                fields[key] = int(dyn[key])
        if "batch_buckets" in dyn:
            fields["batch_buckets"] = tuple(int(b) for b in dyn["batch_buckets"])
        if "enabled" in dyn:
            fields["enabled"] = bool(dyn["enabled"])
        return ModelConfig(policy, dataclasses.replace(default, **fields), gen)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _parse_generation(obj: Any, where: str, default: GenerationConfig) -> GenerationConfig:
    """The ``"generation"`` key: GenerationConfig fields over ``default``."""
    if obj is None:
        return default
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: generation must be a JSON object of GenerationConfig fields, got {obj!r}")
    try:
        return GenerationConfig.from_json({**default.to_json(), **obj})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: generation: {e}") from None


def _default_loader(path: Path) -> Any:
    from cairn.serving._load import load  # an export directory, hashes verified before parsing

    return load(path)


class ModelRepository:
    """A directory of models: ``<root>/<model>/<version>/`` plus optional ``config.json``.

    Args:
      root: the repository directory.
      loader: ``loader(version_dir) -> ServableModel``; default :func:`cairn.serving.load`.
      batching: the batching defaults a model's ``config.json`` overrides.
      generation: the generation-engine defaults (its ``"generation"`` key overrides them).

    Raises:
      FileNotFoundError: ``root`` is not a directory.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        loader: Callable[[Path], Any] | None = None,
        batching: BatchingConfig | None = None,
        generation: GenerationConfig | None = None,
    ) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"model repository {self.root} is not a directory")
        self.loader = loader or _default_loader
        self.batching = batching or BatchingConfig()
        self.generation = generation or GenerationConfig()

    def names(self) -> list[str]:
        """The model directories, sorted."""
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def versions(self, name: str) -> list[int]:
        """The version directories of ``name`` (numeric, no leading zero), ascending.

        Args:
          name: the model's directory name.

        Raises:
          KeyError: no such model directory.
        """
        d = self.root / name
        if not d.is_dir():
            raise KeyError(f"model '{name}' is not in the repository {self.root}")
        return sorted(int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit() and not p.name.startswith("0"))

    def config(self, name: str) -> ModelConfig:
        """``name``'s config.json, or the defaults when there is none.

        Args:
          name: the model's directory name.

        Raises:
          ValueError: config.json is not valid JSON or not a valid config.
        """
        path = self.root / name / "config.json"
        if not path.exists():
            return ModelConfig(batching=self.batching, generation=self.generation)
        try:
            obj = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return parse_config(obj, str(path), self.batching, self.generation)

    def load(self, name: str, version: int) -> Any:
        """Load one version (in a worker thread: loading compiles).

        Args:
          name: the model's directory name.
          version: the version directory number.

        Returns:
          what the repository's loader returns for that directory.
        """
        return self.loader(self.root / name / str(version))

    def fingerprint(self, name: str) -> tuple:
        """What changes when ``name``'s directory does: its versions and the modification
        times of each version directory and of config.json (a version still being copied
        in changes it, so a failed load is retried once the copy completes).

        Args:
          name: the model's directory name.
        """
        d = self.root / name
        entries = [d / str(v) for v in self.versions(name)] + [d / "config.json"]
        return tuple((p.name, p.stat().st_mtime_ns) for p in entries if p.exists())


class ModelSet:
    """In-memory models served as version 1 each (what ``serve(model)`` wraps)."""

    def __init__(
        self,
        models: Mapping[str, Any],
        batching: BatchingConfig | Mapping[str, BatchingConfig] | None = None,
        generation: GenerationConfig | Mapping[str, GenerationConfig] | None = None,
    ) -> None:
        self.models = dict(models)
        self.batching = batching
        self.generation = generation

    def names(self) -> list[str]:
        return sorted(self.models)

    def versions(self, name: str) -> list[int]:
        if name not in self.models:
            raise KeyError(f"model '{name}' is not served here (models: {sorted(self.models)})")
        return [1]

    def config(self, name: str) -> ModelConfig:
        b = self.batching
        if isinstance(b, Mapping):
            b = b.get(name)
        g = self.generation
        if isinstance(g, Mapping):
            g = g.get(name)
        return ModelConfig(batching=b or BatchingConfig(), generation=g or GenerationConfig())

    def load(self, name: str, version: int) -> Any:
        return self.models[name]

    def fingerprint(self, name: str) -> tuple:
        return (name in self.models,)
