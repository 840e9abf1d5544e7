"""The local tier under damage: a corrupt or partial local step is skipped with a warning
naming the step and the tier (restore takes the newest intact step of either tier, the data
iterator's state included), and a full local disk never stops the run."""

from __future__ import annotations

import errno
import logging
import os

import numpy as np
import pytest

import cairn.checkpoint as cc
from cairn.checkpoint import _tree


class Position:
    def __init__(self, pos: int = 0) -> None:
        self.pos = pos

    def get_state(self) -> dict:
        return {"pos": self.pos}

    def set_state(self, state: dict) -> None:
        self.pos = state["pos"]


def _manager(tmp_path, **kw) -> cc.CheckpointManager:
    opts = cc.CheckpointManagerOptions(
        save_interval_steps=4, local_directory=str(tmp_path / "local"), local_save_interval_steps=1,
        local_max_to_keep=3, enable_async=False, preemption_signals=(), **kw)
    return cc.CheckpointManager(tmp_path / "persistent", opts)


def _run(mngr, steps) -> None:
    for s in steps:
        mngr.save(s, {"w": np.full(3, float(s)), "data": Position(10 * s)})


def test_corrupt_local_step_is_skipped_naming_step_and_tier(tmp_path, caplog):
    mngr = _manager(tmp_path)
    _run(mngr, range(1, 7))  # persistent: 4; local: 3 (dropped), 5, 6 (local_max_to_keep 3 keeps 3, 5, 6)
    with open(tmp_path / "local" / "6" / "data" / "state.process_0.json", "r+b") as f:
        f.seek(30)
        f.write(b"X")
    os.remove(tmp_path / "local" / "5" / "COMMIT")  # a partial step: invisible, not corrupt
    fresh = _manager(tmp_path)
    with caplog.at_level(logging.WARNING, logger="cairn.checkpoint"):
        it = Position()
        step, got = fresh.resume({"w": np.zeros(3), "data": it})
    assert step == 4 and got["w"].tolist() == [4.0] * 3 and it.pos == 40
    msgs = [r.getMessage() for r in caplog.records]
    assert any("step 6 of the local tier" in m and "state.process_0.json" in m for m in msgs), msgs
    assert fresh.corrupt_steps().keys() == {6} and fresh.all_steps() == [3, 4]


def test_full_local_disk_warns_and_the_persistent_tier_still_saves(tmp_path, monkeypatch, caplog):
    mngr = _manager(tmp_path)
    local = str(tmp_path / "local")
    real_write = _tree.write

    def write(snap, directory, **kw):
        if directory.startswith(local):
            raise OSError(errno.ENOSPC, "No space left on device", directory)
        return real_write(snap, directory, **kw)

    monkeypatch.setattr(_tree, "write", write)
    with caplog.at_level(logging.WARNING, logger="cairn.checkpoint"):
        _run(mngr, range(1, 6))
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("was not saved in the local tier" in m and "No space left" in m for m in msgs) == 4, msgs
    assert "step 3 was not saved in the local tier" in msgs[2]
    assert mngr.all_steps() == [4]
    assert os.listdir(local) == []  # the failed saves left nothing behind
    monkeypatch.setattr(_tree, "write", real_write)
    _run(mngr, [6])  # space again: the local tier works again
    assert mngr.all_steps() == [4, 6]


def test_async_local_failure_is_not_raised_by_the_next_call(tmp_path, monkeypatch, caplog):
    opts = cc.CheckpointManagerOptions(
        save_interval_steps=4, local_directory=str(tmp_path / "local"), local_save_interval_steps=1,
        preemption_signals=())
    mngr = cc.CheckpointManager(tmp_path / "persistent", opts)
    real_write = _tree.write
    monkeypatch.setattr(_tree, "write", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with caplog.at_level(logging.WARNING, logger="cairn.checkpoint"):
        assert mngr.save(1, {"w": np.ones(2)})
        mngr.wait_until_finished()  # no exception: the local tier's failure is a warning
    assert any("step 1 was not saved in the local tier" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(_tree, "write", real_write)
    assert mngr.save(4, {"w": np.ones(2)})
    mngr.wait_until_finished()
    assert mngr.all_steps() == [4]
    mngr.close()


def test_an_async_local_save_that_fails_before_save_returns_still_reports_it_started(
        tmp_path, monkeypatch, caplog):
    # The race CI once lost: the background tail failed (and was logged) before save()
    # read its result. An async save returns whether it started, never the tail's fate.
    opts = cc.CheckpointManagerOptions(
        save_interval_steps=4, local_directory=str(tmp_path / "local"), local_save_interval_steps=1,
        preemption_signals=())
    mngr = cc.CheckpointManager(tmp_path / "persistent", opts)
    bg = mngr._bg
    real_start = bg.start

    def start_and_finish(fn, what):  # the tail's thread wins the race every time
        real_start(fn, what)
        bg._thread.join()

    monkeypatch.setattr(bg, "start", start_and_finish)
    monkeypatch.setattr(_tree, "write", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with caplog.at_level(logging.WARNING, logger="cairn.checkpoint"):
        assert mngr.save(1, {"w": np.ones(2)}) is True
        assert any("step 1 was not saved in the local tier" in r.getMessage() for r in caplog.records)
        mngr.wait_until_finished()
    assert mngr.all_steps() == []
    mngr.close()


def test_corrupt_array_chunk_in_the_local_tier_names_the_tier_then_falls_back(tmp_path):
    mngr = _manager(tmp_path)
    w = np.random.default_rng(0).standard_normal((256, 256))
    for s in (4, 5):
        mngr.save(s, {"w": w + s, "data": Position(10 * s)})
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "local" / "5" / "w" / "d") for f in fs]
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as f:  # flip one bit in the middle of the array's chunk
        f.seek(os.path.getsize(target) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    fresh = _manager(tmp_path)
    it = Position()
    with pytest.raises(cc.ChecksumError, match=r"step 5 in .*local \(local tier\) is corrupt: .*leaf ''.*local/5/w/d"):
        fresh.resume({"w": np.zeros((256, 256)), "data": it})
    step, got = fresh.resume({"w": np.zeros((256, 256)), "data": it})  # the newest intact step
    assert step == 4 and it.pos == 40
    np.testing.assert_array_equal(got["w"], w + 4)
