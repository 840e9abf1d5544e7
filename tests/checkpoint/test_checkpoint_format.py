"""The on-disk format as documented: keys, codecs, file counts, durability order, metadata."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import cairn.checkpoint as cc
from cairn.checkpoint import _fs, _ownership, _storage


def _ocdbt_keys(db: str) -> list[str]:
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{db}/"}).result()
    return sorted(k.decode() for k in kv.list().result())


def _zarr_json(db: str, path: str) -> dict:
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{db}/"}).result()
    return json.loads(kv.read(f"{path}/zarr.json").result().value)


def test_keys_are_core_array_paths_and_every_chunk_has_crc32c(tmp_path):
    tree = {"layers": [{"mlp": {"kernel": np.ones((4, 3), np.float32)}}], "emb": np.arange(5)}
    cc.save(tmp_path / "c", tree)
    db = str(tmp_path / "c" / "d" / "process_0")
    keys = _ocdbt_keys(db)
    arrays = sorted(k[: -len("/zarr.json")] for k in keys if k.endswith("/zarr.json"))
    assert arrays == ["emb", "layers/0/mlp/kernel"]
    # the chunks sit under the same path prefix (default zarr3 chunk key encoding)
    assert "layers/0/mlp/kernel/c/0/0" in keys and "emb/c/0" in keys
    z = _zarr_json(db, "layers/0/mlp/kernel")
    assert [c["name"] for c in z["codecs"]] == ["bytes", "crc32c"]  # no compression by default
    assert z["data_type"] == "float32" and z["shape"] == [4, 3]
    cc.save(tmp_path / "z", tree, compression="zstd:5")
    z = _zarr_json(str(tmp_path / "z" / "d" / "process_0"), "emb")
    assert [c["name"] for c in z["codecs"]] == ["bytes", "zstd", "crc32c"]
    assert z["codecs"][1]["configuration"]["level"] == 5


def _files(root) -> list[str]:
    return [os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs]


def test_manager_step_with_many_arrays_is_a_handful_of_files(tmp_path):
    class It:
        def get_state(self):
            return {"i": 3}

        def set_state(self, s):
            pass

    params = {f"layer{i}": {"w": np.full((32, 32), i, np.float32), "b": np.zeros(32)} for i in range(100)}
    opt = {"mu": params, "nu": params, "count": 7}
    with cc.CheckpointManager(tmp_path, cc.CheckpointManagerOptions(enable_async=False)) as m:
        m.save(1, {"params": params, "opt": opt, "data": It()})
    files = _files(tmp_path / "1")
    # 500 arrays, 3 items: COMMIT + _STEP.json + per pytree item (metadata, regions, the
    # OCDBT manifest and some data files holding chunks and B-tree nodes) + the
    # Checkpointable's state file. How many data files OCDBT writes depends on how its
    # writes were batched (20 on a quiet machine, 27 under load), so the bound is loose;
    # what matters is that it is far from one file per array
    assert len(files) <= 50, files
    assert sum("/d/" in f for f in files) <= 40, files
    got = cc.CheckpointManager(tmp_path).restore(1)
    np.testing.assert_array_equal(got["opt"]["nu"]["layer99"]["w"], np.full((32, 32), 99, np.float32))


def test_metadata_lists_sharding_and_reads_no_array_data(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    x = jax.device_put(np.arange(12.0, dtype=np.float32).reshape(4, 3), NamedSharding(mesh, P("data", None)))
    cc.save(tmp_path / "c", {"x": x, "v": np.zeros(2, np.int8), "lr": 0.5})
    # the array data may be gone: metadata comes from the JSON alone
    shutil.rmtree(tmp_path / "c" / "d")
    meta = cc.metadata(tmp_path / "c")
    assert set(meta) == {"x", "v", "lr"}
    assert (meta["x"].kind, meta["x"].shape, meta["x"].dtype) == ("jax", (4, 3), "float32")
    assert meta["x"].sharding == ("data", None) and meta["x"].mesh == {"data": 1}
    assert meta["v"].sharding is None and meta["v"].shape == (2,) and meta["v"].dtype == "int8"
    assert meta["lr"].kind == "scalar" and meta["lr"].value == 0.5
    with pytest.raises(cc.CheckpointError, match=r"failed to read leaf '(x|v)'.*does not exist"):
        cc.restore(tmp_path / "c")


def _trace_durability(monkeypatch):
    """Record fsyncs (by the file or directory they refer to) and renames, in order."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(a, b):
        events.append(("rename", f"{os.path.abspath(a)} -> {os.path.abspath(b)}"))
        return real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    return events


def test_commit_fsyncs_metadata_marker_and_parent_around_the_rename(tmp_path, monkeypatch):
    events = _trace_durability(monkeypatch)
    root = str(tmp_path / "run")
    with cc.CheckpointManager(root, cc.CheckpointManagerOptions(enable_async=True)) as m:
        m.save(3, {"params": {"w": np.ones(3)}})
    final = os.path.join(root, "3")
    tmp = _ownership.tmp_name(final)  # 3.<host>_<hostid>_<pid>_<start>.cairn-tmp
    order = [f"{op} {p}" for op, p in events]

    def at(entry: str) -> int:
        assert entry in order, f"{entry} not in {order}"
        return order.index(entry)

    rename = at(f"rename {tmp} -> {final}")
    # every JSON file of the step is fsync'd before the marker, the marker before the rename
    meta = at(f"fsync {tmp}/params/_METADATA.json")
    regions = at(f"fsync {tmp}/params/_REGIONS.process_0.json")
    step = at(f"fsync {tmp}/_STEP.json")
    item_dir = at(f"fsync {tmp}/params")
    marker = at(f"fsync {tmp}/{_fs.COMMIT_MARKER}")
    tmp_dir = max(i for i, e in enumerate(order) if e == f"fsync {tmp}")
    assert max(meta, regions, step, item_dir) < marker < tmp_dir < rename
    # the parent directory is fsync'd after the rename, so the new name survives a crash
    assert any(e == f"fsync {root}" for e in order[rename + 1 :]), order[rename:]
    assert cc.CheckpointManager(root).all_steps() == [3]


_dims = st.tuples(st.integers(0, 20), st.integers(0, 8)).map(lambda t: [t[0], t[0] + t[1]])


@settings(max_examples=200, deadline=None)
@given(
    regions=st.lists(st.tuples(_dims, _dims).map(list), min_size=1, max_size=4),
    chunk=st.tuples(st.integers(1, 6), st.integers(1, 6)),
)
def test_chunks_shared_matches_enumerating_chunks(regions, chunk):
    def touched(r):
        return {
            (i // chunk[0], j // chunk[1])
            for i in range(r[0][0], r[0][1])
            for j in range(r[1][0], r[1][1])
        }

    sets = [touched(r) for r in regions]
    expect = any(sets[a] & sets[b] for a in range(len(sets)) for b in range(a + 1, len(sets)))
    assert _storage.chunks_shared(regions, chunk) == expect
