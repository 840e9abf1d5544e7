"""Orbax's helper surface: checkpoint_utils (evaluator loops, restore args), tree helpers,
handler registries and checkpoint_managers policies (issue 30)."""

from __future__ import annotations

import os
import threading
import time

import jax
import numpy as np
import pytest

import cairn.checkpoint as ocp

cm = ocp.checkpoint_managers


def _manager(path, **options):
    return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False, **options))


# --- checkpoint_utils ---
def test_checkpoints_iterator_yields_newest_steps_and_snapshots_the_current_one(tmp_path):
    with _manager(tmp_path) as mngr:
        mngr.save(0, args=ocp.args.StandardSave({"a": np.arange(3)}))
        seen = []
        for step in ocp.checkpoint_utils.checkpoints_iterator(tmp_path, timeout=0, seconds_to_sleep=0.01):
            snap = tmp_path / "_SNAPSHOTS" / str(step)
            assert snap.is_dir() and (snap / "COMMIT").exists()
            if seen:
                assert not (tmp_path / "_SNAPSHOTS" / str(seen[-1])).exists()  # released
            seen.append(step)
            if step < 3:
                mngr.save(step + 1, args=ocp.args.StandardSave({"a": np.arange(3) + step + 1}))
        assert seen == [0, 1, 2, 3]
        assert os.listdir(tmp_path / "_SNAPSHOTS") == []
        assert ocp.utils.checkpoint_steps(tmp_path) == [0, 1, 2, 3]  # _SNAPSHOTS is not a step


def test_snapshot_keeps_the_files_when_retention_deletes_the_step(tmp_path):
    with _manager(tmp_path, max_to_keep=1) as mngr:
        mngr.save(0, args=ocp.args.StandardSave({"a": np.arange(4)}))
        with ocp.checkpoint_utils.wait_for_new_checkpoint(tmp_path, timeout=1) as step:
            assert step == 0
            mngr.save(1, args=ocp.args.StandardSave({"a": np.zeros(4)}))
            assert mngr.all_steps() == [1]  # step 0 deleted by retention...
            snap = ocp.checkpoint_utils.get_snapshot_dir_from_step_dir(tmp_path / "0")
            got = ocp.restore(os.path.join(snap, "default"))  # ...but its snapshot still reads
            np.testing.assert_array_equal(got["a"], np.arange(4))
        assert not os.path.exists(snap)


def test_wait_for_new_checkpoint_until_step_timeout_and_missing_directory(tmp_path):
    with ocp.checkpoint_utils.wait_for_new_checkpoint(tmp_path / "none", timeout=0.05, seconds_to_sleep=0.01) as step:
        assert step == -1
    with _manager(tmp_path, step_prefix="ckpt", step_format_fixed_length=4) as mngr:
        mngr.save(2, args=ocp.args.StandardSave({"a": 1}))
        kw = {"step_prefix": "ckpt", "step_format_fixed_length": 4, "seconds_to_sleep": 0.01}
        with ocp.checkpoint_utils.wait_for_new_checkpoint(tmp_path, until_step=3, timeout=0.05, **kw) as step:
            assert step == -1
        timer = threading.Timer(0.1, lambda: mngr.save(5, args=ocp.args.StandardSave({"a": 1})))
        timer.start()
        with ocp.checkpoint_utils.wait_for_new_checkpoint(tmp_path, until_step=3, timeout=10, **kw) as step:
            assert step == 5 and (tmp_path / "_SNAPSHOTS" / "ckpt_0005").is_dir()
        timer.join()


def test_checkpoints_iterator_asks_timeout_fn_whether_to_stop():
    calls = []

    def timeout_fn():
        calls.append(time.monotonic())
        return len(calls) > 2

    directory = os.path.join(os.path.dirname(__file__), "no_such_dir_for_test")
    assert list(ocp.checkpoint_utils.checkpoints_iterator(directory, timeout=0, seconds_to_sleep=0.001,
                                                          timeout_fn=timeout_fn)) == []
    # the wait ends on the third call (the first true one); the iterator asks once more
    assert len(calls) == 4


def test_construct_restore_args_by_leaf_kind():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    tree = {"a": jax.device_put(np.arange(4, dtype=np.int32), sharding), "x": np.ones(2), "y": 1, "z": "hi"}
    got = ocp.checkpoint_utils.construct_restore_args(tree, {"a": sharding, "x": None, "y": None, "z": None})
    assert isinstance(got["a"], ocp.ArrayRestoreArgs)
    assert got["a"].sharding == sharding and got["a"].global_shape == (4,) and got["a"].dtype == np.int32
    assert got["x"] == ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.dtype("float64"))
    assert got["y"] == ocp.RestoreArgs(restore_type=int) and got["z"] == ocp.RestoreArgs(restore_type=str)
    with pytest.raises(ValueError, match=r"sharding_tree paths \['q'\] are not in the target"):
        ocp.checkpoint_utils.construct_restore_args({"a": 1}, {"q": None})
    with pytest.raises(TypeError, match="cannot restore a leaf of type object"):
        ocp.checkpoint_utils.construct_restore_args({"a": object()})


def test_utils_primary_host_and_finalized(tmp_path):
    assert ocp.utils.is_primary_host(0) and ocp.utils.is_primary_host(None)
    assert not ocp.utils.is_primary_host(jax.process_count())  # no such process
    with _manager(tmp_path) as mngr:
        mngr.save(0, args=ocp.args.JsonSave({"a": 1}))
    assert ocp.utils.is_checkpoint_finalized(ocp.utils.get_save_directory(0, tmp_path))
    assert not ocp.utils.is_checkpoint_finalized(tmp_path / "7")


# --- tree helpers ---
def test_merge_and_intersect_trees():
    one, two = {"a": 1, "b": {"c": 2, "d": 3}}, {"a": 2, "b": {"c": 4, "e": 6}}
    assert ocp.merge_trees(one, two, {}, {"f": 7}) == {"a": 2, "b": {"c": 4, "d": 3, "e": 6}, "f": 7}
    assert ocp.intersect_trees(one, two) == {"a": 2, "b": {"c": 4}}
    assert ocp.merge_trees({}, {}) == {}
    for leaf in (0, "s", 1.5):
        assert ocp.merge_trees(leaf) == leaf and ocp.intersect_trees(leaf, leaf) == leaf
    target = (0, {"c": 0, "d": 0, "e": 0})  # the target's structure, filled by key path
    assert ocp.merge_trees({"0": 1, "1": {"c": 2, "d": 3}}, {"1": {"c": 4, "e": 6}}, target=target) == (
        1, {"c": 4, "d": 3, "e": 6})
    assert ocp.merge_trees({"x": [1, 2]}, {"x": [3]}) == {"x": {"0": 3, "1": 2}}


def test_use_fallback_reads_the_tree_the_default_does_not():
    original, new = {"a": 0, "f": 1}, {"a": 5, "f": 20}
    tf = {"f": ocp.Transform(use_fallback=True)}
    assert ocp.apply_transformations(original, tf, new) == {"a": 0, "f": 20}
    assert ocp.apply_transformations(original, tf, new, default_to_original=False) == {"a": 5, "f": 1}
    with pytest.raises(ValueError, match="falls back to the original tree, which lacks 'g'"):
        ocp.apply_transformations(original, {"g": ocp.Transform(use_fallback=True)}, {"g": 3}, default_to_original=False)


# --- handler registries ---
def test_registry_add_get_has():
    reg = ocp.DefaultCheckpointHandlerRegistry()
    reg.add("state", ocp.args.StandardSave)  # the handler registered with the args class
    assert isinstance(reg.get("state", ocp.args.StandardSave), ocp.StandardCheckpointHandler)

    class MySave(ocp.args.StandardSave):
        pass

    assert reg.has("state", MySave) and not reg.has("other", ocp.args.StandardSave)
    reg.add(None, ocp.args.JsonSave, ocp.JsonCheckpointHandler)
    assert isinstance(reg.get("anything", ocp.args.JsonSave), ocp.JsonCheckpointHandler)
    with pytest.raises(ValueError, match="already has a handler"):
        reg.add("state", ocp.args.StandardSave, ocp.StandardCheckpointHandler())
    with pytest.raises(ValueError, match="no handler registered for item 'x' with args PyTreeSave"):
        reg.get("x", ocp.args.PyTreeSave)
    with pytest.raises(TypeError, match="CheckpointArgs subclass"):
        reg.add("x", dict, ocp.JsonCheckpointHandler())
    assert len(ocp.DefaultCheckpointHandlerRegistry(reg).get_all_entries()) == 2


def test_composite_handler_refuses_args_another_handler_takes(tmp_path):
    handler = ocp.CompositeCheckpointHandler("state")
    handler.save(tmp_path / "a", ocp.args.Composite(state=ocp.args.StandardSave({"a": 1})))
    with pytest.raises(ValueError, match="item 'state': args JsonSave does not match with any registered handler"):
        handler.save(tmp_path / "b", ocp.args.Composite(state=ocp.args.JsonSave({"a": 1})))
    with pytest.raises(ValueError, match="does not match with any registered handler"):
        handler.restore(tmp_path / "a", ocp.args.Composite(state=ocp.args.JsonRestore()))
    assert handler.restore(tmp_path / "a", ocp.args.Composite()).state == {"a": 1}  # empty: every item
    with pytest.raises(ValueError, match="items_and_handlers"):
        ocp.CompositeCheckpointHandler(handler_registry=ocp.DefaultCheckpointHandlerRegistry(),
                                       state=ocp.StandardCheckpointHandler())
    with pytest.raises(ValueError, match="item_names"):
        ocp.CompositeCheckpointHandler("state", handler_registry=ocp.DefaultCheckpointHandlerRegistry())


def test_composite_handler_closes_each_handler_once():
    closed = []

    class Counting(ocp.StandardCheckpointHandler):
        def close(self):
            closed.append(self)

    h = Counting()
    ocp.CompositeCheckpointHandler("extra", state=h, other=h).close()
    assert closed == [h]


def test_manager_with_handler_registry_and_item_handler_checks(tmp_path):
    reg = ocp.DefaultCheckpointHandlerRegistry()
    reg.add("data", ocp.args.PyTreeSave, ocp.PyTreeCheckpointHandler())
    reg.add("data", ocp.args.PyTreeRestore, ocp.PyTreeCheckpointHandler())
    with ocp.CheckpointManager(tmp_path / "r", handler_registry=reg) as mngr:
        mngr.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"s": 1}),
                                             data=ocp.args.PyTreeSave({"d": np.arange(2)})))
        mngr.wait_until_finished()
        got = mngr.restore(0)
        assert got.state == {"s": 1} and got.data["d"].tolist() == [0, 1]
        with pytest.raises(ValueError, match="item 'data': args StandardSave does not match"):
            mngr.save(1, args=ocp.args.Composite(data=ocp.args.StandardSave({"d": 1})))
    with pytest.raises(ValueError, match="does not match with any registered handler"):
        with ocp.CheckpointManager(tmp_path / "p", item_handlers=ocp.PyTreeCheckpointHandler()) as mngr:
            mngr.save(0, args=ocp.args.StandardSave({"a": 1}))
    with pytest.raises(ValueError, match="item_handlers is one handler"):
        ocp.CheckpointManager(tmp_path / "q", item_names=("params",), item_handlers=ocp.StandardCheckpointHandler())


def test_manager_refuses_args_as_positional_items_and_layout_mismatch(tmp_path):
    with _manager(tmp_path / "one") as mngr:
        mngr.save(0, args=ocp.args.PyTreeSave({"a": 1}))
        with pytest.raises(ValueError, match="restore\\(step, args=...\\)"):
            mngr.restore(0, ocp.args.PyTreeRestore())
        with pytest.raises(ValueError, match=r"one unnamed item, not \['params'\]"):
            mngr.restore(0, args=ocp.args.Composite(params=ocp.args.PyTreeRestore()))


def test_manager_with_sync_checkpointers_saves_synchronously(tmp_path):
    mngr = ocp.CheckpointManager(tmp_path, {"params": ocp.PyTreeCheckpointer()})
    assert mngr.save(0, {"params": {"a": 1}})
    assert not mngr.is_saving_in_progress() and mngr.all_steps() == [0]
    async_mngr = ocp.CheckpointManager(tmp_path / "b", {"params": ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler())})
    assert async_mngr._options.enable_async
    async_mngr.close()


# --- checkpoint_managers policies ---
def test_save_decision_policies(tmp_path):
    policy = cm.AnySavePolicy([cm.FixedIntervalPolicy(3), cm.SpecificStepsPolicy(steps=[4]), cm.FixedIntervalPolicy(5)])
    with _manager(tmp_path / "a", save_interval_steps=1, save_decision_policy=policy) as mngr:
        saved = [s for s in range(1, 11) if mngr.save(s, args=ocp.args.StandardSave({"a": 1}))]
    assert saved == [s for s in range(1, 11) if s % 3 == 0 or s % 5 == 0 or s == 4]
    initial = cm.AnySavePolicy([cm.InitialSavePolicy(), cm.FixedIntervalPolicy(4)])
    with _manager(tmp_path / "b", save_decision_policy=initial) as mngr:
        assert [s for s in range(1, 9) if mngr.save(s, args=ocp.args.StandardSave({"a": 1}))] == [1, 4, 8]
    ctx = cm.DecisionContext(is_saving_in_progress=True)
    assert not cm.ContinuousCheckpointingPolicy().should_save(3, [1], ctx)
    recent = cm.DecisionContext(last_save_time=time.monotonic())
    assert not cm.ContinuousCheckpointingPolicy(minimum_interval_secs=60).should_save(3, [1], recent)
    assert cm.ContinuousCheckpointingPolicy(minimum_interval_secs=0).should_save(3, [1], recent)
    with pytest.raises(ValueError, match="interval must be an int >= 1"):
        cm.FixedIntervalPolicy(0)
    with pytest.raises(TypeError, match="save_decision_policy must be a checkpoint_managers.SaveDecisionPolicy"):
        ocp.CheckpointManagerOptions(save_decision_policy=lambda s: True)


def test_preservation_policies_keep_their_union_and_the_newest(tmp_path):
    loss = [5, 2, 4, 3, 7, 10, 11, 9, 8, 6, 12, 1, 13]
    policy = cm.AnyPreservationPolicy([
        cm.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2),
        cm.EveryNSteps(interval_steps=4),
        cm.CustomSteps(steps=[3]),
    ])
    with _manager(tmp_path, preservation_policy=policy, max_to_keep=1) as mngr:  # max_to_keep is replaced
        for step, v in enumerate(loss):
            mngr.save(step, args=ocp.args.StandardSave({"a": step}), metrics={"loss": v})
        best2 = sorted(range(len(loss)), key=lambda s: loss[s])[:2]
        expected = sorted(set(best2) | {0, 4, 8, 12} | {3} | {len(loss) - 1})
        assert mngr.all_steps() == expected
    infos = [cm.CheckpointInfo(s, metrics=None if s == 1 else {"m": s}) for s in range(4)]
    assert cm.BestN(get_metric_fn=lambda m: m["m"], n=1).should_preserve(infos) == [False, True, False, True]
    assert cm.BestN(get_metric_fn=lambda m: m["m"], n=1, keep_checkpoints_without_metrics=False).should_preserve(
        infos) == [False, False, False, True]
    assert cm.LatestN(2).should_preserve(infos) == [False, False, True, True]
    timed = [cm.CheckpointInfo(s, time=t) for s, t in enumerate([0.0, 5.0, 10.0, 21.0])]
    assert cm.EveryNSeconds(10).should_preserve(timed) == [True, False, True, True]


# --- manager and restore details ---
def test_placeholder_restore_still_names_every_saved_leaf(tmp_path):
    tree = {"a": np.arange(3), "b": np.arange(2), "c": {"a": np.arange(4), "e": np.arange(5)}}
    ck = ocp.PyTreeCheckpointer()
    ck.save(tmp_path / "c", tree)
    got = ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore({"a": 0, "b": ocp.PLACEHOLDER, "c": {"a": 0, "e": ...}}))
    assert got["b"] is ocp.PLACEHOLDER and got["c"]["a"].tolist() == [0, 1, 2, 3]
    for item, missing in (({"a": 0, "b": ..., "c": {"e": ...}}, r"\['c/a'\]"), ({"a": 0, "b": 0, "c": ...}, r"\['c/a', 'c/e'\]")):
        with pytest.raises(ocp.TargetMismatchError, match=f"on-disk value differ: the checkpoint's paths {missing}"):
            ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore(item))
    got = ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore({"a": 0, "b": ...}, partial_restore=True))
    assert set(got) == {"a", "b"}


def test_read_only_manager_does_not_delete_and_reload_rechecks(tmp_path):
    with _manager(tmp_path) as mngr:
        mngr.save(0, args=ocp.args.JsonSave({"a": 1}))
        reader = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(read_only=True))
        reader.delete(0)
        assert reader.all_steps() == [0] == mngr.all_steps()
        mngr.save(1, args=ocp.args.JsonSave({"a": 2}))
        reader.reload()
        assert reader.all_steps() == [0, 1]


def test_legacy_dict_restore_and_layout_messages(tmp_path):
    mngr = ocp.CheckpointManager(tmp_path, {"state": ocp.PyTreeCheckpointer(),
                                            "meta": ocp.Checkpointer(ocp.JsonCheckpointHandler())})
    mngr.save(0, {"state": {"w": np.arange(2)}, "meta": {"lang": "en"}})
    got = mngr.restore(0)
    assert got.meta == {"lang": "en"} and got["state"]["w"].tolist() == [0, 1]
    with _manager(tmp_path / "named", max_to_keep=2) as named:
        named.save(0, args=ocp.args.Composite(p=ocp.args.StandardSave({"a": 1})))
        with pytest.raises(ValueError, match="Must provide `args` of type `Composite`"):
            named.save(1, args=ocp.args.StandardSave({"a": 1}))


def test_existing_checkpoint_error_is_also_a_value_error(tmp_path):
    ck = ocp.PyTreeCheckpointer()
    ck.save(tmp_path / "c", {"a": 1})
    with pytest.raises(ocp.CheckpointExistsError, match="already exists") as info:
        ck.save(tmp_path / "c", {"a": 2})
    assert isinstance(info.value, FileExistsError) and isinstance(info.value, ValueError)
    with _manager(tmp_path / "m") as mngr:
        mngr.save(0, args=ocp.args.StandardSave({"a": 1}))
        with pytest.raises(ValueError, match="step 0 already exists"):  # force does not replace a step
            mngr.save(0, args=ocp.args.StandardSave({"a": 2}), force=True)
        assert mngr.restore(0) == {"a": 1}


def test_user_handler_with_orbax_older_positional_arguments(tmp_path):
    class Legacy(ocp.AsyncCheckpointHandler):
        async def async_save(self, directory, item, extra_args):
            self.save(directory, item, extra_args)
            return []

        def save(self, directory, item, extra_args):
            with open(os.path.join(directory, "x.txt"), "w") as f:
                f.write(f"{item['a']} {extra_args['k']}")

        def restore(self, directory, item=None, extra_args=None):
            with open(os.path.join(directory, "x.txt")) as f:
                return f.read(), item, extra_args

    for cls in (ocp.Checkpointer, ocp.AsyncCheckpointer):
        with cls(Legacy()) as ck:
            ck.save(tmp_path / cls.__name__, {"a": 1}, {"k": 2})
            ck.wait_until_finished()
            assert ck.restore(tmp_path / cls.__name__, item="it", extra_args="e") == ("1 2", "it", "e")
    with pytest.raises(TypeError, match="extra positional arguments only with a user's own handler"):
        ocp.PyTreeCheckpointer().save(tmp_path / "p", {"a": 1}, {"k": 2})


def test_array_handler_checks_and_scalar_as_ndarray(tmp_path):
    with pytest.raises(TypeError, match="ArraySave saves one array or number, got str"):
        ocp.args.ArraySave("hi")
    h = ocp.ArrayCheckpointHandler()
    h.save(tmp_path / "c", args=ocp.args.ArraySave(5))
    got = h.restore(tmp_path / "c", args=ocp.args.ArrayRestore(restore_args=ocp.RestoreArgs(restore_type=np.ndarray)))
    assert isinstance(got, np.ndarray) and got.shape == () and got == 5
    assert h.restore(tmp_path / "c") == 5 and type(h.restore(tmp_path / "c")) is int
    assert ocp.type_handlers.is_ocdbt_checkpoint(tmp_path / "c")
    assert not ocp.type_handlers.is_ocdbt_checkpoint(tmp_path)


def test_restore_from_another_directory_and_legacy_metadata_folder(tmp_path):
    with ocp.CheckpointManager(tmp_path / "pretrained", item_names=("params",)) as other:
        other.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": np.arange(3)})))
    with ocp.CheckpointManager(tmp_path / "run", item_names=("params",)) as mngr:
        with pytest.raises(FileNotFoundError, match="step 0 is not a committed checkpoint"):
            mngr.restore(0)
        got = mngr.restore(0, args=ocp.args.Composite(params=ocp.args.StandardRestore()),
                           directory=tmp_path / "pretrained")
        assert got.params["w"].tolist() == [0, 1, 2] and mngr.all_steps() == []
        assert ocp.utils.is_tmp_checkpoint(tmp_path / "pretrained" / "0") is False
    os.makedirs(tmp_path / "run" / "9.x.cairn-tmp")
    assert ocp.utils.is_tmp_checkpoint(tmp_path / "run" / "9.x.cairn-tmp")
    ocp.Checkpointer(ocp.JsonCheckpointHandler()).save(tmp_path / "run" / "metadata", args=ocp.args.JsonSave({"v": 1}))
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        assert mngr.metadata().custom_metadata == {"v": 1}


def test_custom_metadata_is_stored_and_read_back(tmp_path):
    tree = {"a": np.arange(3), "n": 1}
    for cls in (ocp.Checkpointer, ocp.AsyncCheckpointer):
        with cls(ocp.PyTreeCheckpointHandler()) as ck:
            ck.save(tmp_path / cls.__name__, args=ocp.args.PyTreeSave(tree), custom_metadata={"run": "x", "v": 2})
            ck.wait_until_finished()
            meta = ck.metadata(tmp_path / cls.__name__)
            assert meta.custom_metadata == {"run": "x", "v": 2}
            assert meta["a"].shape == (3,) and meta.item_metadata == dict(meta)
    h = ocp.StandardCheckpointHandler()
    h.save(tmp_path / "h", args=ocp.args.StandardSave(tree, custom_metadata={"foo": 1}))
    assert h.metadata(tmp_path / "h").custom_metadata == {"foo": 1}
    h.save(tmp_path / "none", args=ocp.args.StandardSave(tree))
    assert h.metadata(tmp_path / "none").custom_metadata == {}
    with pytest.raises(TypeError, match="custom_metadata"):
        ocp.PyTreeCheckpointer().save(tmp_path / "bad", tree, custom_metadata={"f": object()})


def test_checkpoint_metadata_is_a_pytree_like_its_dict(tmp_path):
    h = ocp.StandardCheckpointHandler()
    h.save(tmp_path / "c", args=ocp.args.StandardSave({"a": np.arange(3), "b": {"c": np.ones(2)}}, custom_metadata={"x": 1}))
    meta = h.metadata(tmp_path / "c")
    dtypes = jax.tree.map(lambda m: m.dtype, meta)  # reaches each LeafMetadata, keeps the attributes
    assert dict(dtypes) == {"a": "int64", "b/c": "float64"} and dtypes.custom_metadata == {"x": 1}


def test_tmp_checkpoints_lists_unfinished_saves_only(tmp_path):
    assert ocp.utils.tmp_checkpoints(tmp_path / "missing") == []
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(0, args=ocp.args.JsonSave({"a": 1}))
        mngr.wait_until_finished()
        os.makedirs(tmp_path / "run" / "3.x.cairn-tmp")  # a save being written (or abandoned)
        (tmp_path / "run" / "7.cairn-tmp").write_text("")  # a file, not a save
        assert ocp.utils.tmp_checkpoints(mngr.directory) == ["3.x.cairn-tmp"]
        assert ocp.utils.tmp_checkpoints(str(tmp_path / "run")) == ["3.x.cairn-tmp"]
        with pytest.raises(TypeError):  # a save that fails is removed at once: nothing left to list
            mngr.save(1, args=ocp.args.StandardSave({"x": object()}))
            mngr.wait_until_finished()
        assert ocp.utils.tmp_checkpoints(mngr.directory) == ["3.x.cairn-tmp"] and mngr.all_steps() == [0]
