"""CheckpointManager: steps, retention, best step, Checkpointable items, tiers, async errors."""

from __future__ import annotations

import os
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

import cairn.checkpoint as cc
from cairn.checkpoint import _ownership


class Counter:
    """A data-iterator-like Checkpointable."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def get_state(self) -> dict:
        return {"position": self.position, "seed": 7}

    def set_state(self, state: dict) -> None:
        self.position = state["position"]


def test_save_restore_items_in_one_step(tmp_path):
    opts = cc.CheckpointManagerOptions(enable_async=True, step_prefix="ckpt")
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.zeros(3)}
    opt_state = [{"mu": np.ones(3), "count": 4}]
    with cc.CheckpointManager(tmp_path, opts) as mngr:
        assert mngr.save(10, {"params": params, "opt": opt_state, "data": Counter(42)}, metrics={"loss": 0.5})
        mngr.wait_until_finished()
        assert sorted(os.listdir(tmp_path)) == ["ckpt_10"]
        assert mngr.all_steps() == [10] and mngr.latest_step() == 10
        it = Counter()
        got = mngr.restore(items={"params": params, "opt": opt_state, "data": it})
        assert got["data"] is it and it.position == 42
        np.testing.assert_array_equal(np.asarray(got["params"]["w"]), np.asarray(params["w"]))
        assert got["opt"][0]["count"] == 4
        assert mngr.metrics(10) == {"loss": 0.5}
        raw = mngr.restore(10, ["data"])
        assert raw == {"data": {"position": 42, "seed": 7}}
        with pytest.raises(KeyError, match=r"no item\(s\) \['nope'\]"):
            mngr.restore(10, ["nope"])
        meta = mngr.item_metadata()
        assert meta["data"] == "state" and meta["params"]["w"].shape == (2, 3)


def test_should_save_interval_and_max_to_keep_keep_period(tmp_path):
    opts = cc.CheckpointManagerOptions(save_interval_steps=2, max_to_keep=2, keep_period=4, enable_async=False)
    mngr = cc.CheckpointManager(tmp_path, opts)
    saved = [s for s in range(11) if mngr.save(s, {"x": {"v": np.full(2, s)}})]
    assert saved == [0, 2, 4, 6, 8, 10]
    # newest two (8, 10) plus multiples of keep_period (0, 4, 8)
    assert mngr.all_steps() == [0, 4, 8, 10]
    assert not mngr.should_save(10) and not mngr.should_save(9) and mngr.should_save(12)
    assert mngr.restore(4)["x"]["v"].tolist() == [4, 4]
    mngr.delete(4)
    assert mngr.all_steps() == [0, 8, 10]
    with pytest.raises(FileNotFoundError, match="step 4 is not a committed checkpoint"):
        mngr.restore(4)


@pytest.mark.parametrize("mode,expected_best,kept", [("min", 3, [2, 3]), ("max", 0, [0, 1])])
def test_best_fn_retention(tmp_path, mode, expected_best, kept):
    losses = {0: 0.9, 1: 0.8, 2: 0.3, 3: 0.1, 4: 0.5, 5: 0.6}
    opts = cc.CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m["loss"], best_mode=mode)
    mngr = cc.CheckpointManager(tmp_path, opts)
    for s, loss in losses.items():
        mngr.save(s, {"x": {"v": np.full(1, s)}}, metrics={"loss": loss})
    mngr.wait_until_finished()
    assert mngr.best_step() == expected_best
    assert mngr.all_steps() == kept  # the two best only, as Orbax keeps them


def test_best_fn_keeps_the_newest_step_saved_after_a_preemption_notice(tmp_path):
    notice = tmp_path / "notice"
    opts = cc.CheckpointManagerOptions(
        max_to_keep=1, best_fn=lambda m: m["loss"], best_mode="min", enable_async=False,
        preemption_notice_file=str(notice), preemption_signals=(),
    )
    mngr = cc.CheckpointManager(tmp_path / "ckpt", opts)
    for s, loss in enumerate([0.5, 0.1, 0.7]):
        mngr.save(s, {"x": {"v": np.full(1, s)}}, metrics={"loss": loss})
    assert mngr.all_steps() == [1]  # the worse newest step (2) goes
    notice.touch()
    assert mngr.reached_preemption(3)
    mngr.save(3, {"x": {"v": np.full(1, 3)}}, metrics={"loss": 0.9})
    assert mngr.all_steps() == [1, 3]  # the preemption save stays: the run resumes from it
    mngr.close()


def test_max_to_keep_zero_keeps_only_the_periodic_steps(tmp_path):
    opts = cc.CheckpointManagerOptions(max_to_keep=0, keep_period=3, enable_async=False)
    mngr = cc.CheckpointManager(tmp_path, opts)
    for s in range(8):
        assert mngr.save(s, {"x": {"v": np.full(1, s)}})
    assert mngr.all_steps() == [0, 3, 6]
    assert mngr.restore(6)["x"]["v"].tolist() == [6]
    with pytest.warns(UserWarning, match=r"max_to_keep=0\) without keep_period"):
        alone = cc.CheckpointManagerOptions(max_to_keep=0, enable_async=False)
    empty = cc.CheckpointManager(tmp_path / "none", alone)
    assert empty.save(0, {"x": {"v": np.zeros(1)}})
    assert empty.all_steps() == [] and empty.latest_step() is None
    with pytest.raises(ValueError, match="max_to_keep must be >= 0 or None, got -1"):
        cc.CheckpointManagerOptions(max_to_keep=-1)


def test_two_tiers_restore_newest_complete(tmp_path):
    opts = cc.CheckpointManagerOptions(
        save_interval_steps=10, local_directory=str(tmp_path / "local"), local_save_interval_steps=2,
        local_max_to_keep=1, enable_async=False,
    )
    mngr = cc.CheckpointManager(tmp_path / "persist", opts)
    for s in range(0, 15):
        mngr.save(s, {"x": {"v": np.full(1, s)}})
    assert sorted(os.listdir(tmp_path / "persist")) == ["0", "10"]
    assert sorted(os.listdir(tmp_path / "local")) == ["14"]
    assert mngr.all_steps() == [0, 10, 14]
    assert mngr.restore()["x"]["v"].tolist() == [14]
    # losing the local tier (another machine): the persistent tier still restores
    fresh = cc.CheckpointManager(tmp_path / "persist", cc.CheckpointManagerOptions(save_interval_steps=10))
    assert fresh.latest_step() == 10 and fresh.restore()["x"]["v"].tolist() == [10]


def test_incomplete_steps_are_invisible_and_cleaned(tmp_path):
    mngr = cc.CheckpointManager(tmp_path, cc.CheckpointManagerOptions(enable_async=False))
    mngr.save(1, {"x": {"v": np.ones(2)}})
    dead = subprocess.Popen(["sleep", "30"])
    start = _ownership._proc_stat(dead.pid)[1]
    dead.kill()
    dead.wait()
    short, hid = _ownership.host_identity()
    tmp = tmp_path / f"2.{short}_{hid}_{dead.pid}_{start}.cairn-tmp"  # its writer has exited
    (tmp / "x").mkdir(parents=True)
    (tmp_path / "3").mkdir()  # no COMMIT marker
    assert mngr.all_steps() == [1]
    cc.CheckpointManager(tmp_path)
    assert not tmp.exists()
    assert mngr.all_steps() == [1]


def test_async_error_is_raised_on_next_call(tmp_path, monkeypatch):
    from cairn.checkpoint import _tree

    mngr = cc.CheckpointManager(tmp_path)
    calls = {"n": 0}
    orig = _tree.write

    def failing(*a, **k):
        calls["n"] += 1
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_tree, "write", failing)
    assert mngr.save(1, {"x": {"v": np.ones(2)}})
    with pytest.raises(cc.CheckpointError, match="step 1.*No space left on device"):
        mngr.save(2, {"x": {"v": np.ones(2)}})
    monkeypatch.setattr(_tree, "write", orig)
    assert mngr.all_steps() == []
    assert mngr.save(2, {"x": {"v": np.ones(2)}})
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2] and calls["n"] == 1


def test_option_and_item_validation(tmp_path):
    with pytest.raises(ValueError, match="best_mode"):
        cc.CheckpointManagerOptions(best_mode="up")
    with pytest.raises(ValueError, match="save_interval_steps"):
        cc.CheckpointManagerOptions(save_interval_steps=-1)
    with pytest.raises(TypeError, match="should_save_fn"):
        cc.CheckpointManagerOptions(should_save_fn=3)
    with pytest.raises(TypeError, match="keep_time_interval"):
        cc.CheckpointManagerOptions(keep_time_interval=5)
    with pytest.raises(ValueError, match="todelete_subdir"):
        cc.CheckpointManagerOptions(todelete_subdir="../x")
    with pytest.raises(ValueError, match="local_save_interval_steps"):
        cc.CheckpointManagerOptions(local_directory=str(tmp_path))
    mngr = cc.CheckpointManager(tmp_path, cc.CheckpointManagerOptions(enable_async=False))
    with pytest.raises(ValueError, match="item name '../x'"):
        mngr.save(0, {"../x": {"v": 1}})

    class Bad:
        def get_state(self):
            return {"f": object()}

        def set_state(self, s):
            pass

    with pytest.raises(TypeError, match="item 'it': get_state"):
        mngr.save(0, {"it": Bad()})
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        mngr.restore()


def test_read_only_options_switch_off_writes(tmp_path):
    options = cc.CheckpointManagerOptions(read_only=True, max_to_keep=3, save_on_steps=[1], keep_period=2,
                                          todelete_subdir="trash", should_save_fn=lambda s, last: True)
    assert options.save_interval_steps == 0 and options.max_to_keep is None and options.keep_period is None
    assert not options.create and not options.cleanup_tmp_directories and options.save_on_steps == frozenset()
    assert options.todelete_subdir is None and options.should_save_fn is None
    with cc.CheckpointManager(tmp_path) as writer:
        writer.save(0, {"a": np.arange(3)})
    with cc.CheckpointManager(tmp_path, options) as reader:
        assert not reader.save(1, {"a": np.arange(3)}, force=True)
        assert reader.all_steps() == [0]
        np.testing.assert_array_equal(reader.restore(0)["a"], np.arange(3))


def test_save_on_steps_should_save_fn_and_zero_interval(tmp_path):
    options = cc.CheckpointManagerOptions(save_interval_steps=0, save_on_steps=[3, 7], enable_async=False)
    with cc.CheckpointManager(tmp_path / "a", options) as mngr:
        saved = [s for s in range(10) if mngr.save(s, {"x": np.zeros(1)})]
    assert saved == [3, 7]
    fn_calls = []

    def every_third(step, last):
        fn_calls.append((step, last))
        return step % 3 == 0

    options = cc.CheckpointManagerOptions(should_save_fn=every_third, enable_async=False)
    with cc.CheckpointManager(tmp_path / "b", options) as mngr:
        saved = [s for s in range(7) if mngr.save(s, {"x": np.zeros(1)})]
    assert saved == [0, 3, 6] and fn_calls[:2] == [(0, None), (1, 0)]


def test_todelete_subdir_moves_removed_steps(tmp_path):
    options = cc.CheckpointManagerOptions(max_to_keep=1, todelete_subdir="trash", enable_async=False)
    with cc.CheckpointManager(tmp_path, options) as mngr:
        for s in range(3):
            mngr.save(s, {"x": np.full(2, s)})
        assert mngr.all_steps() == [2]
        mngr.delete(2)
        assert mngr.all_steps() == []
    assert sorted(os.listdir(tmp_path / "trash")) == ["0", "1", "2"]


def test_keep_time_interval_keeps_one_step_per_interval(tmp_path, monkeypatch):
    import datetime

    stamps = iter([0.0, 10.0, 20.0, 200.0, 210.0, 220.0])
    monkeypatch.setattr(cc._manager, "_now", lambda: next(stamps))  # each save's time, once per save
    options = cc.CheckpointManagerOptions(max_to_keep=1, keep_time_interval=datetime.timedelta(seconds=100),
                                          enable_async=False)
    with cc.CheckpointManager(tmp_path, options) as mngr:
        for s in range(6):
            mngr.save(s, {"x": np.zeros(1)})
        # steps 0 (t=0) and 3 (t=200) start an interval; 5 is the newest
        assert mngr.all_steps() == [0, 3, 5]


def test_step_name_format_names_the_step_directories(tmp_path):
    fmt = cc.step.standard_name_format(step_prefix="ckpt", step_format_fixed_length=3)
    options = cc.CheckpointManagerOptions(step_name_format=fmt, enable_async=False)
    assert options.step_prefix == "ckpt" and options.step_format_fixed_length == 3
    with cc.CheckpointManager(tmp_path, options) as mngr:
        mngr.save(5, {"x": np.zeros(1)})
        assert mngr.all_steps() == [5]
    assert (tmp_path / "ckpt_005").is_dir() and fmt.build_name(12) == "ckpt_012"
    on = cc.step.standard_name_format(single_host_load_and_broadcast=True)
    assert cc.CheckpointManagerOptions(single_host_load_and_broadcast=True, step_name_format=on).step_name_format == on
    with pytest.raises(ValueError, match="disagrees"):
        cc.CheckpointManagerOptions(single_host_load_and_broadcast=False, step_name_format=on)

    class Custom:
        def build_name(self, step):
            return f"s{step}"

    assert isinstance(Custom(), cc.step.NameFormat)
    with pytest.raises(ValueError, match="needs a standard_name_format"):
        cc.CheckpointManagerOptions(single_host_load_and_broadcast=True, step_name_format=Custom())
    with pytest.raises(NotImplementedError, match="only step.standard_name_format"):
        cc.CheckpointManager(tmp_path / "c", cc.CheckpointManagerOptions(step_name_format=Custom()))
