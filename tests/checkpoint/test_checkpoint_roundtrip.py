"""Round trips of single-directory checkpoints, metadata, targets and their error messages."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cairn.checkpoint as cc
from cairn.core_array import ArraySpec

DTYPES = [
    np.float32, np.float64, np.float16, np.int8, np.int32, np.int64, np.uint8, np.uint32,
    np.bool_, np.complex64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
    ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2,
]


def _random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.name in ("int4", "int2"):
        lo = -8 if dtype.name == "int4" else -2
        return rng.integers(lo, -lo, shape).astype(dtype)
    if dtype.name == "uint4":
        return rng.integers(0, 16, shape).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.reshape(-1).view(np.uint8) if x.dtype.itemsize else x


def _assert_same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(_bits(a), _bits(b))  # bitwise: NaNs and -0.0 included


leaf_arrays = st.tuples(
    st.lists(st.integers(0, 5), min_size=0, max_size=3),
    st.sampled_from(DTYPES),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)


def _make(spec):
    shape, dtype, seed, as_jax = spec
    arr = _random_array(np.random.default_rng(seed), tuple(shape), dtype)
    return jnp.asarray(arr) if as_jax and np.dtype(dtype).name not in ("int2", "uint4") else arr


trees = st.recursive(
    leaf_arrays.map(_make) | st.integers(-(2**62), 2**62) | st.text(max_size=8) | st.floats(allow_nan=False) | st.booleans(),
    lambda children: st.lists(children, min_size=1, max_size=3)
    | st.dictionaries(st.text("abcxyz_", min_size=1, max_size=4), children, min_size=1, max_size=3),
    max_leaves=8,
)


@settings(max_examples=25, deadline=None)
@given(tree=trees)
def test_random_trees_round_trip_bitwise(tmp_path_factory, tree):
    d = tmp_path_factory.mktemp("prop") / "ckpt"
    cc.save(d, tree)
    got = cc.restore(d, target=jax.tree_util.tree_map(lambda x: x, tree))
    flat_a = jax.tree_util.tree_leaves_with_path(tree)
    flat_b = jax.tree_util.tree_leaves_with_path(got)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (_, a), (_, b) in zip(flat_a, flat_b):
        assert type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array))
        if isinstance(a, (np.ndarray, jax.Array)):
            _assert_same(a, b)
        else:
            assert a == b
    # metadata agrees with the data without reading it
    meta = cc.metadata(d)
    for path, m in meta.items():
        assert m.path == path


def test_restore_without_target_gives_back_containers_and_kinds(tmp_path):
    tree = {
        "params": {"w": jnp.arange(6.0).reshape(2, 3), "b": np.array([1, 2], np.int16)},
        "layers": [np.float32(1.5), np.zeros((0, 4))],
        "step": 12,
        "lr": 3e-4,
        "name": "run/α",
        "flag": False,
        "z": 1 - 2j,
    }
    cc.save(tmp_path / "c", tree)
    got = cc.restore(tmp_path / "c")
    assert isinstance(got["params"]["w"], jax.Array)
    _assert_same(got["params"]["w"], tree["params"]["w"])
    assert isinstance(got["params"]["b"], np.ndarray)
    _assert_same(got["params"]["b"], tree["params"]["b"])
    assert isinstance(got["layers"], list) and list(got) == list(tree)  # insertion order
    assert isinstance(got["layers"][0], np.float32) and got["layers"][0] == np.float32(1.5)
    assert got["layers"][1].shape == (0, 4)
    assert got["step"] == 12 and isinstance(got["step"], int)
    assert got["lr"] == 3e-4 and got["name"] == "run/α" and got["flag"] is False and got["z"] == 1 - 2j


def test_metadata_lists_paths_shapes_dtypes_without_data(tmp_path):
    tree = {"a": {"w": np.ones((3, 5), ml_dtypes.bfloat16)}, "s": "x", "n": 3}
    cc.save(tmp_path / "c", tree)
    meta = cc.metadata(tmp_path / "c")
    assert list(meta) == ["a/w", "n", "s"]
    assert meta["a/w"].shape == (3, 5) and meta["a/w"].dtype == "bfloat16"
    assert meta["a/w"].spec == ArraySpec((3, 5), "bfloat16")
    assert meta["a/w"].nbytes == 30
    assert meta["n"].kind == "scalar" and meta["n"].value == 3
    assert meta["a/w"].chunk_shape == (3, 5) and meta["n"].chunk_shape is None  # one chunk
    raw = json.loads((tmp_path / "c" / "_METADATA.json").read_text())  # plain JSON, checksummed
    assert raw["checksum"].startswith("sha256:") and set(raw["body"]["leaves"]) == {"a/w", "n", "s"}


def test_step_is_a_handful_of_files(tmp_path):
    tree = {f"layer{i}": {"w": np.ones((64, 64), np.float32), "b": np.ones(64)} for i in range(50)}
    cc.save(tmp_path / "c", tree)
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "c") for f in fs]
    # 100 arrays: metadata, regions, the OCDBT manifest and a few data files (how many
    # depends on how OCDBT batched the writes, more under load), never one per array
    assert len(files) <= 30, files


def test_target_mismatch_lists_every_difference(tmp_path):
    cc.save(tmp_path / "c", {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4), "c": 1})
    target = {"a": np.zeros((3, 3), np.float32), "b": np.zeros(4, np.float32), "d": np.zeros(1)}
    with pytest.raises(cc.TargetMismatchError) as info:
        cc.restore(tmp_path / "c", target)
    msg = str(info.value)
    assert "4 difference(s)" in msg
    assert "shape differs at 'a': checkpoint (2, 3), target (3, 3)" in msg
    assert "dtype differs at 'b': checkpoint float64, target float32" in msg
    assert "missing in checkpoint: 'd'" in msg
    assert "not in target: 'c'" in msg


def test_cast_partial_and_paths(tmp_path):
    x = np.arange(12, dtype=np.float64).reshape(3, 4) / 7
    cc.save(tmp_path / "c", {"enc": {"w": x, "b": np.ones(4)}, "dec": {"w": x * 2}, "step": 5})
    got = cc.restore(tmp_path / "c", {"enc": {"w": np.zeros((3, 4), np.float32)}}, partial=True, cast=True)
    assert got["enc"]["w"].dtype == np.float32
    np.testing.assert_allclose(got["enc"]["w"], x.astype(np.float32), rtol=0, atol=0)
    bf = cc.restore(tmp_path / "c", {"dec": {"w": ArraySpec((3, 4), "bfloat16")}}, partial=True, cast=True)
    np.testing.assert_array_equal(bf["dec"]["w"], (x * 2).astype(ml_dtypes.bfloat16))
    only = cc.restore(tmp_path / "c", paths=r"enc/.*")
    assert set(only) == {"enc"} and set(only["enc"]) == {"b", "w"}
    keep = np.full(4, -1.0)
    mixed = cc.restore(tmp_path / "c", {"enc": {"w": x, "b": keep}, "dec": {"w": x}, "step": 0}, paths=["enc/w", "step"])
    assert mixed["enc"]["b"] is keep and mixed["dec"]["w"] is x and mixed["step"] == 5
    with pytest.raises(cc.TargetMismatchError, match="no path of checkpoint"):
        cc.restore(tmp_path / "c", paths="nothing.*")


def test_restore_to_jax_targets(tmp_path):
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    cc.save(tmp_path / "c", {"x": x})
    dev = jax.devices()[0]
    sds = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(dev))
    got = cc.restore(tmp_path / "c", {"x": sds})["x"]
    assert isinstance(got, jax.Array) and got.sharding == sds.sharding
    np.testing.assert_array_equal(np.asarray(got), x)
    got2 = cc.restore(tmp_path / "c", {"x": jax.sharding.SingleDeviceSharding(dev)})["x"]
    np.testing.assert_array_equal(np.asarray(got2), x)
    # an ArraySpec with a partition spec becomes a NamedSharding on the given mesh
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = ArraySpec((8, 4), "bfloat16", sharding=("data", None))
    got3 = cc.restore(tmp_path / "c", {"x": spec}, mesh=mesh, cast=True)["x"]
    assert isinstance(got3, jax.Array) and got3.dtype == jnp.bfloat16
    assert got3.sharding == jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
    np.testing.assert_array_equal(np.asarray(got3), x.astype(ml_dtypes.bfloat16))
    with pytest.raises(cc.TargetMismatchError, match=r"dtype differs at 'x'.*cast=True"):
        cc.restore(tmp_path / "c", {"x": spec}, mesh=mesh)


def test_bad_leaf_and_existing_directory_errors(tmp_path):
    with pytest.raises(TypeError, match=r"leaf 'a/obj'.*object"):
        cc.save(tmp_path / "c", {"a": {"obj": object()}})
    assert not os.path.exists(tmp_path / "c")
    cc.save(tmp_path / "c", {"a": 1})
    with pytest.raises(FileExistsError, match="already exists"):
        cc.save(tmp_path / "c", {"a": 2})
    cc.save(tmp_path / "c", {"a": 2}, force=True)
    assert cc.restore(tmp_path / "c") == {"a": 2}
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        cc.restore(tmp_path / "missing")
    with pytest.raises(ValueError, match="compression"):
        cc.save(tmp_path / "z", {"a": np.ones(3)}, compression="lz4")


def test_zstd_compression_round_trip_and_smaller(tmp_path):
    x = np.tile(np.arange(256, dtype=np.float32), (256, 1))
    cc.save(tmp_path / "raw", {"x": x})
    cc.save(tmp_path / "z", {"x": x}, compression="zstd:3")
    _assert_same(cc.restore(tmp_path / "z")["x"], x)

    def size(p):
        return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(p) for f in fs)

    assert size(tmp_path / "z") < size(tmp_path / "raw") / 10


def test_async_checkpointer_snapshot_and_errors(tmp_path):
    x = np.arange(10.0)
    ck = cc.AsyncCheckpointer()
    ck.save(tmp_path / "a", {"x": x})
    x[:] = -1  # the save copied NumPy leaves at call time
    ck.save(tmp_path / "b", {"x": x})  # waits for the first
    ck.wait_until_finished()
    _assert_same(cc.restore(tmp_path / "a")["x"], np.arange(10.0))
    _assert_same(cc.restore(tmp_path / "b")["x"], np.full(10, -1.0))
    # a failing background write surfaces on the next call, exactly once
    ck2 = cc.AsyncCheckpointer()
    from cairn.checkpoint import _tree

    orig = _tree.write

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    _tree.write = boom
    try:
        ck2.save(tmp_path / "e", {"x": x})
    finally:
        _tree.write = orig
    with pytest.raises(cc.CheckpointError, match="No space left on device"):
        ck2.wait_until_finished()
    ck2.wait_until_finished()  # raised once, then clear
    assert not os.path.exists(tmp_path / "e")


def _bytes_read() -> int:
    """Bytes this process has read through read()/pread() so far (page-cache hits included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_partial_restore_reads_only_the_chosen_leaves(tmp_path):
    mib = 1 << 20
    tree = {f"l{i}": {"w": np.full((mib // 4,), i, np.float32)} for i in range(8)}  # 8 x 1 MiB
    cc.save(tmp_path / "c", tree)
    before = _bytes_read()
    got = cc.restore(tmp_path / "c", paths=r"l3/w")
    read = _bytes_read() - before
    np.testing.assert_array_equal(got["l3"]["w"], tree["l3"]["w"])
    assert mib <= read < 1.25 * mib, read  # one leaf's chunk plus JSON and OCDBT index
    before = _bytes_read()
    got = cc.restore(tmp_path / "c", {"l5": {"w": np.zeros(mib // 4, np.float32)}}, partial=True)
    read = _bytes_read() - before
    assert set(got) == {"l5"} and mib <= read < 1.25 * mib, read
