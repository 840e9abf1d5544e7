"""safetensors import/export with path strings as tensor names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stnp

import cairn.checkpoint as cc


def test_export_is_readable_by_safetensors_and_back(tmp_path):
    tree = {
        "layers": [{"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, {"w": jnp.ones((2, 2), jnp.bfloat16)}],
        "f8": np.array([0.5, -2.0], ml_dtypes.float8_e4m3fn),
        "ids": np.array([1, 2, 3], np.int64),
    }
    f = tmp_path / "m.safetensors"
    cc.save_safetensors(f, tree, metadata={"format": "np"})
    from safetensors import safe_open

    with safe_open(str(f), "np") as h:
        assert sorted(h.keys()) == ["f8", "ids", "layers/0/w", "layers/1/w"]
        assert h.metadata() == {"format": "np"}
        np.testing.assert_array_equal(h.get_tensor("layers/0/w"), tree["layers"][0]["w"])
    got = cc.load_safetensors(f)
    np.testing.assert_array_equal(got["layers"]["1"]["w"], np.ones((2, 2), ml_dtypes.bfloat16))
    assert got["f8"].dtype == ml_dtypes.float8_e4m3fn and got["f8"].tolist() == [0.5, -2.0]


def test_import_file_written_by_safetensors_into_target(tmp_path):
    f = str(tmp_path / "ext.safetensors")
    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    stnp.save_file({"enc/w": w, "enc/b": np.zeros(3, np.float32)}, f)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"enc": {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32, sharding=dev), "b": np.zeros(3, np.float32)}}
    got = cc.load_safetensors(f, target)
    assert isinstance(got["enc"]["w"], jax.Array)
    np.testing.assert_array_equal(np.asarray(got["enc"]["w"]), w)
    with pytest.raises(cc.TargetMismatchError) as info:
        cc.load_safetensors(f, {"enc": {"w": np.zeros((3, 3))}, "x": np.zeros(1)})
    msg = str(info.value)
    assert "missing in file: 'x'" in msg and "not in target: 'enc/b'" in msg and "shape differs at 'enc/w'" in msg


def test_export_errors_name_the_path(tmp_path):
    with pytest.raises(TypeError, match="leaf 'a/s'"):
        cc.save_safetensors(tmp_path / "x.safetensors", {"a": {"s": "text"}})
    with pytest.raises(TypeError, match="leaf 'q'.*int4"):
        cc.save_safetensors(tmp_path / "x.safetensors", {"q": np.zeros(2, ml_dtypes.int4)})
    (tmp_path / "bad.safetensors").write_bytes(b"\x01")
    with pytest.raises(cc.CheckpointError, match="not a safetensors file"):
        cc.load_safetensors(tmp_path / "bad.safetensors")
