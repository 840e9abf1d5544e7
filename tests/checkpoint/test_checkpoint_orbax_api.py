"""Orbax's v0 names on cairn.checkpoint (issue 18): each name's behaviour, and bad input
raising errors that name the path or argument. The tutorials themselves, run against real
Orbax, are in tests/compat/test_compat_orbax_tutorials.py."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cairn.checkpoint as ocp


@pytest.fixture
def tree():
    return {"a": np.arange(6, dtype=np.int32), "b": {"c": jnp.linspace(0.0, 1.0, 5), "n": 3}}


# --- ocp.args ---
def test_composite_access_by_key_and_attribute_and_immutable():
    c = ocp.args.Composite(state=ocp.args.StandardSave({"w": 1}), meta=ocp.args.JsonSave({"k": 1}))
    assert c["state"] is c.state and set(c) == {"state", "meta"} and len(c) == 2
    assert c == ocp.args.Composite({"state": c.state, "meta": c.meta})
    with pytest.raises(AttributeError, match="no item 'nope'.*'meta', 'state'"):
        _ = c.nope
    with pytest.raises(AttributeError, match="immutable"):
        c.state = None
    with pytest.raises(ValueError, match="non-empty strings"):
        ocp.args.Composite({"": ocp.args.JsonSave(1)})


def test_save_args_dtype_casts_before_writing(tmp_path, tree):
    ck = ocp.PyTreeCheckpointer()
    ck.save(tmp_path / "c", args=ocp.args.PyTreeSave(tree, save_args={"a": ocp.SaveArgs(dtype=np.int16)}))
    got = ck.restore(tmp_path / "c")
    assert got["a"].dtype == np.int16
    np.testing.assert_array_equal(got["a"], tree["a"].astype(np.int16))
    assert got["b"]["c"].dtype == jnp.float32 and got["b"]["n"] == 3


@pytest.mark.parametrize(
    ("save_args", "error", "match"),
    [
        ({"zz": ocp.SaveArgs()}, ValueError, r"save_args has paths \['zz'\]"),
        ({"a": "int16"}, TypeError, "at 'a'.*must be ocp.SaveArgs"),
        ({"b": {"n": ocp.SaveArgs(dtype=np.int8)}}, TypeError, "at 'b/n'.*needs an array leaf"),
    ],
)
def test_bad_save_args_name_the_path(tmp_path, tree, save_args, error, match):
    with pytest.raises(error, match=match):
        ocp.PyTreeCheckpointer().save(tmp_path / "c", args=ocp.args.PyTreeSave(tree, save_args=save_args))
    assert not (tmp_path / "c").exists()


def test_save_args_validation():
    with pytest.raises(NotImplementedError, match="aggregate"):
        ocp.SaveArgs(aggregate=True)
    with pytest.raises(ValueError, match="chunk_byte_size"):
        ocp.SaveArgs(chunk_byte_size=0)
    with pytest.raises(ValueError, match="ocdbt_target_data_file_size"):
        ocp.args.PyTreeSave({}, ocdbt_target_data_file_size=-1)
    with pytest.raises(NotImplementedError, match="support_layout"):
        ocp.args.StandardRestore(support_layout=True)


def test_apply_transformations_in_memory_and_multi_value_fn_refused_by_restore(tmp_path):
    original = {"a": 0, "b": 1, "c": {"a": 2, "e": 3}}
    transforms = {
        "a1": ocp.Transform(original_key="a"),
        "e1": ocp.Transform(original_key="c/e", value_fn=lambda v: v * 10),
        "f": ocp.Transform(use_fallback=True),
        r"(.*)x(\d)": ocp.Transform(original_key=r"c/\1a"),
        "s": ocp.Transform(multi_value_fn=lambda path, tree: tree["a"] + tree["c"]["e"]),
    }
    new = {"a1": None, "e1": None, "f": "fallback", "x1": None, "s": None, "c": {"a": None}, "g": 5}
    got = ocp.apply_transformations(original, transforms, new)
    assert got == {"a1": 0, "e1": 30, "f": "fallback", "x1": 2, "s": 3, "c": {"a": 2}, "g": 5}
    assert ocp.apply_transformations(original, {}, {"c": {"a": 9}}, default_to_original=False) == {"c": {"a": 9}}
    with pytest.raises(ValueError, match="reads 'zz'"):
        ocp.apply_transformations(original, {"b": ocp.Transform(original_key="zz")}, {"b": None})
    ocp.save(tmp_path / "c", {"a": np.arange(2)})
    with pytest.raises(NotImplementedError, match="multi_value_fn"):
        ocp.PyTreeCheckpointer().restore(tmp_path / "c", args=ocp.args.PyTreeRestore(
            {"a": np.zeros(2)}, transforms={"a": ocp.Transform(multi_value_fn=lambda p, t: t)}))


def test_restore_args_given_to_save_are_refused(tmp_path):
    with pytest.raises(TypeError, match="expected save arguments.*StandardRestore"):
        ocp.StandardCheckpointer().save(tmp_path / "c", args=ocp.args.StandardRestore({"a": 1}))


def test_json_items_must_be_json_able_and_name_the_item(tmp_path):
    ck = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    with pytest.raises(TypeError, match="item 'meta': JsonSave needs a JSON-able value"):
        ck.save(tmp_path / "c", args=ocp.args.Composite(meta=ocp.args.JsonSave({"x": object()})))


# --- checkpointers ---
def test_checkpointer_refuses_existing_directory_unless_forced(tmp_path, tree):
    ck = ocp.PyTreeCheckpointer()
    ck.save(tmp_path / "c", tree)
    with pytest.raises(FileExistsError, match="already exists"):
        ck.save(tmp_path / "c", tree)
    ck.save(tmp_path / "c", {"x": 1}, force=True)
    assert ck.restore(tmp_path / "c") == {"x": 1}


def test_checkpointer_needs_a_handler_instance():
    with pytest.raises(TypeError, match="handler must be an ocp.*CheckpointHandler"):
        ocp.Checkpointer(ocp.StandardCheckpointHandler)


def test_composite_checkpointer_round_trip_and_selected_items(tmp_path, tree):
    ck = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    ck.save(tmp_path / "c", args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave([1, "x"])))
    got = ck.restore(tmp_path / "c")
    assert got.meta == [1, "x"] and got.state["b"]["n"] == 3
    only = ck.restore(tmp_path / "c", args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    assert list(only) == ["meta"]
    with pytest.raises(KeyError, match=r"no item\(s\) \['other'\]; it holds \['meta', 'state'\]"):
        ck.restore(tmp_path / "c", args=ocp.args.Composite(other=ocp.args.JsonRestore()))
    with pytest.raises(TypeError, match="'meta' was saved with JsonSave"):
        ck.restore(tmp_path / "c", args=ocp.args.Composite(meta=ocp.args.StandardRestore()))
    with pytest.raises(TypeError, match="'state' is a pytree; JsonRestore cannot read it"):
        ck.restore(tmp_path / "c", args=ocp.args.Composite(state=ocp.args.JsonRestore()))
    meta = ck.metadata(tmp_path / "c")
    assert meta["meta"] == "json" and meta["state"]["a"].shape == (6,)
    with pytest.raises(TypeError, match="saves args=ocp.args.Composite"):
        ck.save(tmp_path / "d", tree)


def test_json_checkpointer_and_array_checkpointer(tmp_path):
    ocp.Checkpointer(ocp.JsonCheckpointHandler()).save(tmp_path / "j", {"lr": 0.1})
    assert ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(tmp_path / "j") == {"lr": 0.1}
    arr = ocp.Checkpointer(ocp.ArrayCheckpointHandler())
    arr.save(tmp_path / "a", args=ocp.args.ArraySave(np.arange(4.0)))
    np.testing.assert_array_equal(arr.restore(tmp_path / "a"), np.arange(4.0))
    got = arr.restore(tmp_path / "a", args=ocp.args.ArrayRestore(restore_args=ocp.RestoreArgs(dtype=np.float32)))
    assert got.dtype == np.float32


def test_async_checkpointer_with_a_handler_commits_in_the_background(tmp_path, tree):
    ck = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
    ck.save(tmp_path / "c", args=ocp.args.StandardSave(tree))
    ck.wait_until_finished()
    assert os.path.exists(tmp_path / "c" / "COMMIT")
    got = ck.restore(tmp_path / "c")
    assert isinstance(got["b"]["c"], jax.Array) and isinstance(got["a"], np.ndarray)
    ck.close()


def test_standard_checkpointer_casts_to_the_target_dtype_as_orbax(tmp_path, tree):
    ck = ocp.StandardCheckpointer()
    ck.save(tmp_path / "c", tree)
    target = {"a": jax.ShapeDtypeStruct((6,), np.float32), "b": {"c": jax.ShapeDtypeStruct((5,), jnp.bfloat16), "n": 0}}
    got = ck.restore(tmp_path / "c", target)
    assert isinstance(got["a"], np.ndarray) and got["a"].dtype == np.float32  # numpy stays numpy
    np.testing.assert_array_equal(got["a"], tree["a"].astype(np.float32))
    assert isinstance(got["b"]["c"], jax.Array) and got["b"]["c"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got["b"]["c"]), np.asarray(tree["b"]["c"]).astype(jnp.bfloat16))


def test_shape_mismatch_is_an_error_unless_strict_false_truncates_and_pads(tmp_path, tree):
    ck = ocp.StandardCheckpointer()
    ck.save(tmp_path / "c", tree)
    target = {"a": jax.ShapeDtypeStruct((4,), np.int32), "b": {"c": jax.ShapeDtypeStruct((8,), jnp.float32), "n": 0}}
    with pytest.raises(ocp.TargetMismatchError, match=r"shape differs at 'a': checkpoint \(6,\), target \(4,\)"):
        ck.restore(tmp_path / "c", target)
    got = ck.restore(tmp_path / "c", target, strict=False)
    np.testing.assert_array_equal(got["a"], tree["a"][:4])
    want_c = np.zeros(8, np.float32)
    want_c[:5] = np.asarray(tree["b"]["c"])
    np.testing.assert_array_equal(np.asarray(got["b"]["c"]), want_c)
    with pytest.raises(ValueError, match=r"at 'a'.*another rank"):
        ck.restore(tmp_path / "c", dict(target, a=jax.ShapeDtypeStruct((2, 3), np.int32)), strict=False)


def test_partial_restore_and_placeholder(tmp_path, tree):
    ck = ocp.PyTreeCheckpointer()
    ck.save(tmp_path / "c", tree)
    with pytest.raises(ocp.TargetMismatchError, match="not in target: 'a'"):
        ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore({"b": {"c": np.zeros(5), "n": 0}}))
    got = ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore({"b": {"n": 0}}, partial_restore=True))
    assert got == {"b": {"n": 3}}
    got = ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore({"a": ocp.PLACEHOLDER, "b": {"c": ocp.PLACEHOLDER, "n": 0}}))
    assert got == {"a": ocp.PLACEHOLDER, "b": {"c": ocp.PLACEHOLDER, "n": 3}}


def test_restore_args_alone_give_the_structure(tmp_path, tree):
    ck = ocp.PyTreeCheckpointer()
    ck.save(tmp_path / "c", tree)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    ra = {
        "a": ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.int64),
        "b": {"c": ocp.ArrayRestoreArgs(mesh=mesh, mesh_axes=jax.sharding.PartitionSpec("x")), "n": ocp.RestoreArgs()},
    }
    got = ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore(restore_args=ra))
    assert set(got) == {"a", "b"} and got["b"]["n"] == 3
    assert isinstance(got["a"], np.ndarray) and got["a"].dtype == np.int64
    assert got["b"]["c"].sharding.spec == jax.sharding.PartitionSpec("x")
    with pytest.raises(ocp.TargetMismatchError, match=r"restore_args name paths the checkpoint lacks: \['z'\]"):
        ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore(restore_args={"z": ocp.RestoreArgs()}))
    with pytest.raises(ValueError, match=r"shape differs at 'a': checkpoint \(6,\), target \(7,\)"):
        ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore(restore_args={"a": ocp.ArrayRestoreArgs(global_shape=(7,))}, partial_restore=True))


def test_transforms_rename_apply_value_fn_and_fall_back(tmp_path, tree):
    ck = ocp.PyTreeCheckpointer()
    ck.save(tmp_path / "c", tree)
    item = {"x": ..., "y": ..., "z": np.ones(2)}
    tf = {
        "x": ocp.Transform(original_key="a"),
        "y": ocp.Transform(original_key="b/c", value_fn=lambda v: v * 2),
        "z": ocp.Transform(original_key="missing", use_fallback=True),
    }
    got = ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore(item=item, transforms=tf))
    np.testing.assert_array_equal(got["x"], tree["a"])
    np.testing.assert_allclose(np.asarray(got["y"]), np.asarray(tree["b"]["c"]) * 2)
    np.testing.assert_array_equal(got["z"], np.ones(2))
    with pytest.raises(ocp.TargetMismatchError, match="transform of 'z' reads 'missing'"):
        ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore(item=item, transforms=dict(tf, z=ocp.Transform("missing"))))
    with pytest.raises(ValueError, match=r"transforms name paths \['q'\] that the item lacks"):
        ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore(item=item, transforms={"q": ocp.Transform("a")}))
    with pytest.raises(ValueError, match="transforms need an item"):
        ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore(transforms=tf))


# --- CheckpointManager ---
def test_manager_single_item_args_round_trip(tmp_path, tree):
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, max_to_keep=2)
    assert opts.enable_async is False
    with ocp.CheckpointManager(tmp_path, options=opts) as mngr:
        for step in range(3):
            assert mngr.save(step, args=ocp.args.StandardSave(tree))
        assert mngr.all_steps() == [1, 2]
        got = mngr.restore(2)
        assert list(got) == ["a", "b"] and got["b"]["n"] == 3
        got = mngr.restore(2, args=ocp.args.StandardRestore({"a": np.zeros(6, np.float64), "b": {"c": np.zeros(5), "n": 0}}))
        assert got["a"].dtype == np.float64 and isinstance(got["b"]["c"], np.ndarray)
        assert os.path.isdir(tmp_path / "2" / "default")
        both = mngr.restore(2, args=ocp.args.Composite(default=ocp.args.StandardRestore()))
        assert list(both) == ["default"] and both.default["b"]["n"] == 3


def test_manager_composite_with_json_and_state_items(tmp_path, tree):
    class It:
        def __init__(self):
            self.i = 5

        def get_state(self):
            return {"i": self.i}

        def set_state(self, s):
            self.i = s["i"]

    with ocp.CheckpointManager(tmp_path, item_names=("state", "cfg")) as mngr:
        mngr.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(tree), cfg=ocp.args.JsonSave({"lr": 0.1})))
        mngr.wait_until_finished()
        got = mngr.restore(0)
        assert got.cfg == {"lr": 0.1} and got.state["b"]["n"] == 3
        assert mngr.item_metadata(0)["cfg"] == "json"
        with pytest.raises(ValueError, match=r"holds the items \['cfg', 'state'\]; restore it with args=ocp.args.Composite"):
            mngr.restore(0, args=ocp.args.StandardRestore())
        mngr.save(1, {"it": It(), "tree": tree})  # cairn's own dict API still answers a dict
        mngr.wait_until_finished()
        it = It()
        it.i = 0
        got = mngr.restore(1, {"it": it, "tree": None})
        assert type(got) is dict and got["it"].i == 5
        with pytest.raises(TypeError, match="either items or args"):
            mngr.save(2, {"x": 1}, args=ocp.args.StandardSave({"x": 1}))
        with pytest.raises(TypeError, match="args must be ocp.args"):
            mngr.save(2, args={"x": 1})


def test_manager_json_item_damage_is_reported_as_corruption(tmp_path):
    with ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(enable_async=False)) as mngr:
        mngr.save(0, args=ocp.args.Composite(cfg=ocp.args.JsonSave({"lr": 0.1})))
    with open(tmp_path / "0" / "cfg" / "item.json", "r+b") as f:
        f.seek(5)
        f.write(b"#")
    mngr = ocp.CheckpointManager(tmp_path)
    assert mngr.latest_step() is None and "item.json" in mngr.corrupt_steps()[0]


def test_manager_constructor_errors(tmp_path):
    with pytest.raises(TypeError, match="options must be a CheckpointManagerOptions"):
        ocp.CheckpointManager(tmp_path, None, 3)
    with pytest.raises(TypeError, match="checkpointers must be a Checkpointer"):
        ocp.CheckpointManager(tmp_path, "pytree")
    with pytest.raises(TypeError, match=r"checkpointers \['b'\] are not Checkpointers"):
        ocp.CheckpointManager(tmp_path, {"a": ocp.PyTreeCheckpointer(), "b": 1})
    with pytest.raises(TypeError, match="item_handlers"):
        ocp.CheckpointManager(tmp_path, item_handlers="json")


def test_manager_legacy_dict_of_checkpointers(tmp_path):
    # Orbax's older form: a dict of checkpointers, items by name, per-item restore targets
    tree = {"w": np.arange(4, dtype=np.float32)}
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(tmp_path, {"state": ocp.PyTreeCheckpointer()}, options) as mngr:
        for step in range(3):
            assert mngr.save(step, {"state": {"w": tree["w"] + step}})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
        got = mngr.restore(2)
        np.testing.assert_array_equal(got["state"]["w"], tree["w"] + 2)
        target = {"w": np.zeros(4, np.float64)}
        got = mngr.restore(2, {"state": target})
        assert got["state"]["w"].dtype == np.float64
        with pytest.raises(KeyError, match="no checkpointer for item"):
            mngr.save(3, {"other": tree})
    with ocp.CheckpointManager(tmp_path / "one", ocp.PyTreeCheckpointer()) as mngr:
        mngr.save(0, tree)
        mngr.wait_until_finished()
        np.testing.assert_array_equal(mngr.restore(0)["w"], tree["w"])


def test_manager_metadata_is_kept(tmp_path):
    with ocp.CheckpointManager(tmp_path, metadata={"model": "mlp", "width": 8}) as mngr:
        assert mngr.metadata().custom_metadata == {"model": "mlp", "width": 8}
        mngr.save(3, args=ocp.args.StandardSave({"w": np.arange(2)}), metrics={"loss": 0.5},
                  custom_metadata={"note": "warm"})
        mngr.wait_until_finished()
        step = mngr.metadata(3)
        assert step.metrics == {"loss": 0.5} and step.custom_metadata == {"note": "warm"}
        assert step.item_metadata["w"].shape == (2,) and step.init_timestamp_nsecs > 0
    with ocp.CheckpointManager(tmp_path) as mngr:
        assert mngr.metadata() == ocp.RootMetadata({"model": "mlp", "width": 8})
    with ocp.CheckpointManager(tmp_path / "none") as mngr:
        assert mngr.metadata().custom_metadata == {}
    with pytest.raises(TypeError, match="JSON-able"):
        ocp.CheckpointManager(tmp_path / "b", metadata={"f": object()})


# --- utils ---
def test_to_shape_dtype_struct_and_erase_and_create_empty(tmp_path):
    x = jnp.ones((2, 3))
    s = ocp.utils.to_shape_dtype_struct(x)
    assert (s.shape, s.dtype, s.sharding) == ((2, 3), jnp.float32, x.sharding)
    assert ocp.utils.to_shape_dtype_struct(np.zeros(2, np.int8)).sharding is None
    assert ocp.utils.to_shape_dtype_struct(2.5) == 2.5
    assert ocp.utils.to_shape_dtype_struct(2.5, scalar_dtype=np.float32).dtype == np.float32
    assert ocp.utils.to_shape_dtype_struct(x, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    p = ocp.test_utils.erase_and_create_empty(tmp_path / "d")
    assert p.is_dir() and list(p.iterdir()) == []


def test_manager_saves_a_checkpointable_wrapped_as_item_like_grain_args(tmp_path):
    class Iterator:
        def __init__(self, i):
            self.i = i

        def get_state(self):
            return {"i": self.i}

        def set_state(self, s):
            self.i = s["i"]

    class Wrap:  # what grain.checkpoint.CheckpointSave / CheckpointRestore look like
        def __init__(self, item):
            self.item = item

    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(3, args=ocp.args.Composite(ds=Wrap(Iterator(7)), cfg=ocp.args.JsonSave({"a": 1})))
        mngr.wait_until_finished()
        it = Iterator(0)
        got = mngr.restore(3, args=ocp.args.Composite(ds=Wrap(it)))
        assert got.ds is it and it.i == 7
        assert mngr.restore(3).ds == {"i": 7}


def test_placeholder_everywhere_reads_nothing(tmp_path, tree):
    ck = ocp.PyTreeCheckpointer()
    ck.save(tmp_path / "c", tree)
    target = {"a": ocp.PLACEHOLDER, "b": {"c": ocp.PLACEHOLDER, "n": ocp.PLACEHOLDER}}
    assert ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore(target)) == target


@pytest.mark.parametrize("name", ["../up", "COMMIT", "_ITEMS.json", "a/b"])
def test_composite_item_names_must_be_plain_file_names(tmp_path, name):
    ck = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    with pytest.raises(ValueError, match="item name .* must be a plain file-name part"):
        ck.save(tmp_path / "c", args=ocp.args.Composite({name: ocp.args.JsonSave(1)}))
    assert not (tmp_path / "c").exists()


def test_handlers_save_restore_and_metadata_without_a_checkpointer(tmp_path):
    tree = {"a": np.arange(3), "b": {"c": np.ones((2, 2), np.float32)}}
    h = ocp.StandardCheckpointHandler()
    h.save(tmp_path / "s", args=ocp.args.StandardSave(tree))
    got = h.restore(tmp_path / "s", args=ocp.args.StandardRestore({"a": np.zeros(3, np.float32), "b": {"c": np.zeros((2, 2), np.float32)}}))
    assert got["a"].dtype == np.float32 and got["a"].tolist() == [0, 1, 2]
    assert h.metadata(tmp_path / "s")["b/c"].shape == (2, 2)
    j = ocp.JsonCheckpointHandler()
    j.save(tmp_path / "j", {"lr": 0.5})
    assert j.restore(tmp_path / "j") == {"lr": 0.5}
    c = ocp.CompositeCheckpointHandler()
    c.save(tmp_path / "c", args=ocp.args.Composite(state=ocp.args.StandardSave(tree), cfg=ocp.args.JsonSave([1])))
    back = c.restore(tmp_path / "c")
    assert back.cfg == [1] and back.state["b"]["c"].sum() == 4
    with pytest.raises(TypeError, match="either the item or args"):
        h.save(tmp_path / "t", tree, args=ocp.args.StandardSave(tree))


def test_args_subclass_and_register_with_handler(tmp_path):
    import dataclasses
    from typing import Any

    @dataclasses.dataclass
    class MySave(ocp.args.StandardSave):  # Orbax's args are plain dataclasses: subclassable
        note: str = ""

    @ocp.args.register_with_handler(ocp.JsonCheckpointHandler, for_save=True)
    @dataclasses.dataclass
    class ConfigSave(ocp.args.CheckpointArgs):
        item: dict

    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(0, args=ocp.args.Composite(state=MySave({"w": np.arange(2)}, note="x"), cfg=ConfigSave({"k": 1})))
        mngr.wait_until_finished()
        got = mngr.restore(0)
    assert got.cfg == {"k": 1} and got.state["w"].tolist() == [0, 1]
    assert ocp.args.get_registered_handler_cls(ConfigSave) is ocp.JsonCheckpointHandler
    # cairn's own args are registered with their handlers first (as Orbax's are): the first wins
    assert ocp.args.get_registered_args_cls(ocp.JsonCheckpointHandler) == (ocp.args.JsonSave, ocp.args.JsonRestore)

    class MyJsonHandler(ocp.JsonCheckpointHandler):
        pass

    @ocp.args.register_with_handler(MyJsonHandler, for_save=True)
    @dataclasses.dataclass
    class MySaveOnly(ocp.args.CheckpointArgs):
        item: dict

    with pytest.raises(ValueError, match="restoring"):
        ocp.args.get_registered_args_cls(MyJsonHandler)

    @ocp.args.register_with_handler(MyJsonHandler, for_save=True, for_restore=True)
    @dataclasses.dataclass
    class ConfigBoth(ocp.args.CheckpointArgs):
        item: Any = None

    assert ocp.args.get_registered_args_cls(MyJsonHandler()) == (MySaveOnly, ConfigBoth)
    with pytest.raises(TypeError, match="must subclass CheckpointArgs"):
        ocp.args.register_with_handler(ocp.JsonCheckpointHandler, for_save=True)(dict)
    with pytest.raises(ValueError, match="for_save=True and/or"):
        ocp.args.register_with_handler(ocp.JsonCheckpointHandler)
    with pytest.raises(ocp.StepAlreadyExistsError):
        with ocp.CheckpointManager(tmp_path) as mngr:
            mngr.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.arange(2)})), force=True)


def test_manager_refuses_mixing_one_item_and_named_items(tmp_path):
    tree = {"w": np.arange(2)}
    with ocp.CheckpointManager(tmp_path / "a") as mngr:
        mngr.save(0, args=ocp.args.StandardSave(tree))
        with pytest.raises(ValueError, match="holds one unnamed item"):
            mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(tree)))
    with ocp.CheckpointManager(tmp_path / "a") as mngr:  # the newest step says which
        with pytest.raises(ValueError, match="holds one unnamed item"):
            mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(tree)))
        with pytest.raises(ValueError, match="args="):
            mngr.save(1, ocp.args.StandardSave(tree))
    with ocp.CheckpointManager(tmp_path / "b", item_names=("state",)) as mngr:
        with pytest.raises(ValueError, match="does not match with any registered handler"):
            mngr.save(0, args=ocp.args.Composite(other=ocp.args.StandardSave(tree)))
        with pytest.raises(ValueError, match="holds named items"):
            mngr.save(0, args=ocp.args.StandardSave(tree))


def test_utils_flat_dicts_and_gcs_paths():
    tree = {"a": 1, "b": {"c": [2, 3], "d": {}}}
    flat = ocp.utils.to_flat_dict(tree)
    assert flat == {("a",): 1, ("b", "c", "0"): 2, ("b", "c", "1"): 3}
    assert ocp.utils.to_flat_dict(tree, sep="/", keep_empty_nodes=True)["b/d"] == {}
    assert ocp.utils.from_flat_dict({("a",): 1, ("b", "c"): 2}) == {"a": 1, "b": {"c": 2}}
    assert ocp.utils.from_flat_dict({"x/0": 5, "x/1": 6}, target={"x": [0, 0]}, sep="/") == {"x": [5, 6]}
    with pytest.raises(KeyError, match="not in the flat dict"):
        ocp.utils.from_flat_dict({}, target={"x": 1})
    assert ocp.utils.is_gcs_path("gs://b/c") and not ocp.utils.is_gcs_path("/tmp/c")


def test_options_async_multiprocessing_file_and_step_format(tmp_path):
    done = []
    options = ocp.CheckpointManagerOptions(
        step_format_fixed_length=4, async_options=ocp.AsyncOptions(timeout_secs=30, post_finalization_callback=lambda: done.append(1)))
    assert options.timeout_secs == 30
    with ocp.CheckpointManager(tmp_path, options=options) as mngr:
        mngr.save(7, args=ocp.args.StandardSave({"w": np.arange(2)}))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [7] and done == [1]
    assert (tmp_path / "0007").is_dir()
    assert ocp.utils.get_save_directory(7, tmp_path, "default", step_format_fixed_length=4) == tmp_path / "0007" / "default"
    assert (ocp.utils.get_save_directory(7, tmp_path, "default", step_format_fixed_length=4)).is_dir()
    assert ocp.utils.get_save_directory(3, tmp_path, step_prefix="ckpt") == tmp_path / "ckpt_3"
    with pytest.raises(NotImplementedError, match="primary_host"):
        ocp.MultiprocessingOptions(primary_host=1)
    with pytest.raises(NotImplementedError, match="path_permission_mode"):
        ocp.FileOptions(path_permission_mode=0o750)
    with pytest.raises(TypeError, match="async_options must be a AsyncOptions"):
        ocp.CheckpointManagerOptions(async_options=30)


def test_a_users_own_handler_is_written_and_committed_by_checkpointers(tmp_path):
    import concurrent.futures
    import dataclasses
    import json as _json
    from typing import Any

    class TextHandler(ocp.AsyncCheckpointHandler):  # stores its item as one text file
        def __init__(self, pool):
            self.pool, self.finalized = pool, []

        def save(self, directory, args):
            (pathlib.Path(directory) / "v.txt").write_text(_json.dumps(args.item))

        async def async_save(self, directory, args):
            return [self.pool.submit(self.save, directory, args)]

        def restore(self, directory, args=None):
            return _json.loads((pathlib.Path(directory) / "v.txt").read_text())

        def finalize(self, directory):
            self.finalized.append(os.path.basename(directory))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for cls in (ocp.Checkpointer, ocp.AsyncCheckpointer):
            h = TextHandler(pool)
            with cls(h) as ckptr:
                ckptr.save(tmp_path / cls.__name__, args=ocp.args.JsonSave({"a": [1, 2]}))
                ckptr.wait_until_finished()
                assert ckptr.restore(tmp_path / cls.__name__) == {"a": [1, 2]}
            assert len(h.finalized) == 1 and (tmp_path / cls.__name__ / "COMMIT").exists()
            with pytest.raises(FileExistsError), cls(h) as ckptr:
                ckptr.save(tmp_path / cls.__name__, args=ocp.args.JsonSave({}))

    @ocp.args.register_with_handler(TextHandler, for_save=True)
    @dataclasses.dataclass
    class TextSave(ocp.args.CheckpointArgs):
        item: Any

    with concurrent.futures.ThreadPoolExecutor(1) as pool, ocp.Checkpointer(TextHandler(pool)) as ckptr:
        ckptr.save(tmp_path / "bare", [3, 4])  # a bare item is wrapped in the args registered with the handler
        assert ckptr.restore(tmp_path / "bare") == [3, 4]


def test_manager_directory_is_a_path_object_for_str_and_path_input(tmp_path):
    for given in (str(tmp_path / "s"), tmp_path / "p"):
        with ocp.CheckpointManager(given) as mngr:
            assert isinstance(mngr.directory, pathlib.Path)
            assert mngr.directory == pathlib.Path(given).absolute()
            mngr.save(0, args=ocp.args.JsonSave({"a": 1}))
            mngr.wait_until_finished()
            assert [p.name for p in mngr.directory.iterdir()] == ["0"]
            mngr.delete(0)
            assert list(mngr.directory.iterdir()) == []


def test_leaf_metadata_dtype_is_its_name_and_equals_the_dtype_objects(tmp_path):
    ck = ocp.StandardCheckpointer()
    tree = {"w": jnp.ones(3, jnp.bfloat16), "x": np.zeros(2, np.float32), "n": 3, "s": "hi"}
    ck.save(tmp_path / "c", tree)
    md = ck.metadata(tmp_path / "c")
    w, x = md["w"].dtype, md["x"].dtype
    assert w == "bfloat16" and w == jnp.bfloat16 and w == np.dtype(jnp.bfloat16) and w != jnp.float32
    assert x == np.float32 and x == "float32" and x != "float64" and x != np.int32
    assert md["n"].dtype == np.int64 and md["s"].dtype == "str" and md["s"].dtype != np.float32
    assert isinstance(w, str) and {x: 1}["float32"] == 1  # still a str: hashes and prints as the name


def test_utils_is_scalar_as_orbax():
    assert ocp.utils.is_scalar(1) and ocp.utils.is_scalar(2.5) and ocp.utils.is_scalar(np.float32(1))
    assert ocp.utils.is_scalar(True)  # a bool is an int
    assert not ocp.utils.is_scalar(np.zeros(())) and not ocp.utils.is_scalar(jnp.ones(2))
    assert not ocp.utils.is_scalar("1") and not ocp.utils.is_scalar(None)
