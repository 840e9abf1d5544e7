"""SIGTERM at many moments of a cairn.nn + cairn.optim + cairn.data training loop that uses
``CheckpointManager.resume`` / ``should_save`` / ``exit_if_preempted``: every interrupted run
saves the step it reached (no step lost), exits with ``PREEMPTION_EXIT_CODE``, and a restart
finishes bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

import cairn.checkpoint as cc

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_preempt_worker.py")
TOTAL = 12
# (event, its argument or None for the first one, extra delay in seconds)
MOMENTS = [
    ("compile", None, 0.0),  # while the train step compiles
    ("step", "3", 0.0),  # inside a step
    ("save", "4", 0.0),  # during an async save (local tier)
    ("eval", "6", 0.0),  # while the evaluation function compiles
    ("data", "9", 0.0),  # waiting for the next batch
]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}


def _interrupted_run(directory: str, moment: tuple) -> dict:
    """Start the worker, send SIGTERM when it prints ``EVENT <moment>``; its output."""
    err = tempfile.TemporaryFile("w+")  # stdout is read by the thread below alone
    proc = subprocess.Popen(
        [sys.executable, WORKER, str(TOTAL), directory, directory + ".npz"],
        stdout=subprocess.PIPE, stderr=err, text=True, env=_env(),
    )
    lines: list[str] = []
    kind, arg, delay = moment

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            parts = line.split()
            if parts[:2] == ["EVENT", kind] and (arg is None or parts[2:] == [arg]):
                time.sleep(delay)
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass

    reader = threading.Thread(target=read)
    reader.start()
    return {"proc": proc, "reader": reader, "lines": lines, "dir": directory, "moment": moment, "errfile": err}


def _finish(run: dict) -> None:
    try:
        run["proc"].wait(timeout=300)
    except subprocess.TimeoutExpired:
        run["proc"].kill()
        raise
    run["reader"].join()
    run["errfile"].seek(0)
    run["rc"], run["err"] = run["proc"].returncode, run["errfile"].read()


def _check_and_resume(tmp_path, moments: list[tuple]) -> None:
    runs = [_interrupted_run(str(tmp_path / f"run{i}"), m) for i, m in enumerate(moments)]
    for run in runs:
        _finish(run)
    for run in runs:
        lines, rc = run["lines"], run["rc"]
        done_steps = sum(1 for line in lines if line.startswith("EVENT step"))
        what = f"moment {run['moment']}: rc {rc}, output {lines[-5:]}, stderr {run['err'][-2000:]}"
        if rc == cc.PREEMPTION_EXIT_CODE:
            assert lines[-1] == "PREEMPTED", what
            # no step lost: the step the run reached is committed, in the persistent tier
            mngr = cc.CheckpointManager(os.path.join(run["dir"], "persistent"))
            assert mngr.latest_step() == done_steps, what
            mngr.close()
        else:  # the signal came after the last step: nothing to redo
            assert "DONE" in lines and rc in (0, -signal.SIGTERM), what
    preempted = [r["moment"] for r in runs if r["rc"] == cc.PREEMPTION_EXIT_CODE]
    print("preempted at", preempted)
    assert len(preempted) >= len(runs) // 2, [(r["moment"], r["rc"]) for r in runs]
    # restart every run, and the uninterrupted reference, in one more process
    ref = str(tmp_path / "reference")
    args = [sys.executable, WORKER, str(TOTAL)]
    for run in runs:
        args += [run["dir"], run["dir"] + ".resumed.npz"]
    args += [ref, ref + ".npz"]
    res = subprocess.run(args, capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    want = np.load(ref + ".npz")
    for run in runs:
        out = run["dir"] + (".resumed.npz" if run["rc"] == cc.PREEMPTION_EXIT_CODE else ".npz")
        got = np.load(out)
        assert set(got) == set(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), (run["moment"], k)
    resumed = [line for line in res.stdout.splitlines() if line.startswith("RESUMED")]
    assert len(resumed) == len(runs)  # every run restarted from a checkpoint, the reference did not
    # goodput across the two runs of each: nothing redone, since the preempted run saved the step it reached
    reports = [json.loads(line.split(" ", 1)[1]) for line in res.stdout.splitlines() if line.startswith("GOODPUT")]
    assert len(reports) == len(runs) + 1
    for run, rep in zip(runs, reports, strict=False):
        assert rep["steps_redone"] == 0 and rep["restart_lost_s"] == 0.0, (run["moment"], rep)
        assert rep["runs"] == 2
        assert 0.0 < rep["goodput"] < 1.0 and rep["productive_s"] > 0


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_sigterm_at_five_moments_resumes_bit_identical(tmp_path):
    _check_and_resume(tmp_path, MOMENTS)


@pytest.mark.slow
def test_sigterm_at_twenty_random_moments_resumes_bit_identical(tmp_path):
    rng = random.Random(29)
    kinds = ["step", "data", "save", "eval"]
    moments = [("compile", None, rng.uniform(0, 0.3))]
    while len(moments) < 20:
        kind = rng.choice(kinds)
        last = {"step": TOTAL - 1, "data": TOTAL - 1, "save": TOTAL, "eval": TOTAL}[kind]
        valid = [s for s in range(last + 1) if kind not in ("save", "eval") or (
            s > 0 and (s % 3 == 0 if kind == "eval" else s % 2 == 0 or s % 5 == 0))]
        moments.append((kind, str(rng.choice(valid)), rng.uniform(0, 0.05)))
    for i in range(0, 20, 5):
        _check_and_resume(tmp_path / f"batch{i}", moments[i:i + 5])


# --- the same loop as two jax.distributed processes: SIGTERM to one of them ---


def _two_process_run(directories: list[str], on_line=None, timeout: float = 600) -> list[dict]:
    """Both processes of the worker (its directories in turn); ``on_line(i, line, procs)``
    sees every stdout line of process ``i``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, WORKER, str(TOTAL)]
    for d in directories:
        args += [d, d + ".npz"]
    procs, outs = [], []
    for i in range(2):
        env = dict(_env(), CAIRN_TEST_COORDINATOR=f"127.0.0.1:{port}", CAIRN_TEST_PROCESS_ID=str(i))
        err = tempfile.TemporaryFile("w+")
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=env))
        outs.append({"lines": [], "errfile": err})

    def read(i: int) -> None:
        for line in procs[i].stdout:
            outs[i]["lines"].append(line.strip())
            if on_line is not None:
                on_line(i, line.strip(), procs)

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in readers:
        t.start()
    for i, p in enumerate(procs):
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        readers[i].join()
        outs[i]["errfile"].seek(0)
        outs[i].update(rc=p.returncode, err=outs[i]["errfile"].read())
    return outs


def _signal_one(moment: tuple, target: int):
    """An ``on_line`` that sends SIGTERM to process ``target`` once it prints the moment's event."""
    kind, arg, delay = moment
    sent = []

    def on_line(i, line, procs):
        parts = line.split()
        if not sent and i == target and parts[:2] == ["EVENT", kind] and (arg is None or parts[2:] == [arg]):
            sent.append(1)
            time.sleep(delay)
            try:
                procs[i].send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    return on_line


def _check_two_processes(tmp_path, moments: list[tuple], seed: int) -> None:
    rng = random.Random(seed)
    runs = []
    for i, moment in enumerate(moments):  # one pair at a time: two processes per run already
        d = str(tmp_path / f"run{i}")
        target = rng.randrange(2)
        outs = _two_process_run([d], _signal_one(moment, target))
        runs.append({"dir": d, "moment": moment, "target": target, "outs": outs})
    for run in runs:
        rcs = [o["rc"] for o in run["outs"]]
        what = f"moment {run['moment']} to process {run['target']}: rc {rcs}, " + " | ".join(
            f"{o['lines'][-3:]} {o['err'][-1500:]}" for o in run["outs"])
        steps = [sum(1 for x in o["lines"] if x.startswith("EVENT step")) for o in run["outs"]]
        if rcs == [0, 0]:  # the signal came after the last step (the final evaluation): nothing to redo
            assert all("DONE" in o["lines"] for o in run["outs"]) and steps == [TOTAL, TOTAL], what
        else:
            assert rcs == [cc.PREEMPTION_EXIT_CODE] * 2, what  # both stop, though only one was signalled
        assert steps[0] == steps[1], what  # they agreed on the step
        mngr = cc.CheckpointManager(os.path.join(run["dir"], "persistent"))
        assert mngr.latest_step() == steps[0], what  # and saved it: no step lost
        mngr.close()
    preempted = [r["moment"] for r in runs if [o["rc"] for o in r["outs"]] == [cc.PREEMPTION_EXIT_CODE] * 2]
    assert len(preempted) >= len(runs) // 2, [(r["moment"], [o["rc"] for o in r["outs"]]) for r in runs]
    ref = str(tmp_path / "reference")
    outs = _two_process_run([r["dir"] for r in runs] + [ref], timeout=1200)
    assert [o["rc"] for o in outs] == [0, 0], [o["err"][-3000:] for o in outs]
    for pid in range(2):
        assert sum(1 for x in outs[pid]["lines"] if x.startswith("RESUMED")) == len(runs)
        want = np.load(f"{ref}.npz.{pid}.npz")
        for run in runs:
            got = np.load(f"{run['dir']}.npz.{pid}.npz")
            assert set(got) == set(want)
            for k in want:
                assert got[k].tobytes() == want[k].tobytes(), (run["moment"], pid, k)
    want0, want1 = np.load(f"{ref}.npz.0.npz"), np.load(f"{ref}.npz.1.npz")
    assert all(want0[k].tobytes() == want1[k].tobytes() for k in want0 if k != "data_state")


def _random_moments(rng: random.Random, n: int) -> list[tuple]:
    kinds = ["step", "data", "save", "eval"]
    moments = [("compile", None, rng.uniform(0, 0.3))]
    while len(moments) < n:
        kind = rng.choice(kinds)
        last = {"step": TOTAL - 1, "data": TOTAL - 1, "save": TOTAL, "eval": TOTAL}[kind]
        valid = [s for s in range(last + 1) if kind not in ("save", "eval") or (
            s > 0 and (s % 3 == 0 if kind == "eval" else s % 2 == 0 or s % 5 == 0))]
        moments.append((kind, str(rng.choice(valid)), rng.uniform(0, 0.05)))
    return moments


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_sigterm_to_one_at_twenty_random_moments(tmp_path):
    """The loop as two jax.distributed processes, SIGTERM to one of them at 20 random moments:
    both save the same step and exit 75, and both finish bit-identical to an uninterrupted
    two-process run."""
    _check_two_processes(tmp_path, _random_moments(random.Random(2029), 20), seed=7)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_sigterm_to_one_inside_a_step(tmp_path):
    _check_two_processes(tmp_path, [("step", "5", 0.0)], seed=1)
