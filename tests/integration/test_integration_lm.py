"""The reference recipe (examples/lm) composed end to end: resume, sharding, bad configs."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LM = ROOT / "examples" / "lm"
sys.path.insert(0, str(LM))

import lm_config  # noqa: E402

# A tiny configuration: the same code path as the default run, seconds instead of minutes.
TINY = [
    "model.d_model=32", "model.num_layers=1", "model.num_heads=4", "model.num_kv_heads=2",
    "model.mlp_dim=64", "data.seq_len=32", "data.batch_size=8", "data.num_train=600",
    "data.num_eval=16", "data.max_digits=2", "data.num_shards=2", "optim.warmup_steps=2",
    "train.steps=8", "train.log_every=4", "checkpoint.every=3", "checkpoint.max_to_keep=5",
    "train.progress=false",
    # the production steps after training (quantize, export, serve) have their own tests in
    # test_integration_lm_serving.py; here they would only cost time
    "quant.enabled=false", "serve.enabled=false", "posttrain.enabled=false",
]


def _cfg(tmp_path, *extra):
    return lm_config.load_config(LM / "config.toml", TINY + [f'run.dir="{tmp_path}"', *extra])


def _restore_step(run_dir, step):
    from cairn import checkpoint as ckpt

    mgr = ckpt.CheckpointManager(pathlib.Path(run_dir) / "checkpoints")
    try:
        return mgr.restore(step)
    finally:
        mgr.close()


def _assert_trees_equal(a, b, what):
    from cairn.core_array import flatten_with_paths

    fa, fb = flatten_with_paths(a), flatten_with_paths(b)
    assert fa.keys() == fb.keys(), what
    for k in fa:
        x, y = np.asarray(fa[k]), np.asarray(fb[k])
        assert x.dtype == y.dtype and x.shape == y.shape, (what, k)
        assert np.array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8)), f"{what}: {k} differs"


# slow (30 s): the default suite's main-job resume check is the SIGTERM one in
# test_integration_lm_preemption.py, and resume with data workers is tested in tests/data
@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 0])
def test_interrupt_and_resume_is_bit_identical(tmp_path, workers):
    import lm_train

    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    full = lm_train.train(_cfg(full_dir, f"data.num_workers={workers}"), quiet=True)
    # "killed" after step 5: the newest checkpoint is step 3, so steps 4 and 5 are redone
    first = lm_train.train(_cfg(cut_dir, f"data.num_workers={workers}"), stop_after=5, quiet=True)
    assert first["stopped_early"] and first["steps"] == 5
    second = lm_train.train(_cfg(cut_dir, f"data.num_workers={workers}"), resume=True, quiet=True)
    assert second["resumed_from"] == 3 and second["steps"] == 8

    # the same batches, step for step, including the redone ones
    assert {s: d for s, d in first["data_digests"].items() if s <= 3} == {s: full["data_digests"][s] for s in (1, 2, 3)}
    for s, d in second["data_digests"].items():
        assert d == full["data_digests"][s], f"batch of step {s} differs after resume"
    for s in (4, 5):
        assert first["data_digests"][s] == second["data_digests"][s]

    a, b = _restore_step(full_dir, 8), _restore_step(cut_dir, 8)
    _assert_trees_equal(a["model"], b["model"], "parameters")
    _assert_trees_equal(a["optimizer"], b["optimizer"], "optimizer state")
    assert a["data"] == b["data"], "data iterator state"
    assert full["heldout_exact_match"] == second["heldout_exact_match"]

    # the resumed run's report covers the whole run (issue 25, item 9: it used to hold only the
    # steps after the resume): the loss of every step 1..8, bit for bit the uninterrupted run's
    # (the first run's steps 1..3 come from the history saved with checkpoint 3)
    assert [s for s, _ in second["curve"]] == list(range(1, 9))
    assert second["curve"] == full["curve"]
    assert second["data_digests"] == full["data_digests"]
    assert second["final_loss"] == full["final_loss"] == full["curve"][-1][1]
    assert second["checkpoints_saved"] == full["checkpoints_saved"] == 3  # steps 3, 6, 8
    saved_full = json.loads((full_dir / "metrics.json").read_text())
    saved_cut = json.loads((cut_dir / "metrics.json").read_text())
    assert saved_cut["curve"] == saved_full["curve"] and len(saved_cut["curve"]) == 8
    # same points, same title: the plotted curves are the same picture
    assert (cut_dir / "loss_curve.png").read_bytes() == (full_dir / "loss_curve.png").read_bytes()


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_report_files_and_learning(tmp_path):
    import lm_train

    r = lm_train.train(_cfg(tmp_path, "train.steps=30", "data.num_workers=0"), quiet=True)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    for key in ("final_loss", "heldout_exact_match", "tokens_per_s", "mfu", "checkpoint_blocked_s", "data_blocked_s"):
        assert key in metrics, key
    losses = [v for _, v in r["curve"]]
    assert len(losses) == 30 and np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < np.mean(losses[:5]), "the loss did not go down"
    assert 0.0 < r["mfu"] < 1.0 and r["peak_flops"] > 0


_SHARDED = r"""
import json, os, sys
sys.path.insert(0, {lm!r})
import jax, lm_config, lm_train
cfg = lm_config.load_config({config!r}, {overrides!r})
r = lm_train.train(cfg, quiet=True)
print("RESULT " + json.dumps({{"curve": r["curve"], "specs": r["param_partition_specs"], "mesh": r["mesh"],
                              "devices": jax.device_count()}}))
"""


def _run_sharded(tmp_path, devices, mesh_overrides):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    overrides = TINY + [f'run.dir="{tmp_path}"', "train.steps=6", "data.num_workers=0", *mesh_overrides]
    code = _SHARDED.format(lm=str(LM), config=str(LM / "config.toml"), overrides=overrides)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_eight_device_run_matches_one_device_and_is_sharded(tmp_path):
    one = _run_sharded(tmp_path / "one", 1, [])
    eight = _run_sharded(tmp_path / "eight", 8, ["mesh.data=4", "mesh.model=2"])
    assert eight["devices"] == 8 and eight["mesh"] == {"data": 4, "model": 2}
    l1 = np.array([v for _, v in one["curve"]])
    l8 = np.array([v for _, v in eight["curve"]])
    # float32, same data and initialisation; only the reduction order differs across devices
    np.testing.assert_allclose(l8, l1, rtol=2e-4, atol=2e-5)

    # the parameters are sharded exactly as the config's rules say
    from cairn.core_array import LogicalAxisRules

    cfg = lm_config.load_config(LM / "config.toml", TINY)
    rules = LogicalAxisRules([tuple(r) for r in cfg.mesh.rules])
    expected_axes = {
        "embed/embedding": ("vocab", "embed"),
        "layers/0/attn/q/kernel": ("embed", "heads", "head_dim"),
        "layers/0/attn/k/kernel": ("embed", "kv_heads", "head_dim"),
        "layers/0/attn/o/kernel": ("heads", "head_dim", "embed"),
        "layers/0/mlp/gate/kernel": ("embed", "mlp"),
        "layers/0/mlp/down/kernel": ("mlp", "embed"),
        "norm/scale": ("embed",),
    }
    def trimmed(spec: str) -> tuple:  # ('data', 'model', None) and ('data', 'model') shard alike
        parts = list(ast.literal_eval(spec))
        while parts and parts[-1] is None:
            parts.pop()
        return tuple(parts)

    for path, axes in expected_axes.items():
        want = str(rules.mesh_axes(axes, ("data", "model")))
        assert trimmed(eight["specs"][path]) == trimmed(want), (path, eight["specs"][path], want)
    assert eight["specs"]["layers/0/mlp/gate/kernel"] == "('data', 'model')"


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.widht=3"], "model.widht"),
        (["bogus.x=1"], "bogus"),
        (["data.batch_size=0"], "data.batch_size"),
        (["model.num_heads=3"], "model.num_heads"),
        (["data.source=parquet", 'data.paths=["/nonexistent/*.parquet"]'], "data.paths"),
        (["train.steps=many"], "train.steps"),
    ],
)
def test_bad_config_is_rejected_naming_the_key(tmp_path, overrides, key):
    with pytest.raises(lm_config.ConfigError, match=key.replace(".", r"\.")):
        _cfg(tmp_path, *overrides)


@pytest.mark.parametrize(
    "overrides, devices, key",
    [
        (["mesh.data=3", "mesh.model=1"], 8, "mesh.data"),
        (["mesh.model=3"], 8, "mesh.model"),
        (["mesh.data=8", "data.batch_size=12"], 8, "data.batch_size"),
    ],
)
def test_impossible_mesh_is_rejected_naming_the_key(tmp_path, overrides, devices, key):
    cfg = _cfg(tmp_path, *overrides)
    with pytest.raises(lm_config.ConfigError, match=key.replace(".", r"\.")):
        lm_config.mesh_shape(cfg, devices)


def test_cli_stops_before_training_on_a_bad_config(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, str(LM / "train.py"), "--set", f'run.dir="{run_dir}"', "optim.lr=1"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "optim.lr" in out.stderr and "learning_rate" in out.stderr
    assert not run_dir.exists(), "nothing may be written before the config is valid"


def _cli(run_dir, steps, *extra):
    """The recipe's command line, as a user runs it (a fresh interpreter)."""
    sets = [*TINY, f'run.dir="{run_dir}"', f"train.steps={steps}", *extra]
    return [sys.executable, str(LM / "train.py"), "--quiet", "--set", *sets]


def _committed_steps(ckpt_dir) -> list[int]:
    """Committed steps, read from the directory alone (opening a manager would clean up the
    running process's temporary step)."""
    if not ckpt_dir.exists():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit() and (p / "COMMIT").exists())


@pytest.mark.multiprocess
@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_sigkill_mid_run_then_resume_matches_the_uninterrupted_run(tmp_path):
    """A real kill, not a clean stop: SIGKILL the training process (data workers included)
    once a checkpoint is committed and the run is past it, then `--resume`. The final
    parameters, optimizer state and data position equal those of a run never interrupted."""
    import signal
    import time

    steps = 60
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    extra = ["checkpoint.every=4", "checkpoint.max_to_keep=3", "data.num_workers=2"]
    subprocess.run(_cli(full_dir, steps, *extra), check=True, timeout=600, capture_output=True)

    proc = subprocess.Popen(_cli(cut_dir, steps, *extra), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    killed_after = None
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            done = _committed_steps(cut_dir / "checkpoints")
            if done and done[-1] >= 8:
                os.killpg(proc.pid, signal.SIGKILL)
                killed_after = done[-1]
                break
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert killed_after is not None, "the run ended before it could be killed: " + proc.stderr.read().decode()[-2000:]
    assert killed_after < steps, "killed too late to interrupt anything"
    assert proc.returncode == -signal.SIGKILL

    out = subprocess.run(_cli(cut_dir, steps, *extra) + ["--resume"], timeout=600, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = json.loads((cut_dir / "metrics.json").read_text())
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] >= killed_after
    a, b = _restore_step(full_dir, steps), _restore_step(cut_dir, steps)
    _assert_trees_equal(a["model"], b["model"], "parameters")
    _assert_trees_equal(a["optimizer"], b["optimizer"], "optimizer state")
    assert a["data"] == b["data"], "data iterator state"


_TWO_PROCESS = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.argv = [sys.argv[0]] + sys.argv[1:]
sys.path.insert(0, {lm!r})
import train
sys.exit(train.main())
"""


@pytest.mark.multiprocess
@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_two_processes_through_jax_distributed(tmp_path):
    """The same config launched as two processes (two CPU devices each) joined by
    jax.distributed: each process reads its own shard of the records and feeds its rows of
    the global batch; the run learns, checkpoints once for both processes, and resumes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"

    def launch(steps, *extra):
        procs = []
        for pid in range(2):
            args = ["--quiet", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                    "--process-id", str(pid), "--set", *TINY, f'run.dir="{run_dir}"',
                    f"train.steps={steps}", "data.num_workers=0"]
            code = _TWO_PROCESS.format(lm=str(LM))
            procs.append(subprocess.Popen([sys.executable, "-c", code, *args, *extra],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=300))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
        for p, (_, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
        return json.loads((run_dir / "metrics.json").read_text())

    first = launch(6)
    assert first["processes"] == 2 and first["devices"] == 4 and first["mesh"] == {"data": 4, "model": 1}
    losses = [v for _, v in first["curve"]]
    assert len(losses) == 6 and np.isfinite(losses).all()
    assert _committed_steps(run_dir / "checkpoints") == [3, 6]
    # one step directory for both processes; each wrote the data-iterator state of its own shard
    second = launch(9, "--resume")
    assert second["resumed_from"] == 6 and second["steps"] == 9
    assert _committed_steps(run_dir / "checkpoints")[-1] == 9


# A run directory that already holds checkpoints is never trained into unless asked: a second
# `nox -s demo` used to train for 86 s and then die with `FileExistsError: step 800 already
# exists`, losing the run (issue 12, item 11).
def _snapshot(ckpt_dir):
    return {p.relative_to(ckpt_dir): p.stat().st_mtime_ns for p in ckpt_dir.rglob("*")}


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_second_run_without_a_choice_stops_before_any_work_naming_the_directory(tmp_path):
    import lm_train

    first = lm_train.train(_cfg(tmp_path, "train.steps=3", "data.num_workers=0"), quiet=True)
    assert first["steps"] == 3
    ckpt_dir = tmp_path / "checkpoints"
    before = _snapshot(ckpt_dir)
    metrics_before = (tmp_path / "metrics.json").read_bytes()
    with pytest.raises(lm_train.RunDirError) as e:
        lm_train.train(_cfg(tmp_path, "train.steps=3", "data.num_workers=0"), quiet=True)
    msg = str(e.value)
    assert str(tmp_path) in msg and "--resume" in msg and "--overwrite" in msg and "run.dir" in msg
    assert _snapshot(ckpt_dir) == before, "the first run's checkpoints must be untouched"
    assert (tmp_path / "metrics.json").read_bytes() == metrics_before


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_resume_and_overwrite_are_the_two_ways_on(tmp_path):
    import lm_train

    lm_train.train(_cfg(tmp_path, "train.steps=3", "data.num_workers=0"), quiet=True)
    resumed = lm_train.train(_cfg(tmp_path, "train.steps=6", "data.num_workers=0"), quiet=True, resume=True)
    assert resumed["resumed_from"] == 3 and resumed["steps"] == 6
    assert 6 in _committed_steps(tmp_path / "checkpoints")
    fresh = lm_train.train(_cfg(tmp_path, "train.steps=3", "data.num_workers=0"), quiet=True, overwrite=True)
    assert fresh["resumed_from"] is None and fresh["steps"] == 3
    assert _committed_steps(tmp_path / "checkpoints") == [3], "overwrite must drop the old steps"
    with pytest.raises(lm_train.RunDirError, match="contradict"):
        lm_train.train(_cfg(tmp_path, "train.steps=3"), quiet=True, resume=True, overwrite=True)


def test_an_empty_or_missing_run_dir_needs_no_flag(tmp_path):
    import lm_train

    assert lm_train.existing_checkpoints(tmp_path / "nowhere") == []
    (tmp_path / "checkpoints").mkdir()
    lm_train.check_run_dir(tmp_path, resume=False, overwrite=False)  # empty: nothing to lose


def test_cli_second_run_exits_2_at_once_and_names_the_choices(tmp_path):
    # a run directory left by an earlier run: a committed step and its report
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "3").mkdir(parents=True)
    (run_dir / "checkpoints" / "3" / "COMMIT").write_text("{}")
    (run_dir / "metrics.json").write_text('{"steps": 3}')
    before = _snapshot(run_dir)
    second = subprocess.run(_cli(run_dir, 3, "data.num_workers=0"), capture_output=True, text=True, timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    assert str(run_dir) in second.stderr and "--resume" in second.stderr and "--overwrite" in second.stderr
    assert _snapshot(run_dir) == before, "nothing may be written or removed before the choice is made"


# --resume on a finished run used to evaluate again and write `final loss nan`, 0 tokens/s and
# an empty loss_curve.png over the real report (issue 25, item 9)
def _files(run_dir):
    """Every path under ``run_dir`` with its mtime and, for files, its bytes."""
    return {p.relative_to(run_dir): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(run_dir.rglob("*"))}


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_resume_of_a_finished_run_changes_nothing_and_says_so(tmp_path, capsys, monkeypatch):
    import lm_train
    import train

    monkeypatch.delenv("CAIRN_LM_COMMAND", raising=False)
    run_dir = tmp_path / "run"
    full = lm_train.train(_cfg(run_dir, "data.num_workers=0"), quiet=True)
    assert full["steps"] == 8 and np.isfinite(full["final_loss"]) and full["tokens_per_s"] > 0
    before = _files(run_dir)
    assert {pathlib.Path("metrics.json"), pathlib.Path("loss_curve.png"), pathlib.Path("kernels.json")} <= set(before)

    again = lm_train.train(_cfg(run_dir, "data.num_workers=0"), resume=True, quiet=True)
    assert _files(run_dir) == before, "resuming a finished run must not write anything"
    assert again["already_finished"] == {"step": 8, "train_steps": 8}
    assert again["final_loss"] == full["final_loss"] and again["tokens_per_s"] == full["tokens_per_s"]

    capsys.readouterr()
    rc = train.main(["--quiet", "--resume", "--set", *TINY, f'run.dir="{run_dir}"', "data.num_workers=0"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"run directory {run_dir} already finished" in out and "nothing was trained or rewritten" in out
    assert "`python examples/lm/train.py --overwrite`" in out
    assert f"final loss             {full['final_loss']:.4f}" in out  # the run's own report, shown again
    assert _files(run_dir) == before

    # killed after its last checkpoint but before the report was written: --resume trains
    # nothing and writes the report of the whole run from the checkpoint's history
    saved = json.loads((run_dir / "metrics.json").read_text())
    (run_dir / "metrics.json").unlink()
    (run_dir / "loss_curve.png").unlink()
    rebuilt = lm_train.train(_cfg(run_dir, "data.num_workers=0"), resume=True, quiet=True)
    assert "already_finished" not in rebuilt and rebuilt["resumed_from"] == 8
    rebuilt = json.loads((run_dir / "metrics.json").read_text())
    assert rebuilt["curve"] == saved["curve"] and len(rebuilt["curve"]) == 8
    for key in ("final_loss", "heldout_exact_match", "tokens_per_s", "checkpoints_saved", "data_digests"):
        assert rebuilt[key] == saved[key], key
    assert (run_dir / "loss_curve.png").read_bytes() == before[pathlib.Path("loss_curve.png")][1]


# A second `nox -s demo` used to reinstall for about 60 s before train.py said that the run
# directory was in use, and its advice read `--resume`, not `nox -s demo -- --resume`; and
# `--set train.steps=60` alone was refused because of the file's 80 warm-up steps (issue 25, item 10).
def _leftover_run(run_dir):
    (run_dir / "checkpoints" / "3").mkdir(parents=True)
    (run_dir / "checkpoints" / "3" / "COMMIT").write_text("{}")


def test_preflight_resolves_the_run_dir_as_train_py_does_and_advises_the_command_typed(tmp_path, monkeypatch):
    import lm_cli

    monkeypatch.delenv(lm_cli.COMMAND_ENV, raising=False)
    run_dir = tmp_path / "run"
    sets = ["--set", f'run.dir="{run_dir}"']
    assert lm_cli.preflight(sets, cmd="nox -s demo --") is None, "nothing there yet"
    _leftover_run(run_dir)
    before = _snapshot(run_dir)

    msg = lm_cli.preflight([*sets, "train.steps=60"], cmd="nox -s demo --")
    assert str(run_dir) in msg
    for advice in ("`nox -s demo -- --resume`", "`nox -s demo -- --overwrite`", "`nox -s demo -- --set run.dir="):
        assert advice in msg, advice
    direct = lm_cli.preflight(sets)
    assert "`python examples/lm/train.py --resume`" in direct and "nox" not in direct
    monkeypatch.setenv(lm_cli.COMMAND_ENV, "nox -s demo --")  # what the demo session gives train.py
    assert "`nox -s demo -- --overwrite`" in lm_cli.preflight(sets)
    monkeypatch.delenv(lm_cli.COMMAND_ENV)

    assert lm_cli.preflight([*sets, "--resume"]) is None
    assert lm_cli.preflight(["--overwrite", *sets]) is None
    assert "contradict" in lm_cli.preflight([*sets, "--resume", "--overwrite"])
    # the run directory of a --config file, and --set over it, as train.py reads them
    toml = tmp_path / "mine.toml"
    toml.write_text(f'[run]\ndir = "{run_dir}"\n')
    assert str(run_dir) in lm_cli.preflight(["--config", str(toml)])
    assert lm_cli.preflight(["--config", str(toml), "--set", f'run.dir="{tmp_path / "other"}"']) is None
    # a bad config stops here too; --help and arguments that do not parse are train.py's
    assert lm_cli.preflight([*sets, "optim.lr=1"]).startswith("config error: unknown config key 'optim.lr'")
    assert lm_cli.preflight([*sets, "--help"]) is None
    assert lm_cli.preflight([*sets, "--stop-after", "soon"]) is None
    assert _snapshot(run_dir) == before


def _load_noxfile(monkeypatch):
    """noxfile.py imported with a stand-in for nox (not installed in the test environment):
    its sessions are then plain functions of a session object."""
    import importlib.util
    import types

    stub = types.ModuleType("nox")
    stub.options = types.SimpleNamespace()
    stub.session = lambda *a, **k: (lambda f: f)
    stub.parametrize = lambda *a, **k: (lambda f: f)
    monkeypatch.setitem(sys.modules, "nox", stub)
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _session(posargs):
    """A stand-in nox session that records what it was asked to do, in order."""
    import types

    calls = []

    def error(msg):
        calls.append(("error", msg))
        raise RuntimeError(msg)

    return types.SimpleNamespace(posargs=posargs, calls=calls, error=error,
                                 install=lambda *args: calls.append(("install", args)),
                                 run=lambda *args, env=None: calls.append(("run", args, env)))


def test_second_demo_stops_before_installing_anything(tmp_path, monkeypatch):
    noxfile = _load_noxfile(monkeypatch)
    run_dir = tmp_path / "run"
    _leftover_run(run_dir)
    second = _session(["--set", f'run.dir="{run_dir}"'])
    with pytest.raises(RuntimeError):
        noxfile.demo(second)
    assert [c[0] for c in second.calls] == ["error"], "nothing may be installed before the check"
    assert str(run_dir) in second.calls[0][1] and "`nox -s demo -- --resume`" in second.calls[0][1]

    resumed = _session(["--resume", "--set", f'run.dir="{run_dir}"'])
    noxfile.demo(resumed)
    assert [c[0] for c in resumed.calls] == ["install", "install", "run"]
    _, args, env = resumed.calls[-1]
    assert args == ("python", "examples/lm/train.py", *resumed.posargs)
    assert env == {"CAIRN_LM_COMMAND": "nox -s demo --"}  # train.py's own advice then reads the same


_NO_JAX = r"""
import sys
sys.path.insert(0, {lm!r})
import train
rc = train.main({argv!r})
print("jax imported:", "jax" in sys.modules)
sys.exit(rc)
"""


def test_cli_refuses_a_used_run_dir_before_importing_jax(tmp_path):
    run_dir = tmp_path / "run"
    _leftover_run(run_dir)
    argv = ["--quiet", "--set", f'run.dir="{run_dir}"']
    env = {k: v for k, v in os.environ.items() if k != "CAIRN_LM_COMMAND"}
    out = subprocess.run([sys.executable, "-c", _NO_JAX.format(lm=str(LM), argv=argv)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "jax imported: False" in out.stdout
    assert str(run_dir) in out.stderr and "`python examples/lm/train.py --resume`" in out.stderr
    env["CAIRN_LM_COMMAND"] = "nox -s demo --"
    out = subprocess.run([sys.executable, "-c", _NO_JAX.format(lm=str(LM), argv=argv)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "`nox -s demo -- --resume`" in out.stderr


def test_a_shorter_run_than_the_files_warmup_works_and_says_so(capsys):
    import warnings

    import lm_train
    import train

    with pytest.warns(lm_config.ConfigWarning, match=r"optim\.warmup_steps.*80 .*train\.steps = 60.*using 6"):
        cfg = lm_config.load_config(LM / "config.toml", ["train.steps=60"])
    assert cfg.optim.warmup_steps == 6 and cfg.train.steps == 60
    _, schedule = lm_train.make_optimizer(cfg)
    # the published schedule: linear warm-up to the peak at step 6, cosine decay to end_lr_ratio * peak at 60
    peak, end = cfg.optim.learning_rate, cfg.optim.learning_rate * cfg.optim.end_lr_ratio
    for t, want in ((3, peak * 3 / 6), (6, peak), (33, end + (peak - end) * 0.5 * (1 + np.cos(np.pi * 27 / 54))),
                    (60, end)):
        assert float(schedule(t)) == pytest.approx(want, rel=1e-5), t
    # train.steps equal to the file's warm-up passed the old check and then failed in the optimizer
    with pytest.warns(lm_config.ConfigWarning):
        cfg80 = lm_config.load_config(LM / "config.toml", ["train.steps=80"])
    assert cfg80.optim.warmup_steps == 8
    lm_train.make_optimizer(cfg80)
    # a warm-up asked for explicitly is never changed: refused, naming the key and a value that fits
    with pytest.raises(lm_config.ConfigError, match=r"'optim\.warmup_steps': 100 .*train\.steps = 60.*optim\.warmup_steps=6"):
        lm_config.load_config(LM / "config.toml", ["train.steps=60", "optim.warmup_steps=100"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warm-up that fits is left alone, silently
        assert lm_config.load_config(LM / "config.toml", ["train.steps=200"]).optim.warmup_steps == 80
    # the command line prints the note
    assert train._load_config(train.parse_args(["--set", "train.steps=60"])).optim.warmup_steps == 6
    assert "note: config key 'optim.warmup_steps': 80 does not fit in train.steps = 60" in capsys.readouterr().err
