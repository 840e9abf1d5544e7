"""Orbax-compatible events of cairn.checkpoint (issue 30): step statistics handed to a
manager's logger, Orbax's jax.monitoring names, background errors that keep their own
type, the timeout of a user's handler's futures, and ``None`` restore targets."""

import ast
import concurrent.futures
import dataclasses
import logging
import threading
from unittest import mock

import jax
import numpy as np
import pytest

import cairn.checkpoint as ocp
from cairn.checkpoint import logging as ocp_logging
from cairn.checkpoint.logging import step_statistics


class _Collect(ocp_logging.AbstractLogger):
    def __init__(self):
        self.entries = []

    def log_entry(self, entry):
        self.entries.append(entry)


def test_manager_gives_save_and_restore_statistics_to_its_logger(tmp_path):
    got = _Collect()
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path, options=opts, logger=ocp_logging.CompositeLogger(got)) as mngr:
        assert mngr.save(0, args=ocp.args.StandardSave({"a": np.arange(3)}))
        assert not mngr.save(0, args=ocp.args.StandardSave({"a": np.arange(3)}))  # not due: no entry
        assert mngr.save(1, args=ocp.args.StandardSave({"a": np.arange(3)}))
        mngr.restore(1)
    save0, save1, restore = got.entries
    assert set(save0) == {f.name for f in dataclasses.fields(step_statistics.SaveStepStatistics)}
    assert (save0["step"], save0["event_type"], save0["directory"]) == (0, "save", str(tmp_path))
    assert save0["synchronous"] is True and save0["reached_preemption"] is False
    assert save0["time_between_consecutive_saves_sec"] is None and save1["time_between_consecutive_saves_sec"] >= 0
    for key in ("wait_for_prev", "get_old_steps", "checkpointer_blocking", "checkpoint_manager_blocking"):
        assert save0[f"{key}_duration_secs"] >= 0 and save0[f"{key}_start_time"] > 0
    assert (restore["step"], restore["event_type"]) == (1, "restore")
    assert restore["checkpointer_duration_secs"] <= restore["checkpoint_manager_duration_secs"]


def test_standard_logger_is_the_default_and_logs_a_readable_dict(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="cairn.checkpoint"):
        with ocp.CheckpointManager(tmp_path) as mngr:
            mngr.save(4, args=ocp.args.StandardSave({"a": 1}))
            mngr.wait_until_finished()
    line = [r.getMessage() for r in caplog.records if "step statistics" in r.getMessage()][-1]
    entry = ast.literal_eval(line[line.index("{"):])
    assert entry["step"] == 4 and entry["event_type"] == "save" and entry["synchronous"] is False


def test_bad_logger_is_refused(tmp_path):
    with pytest.raises(TypeError, match="logger must have log_entry"):
        ocp.CheckpointManager(tmp_path, logger=object())
    with pytest.raises(TypeError, match="loggers with log_entry"):
        ocp_logging.CompositeLogger(_Collect(), "not a logger")
    with pytest.raises(TypeError, match="takes a dict"):
        ocp_logging.StandardLogger().log_entry([1])


@pytest.mark.parametrize("continuous", [True, False])
def test_manager_init_reports_orbax_monitoring_events(tmp_path, continuous):
    policy = ocp.checkpoint_managers.ContinuousCheckpointingPolicy() if continuous else None
    with mock.patch.object(jax.monitoring, "record_scalar") as scalar:
        with ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(save_decision_policy=policy)):
            pass
    scalar.assert_any_call("/jax/orbax/checkpoint_manager/continuous_checkpointing_enabled", int(continuous))


def test_composite_finalize_reports_each_items_time(tmp_path):
    handler = ocp.CompositeCheckpointHandler(state=ocp.StandardCheckpointHandler())
    handler.save(tmp_path / "c", args=ocp.args.Composite(state=ocp.args.StandardSave({"a": 1}),
                                                          meta=ocp.args.JsonSave({"k": 2})))
    with mock.patch.object(jax.monitoring, "record_event_duration_secs") as duration:
        handler.finalize(tmp_path / "c")
    names = [c.args[0] for c in duration.call_args_list]
    assert names == ["/jax/orbax/write/background_item_finalize_secs"] * 2


# --- background errors keep their own type ---
class _Failing(ocp.AsyncCheckpointHandler):
    """A user's handler whose commit future fails (or never finishes, with ``block``)."""

    def __init__(self, error=None, block=None):
        self.error, self.block = error, block
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def save(self, directory, args):
        pass

    async def async_save(self, directory, args):
        def commit():
            if self.block is not None:
                self.block.wait()
            if self.error is not None:
                raise self.error
        return [self.pool.submit(commit), self.pool.submit(lambda: None)]

    def restore(self, directory, args=None):
        return None


@ocp.args.register_with_handler(_Failing, for_save=True)
@dataclasses.dataclass
class _FailingSave(ocp.args.CheckpointArgs):
    pass


@pytest.mark.parametrize("error", [SystemError("boom"), KeyError("k"), ValueError("v")])
def test_background_error_is_a_checkpoint_error_of_the_original_type(tmp_path, error):
    ck = ocp.AsyncCheckpointer(_Failing(error))
    ck.save(tmp_path / "x", args=_FailingSave())
    with pytest.raises(type(error)) as info:
        ck.wait_until_finished()
    assert isinstance(info.value, ocp.CheckpointError) and info.value.__cause__ is error
    assert "background save of" in str(info.value)
    assert not (tmp_path / "x").exists()
    ck.wait_until_finished()  # the error was handed over once


def test_background_error_not_an_exception_is_a_plain_checkpoint_error(tmp_path):
    class Stop(BaseException):
        pass

    ck = ocp.AsyncCheckpointer(_Failing(Stop("halt")))
    ck.save(tmp_path / "x", args=_FailingSave())
    with pytest.raises(ocp.CheckpointError) as info:
        ck.wait_until_finished()
    assert type(info.value) is ocp.CheckpointError and isinstance(info.value.__cause__, Stop)


def test_user_handler_futures_past_timeout_secs_raise_timeout_error(tmp_path):
    block = threading.Event()
    ck = ocp.AsyncCheckpointer(_Failing(block=block), timeout_secs=0.2)
    try:
        ck.save(tmp_path / "x", args=_FailingSave())
        with pytest.raises(TimeoutError, match=r"completed 0/2 futures but timed out after 0.2 seconds"):
            ck.wait_until_finished()
    finally:
        block.set()
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="timeout_secs must be a positive"):
        ocp.AsyncCheckpointer(_Failing(), timeout_secs=0)


# --- None in a restore target ---
def test_none_in_restore_target_skips_that_part(tmp_path):
    ck = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    ck.save(tmp_path / "c", {"b": np.arange(4), "c": {"x": 1, "y": np.ones(2)}})
    assert ck.restore(tmp_path / "c", args=ocp.args.StandardRestore({"b": None, "c": None})) == {"b": None, "c": None}
    got = ck.restore(tmp_path / "c", args=ocp.args.PyTreeRestore({"b": np.zeros(4, np.int64), "c": None}))
    assert got["c"] is None
    np.testing.assert_array_equal(got["b"], np.arange(4))
    # a saved part neither in the target nor None there is still refused
    with pytest.raises(ocp.TargetMismatchError, match=r"\['c/x', 'c/y'\]"):
        ck.restore(tmp_path / "c", args=ocp.args.StandardRestore({"b": None}))


# --- JsonCheckpointHandler(filename=) ---
def test_json_handler_filename_names_the_file(tmp_path):
    h = ocp.JsonCheckpointHandler(filename="file")
    h.save(tmp_path / "a", args=ocp.args.JsonSave({"a": 1, "b": [2.5, "x"]}))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["file"]
    assert h.restore(tmp_path / "a") == {"a": 1, "b": [2.5, "x"]}
    ck = ocp.Checkpointer(ocp.JsonCheckpointHandler(filename="meta"))  # committed atomically, as every save
    ck.save(tmp_path / "b", {"x": [1, 2]})
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["COMMIT", "meta"]
    assert ck.restore(tmp_path / "b") == {"x": [1, 2]}
    (tmp_path / "b" / "meta").write_text((tmp_path / "b" / "meta").read_text().replace("1", "7"))
    with pytest.raises(ocp.CheckpointCorruptError):
        ck.restore(tmp_path / "b")
    with pytest.raises(FileNotFoundError, match="no JSON file 'other'"):
        ocp.JsonCheckpointHandler(filename="other").restore(tmp_path / "a")
    for bad in ("a/b", "", "COMMIT", 3):
        with pytest.raises(ValueError, match="plain file name"):
            ocp.JsonCheckpointHandler(filename=bad)


# --- a user's handler in a Checkpointer: custom_metadata and metadata() ---
class _Wrapping(ocp.AsyncCheckpointHandler):
    """Delegates to a PyTreeCheckpointHandler (so the directory is cairn's pytree format)."""

    def __init__(self):
        self.inner = ocp.PyTreeCheckpointHandler()

    def save(self, directory, args):
        self.inner.save(directory, args=ocp.args.PyTreeSave(args.item))

    def restore(self, directory, args=None):
        return self.inner.restore(directory)


class _OwnMetadata(_Wrapping):
    def metadata(self, directory):
        return {"mine": str(directory)}


@ocp.args.register_with_handler(_Wrapping, for_save=True)
@dataclasses.dataclass
class _WrappingSave(ocp.args.CheckpointArgs):
    item: object = None


@pytest.mark.parametrize("cls", [ocp.Checkpointer, ocp.AsyncCheckpointer])
def test_user_handler_save_keeps_custom_metadata(tmp_path, cls):
    with cls(_Wrapping()) as ck:
        ck.save(tmp_path / "x", args=_WrappingSave({"w": np.arange(3)}), custom_metadata={"run": "a", "n": 2})
        ck.wait_until_finished()
        meta = ck.metadata(tmp_path / "x")
        assert meta.custom_metadata == {"run": "a", "n": 2} and meta["w"].shape == (3,)
        np.testing.assert_array_equal(ck.restore(tmp_path / "x")["w"], np.arange(3))
    with pytest.raises(TypeError, match="custom_metadata"):
        cls(_Wrapping()).save(tmp_path / "y", args=_WrappingSave({"w": 1}), custom_metadata={"bad": object()})
    assert ocp.Checkpointer(_OwnMetadata()).metadata(tmp_path / "x") == {"mine": str(tmp_path / "x")}


# --- typed PRNG keys ---
def _keys(seed):
    return {"k": jax.random.key(seed), "r": jax.random.key(seed, impl="rbg"),
            "ks": jax.random.split(jax.random.key(seed + 7), 4), "w": np.arange(3.0)}


def _same_keys(a, b):
    assert jax.random.key_impl(a) == jax.random.key_impl(b) and a.shape == b.shape
    np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))


def test_typed_prng_keys_round_trip_with_and_without_target(tmp_path):
    saved = _keys(1)
    ocp.save(tmp_path / "a", saved)
    got = ocp.restore(tmp_path / "a")
    for k in ("k", "r", "ks"):
        _same_keys(got[k], saved[k])
    # the restored key draws the same numbers as the saved one
    np.testing.assert_array_equal(jax.random.normal(got["k"], (3,)), jax.random.normal(saved["k"], (3,)))
    ck = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    ck.save(tmp_path / "b", saved)
    for target in (_keys(0), jax.tree.map(ocp.utils.to_shape_dtype_struct, _keys(0)), jax.eval_shape(lambda: _keys(0))):
        got = ck.restore(tmp_path / "b", args=ocp.args.StandardRestore(target))
        for k in ("k", "r", "ks"):
            _same_keys(got[k], saved[k])
    assert ocp.metadata(tmp_path / "a")["r"].shape == (4,)  # the stored key data (rbg: 4 words)


def test_typed_prng_key_target_on_a_plain_array_is_refused(tmp_path):
    ocp.save(tmp_path / "a", {"k": jax.numpy.zeros(2, jax.numpy.uint32)})
    with pytest.raises(ocp.TargetMismatchError, match="target is a PRNG key array"):
        ocp.restore(tmp_path / "a", {"k": jax.random.key(0)})
    assert ocp.utils.is_pathways_backend() is False


# --- a user's handler inside a CheckpointManager ---
class _Delegating(ocp.AsyncCheckpointHandler):
    """A user's handler writing through a PyTreeCheckpointHandler; ``fail`` makes its commit
    future raise ``SystemError``; ``finalized`` records the folders it finalized."""

    def __init__(self, fail=False):
        self.inner, self.fail, self.finalized = ocp.PyTreeCheckpointHandler(), fail, []
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def save(self, directory, args):
        self.inner.save(directory, args=ocp.args.PyTreeSave(args.item))

    async def async_save(self, directory, args):
        self.save(directory, args)

        def commit():
            if self.fail:
                raise SystemError("commit failed")
        return [self.pool.submit(commit)]

    def restore(self, directory, args=None):
        return {"restored_by": "handler", **self.inner.restore(directory)}

    def finalize(self, directory):
        self.finalized.append(directory)


@ocp.args.register_with_handler(_Delegating, for_save=True)
@dataclasses.dataclass
class _DelegatingSave(ocp.args.CheckpointArgs):
    item: object = None


@ocp.args.register_with_handler(_Delegating, for_restore=True)
@dataclasses.dataclass
class _DelegatingRestore(ocp.args.CheckpointArgs):
    item: object = None


@pytest.mark.parametrize("background", [True, False])
def test_user_handler_in_manager_writes_and_reads_its_item(tmp_path, background):
    handler = _Delegating()
    ckptr = (ocp.AsyncCheckpointer if background else ocp.Checkpointer)(handler)
    with ocp.CheckpointManager(tmp_path / "a", ckptr) as mngr:  # Orbax's older positional form
        assert mngr.save(1, {"w": np.arange(3)})
        mngr.wait_until_finished()
        got = mngr.restore(1)
        assert got["restored_by"] == "handler"
        np.testing.assert_array_equal(got["w"], np.arange(3))
        assert mngr.item_metadata(1) == {"default": "opaque"} and len(handler.finalized) == 1
    with ocp.CheckpointManager(tmp_path / "b", item_handlers={"x": _Delegating(), "y": ocp.JsonCheckpointHandler()}) as mngr:
        mngr.save(2, args=ocp.args.Composite(x=_DelegatingSave({"v": 5}), y=ocp.args.JsonSave([1])))
        mngr.wait_until_finished()
        got = mngr.restore(2, args=ocp.args.Composite(x=_DelegatingRestore(), y=ocp.args.JsonRestore()))
        assert got.x == {"restored_by": "handler", "v": 5} and got.y == [1]
    with ocp.CheckpointManager(tmp_path / "b") as plain:  # without the handler the item cannot be read
        with pytest.raises(TypeError, match="written by a user's handler"):
            plain.restore(2)


def test_user_handler_error_in_manager_reaches_every_waiter_and_is_cleared_by_the_saver(tmp_path):
    pool = concurrent.futures.ThreadPoolExecutor(2)
    with ocp.CheckpointManager(tmp_path, ocp.AsyncCheckpointer(_Delegating(fail=True))) as mngr:
        assert mngr.save(3, {"a": 1})
        waiters = [pool.submit(mngr.wait_until_finished) for _ in range(2)]
        for w in waiters:  # other threads see the error, but do not consume it
            with pytest.raises(SystemError):
                w.result(timeout=30)
        with pytest.raises(SystemError, match="commit failed") as info:
            mngr.wait_until_finished()
        assert isinstance(info.value, ocp.CheckpointError) and "step 3" in str(info.value)
        mngr.wait_until_finished()  # the saving thread was handed it: cleared
        assert mngr.all_steps() == []
    pool.shutdown()


def test_user_handler_futures_in_manager_past_async_timeout(tmp_path):
    block = threading.Event()
    opts = ocp.CheckpointManagerOptions(async_options=ocp.AsyncOptions(timeout_secs=0.2))
    try:
        with ocp.CheckpointManager(tmp_path, ocp.AsyncCheckpointer(_Failing(block=block)), options=opts) as mngr:
            mngr.save(0, args=_FailingSave())
            with pytest.raises(TimeoutError, match="timed out after 0.2 seconds"):
                mngr.wait_until_finished()
            assert mngr.all_steps() == []
    finally:
        block.set()


# --- composite metadata: item handlers, commit time, an empty folder ---
def test_composite_metadata_records_each_items_handler(tmp_path):
    ck = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    ck.save(tmp_path / "y", args=ocp.args.Composite(state=ocp.args.PyTreeSave({"a": 1}), other=ocp.args.JsonSave(1)))
    meta = ck.metadata(tmp_path / "y")
    assert meta.item_handlers == {"state": ocp.PyTreeCheckpointHandler().typestr(),
                                  "other": ocp.JsonCheckpointHandler().typestr()}
    assert ocp.PyTreeCheckpointHandler().typestr() == "cairn.checkpoint._handlers.PyTreeCheckpointHandler"
    assert meta.commit_timestamp_nsecs > 1.7e18 and meta.metrics == {} and meta.init_timestamp_nsecs is None
    # a handler given for the item wins over the args' class; a bare handler save has no commit time
    h = ocp.CompositeCheckpointHandler(state=ocp.StandardCheckpointHandler())
    h.save(tmp_path / "z", args=ocp.args.Composite(state=ocp.args.StandardSave({"a": 1})))
    meta = h.metadata(tmp_path / "z")
    assert meta.item_handlers == {"state": ocp.StandardCheckpointHandler().typestr()}
    assert meta.commit_timestamp_nsecs is None
    assert ocp.Checkpointer(ocp.StandardCheckpointHandler()).metadata(tmp_path / "y").item_handlers is not None
    ocp.save(tmp_path / "single", {"a": 1})
    assert ocp.PyTreeCheckpointHandler().metadata(tmp_path / "single").item_handlers is None


def test_composite_metadata_of_an_empty_folder_is_empty(tmp_path):
    h = ocp.CompositeCheckpointHandler("extra", state=ocp.StandardCheckpointHandler())
    for where in (tmp_path, tmp_path / "missing"):
        meta = h.metadata(where)
        assert dict(meta) == {} and meta.item_handlers == {} and meta.custom_metadata == {}
        assert meta.performance_metrics == step_statistics.SaveStepStatistics()
        assert meta.commit_timestamp_nsecs is None
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        ocp.StandardCheckpointHandler().metadata(tmp_path)  # a single-item handler still needs a checkpoint
