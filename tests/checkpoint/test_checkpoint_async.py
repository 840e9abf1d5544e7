"""AsyncCheckpointer semantics: early return, one save at a time, errors on the next call."""

from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cairn.checkpoint as cc
from cairn.checkpoint import _fs, _ownership, _tree


def _gated_write(monkeypatch, log: list):
    """Patch the background write so each call waits for its own release event."""
    orig = _tree.write
    gates: dict[str, threading.Event] = {}

    def write(snap, directory, **kw):
        name = os.path.basename(directory).split(".")[0]  # <name>.<owner>.cairn-tmp
        log.append(("start", name, {n: _fs.is_committed(d) for n, d in log_dirs(directory)}))
        gate = gates.setdefault(name, threading.Event())
        if not gate.wait(30):
            raise TimeoutError(f"write of {name} was never released")
        orig(snap, directory, **kw)
        log.append(("end", name, None))

    def log_dirs(directory):
        parent = os.path.dirname(directory)
        return [(n, os.path.join(parent, n)) for n in ("a", "b")]

    monkeypatch.setattr(_tree, "write", write)
    return gates


def test_save_returns_before_the_write_and_second_save_waits(tmp_path, monkeypatch):
    log: list = []
    gates = _gated_write(monkeypatch, log)
    gates["a"] = threading.Event()
    ck = cc.AsyncCheckpointer()
    x = jnp.arange(8.0)
    ck.save(tmp_path / "a", {"x": x})  # returns while the write is still held back
    assert not (tmp_path / "a").exists() and os.path.isdir(_ownership.tmp_name(str(tmp_path / "a")))
    second = threading.Thread(target=ck.save, args=(tmp_path / "b", {"x": x + 1}))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # blocked behind the first save
    assert [e[:2] for e in log] == [("start", "a")]
    gates["a"].set()
    second.join(30)
    assert not second.is_alive()
    gates.setdefault("b", threading.Event()).set()
    ck.wait_until_finished()
    assert [e[:2] for e in log] == [("start", "a"), ("end", "a"), ("start", "b"), ("end", "b")]
    assert log[2][2]["a"] is True  # "a" was committed before "b" started writing
    np.testing.assert_array_equal(np.asarray(cc.restore(tmp_path / "b")["x"]), np.arange(8.0) + 1)


def test_background_error_raised_by_the_next_save_then_clear(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError(5, "Input/output error")

    ck = cc.AsyncCheckpointer()
    monkeypatch.setattr(_tree, "write", boom)
    ck.save(tmp_path / "a", {"x": np.ones(2)})
    monkeypatch.undo()
    with pytest.raises(cc.CheckpointError, match=r"background save of .*a failed: .*Input/output error") as info:
        ck.save(tmp_path / "b", {"x": np.ones(2)})
    assert isinstance(info.value.__cause__, OSError)
    assert not (tmp_path / "b").exists()  # the failing call did not start another save
    ck.save(tmp_path / "b", {"x": np.ones(2)})
    ck.wait_until_finished()
    assert sorted(os.listdir(tmp_path)) == ["b"]  # the failed save removed its temporary directory
    monkeypatch.setattr(_tree, "write", boom)
    ck.save(tmp_path / "c", {"x": np.ones(2)})
    with pytest.raises(cc.CheckpointError, match="Input/output error"):
        ck.restore(tmp_path / "b")  # restore and metadata are calls too
    ck.save(tmp_path / "d", {"x": np.ones(2)})
    with pytest.raises(cc.CheckpointError, match="Input/output error"):
        ck.metadata(tmp_path / "b")
    ck.close()  # the error was raised once; nothing is pending


def test_check_for_errors_raises_a_finished_saves_error_without_waiting(tmp_path, monkeypatch):
    log: list = []
    gates = _gated_write(monkeypatch, log)
    ck = cc.AsyncCheckpointer()
    gates["a"] = threading.Event()
    ck.save(tmp_path / "a", {"x": np.ones(2)})
    for _ in range(3000):  # until the background write has started (and is held back)
        if log:
            break
        threading.Event().wait(0.01)
    ck.check_for_errors()  # the save is still held back: returns at once, raises nothing
    assert [e[:2] for e in log] == [("start", "a")] and not (tmp_path / "a").exists()
    gates["a"].set()
    ck.wait_until_finished()
    ck.check_for_errors()  # it succeeded

    def boom(*a, **k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_tree, "write", boom)
    ck.save(tmp_path / "b", {"x": np.ones(2)})
    for _ in range(3000):  # let the failing save finish, without calling a waiting method
        if not ck._bg.busy():
            break
        threading.Event().wait(0.01)
    with pytest.raises(cc.CheckpointError, match="Input/output error"):
        ck.check_for_errors()
    ck.check_for_errors()  # raised once
    ck.close()


def test_donating_the_saved_arrays_after_save_returns_keeps_the_checkpoint_intact(tmp_path):
    """A training step donates params right after an async save; the saved bytes must not move."""
    params = {"w": jnp.arange(1 << 16, dtype=jnp.float32), "b": jnp.ones(1000)}
    expect = {k: np.asarray(v).copy() for k, v in params.items()}
    step = jax.jit(lambda p: jax.tree_util.tree_map(lambda a: a * 0 - 7, p), donate_argnums=0)
    ck = cc.AsyncCheckpointer()
    ck.save(tmp_path / "c", params)
    for _ in range(5):
        params = step(params)
    jax.block_until_ready(params)
    ck.wait_until_finished()
    got = cc.restore(tmp_path / "c")
    for k in expect:
        np.testing.assert_array_equal(np.asarray(got[k]), expect[k])
