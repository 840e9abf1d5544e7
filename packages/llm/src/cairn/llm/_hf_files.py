"""The Hugging Face checkpoint directory: ``model.safetensors`` or shards plus an index.

Layout read and written::

    config.json
    model.safetensors                          # one file, or
    model-00001-of-0000N.safetensors ...       # shards and
    model.safetensors.index.json               # {"metadata": {"total_size": bytes},
                                               #  "weight_map": {tensor name: shard file}}

Reading goes through ``safetensors.safe_open``: the headers of every file are read and
checked first (a truncated or corrupt file is named before any tensor is read), then
tensors are read one at a time: a whole tensor with plain file reads into a fresh array
(a memory map would count the shard's touched pages as resident memory until it is
closed), a box of one (a device's share) through safetensors' slice.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import ml_dtypes  # also registers bfloat16 and the float8 types with NumPy for safetensors
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from cairn.core_array import atomic_write, atomic_write_text
from cairn.llm._errors import CheckpointError

__all__ = ["ShardedReader", "parse_size", "write_shards"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class ShardedReader:
    """Every tensor's file, shape and dtype from the headers of a checkpoint directory.

    Raises ``CheckpointError`` naming the file when the directory holds no weights, the
    index is not JSON or names a missing file or a tensor its shard lacks, or a file's
    header cannot be parsed (truncated, corrupt, not safetensors).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = pathlib.Path(directory)
        index, single = self.directory / INDEX, self.directory / SINGLE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (no JSON 'weight_map'): {e}") from e
        elif single.exists():
            weight_map = None
        else:
            raise CheckpointError(f"{self.directory}: no {SINGLE} and no {INDEX}")
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
        self.headers: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {f: self._header(f) for f in files}
        self.file_of: dict[str, str] = {}
        for file, header in self.headers.items():
            for name in header:
                self.file_of.setdefault(name, file)
        if weight_map is not None:
            wrong = sorted(n for n, f in weight_map.items() if n not in self.headers[f])
            if wrong:
                raise CheckpointError(
                    f"{index}: the index places {len(wrong)} tensor(s) in shards that do not hold them: "
                    + ", ".join(f"{n} (in {weight_map[n]})" for n in wrong[:20])
                )
            self.file_of = dict(weight_map)

    def _header(self, file: str) -> dict[str, tuple[tuple[int, ...], str]]:
        path = self.directory / file
        if not path.exists():
            raise CheckpointError(f"{path}: shard named by {INDEX} does not exist")
        try:
            with safe_open(str(path), framework="np") as f:
                out = {}
                for name in f.keys():
                    sl = f.get_slice(name)
                    out[name] = (tuple(int(d) for d in sl.get_shape()), str(sl.get_dtype()))
                return out
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read the safetensors file (truncated or corrupt?): {e}") from e

    def shape(self, name: str) -> tuple[int, ...]:
        file = self.file_of[name]
        return self.headers[file][name][0]

    def dtype(self, name: str) -> str:
        """The safetensors dtype code (``F32``, ``BF16``, ``I8``...)."""
        file = self.file_of[name]
        return self.headers[file][name][1]

    def read(self, names: list[str]) -> Iterator[tuple[str, Any]]:
        """``(name, lazy tensor)`` for each of ``names``, file by file. ``t[...]`` reads the
        tensor whole into a fresh array with plain file reads (no memory map: the file's
        pages stay page cache, not this process's resident memory); ``t[a:b, c:d]`` reads only
        that box through safetensors' slice. Valid until the next item is drawn."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.file_of[n], []).append(n)
        for file, wanted in by_file.items():
            path = self.directory / file
            try:
                with open(path, "rb") as raw, safe_open(str(path), framework="np") as f:
                    offsets = _data_offsets(raw)
                    for n in wanted:
                        yield n, _LazyTensor(raw, f, n, offsets[n], self.headers[file][n], path)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path}: cannot read tensor data: {e}") from e


# safetensors dtype codes -> NumPy (little-endian); the loader reads only float tensors
_NP_DTYPES = {"F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype("<f4"),
              "F64": np.dtype("<f8")}


def _data_offsets(raw: Any) -> dict[str, tuple[int, int]]:
    """``{name: (start, end)}`` absolute byte offsets of every tensor of an open safetensors file."""
    raw.seek(0)
    (n,) = np.frombuffer(raw.read(8), "<u8")
    header = json.loads(raw.read(int(n)))
    base = 8 + int(n)
    return {k: (base + v["data_offsets"][0], base + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


class _LazyTensor:
    """One tensor of an open shard: ``[...]`` reads it whole (``readinto`` a fresh buffer),
    any other index reads that box through safetensors' slice."""

    def __init__(self, raw: Any, st: Any, name: str, span: tuple[int, int],
                 meta: tuple[tuple[int, ...], str], path: pathlib.Path) -> None:
        self.raw, self.st, self.name, self.span, self.path = raw, st, name, span, path
        self.shape, self.code = meta

    def __getitem__(self, index: Any) -> np.ndarray:
        dtype = _NP_DTYPES.get(self.code)
        if index is not Ellipsis or dtype is None:
            return self.st.get_slice(self.name)[index]
        start, end = self.span
        out = np.empty(self.shape, dtype)
        self.raw.seek(start)
        if out.nbytes != end - start or self.raw.readinto(out.reshape(-1).view(np.uint8)) != out.nbytes:
            raise CheckpointError(f"{self.path}: tensor {self.name} is truncated (expected {end - start} bytes)")
        return out


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or ``"5GB"`` / ``"500MB"`` / ``"2GiB"`` (decimal or binary units)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a positive int or a size like '5GB', got {size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def _plan(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name, arr in tensors.items():
        if shards[-1] and used + arr.nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += arr.nbytes
    return shards


def write_shards(directory: str | os.PathLike, tensors: Mapping[str, np.ndarray], max_shard_size: int | str,
                 config: Mapping[str, Any]) -> list[str]:
    """Writes ``config.json`` and ``tensors`` (in order) as one file or shards plus the index.

    Each file is written under a temporary name and renamed; shards of an earlier save
    that this one does not overwrite are removed, so the directory never mixes two saves'
    weights. Returns the weight file names.
    """
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    plan = _plan(tensors, parse_size(max_shard_size))
    names = [SINGLE] if len(plan) == 1 else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    for file, members in zip(names, plan):
        shard = {n: np.ascontiguousarray(tensors[n]) for n in members}

        def write(tmp: str, shard: dict[str, np.ndarray] = shard) -> None:
            save_file(shard, tmp, metadata={"format": "pt"})

        atomic_write(d / file, write)
    with contextlib.suppress(FileNotFoundError):
        (d / INDEX).unlink()
    if len(plan) > 1:
        index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
                 "weight_map": {n: f for f, members in zip(names, plan) for n in members}}
        atomic_write_text(d / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
    for old in d.iterdir():
        if (old.name == SINGLE or _SHARD.fullmatch(old.name)) and old.name not in names:
            old.unlink()
    atomic_write_text(d / "config.json", json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    return names


