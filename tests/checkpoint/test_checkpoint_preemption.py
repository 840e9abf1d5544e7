"""Preemption in cairn.checkpoint: notices (signal, file, callable), should_save, the exit
helper, resume, handler chaining and restoring, and two jax.distributed processes agreeing
on the step when only one of them is signalled."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest

import cairn.checkpoint as cc

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ckpt_preempt_worker.py")


def _two_processes(directory: str, mode: str, total: int, on_line=None) -> list[tuple[int, list[str], str]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    errs = [tempfile.TemporaryFile("w+") for _ in range(2)]  # read by no thread but ours
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(port), str(i), directory, mode, str(total)],
                         stdout=subprocess.PIPE, stderr=errs[i], text=True, env=env)
        for i in range(2)
    ]
    lines: list[list[str]] = [[], []]

    def read(i: int) -> None:
        for line in procs[i].stdout:
            lines[i].append(line.strip())
            if on_line is not None:
                on_line(i, line.strip(), procs)

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in readers:
        t.start()
    out = []
    for i, p in enumerate(procs):
        try:
            p.wait(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        readers[i].join()
        errs[i].seek(0)
        out.append((p.returncode, lines[i], errs[i].read()))
    return out


def _expected_w(total: int) -> np.ndarray:
    w = np.zeros(4)
    for step in range(total):
        w = w / 2 + step
    return w


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.multiprocess
def test_sigterm_to_one_process_both_save_the_same_step_and_resume(tmp_path):
    d = str(tmp_path / "ckpt")
    sent = threading.Event()

    def on_line(i, line, procs):
        if i == 1 and line == "STEP 3" and not sent.is_set():
            sent.set()
            procs[1].send_signal(signal.SIGTERM)  # process 0 is never signalled

    outs = _two_processes(d, "train", 40, on_line)
    stops = []
    for i, (rc, lines, err) in enumerate(outs):
        assert rc == cc.PREEMPTION_EXIT_CODE, f"process {i}: rc {rc}\n{err[-3000:]}"
        assert lines[-1].startswith("PREEMPTED"), lines[-3:]
        stops.append(int(lines[-1].split()[1]))
    assert stops[0] == stops[1] and 3 <= stops[0] < 40
    step = stops[0]
    mngr = cc.CheckpointManager(d)
    assert mngr.all_steps() == [step]  # saved once, by both processes, as one step
    np.testing.assert_array_equal(mngr.restore(step, ["w"])["w"], _expected_w(step))
    mngr.close()
    # the next start resumes by itself on both processes and finishes as if never stopped
    outs = _two_processes(d, "train", 40)
    for i, (rc, lines, err) in enumerate(outs):
        assert rc == 0, err[-3000:]
        assert f"RESUMED {step}" in lines, lines[:4]
        final = lines[-1].split()
        assert final[0] == "FINAL" and int(final[1]) == 1000 * i + 40  # its own data position
        np.testing.assert_array_equal(np.array(final[2:], float), _expected_w(40))


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.multiprocess
def test_a_process_that_never_reaches_the_sync_point_is_named(tmp_path):
    outs = _two_processes(str(tmp_path / "ckpt"), "stall", 0)
    rc, lines, err = outs[0]
    assert rc == 0, err[-3000:]
    timeout = [line for line in lines if line.startswith("TIMEOUT")]
    assert timeout and timeout[0].startswith("TIMEOUT [1] "), lines
    assert "process(es) [1] of 2 did not reach the preemption check of step 1 within 3 s" in timeout[0]


class Position:
    def __init__(self, pos: int = 0) -> None:
        self.pos = pos

    def get_state(self) -> dict:
        return {"pos": self.pos}

    def set_state(self, state: dict) -> None:
        self.pos = state["pos"]


def test_signal_sets_the_flag_chains_and_close_restores_the_handler(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        opts = cc.CheckpointManagerOptions(preemption_signals=(signal.SIGUSR1,), enable_async=False)
        mngr = cc.CheckpointManager(tmp_path, opts)
        before = signal.getsignal(signal.SIGUSR1)
        assert not mngr.reached_preemption(0)  # the first question installs the handler
        assert signal.getsignal(signal.SIGUSR1) != before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # the previous handler still ran
        assert mngr.reached_preemption(1) and mngr.reached_preemption(5)
        assert not mngr.reached_preemption(0)  # asked before the notice: the answer is kept
        assert mngr.preemption_step == 1
        mngr.close()
        assert signal.getsignal(signal.SIGUSR1) is before
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_notice_file_and_callable(tmp_path):
    notice = tmp_path / "preempted"
    mngr = cc.CheckpointManager(tmp_path / "a", cc.CheckpointManagerOptions(
        preemption_signals=(), preemption_notice_file=str(notice)))
    assert not mngr.reached_preemption(1)
    notice.touch()
    assert mngr.reached_preemption(2) and mngr.preemption_step == 2
    mngr.close()
    calls = []
    mngr = cc.CheckpointManager(tmp_path / "b", cc.CheckpointManagerOptions(
        preemption_signals=(), preemption_check=lambda: len(calls.append(1) or calls) >= 3))
    assert [mngr.reached_preemption(s) for s in range(4)] == [False, False, True, True]
    assert len(calls) == 3  # not asked again once the preemption is reached
    mngr.close()


def _notice_file_tiers(tmp_path, every: int, local_every: int, **kw) -> tuple:
    """(the notice file, options of a persistent tier every ``every`` steps and a local one
    every ``local_every``, preempted by that file only)."""
    notice = tmp_path / "preempted"
    return notice, cc.CheckpointManagerOptions(
        save_interval_steps=every, local_directory=str(tmp_path / "local"), local_save_interval_steps=local_every,
        preemption_signals=(), preemption_notice_file=str(notice), **kw)


def test_should_save_and_exit_save_to_the_persistent_tier(tmp_path):
    notice, opts = _notice_file_tiers(tmp_path, 100, 2, enable_async=False)
    mngr = cc.CheckpointManager(tmp_path / "persistent", opts)
    it = Position()
    for step in range(1, 5):
        it.pos = step
        assert mngr.should_save(step) == (step % 2 == 0)
        mngr.save(step, {"w": np.full(2, step, np.float64), "data": it})
        mngr.exit_if_preempted(step, {"w": np.full(2, step, np.float64), "data": it})  # returns: no notice
    assert os.listdir(tmp_path / "persistent") == [] and mngr.latest_step() == 4
    notice.touch()
    it.pos = 5
    assert mngr.should_save(5)  # not due in any tier, but preempted
    assert mngr.save(5, {"w": np.full(2, 5.0), "data": it})
    assert os.listdir(tmp_path / "persistent") == ["5"]
    with pytest.raises(SystemExit) as exc:
        mngr.exit_if_preempted(5, {"w": np.full(2, 5.0), "data": it})
    assert exc.value.code == cc.PREEMPTION_EXIT_CODE == 75
    fresh = cc.CheckpointManager(tmp_path / "persistent")  # the local tier is gone with the machine
    it2 = Position()
    step, got = fresh.resume({"w": np.zeros(2), "data": it2})
    assert step == 5 and got["w"].tolist() == [5, 5] and it2.pos == 5
    fresh.close()


def test_exit_copies_a_local_only_step_to_the_persistent_tier(tmp_path):
    opts = cc.CheckpointManagerOptions(
        save_interval_steps=100, local_directory=str(tmp_path / "local"), local_save_interval_steps=1,
        preemption_signals=(signal.SIGUSR1,))
    mngr = cc.CheckpointManager(tmp_path / "persistent", opts)
    assert mngr.save(3, {"w": np.arange(1e6)})  # async, in the local tier
    os.kill(os.getpid(), signal.SIGUSR1)  # arrives while the local save is written
    with pytest.raises(SystemExit):
        mngr.exit_if_preempted(3, {"w": np.arange(1e6)})
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # restored by close()
    assert sorted(os.listdir(tmp_path / "persistent")) == ["3"]
    assert sorted(os.listdir(tmp_path / "local")) == ["3"]
    np.testing.assert_array_equal(cc.CheckpointManager(tmp_path / "persistent").restore(3)["w"], np.arange(1e6))


def test_a_notice_after_the_last_check_copies_the_newest_local_step_at_close(tmp_path):
    """A notice that came after the loop's last exit_if_preempted (the final evaluation, say)
    is not dropped: close() copies the newest step, held only by the local tier, to the
    persistent tier, intact and restorable (its metadata names the tier)."""
    notice, opts = _notice_file_tiers(tmp_path, 5, 2, max_to_keep=2)
    mngr = cc.CheckpointManager(tmp_path / "persistent", opts)
    it = Position()
    for step in range(1, 13):
        it.pos = step
        mngr.save(step, {"w": np.full(3, step, np.float64), "data": it})
        mngr.exit_if_preempted(step, {"w": np.full(3, step, np.float64), "data": it})
    assert sorted(os.listdir(tmp_path / "persistent")) == ["10", "5"]
    notice.touch()  # after the last check: the loop is over
    mngr.close()
    mngr.close()  # a second close exchanges nothing and copies nothing
    assert sorted(os.listdir(tmp_path / "persistent")) == ["10", "12"]  # retention applied
    fresh = cc.CheckpointManager(tmp_path / "persistent")  # the local tier is gone with the machine
    it2 = Position()
    step, got = fresh.resume({"w": np.zeros(3), "data": it2})
    assert step == 12 and got["w"].tolist() == [12, 12, 12] and it2.pos == 12
    assert fresh.item_metadata(12) is not None and fresh.metrics(12) is None
    text = (tmp_path / "persistent" / "12" / "_STEP.json").read_text()
    assert '"persistent"' in text and '"local"' not in text  # the copy's metadata names its tier
    fresh.close()


def test_close_without_a_notice_or_after_an_error_copies_nothing(tmp_path):
    notice, opts = _notice_file_tiers(tmp_path, 5, 2, enable_async=False)
    with cc.CheckpointManager(tmp_path / "persistent", opts) as mngr:
        mngr.save(2, {"w": np.ones(2)})
    assert os.listdir(tmp_path / "persistent") == []  # no notice: the local step stays local
    with pytest.raises(RuntimeError, match="boom"), cc.CheckpointManager(tmp_path / "persistent", opts) as mngr:
        mngr.save(4, {"w": np.ones(2)})
        notice.touch()
        raise RuntimeError("boom")
    assert os.listdir(tmp_path / "persistent") == []  # left by an error: no end-of-run exchange


def test_resume_without_a_checkpoint_returns_the_targets(tmp_path):
    it = Position(7)
    items = {"w": np.zeros(3), "data": it}
    with cc.CheckpointManager(tmp_path) as mngr:
        step, got = mngr.resume(items)
        assert step is None and got is items and it.pos == 7
        mngr.save(2, {"w": np.ones(3), "data": Position(9)})
    with cc.CheckpointManager(tmp_path) as mngr:
        step, got = mngr.resume(items)
        assert step == 2 and got["w"].tolist() == [1, 1, 1] and it.pos == 9
        with pytest.raises(cc.TargetMismatchError, match="shape"):
            mngr.resume({"w": np.zeros(4), "data": it})  # a mismatching checkpoint is not ignored


def test_a_second_sigterm_kills_a_loop_that_never_stops(tmp_path):
    code = (
        "import os, signal, time, cairn.checkpoint as cc\n"
        f"m = cc.CheckpointManager({str(tmp_path)!r})\n"
        "m.reached_preemption(0)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "assert m.reached_preemption(1)\n"
        "print('survived the first', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout == "survived the first\n" and res.returncode == -signal.SIGTERM, res.stderr


def test_preemption_option_validation():
    with pytest.raises(ValueError, match="preemption_sync_interval_steps must be >= 1"):
        cc.CheckpointManagerOptions(preemption_sync_interval_steps=0)
    with pytest.raises(TypeError, match="preemption_check must be callable"):
        cc.CheckpointManagerOptions(preemption_check=True)
    with pytest.raises(ValueError, match=r"preemption_signals holds \[12345\]"):
        cc.CheckpointManagerOptions(preemption_signals=(12345,))
