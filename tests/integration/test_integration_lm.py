"""The reference recipe (examples/lm) composed end to end: resume, sharding, bad configs."""

from __future__ import annotations

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


@pytest.mark.parametrize("workers", [2, pytest.param(0, marks=pytest.mark.slow)])
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
    assert [v for s, v in full["curve"] if s > 3] == [v for _, v in second["curve"]]
    assert full["heldout_exact_match"] == second["heldout_exact_match"]


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
        "blocks/0/attn/q/kernel": ("embed", "heads"),
        "blocks/0/attn/k/kernel": ("embed", "kv_heads"),
        "blocks/0/attn/o/kernel": ("heads", "embed"),
        "blocks/0/mlp/gate/kernel": ("embed", "mlp"),
        "blocks/0/mlp/down/kernel": ("mlp", "embed"),
    }
    for path, axes in expected_axes.items():
        want = str(rules.mesh_axes(axes, ("data", "model")))
        assert eight["specs"][path] == want, (path, eight["specs"][path], want)
    assert eight["specs"]["blocks/0/mlp/gate/kernel"] == "('data', 'model')"
    assert eight["specs"]["final_norm/scale"] == "()" or "None" in eight["specs"]["final_norm/scale"]


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
