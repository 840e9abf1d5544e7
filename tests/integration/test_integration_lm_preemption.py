"""The main job (examples/lm) under preemption: SIGTERM at a step, during an async save,
during the evaluation or the start-up makes it save the step it reached, exit with
``PREEMPTION_EXIT_CODE`` (75) and leave ``PREEMPTED.json``; the next start into the same
run directory resumes without ``--resume`` and finishes bit-identical to an uninterrupted
run (parameters, optimizer state, data position, loss curve), no committed step lost, and
its report covers both runs (curve, goodput over both, the preemption)."""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LM = ROOT / "examples" / "lm"
sys.path.insert(0, str(LM))

import lm_cli  # noqa: E402
import lm_config  # noqa: E402

jax = pytest.importorskip("jax")

from cairn import checkpoint as ckpt  # noqa: E402

TINY = [
    "model.d_model=32", "model.num_layers=1", "model.num_heads=4", "model.num_kv_heads=2",
    "model.mlp_dim=64", "data.seq_len=32", "data.batch_size=8", "data.num_train=600",
    "data.num_eval=16", "data.max_digits=2", "data.num_shards=2", "optim.warmup_steps=2",
    "train.steps=8", "train.log_every=1", "checkpoint.every=3", "checkpoint.max_to_keep=20",
    "train.progress=false", "quant.enabled=false", "serve.enabled=false", "posttrain.enabled=false", "data.num_workers=0",
    # no kernel timing at start-up: the same implementation in every run, and quicker
    "kernels.attention=xla", "kernels.loss=xla",
]


def _cfg(run_dir, *extra):
    return lm_config.load_config(LM / "config.toml", TINY + [f'run.dir="{run_dir}"', *extra])


def _committed(run_dir) -> list[int]:
    d = pathlib.Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / "COMMIT").exists()) if d.exists() else []


def _final_state(run_dir, step):
    mgr = ckpt.CheckpointManager(pathlib.Path(run_dir) / "checkpoints")
    try:
        return mgr.restore(step)
    finally:
        mgr.close()


def _assert_same_run(got_dir, want_dir, steps=8):
    """Bit for bit: the final checkpoint (parameters, optimizer, data position) and the report's curve."""
    from cairn.core_array import flatten_with_paths

    a, b = _final_state(got_dir, steps), _final_state(want_dir, steps)
    for item in ("model", "optimizer"):
        fa, fb = flatten_with_paths(a[item]), flatten_with_paths(b[item])
        assert fa.keys() == fb.keys()
        for k in fa:
            x, y = np.asarray(fa[k]), np.asarray(fb[k])
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f"{got_dir}: {item} {k} differs"
    assert a["data"] == b["data"], "data iterator state"
    got = json.loads((pathlib.Path(got_dir) / "metrics.json").read_text())
    want = json.loads((pathlib.Path(want_dir) / "metrics.json").read_text())
    assert got["curve"] == want["curve"] and [s for s, _ in got["curve"]] == list(range(1, steps + 1))
    assert got["data_digests"] == want["data_digests"]
    assert got["final_loss"] == want["final_loss"] and got["heldout_exact_match"] == want["heldout_exact_match"]
    return got


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of the tiny config (shared by the tests of this module)."""
    import lm_train

    run_dir = tmp_path_factory.mktemp("reference")
    lm_train.train(_cfg(run_dir), quiet=True)
    return run_dir


def _interrupt(monkeypatch, moment: str, at: int) -> None:
    """Send this process SIGTERM at ``moment``: inside step ``at`` (after its batch is read),
    right after the async save of step ``at`` started, at the start of the held-out
    evaluation, or during start-up (before the model is built)."""
    import lm_model
    import lm_train

    def kill():
        os.kill(os.getpid(), signal.SIGTERM)

    if moment == "step":
        digest, calls = lm_train._digest, []

        def digest_then_kill(batch):
            calls.append(1)
            if len(calls) == at:
                kill()
            return digest(batch)

        monkeypatch.setattr(lm_train, "_digest", digest_then_kill)
    elif moment == "save":
        save = ckpt.CheckpointManager.save

        def save_then_kill(self, step, *a, **k):
            out = save(self, step, *a, **k)
            if step == at:
                kill()  # the commit is still being written in the background
            return out

        monkeypatch.setattr(ckpt.CheckpointManager, "save", save_then_kill)
    elif moment == "eval":
        evaluate = lm_train.evaluate
        monkeypatch.setattr(lm_train, "evaluate", lambda *a: (kill(), evaluate(*a))[1])
    else:  # start-up
        build = lm_model.build
        monkeypatch.setattr(lm_model, "build", lambda *a: (kill(), build(*a))[1])


def _preempt_and_resume(tmp_path, monkeypatch, moment, at):
    import lm_train

    run_dir = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as m:
        _interrupt(m, moment, at)
        with pytest.raises(SystemExit) as exc:
            lm_train.train(_cfg(run_dir), quiet=True)
    assert exc.value.code == ckpt.PREEMPTION_EXIT_CODE == 75
    assert signal.getsignal(signal.SIGTERM) == before, "the manager put the previous handler back"
    marker = json.loads((run_dir / lm_cli.PREEMPTED_FILE).read_text())
    # no step lost: the step reached is committed, with every checkpoint due before it
    reached = {"step": at, "save": at, "eval": 8, "startup": 0}[moment]
    assert marker["step"] == reached and _committed(run_dir)[-1] == reached
    assert [s for s in _committed(run_dir) if s % 3 == 0 and s > 0] == list(range(3, reached + 1, 3))
    # the next start needs no flag: the directory says it was preempted
    assert lm_cli.run_dir_refusal(run_dir, resume=False, overwrite=False) is None
    report = lm_train.train(_cfg(run_dir), quiet=True)
    assert report["resumed_from"] == reached and report["steps"] == 8
    assert not (run_dir / lm_cli.PREEMPTED_FILE).exists(), "a finished run is not resumed by itself again"
    assert lm_cli.run_dir_refusal(run_dir, resume=False, overwrite=False) is not None
    return run_dir, reached


@pytest.mark.slow  # 29 s with its fixture: CI's 10-minute budget (tests_slow runs it and the 20 random moments)
def test_sigterm_mid_step_saves_exits_75_and_the_next_start_resumes_bit_identical(tmp_path, monkeypatch, reference):
    run_dir, _ = _preempt_and_resume(tmp_path, monkeypatch, "step", 5)
    got = _assert_same_run(run_dir, reference)
    assert got["preemptions"] == [{"step": 5, "resumed_from": 5}]
    g = got["goodput"]
    # goodput over both runs: nothing redone (the step reached was saved), the gap between them counted
    assert g["runs"] == 2 and g["steps_redone"] == 0 and g["restart_lost_s"] == 0.0
    assert 0.0 < g["goodput"] < 1.0 and g["productive_s"] > 0 and g["downtime_s"] >= 0
    assert g["total_s"] == pytest.approx(sum(v for k, v in g.items() if k.endswith("_s") and k != "total_s"))
    assert json.loads((reference / "metrics.json").read_text())["goodput"]["runs"] == 1


@pytest.mark.slow  # a few seconds each on a 2-core machine
@pytest.mark.parametrize(("moment", "at"), [("save", 6), ("eval", 8), ("startup", 0)])
def test_sigterm_during_a_save_the_evaluation_or_start_up(tmp_path, monkeypatch, reference, moment, at):
    run_dir, _ = _preempt_and_resume(tmp_path, monkeypatch, moment, at)
    _assert_same_run(run_dir, reference)


def test_a_preempted_run_is_resumed_only_from_its_own_committed_step(tmp_path):
    """PREEMPTED.json counts only with a committed step at least as new; --overwrite forgets it."""
    ckpt_dir = tmp_path / "checkpoints"
    (ckpt_dir / "6").mkdir(parents=True)
    (tmp_path / lm_cli.PREEMPTED_FILE).write_text(json.dumps({"step": 6}))
    assert lm_cli.preempted_step(tmp_path) is None  # step 6 not committed
    assert "already holds checkpoints" in lm_cli.run_dir_refusal(tmp_path, resume=False, overwrite=False)
    (ckpt_dir / "6" / "COMMIT").write_text("{}")
    assert lm_cli.preempted_step(tmp_path) == 6
    assert lm_cli.run_dir_refusal(tmp_path, resume=False, overwrite=False) is None
    (tmp_path / lm_cli.PREEMPTED_FILE).write_text("not json")
    assert lm_cli.preempted_step(tmp_path) is None


@pytest.mark.parametrize(("argv", "steps", "want"), [
    ([], 100, None),
    (["--profile"], 100, (10, 5)),
    (["--profile"], 8, (4, 5)),  # moved earlier to fit a short run
    (["--profile", "--profile-start", "3", "--profile-steps", "2"], 100, (3, 2)),
])
def test_profile_window(argv, steps, want):
    assert lm_cli.profile_window(lm_cli.make_parser().parse_args(argv), steps) == want


@pytest.mark.parametrize("argv", [["--profile", "--profile-start", "7"], ["--profile", "--profile-steps", "0"],
                                  ["--profile", "--profile-start", "0"]])
def test_a_profile_window_outside_the_run_is_refused_naming_the_flag(argv):
    with pytest.raises(ValueError, match="--profile"):
        lm_cli.profile_window(lm_cli.make_parser().parse_args(argv), 8)


# --- the command line, as a supervisor runs it: SIGTERM at random moments, then the same command ---

CLI_STEPS = 12
_CLI = TINY + [f"train.steps={CLI_STEPS}", "train.progress=true"]
_RESUME = r"""
import json, sys
sys.path.insert(0, {lm!r})
import train
for argv in json.loads(sys.argv[1]):
    rc = train.main(argv)
    print("RC", rc, flush=True)
"""


def _random_moments(rng: random.Random, n: int) -> list[tuple[str, str, float]]:
    """(kind, the output line that starts it, delay in seconds): start-up and compilation
    (after the kernels line the handler is installed), inside a step, during an async save
    (checkpoint.every=3), during the held-out evaluation."""
    kinds = ["startup", "step", "save", "eval"]
    out = []
    for i in range(n):
        kind = kinds[i] if i < len(kinds) else rng.choice(kinds)
        if kind == "startup":
            out.append((kind, "kernels:", rng.uniform(0.0, 1.0)))
        elif kind == "step":
            out.append((kind, f"step {rng.randrange(1, CLI_STEPS)}/", rng.uniform(0.0, 0.05)))
        elif kind == "save":
            out.append((kind, f"step {rng.choice(range(3, CLI_STEPS + 1, 3))}/", rng.uniform(0.0, 0.02)))
        else:
            out.append((kind, "evaluating:", rng.uniform(0.0, 0.05)))
    return out


def _signalled_run(run_dir: pathlib.Path, moment: tuple[str, str, float]) -> dict:
    """The CLI in a fresh interpreter, SIGTERM sent ``delay`` s after it prints ``anchor``."""
    argv = [sys.executable, str(LM / "train.py"), "--set", *_CLI, f'run.dir="{run_dir}"']
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    _, anchor, delay = moment

    def read() -> None:
        sent = False
        for line in proc.stdout:
            lines.append(line.rstrip())
            if not sent and line.startswith(anchor):
                time.sleep(delay)
                sent = True
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass

    reader = threading.Thread(target=read)
    reader.start()
    return {"proc": proc, "reader": reader, "lines": lines, "dir": run_dir, "moment": moment}


def _check_cli_moments(tmp_path, moments) -> None:
    runs = []
    for i in range(0, len(moments), 5):  # five at a time
        batch = [_signalled_run(tmp_path / f"run{i + j}", m) for j, m in enumerate(moments[i:i + 5])]
        for r in batch:
            r["proc"].wait(timeout=900)
            r["reader"].join()
        runs += batch
    for r in runs:
        what = f"moment {r['moment']}: rc {r['proc'].returncode}, output {r['lines'][-6:]}"
        assert r["proc"].returncode == ckpt.PREEMPTION_EXIT_CODE, what
        step = json.loads((r["dir"] / lm_cli.PREEMPTED_FILE).read_text())["step"]
        printed = [int(x.split()[1].split("/")[0]) for x in r["lines"] if x.startswith("step ")]
        # no step lost: the step reached (at least the last one printed) is the newest committed,
        # and every checkpoint due before it is there
        assert _committed(r["dir"])[-1] == step >= max(printed, default=0), what
        assert [s for s in _committed(r["dir"]) if s % 3 == 0 and s > 0] == list(range(3, step + 1, 3)), what
        assert any(x.startswith("preempted: step") for x in r["lines"]), what
    # the same command again for each (no --resume), and an uninterrupted run, in one interpreter
    ref = tmp_path / "reference"
    argvs = [["--quiet", "--set", *_CLI, f'run.dir="{d}"'] for d in [r["dir"] for r in runs] + [ref]]
    out = subprocess.run([sys.executable, "-c", _RESUME.format(lm=str(LM)), json.dumps(argvs)],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0 and out.stdout.count("RC 0") == len(argvs), (out.stdout[-2000:], out.stderr[-3000:])
    for r in runs:
        got = _assert_same_run(r["dir"], ref, CLI_STEPS)
        assert len(got["preemptions"]) == 1 and got["goodput"]["runs"] == 2, r["moment"]
        assert got["goodput"]["steps_redone"] == 0, r["moment"]


@pytest.mark.slow  # several fresh interpreters
def test_cli_sigterm_at_each_kind_of_moment_exits_75_and_the_same_command_resumes(tmp_path):
    _check_cli_moments(tmp_path, _random_moments(random.Random(31), 4))


@pytest.mark.slow
def test_cli_sigterm_at_twenty_random_moments(tmp_path):
    _check_cli_moments(tmp_path, _random_moments(random.Random(29), 20))


# --- the report's new parts (issue 31): ETA, machine load, goodput line, latency plot, try it ---


def test_progress_line_shows_an_eta_from_the_pace_after_the_first_update():
    import io

    import lm_report

    assert [lm_report.format_eta(s) for s in (0, 42.4, 187, 3725, float("nan"))] == ["0s", "42s", "3m07s", "1h02m", "?"]
    out = io.StringIO()
    p = lm_report.Progress(100, 0, 10, stream=out)
    p.t0 -= 30.0  # the first 10 steps took 30 s (compilation)
    assert p.eta_s(10, p.t0 + 30.0) == pytest.approx(270.0)  # before any update: the pace since the start
    p.update(10, 1.0, 100.0, 1e-3)
    now = p._mark[0]
    assert p.eta_s(20, now + 5.0) == pytest.approx(40.0)  # 10 steps in 5 s after the first update, 80 left
    assert "ETA " in out.getvalue() and out.getvalue().startswith("step 10/100")


def test_report_lines_give_load_goodput_and_preemptions():
    import lm_report

    g = {"goodput": 0.5, "productive_s": 5.0, "compile_s": 1.0, "data_s": 0.0, "checkpoint_s": 1.5,
         "restart_lost_s": 0.0, "startup_s": 2.0, "downtime_s": 0.5, "other_s": 0.0, "total_s": 10.0,
         "steps_redone": 0, "runs": 2}
    line = lm_report.format_goodput(g)
    assert line.startswith("50.0% (productive 5.0 s of 10.0 s; ") and "checkpoint 1.5" in line and "data" not in line
    assert line.endswith("2 run(s), 0 step(s) redone)")
    r = {"loadavg": [3.25, 2.0, 1.5], "cpu_count": 2}
    assert lm_report.format_load(r) == "load 3.2 / 2.0 / 1.5 (1, 5, 15 min) on 2 CPUs"
    assert lm_report.format_load({}) == ""


def test_latency_plot_and_the_try_it_text(tmp_path):
    import shlex

    import lm_report

    lv = {"concurrency": 1, "tokens_per_s": 100.0, "latencies_ms": [1.0, 2.0, 3.0], "ttfts_ms": [0.5, 0.6, 0.7],
          "loadavg": [1.0, 1.0, 1.0]}
    serving = {"repository": str(tmp_path / "my runs" / "serving"), "models": {"w8": {"levels": [lv, {**lv, "concurrency": 4}]}},
               "try": {"model": "lm_w8", "prompt": "12+34=", "expected": "46", "answer": "46", "max_tokens": 5}}
    assert lm_report.write_latency_plot(tmp_path / "lat.png", serving) and (tmp_path / "lat.png").stat().st_size > 1000
    assert not lm_report.write_latency_plot(tmp_path / "none.png", {"models": {}}) and not (tmp_path / "none.png").exists()
    text = lm_report.format_try_it(serving)
    lines = [shlex.split(x) for x in text.splitlines() if x.startswith("  ")]
    assert lines[0] == ["cairn-serve", "--model-repository", serving["repository"], "--port", "8000"]
    curl = lines[1]
    body = json.loads(curl[curl.index("-d") + 1])
    assert curl[2] == "http://127.0.0.1:8000/v1/completions"
    assert body == {"model": "lm_w8", "prompt": "12+34=", "max_tokens": 5, "temperature": 0}
    assert lines[2][:2] == ["python", "-c"] and "completions.create(model='lm_w8', prompt='12+34='" in lines[2][2]
    compile(lines[2][2], "<printed>", "exec")  # the printed snippet is valid Python


@pytest.mark.slow  # two fresh interpreters with data workers
def test_sigterm_to_the_whole_process_group_with_data_workers_exits_75_and_resumes(tmp_path):
    """A scheduler (Slurm, a container runtime) signals every process of the job, data workers
    included: the main process's handler saves and exits 75, and the same command resumes and
    finishes (that the workers themselves ignore SIGTERM is tested in tests/data)."""
    argv = [sys.executable, str(LM / "train.py"), "--set", *_CLI, "data.num_workers=2", f'run.dir="{tmp_path}"']
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip())
        if line.startswith("step 5/"):
            os.killpg(proc.pid, signal.SIGTERM)
            break
    lines += proc.stdout.read().splitlines()
    assert proc.wait(timeout=600) == ckpt.PREEMPTION_EXIT_CODE, lines[-10:]
    assert any(x.startswith("preempted: step") for x in lines), lines[-10:]
    step = json.loads((tmp_path / lm_cli.PREEMPTED_FILE).read_text())["step"]
    assert step >= 5
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert not (tmp_path / lm_cli.PREEMPTED_FILE).exists()
    history = json.loads((tmp_path / "metrics.json").read_text())
    assert len(history["preemptions"]) == 1 and history["goodput"]["runs"] == 2
