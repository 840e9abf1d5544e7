"""The reference recipe (examples/lm) on cairn.kernels: attention and fused loss equal plain
XLA's, "auto" picks one by measurement and says so in the report, forced kernels train."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = pathlib.Path(__file__).resolve().parents[2]
LM = ROOT / "examples" / "lm"
sys.path.insert(0, str(LM))

import lm_config  # noqa: E402
import lm_model  # noqa: E402
import lm_task  # noqa: E402

import cairn.kernels as ck  # noqa: E402
from cairn import nn  # noqa: E402
from cairn.core_array import flatten_with_paths  # noqa: E402

# the recipe's code path at a size that runs in seconds (as tests/integration/test_integration_lm.py)
TINY = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.mlp_dim=64", "data.seq_len=32", "data.batch_size=8", "data.num_train=600",
    "data.num_eval=16", "data.max_digits=2", "data.num_shards=2", "optim.warmup_steps=2",
    "train.steps=6", "train.log_every=3", "checkpoint.every=3", "train.progress=false",
    "data.num_workers=0",
]


def _cfg(tmp_path, *extra):
    return lm_config.load_config(LM / "config.toml", TINY + [f'run.dir="{tmp_path}"', *extra])


def _packed_batch(b: int = 4, s: int = 32, seed: int = 0) -> dict:
    """Rows packed with several segments (positions restart) and a padded tail; 0/1 weights."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, s), np.int32)
    pos = np.zeros((b, s), np.int32)
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(3, s - 4), size=2, replace=False))
        end = s - int(rng.integers(0, 5))  # the padding tail (segment 0)
        bounds = [0, *cuts.tolist(), end]
        for i in range(3):
            seg[r, bounds[i]:bounds[i + 1]] = i + 1
            pos[r, bounds[i]:bounds[i + 1]] = np.arange(bounds[i + 1] - bounds[i])
    weights = ((seg > 0) & (rng.random((b, s)) < 0.6)).astype(np.float32)
    return {
        "inputs": jnp.asarray(rng.integers(0, lm_task.VOCAB_SIZE, (b, s)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, lm_task.VOCAB_SIZE, (b, s)), jnp.int32),
        "weights": jnp.asarray(weights),
        "segment_ids": jnp.asarray(seg),
        "positions": jnp.asarray(pos),
    }


def _model(cfg, attention: str, loss: str):
    """The recipe's model (a cairn.llm CausalLM) and the implementations it runs under."""
    return lm_model.build(cfg, 0), lm_model.Impl(attention, loss)


@functools.partial(nn.jit, static_argnums=2)
def _jit_loss_and_grads(model, batch, impl):
    (loss, _), grads = nn.value_and_grad(lm_model.loss_and_metrics, has_aux=True)(model, batch, impl)
    return loss, grads


@functools.partial(nn.jit, static_argnums=2)
def _logits(model, batch, impl):
    return lm_model.logits(model, batch, impl)


def _loss_and_grads(model_impl, batch):
    loss, grads = _jit_loss_and_grads(model_impl[0], batch, model_impl[1])
    return loss, flatten_with_paths(grads)


def _assert_grads_close(ga: dict, gb: dict, rtol: float, atol: float) -> None:
    assert ga.keys() == gb.keys()
    for k in ga:
        np.testing.assert_allclose(np.asarray(gb[k]), np.asarray(ga[k]), rtol=rtol, atol=atol, err_msg=k)


def _nll_f64(logits: np.ndarray, targets: np.ndarray, weights: np.ndarray) -> float:
    """The weighted mean next-token cross-entropy in float64 NumPy (the independent reference)."""
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    nll = lse - np.take_along_axis(z, targets[..., None], -1)[..., 0]
    return float((nll * weights).sum() / max(weights.sum(), 1.0))


# --- the two paths compute the same function ---


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_kernels_attention_equals_xla_attention_values_and_grads(tmp_path):
    cfg = _cfg(tmp_path)
    batch = _packed_batch()
    ref, ker = _model(cfg, "xla", "xla"), _model(cfg, "kernels", "xla")
    np.testing.assert_allclose(np.asarray(_logits(ker[0], batch, ker[1])), np.asarray(_logits(ref[0], batch, ref[1])),
                               rtol=1e-5, atol=2e-5)
    (la, ga), (lb, gb) = _loss_and_grads(ref, batch), _loss_and_grads(ker, batch)
    np.testing.assert_allclose(float(lb), float(la), rtol=1e-6)
    _assert_grads_close(ga, gb, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("impl", lm_model.IMPLEMENTATIONS)
def test_packed_attention_matches_the_explicit_mask_on_raw_inputs(impl):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 16, 4, 8))
    k, v = (rng.standard_normal((3, 16, 2, 8)) for _ in range(2))
    seg = np.repeat([[1] * 5 + [2] * 7 + [0] * 4], 3, axis=0).astype(np.int32)
    got = np.asarray(lm_model.attend(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(seg), impl))
    # float64 reference: softmax over the explicit mask, query head h on key/value head h // 2
    mask = np.asarray(lm_model.attention_mask(jnp.asarray(seg)))[:, 0]
    kr, vr = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) / np.sqrt(8)
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - np.max(s, -1, keepdims=True, initial=-1e300, where=mask[:, None]))
    p = np.where(mask[:, None], p, 0.0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    want = np.einsum("bhqk,bkhd->bqhd", p, vr)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[:, 12:].any(), "padding rows must be 0"


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_fused_loss_equals_the_logits_loss_and_a_float64_reference(tmp_path):
    cfg = _cfg(tmp_path)
    batch = _packed_batch(seed=3)
    ref, ker = _model(cfg, "xla", "xla"), _model(cfg, "xla", "kernels")
    (la, ga), (lb, gb) = _loss_and_grads(ref, batch), _loss_and_grads(ker, batch)
    logits = np.asarray(_logits(ref[0], batch, ref[1]))
    want = _nll_f64(logits, np.asarray(batch["targets"]), np.asarray(batch["weights"]))
    np.testing.assert_allclose(float(lb), want, rtol=2e-5)
    np.testing.assert_allclose(float(la), want, rtol=2e-5)
    _assert_grads_close(ga, gb, rtol=1e-4, atol=1e-6)
    _, aux = lm_model.loss_and_metrics(ker[0], batch, ker[1])
    assert set(aux) == {"loss"}, "the fused loss forms no logits, so no logit metrics in training"
    _, full = lm_model.logit_metrics(ker[0], batch, ker[1])
    assert {"loss", "token_accuracy", "row_exact"} <= set(full)


@settings(max_examples=15, deadline=None)
@given(
    b=st.integers(1, 3), s=st.integers(1, 9), d=st.integers(1, 8), vocab=st.integers(2, 40),
    seed=st.integers(0, 2**16), dtype=st.sampled_from(["float32", "bfloat16"]),
)
@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_fused_loss_property_against_float64(b, s, d, vocab, seed, dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, s, d)).astype(np.float32)
    proj = rng.standard_normal((d, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, (b, s)).astype(np.int32)
    weights = (rng.random((b, s)) < 0.5).astype(np.float32)
    dt = jnp.dtype(dtype)
    got = lm_model.fused_loss(jnp.asarray(x, dt), jnp.asarray(targets), jnp.asarray(weights), jnp.asarray(proj, dt))
    xr, pr = (np.asarray(jnp.asarray(a, dt).astype(jnp.float32)) for a in (x, proj))  # the rounded inputs
    want = _nll_f64(np.einsum("bsd,dv->bsv", xr.astype(np.float64), pr), targets, weights)
    tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
    np.testing.assert_allclose(float(got), want, rtol=tol, atol=tol * 10)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_unknown_implementation_is_rejected_naming_it(tmp_path):
    with pytest.raises(ValueError, match="attention implementation .*'triton'"):
        _model(_cfg(tmp_path), "triton", "xla")
    with pytest.raises(ValueError, match="loss implementation .*'fused'"):
        _model(_cfg(tmp_path), "xla", "fused")
    with pytest.raises(lm_config.ConfigError, match=r"kernels\.loss"):
        _cfg(tmp_path, 'kernels.loss="fast"')


# --- auto: measured, reported, remembered ---


@pytest.fixture
def fresh_choices(tmp_path, monkeypatch):
    import lm_train

    monkeypatch.setenv("CAIRN_KERNELS_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.setattr(lm_train, "_CHOICES", {})
    return lm_train


def _check_entry(entry: dict, chosen_by: str) -> None:
    assert entry["implementation"] in lm_model.IMPLEMENTATIONS and entry["chosen_by"] == chosen_by
    assert entry["kernels_implementation"] in set(ck.implementations(entry["kernels_op"]))
    assert isinstance(entry["kernels_config"], dict)
    json.dumps(entry)  # it goes into metrics.json


def test_auto_selection_measures_both_and_reports_the_choice(tmp_path, fresh_choices):
    lm_train = fresh_choices
    cfg = _cfg(tmp_path / "run")
    choice = lm_train.choose_kernels(cfg, tmp_path / "run")
    assert set(choice) == {"attention", "loss"}
    for op, entry in choice.items():
        _check_entry(entry, "auto")
        ms = entry["candidates_ms"]
        assert set(ms) == {"xla", "kernels"} and min(ms.values()) > 0 and entry["source"] == "measured"
        faster = ms["kernels"] < (1 - lm_train.AUTO_MARGIN) * ms["xla"]
        assert entry["implementation"] == ("kernels" if faster else "xla"), (op, ms)
    assert choice["attention"]["kernels_op"] == "dot_product_attention"
    assert choice["loss"]["kernels_op"] == "linear_softmax_cross_entropy_loss"
    assert "attention=" in lm_train.describe_kernels(choice) and "loss=" in lm_train.describe_kernels(choice)

    # remembered: in this process, then from the cache file, and a resumed run keeps its own
    assert {e["source"] for e in lm_train.choose_kernels(cfg).values()} == {"memo"}
    lm_train._CHOICES.clear()
    again = lm_train.choose_kernels(cfg)
    assert {e["source"] for e in again.values()} == {"cache"}
    assert {op: e["implementation"] for op, e in again.items()} == {op: e["implementation"] for op, e in choice.items()}
    saved = json.loads((tmp_path / "run" / "kernels.json").read_text())
    flipped = {op: {**e, "implementation": "xla" if e["implementation"] == "kernels" else "kernels"}
               for op, e in saved.items()}
    (tmp_path / "run" / "kernels.json").write_text(json.dumps(flipped))
    resumed = lm_train.choose_kernels(cfg, tmp_path / "run", resume=True)
    for op in resumed:
        assert resumed[op]["source"] == "run_dir" and resumed[op]["implementation"] == flipped[op]["implementation"]


def test_the_start_up_line_and_report_say_where_each_choice_came_from(tmp_path, fresh_choices, monkeypatch):
    """Issue 25: a measured choice names its date and load, a cached one the file it came from,
    and cairn.kernels' own config the rule that chose it (here the untuned default heuristic)."""
    import lm_report

    from cairn.kernels import _cache

    lm_train = fresh_choices
    _cache.clear()  # no autotune entry from earlier tests in this process
    monkeypatch.setattr(os, "getloadavg", lambda: (6.5, 1.0, 1.0))
    cfg = _cfg(tmp_path / "run", 'kernels.attention="kernels"')  # the loss stays "auto"
    first = lm_train.choose_kernels(cfg)
    attention, loss = first["attention"]["provenance"], first["loss"]["provenance"]
    assert attention.startswith("the run's config") and "untuned default heuristic" in attention
    assert loss.startswith("a measurement now") and "load 6.5 on" in loss
    lm_train._CHOICES.clear()  # a later process: the decision comes from the choice cache file
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 1.0, 1.0))
    again = lm_train.choose_kernels(cfg)["loss"]
    assert again["source"] == "cache" and "load 6.5 on" in again["provenance"]
    assert first["loss"]["measured"]["date"] in again["provenance"] and "lm_recipe_choices.json" in again["provenance"]
    line = lm_train.describe_kernels({"attention": first["attention"], "loss": again})
    assert "untuned default heuristic" in line and "the choice cache" in line
    assert "the choice cache" in lm_report._short(again)


def test_config_choice_is_not_measured(tmp_path, fresh_choices):
    choice = fresh_choices.choose_kernels(_cfg(tmp_path, 'kernels.attention="kernels"', 'kernels.loss="xla"'))
    assert choice["attention"]["implementation"] == "kernels" and choice["loss"]["implementation"] == "xla"
    for entry in choice.values():
        _check_entry(entry, "config")
        assert entry["candidates_ms"] == {}


# --- training on the kernels ---


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_forced_kernels_train_with_finite_loss_and_report_them(tmp_path, fresh_choices):
    lm_train = fresh_choices
    cfg = _cfg(tmp_path, 'kernels.attention="kernels"', 'kernels.loss="kernels"')
    with ck.recording() as calls:
        r = lm_train.train(cfg, quiet=True)
    losses = [v for _, v in r["curve"]]
    assert len(losses) == 6 and np.isfinite(losses).all() and np.isfinite(r["heldout_exact_match"])
    assert {c.op for c in calls} == {"dot_product_attention", "linear_softmax_cross_entropy_loss"}
    assert {op: e["implementation"] for op, e in r["kernels"].items()} == {"attention": "kernels", "loss": "kernels"}
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["kernels"]["loss"]["chosen_by"] == "config"


_SHARDED = r"""
import json, sys
sys.path.insert(0, {lm!r})
import jax, lm_config, lm_train
out = {{}}
for impl in ("xla", "kernels"):
    cfg = lm_config.load_config({config!r}, {overrides!r} + ['run.dir="{run}/' + impl + '"',
                                f'kernels.attention="{{impl}}"', f'kernels.loss="{{impl}}"'])
    out[impl] = [v for _, v in lm_train.train(cfg, quiet=True)["curve"]]
print("RESULT " + json.dumps({{"curves": out, "devices": jax.device_count()}}))
"""


@pytest.mark.slow
def test_kernels_on_four_devices_train_like_xla(tmp_path):
    """Data and model sharded over a 2 x 2 mesh: the kernels run on each shard and the
    loss curve is plain XLA's up to float32 reduction order."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               CAIRN_KERNELS_CACHE_DIR=str(tmp_path / "kcache"))
    code = _SHARDED.format(lm=str(LM), config=str(LM / "config.toml"), run=str(tmp_path),
                           overrides=TINY + ["mesh.data=2", "mesh.model=2"])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads([x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    assert res["devices"] == 4
    np.testing.assert_allclose(res["curves"]["kernels"], res["curves"]["xla"], rtol=2e-4, atol=2e-5)
