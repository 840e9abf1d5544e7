"""The reference recipe's production steps (examples/lm): generation through a KV cache,
quantization, export through cairn.serving and the cairn-serve CLI in a subprocess."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LM = ROOT / "examples" / "lm"
sys.path.insert(0, str(LM))

import lm_config  # noqa: E402

jax = pytest.importorskip("jax")
jnp = jax.numpy

TINY = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.mlp_dim=64", "data.seq_len=32", "data.batch_size=8", "data.num_train=600",
    "data.num_eval=24", "data.max_digits=2", "data.num_shards=2", "optim.warmup_steps=2",
    "train.steps=12", "train.log_every=4", "checkpoint.every=12", "train.progress=false",
    "data.num_workers=0", "quant.tile_size=16", "quant.calibration_batches=2",
    "serve.max_new_tokens=5", "serve.num_slots=4", "serve.prefill_batch=2", "serve.concurrency=[1, 3]",
]


def _cfg(*extra):
    return lm_config.load_config(LM / "config.toml", [*TINY, *extra])


@pytest.fixture(scope="module")
def tiny():
    """A randomly initialised tiny model, its params dict and sizes."""
    import lm_generate
    import lm_model
    import lm_task

    from cairn import nn

    cfg = _cfg()
    model = lm_model.TransformerLM(cfg, lm_task.VOCAB_SIZE, rngs=nn.Rngs(params=3))
    return cfg, model, lm_generate.params_of(model), lm_generate.Dims.from_config(cfg, max_length=24)


def _model_logits(model, tokens):
    b, s = tokens.shape
    seg = np.ones((b, s), np.int32)
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos)), np.float64)


def test_decode_through_the_cache_equals_the_full_forward(tiny):
    import lm_generate

    _, model, params, dims = tiny
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 130, (3, 20)).astype(np.int32)
    ref = _model_logits(model, tokens)  # lm_model.TransformerLM's own forward pass
    lengths = np.array([4, 7, 1], np.int32)
    prompts = np.where(np.arange(8)[None] < lengths[:, None], tokens[:, :8], 0).astype(np.int32)  # padding is ignored
    logits, cache = lm_generate.make_prefill(dims)(params, jnp.asarray(prompts), jnp.asarray(lengths))
    assert set(cache) == set(dims.cache_specs()) and cache["k0"].shape == (3, 24, 2, 8)
    tol = 1e-5 * np.abs(ref).max()
    np.testing.assert_allclose(logits, ref[np.arange(3), lengths - 1], atol=tol)
    decode = jax.jit(lm_generate.make_decode(dims))
    pos = lengths.copy()
    for _ in range(12):  # each row at its own position
        logits, cache = decode(params, jnp.asarray(tokens[np.arange(3), pos]), jnp.asarray(pos), cache)
        np.testing.assert_allclose(logits, ref[np.arange(3), pos], atol=tol)
        pos += 1


def test_a_row_does_not_depend_on_the_other_rows(tiny):
    import lm_generate

    _, _, params, dims = tiny
    gen = lm_generate.Generator(lm_generate.make_prefill(dims), lm_generate.make_decode(dims), params, dims, batch=4)
    prompts = [[1, 20, 21, 22], [1, 40], [1, 50, 51, 52, 53, 54, 55], [1, 60, 61]]
    together = gen.generate(prompts, 8, eos=())
    alone = [gen.generate([p], 8, eos=())[0] for p in prompts]
    assert together == alone and all(len(t) == 8 for t in together)


def test_greedy_generation_equals_argmax_of_the_full_forward(tiny):
    import lm_generate

    _, model, params, dims = tiny
    gen = lm_generate.Generator(lm_generate.make_prefill(dims), lm_generate.make_decode(dims), params, dims, batch=2)
    prompt = [1, 30, 31, 32]
    got = gen.generate([prompt], 6, eos=())[0]
    seq = list(prompt)
    for _ in range(6):  # no cache: the whole (right-padded, causal) sequence again each step
        row = np.zeros((1, 12), np.int32)
        row[0, : len(seq)] = seq
        seq.append(int(np.argmax(_model_logits(model, row)[0, len(seq) - 1])))
    assert got == seq[len(prompt):]


def test_generation_rejects_a_prompt_longer_than_the_cache(tiny):
    import lm_generate

    _, _, params, dims = tiny
    gen = lm_generate.Generator(lm_generate.make_prefill(dims), lm_generate.make_decode(dims), params, dims, batch=2)
    with pytest.raises(ValueError, match="max_length 24"):
        gen.generate([[1] * 20], 8)


def test_problem_prompt_and_vocabulary():
    import lm_generate
    import lm_task

    prompt, answer = lm_generate.problem_prompt("372+59=134")
    assert prompt[0] == lm_task.BOS and lm_task.decode(np.array(prompt)) == "372+59=" and answer == "134"
    vocab = lm_generate.vocabulary()
    assert len(vocab) == lm_task.VOCAB_SIZE and vocab[lm_task.EOS] is None
    assert "".join(vocab[t] for t in lm_task.encode("12+3=")) == "12+3="


@pytest.mark.parametrize("method", ["w8", "w4_gptq", pytest.param("w4_awq", marks=pytest.mark.slow)])
def test_quantized_variants_hold_packed_qarrays_and_stay_close(tiny, method):
    import lm_generate
    import lm_quant

    from cairn.core_array import QArray

    cfg, model, params, dims = tiny
    batches = lm_quant.calibration_batches(cfg, 2)
    v = lm_quant.quantize_variant(method, params, dims, batches, tile=16)
    leaves = jax.tree.leaves(v.params, is_leaf=lambda x: isinstance(x, QArray))
    qs = [x for x in leaves if isinstance(x, QArray)]
    assert len(qs) == 7 * dims.num_layers  # q k v o gate up down of every block
    assert not isinstance(v.params["embed"]["embedding"], QArray)  # tied with the head: stays float
    q = v.params["blocks"]["0"]["mlp"]["up"]["kernel"]
    if method == "w8":
        assert q.qtype == "int8" and q.packed_length is None
    else:
        assert q.qtype == "int4" and q.qvalue.dtype == np.uint8 and q.qvalue.shape == (32, 32) and q.packed_length == 64
    float_bytes = sum(int(np.prod(x.shape)) * 4 for x in qs)
    assert lm_quant.param_bytes(qs) < float_bytes * (0.3 if method == "w8" else 0.22)  # int8 / packed int4 + scales
    assert v.param_bytes < lm_quant.param_bytes(params)
    assert isinstance(params["blocks"]["0"]["mlp"]["up"]["kernel"], jax.Array), "the float params are unchanged"
    # the quantized decode through the cache agrees with the quantized prefill of the longer prompt
    tokens = np.array([[1, 20, 21, 22, 23, 24]], np.int32)
    _, cache = jax.jit(v.prefill)(v.params, jnp.asarray(tokens[:, :4]), jnp.array([4], np.int32))
    step, _ = jax.jit(v.decode)(v.params, jnp.asarray(tokens[:, 4]), jnp.array([4], np.int32), cache)
    full, _ = jax.jit(v.prefill)(v.params, jnp.asarray(tokens[:, :5]), jnp.array([5], np.int32))
    np.testing.assert_allclose(step, full, atol=1e-4 * float(np.abs(full).max()))
    ref = _model_logits(model, tokens[:, :5])[0, -1]
    rel = np.linalg.norm(np.asarray(full[0]) - ref) / np.linalg.norm(ref)
    assert rel < (0.05 if method == "w8" else 0.5), rel
    assert lm_generate.Dims.from_config(cfg).max_length == 16  # BOS 2+2 digits = 5 new tokens, next power of two


def test_skip_reasons_and_the_report_of_a_stopped_run():
    import lm_production
    import lm_report

    assert lm_production.skip_reason(_cfg()) is None
    assert "both false" in lm_production.skip_reason(_cfg("quant.enabled=false", "serve.enabled=false"))
    assert "synthetic" in lm_production.skip_reason(_cfg("data.source=parquet", f'data.paths=["{__file__}"]'))
    assert lm_report.format_production({"stopped_early": True}) == [
        "production steps       skipped: the run stopped before train.steps"]


@pytest.mark.parametrize(("overrides", "key"), [
    (["quant.methods=['w3']"], "quant.methods"),
    (["quant.methods=['w8', 'w8']"], "quant.methods"),
    (["serve.models=['w4_awq']"], "serve.models"),
    (["quant.enabled=false"], "serve.models"),  # w8 is served but no longer built
    (["serve.concurrency=[0]"], "serve.concurrency"),
    (["serve.num_slots=0"], "serve.num_slots"),
])
def test_bad_production_config_names_the_key(overrides, key):
    with pytest.raises(lm_config.ConfigError, match=key.replace(".", r"\.")):
        _cfg(*overrides)


# --- the whole chain: train, quantize, export, cairn-serve in a subprocess ---


def _served_run(run_dir):
    """The recipe's command line at the tiny config with the production steps on (w4 GPTQ served)."""
    sets = [*TINY, f'run.dir="{run_dir}"', "quant.methods=['w8', 'w4_gptq']", "serve.models=['w4_gptq']"]
    out = subprocess.run([sys.executable, str(LM / "train.py"), "--quiet", "--set", *sets],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return run_dir, json.loads((run_dir / "metrics.json").read_text()), out.stdout


@pytest.mark.slow
def test_cli_run_serves_what_it_generates_in_process(tmp_path):
    # one test, so that the run (about 30 s) is made once however xdist distributes tests
    served = _served_run(tmp_path)
    _check_report(*served)
    _check_served_repository(*served)


def _check_report(run_dir, metrics, stdout):
    gen = metrics["generation"]["variants"]
    assert set(gen) == {"float", "w8", "w4_gptq"} and metrics["generation"]["examples"] == 24
    assert gen["w4_gptq"]["param_bytes"] < gen["w8"]["param_bytes"] < gen["float"]["param_bytes"]
    m = metrics["serving"]["models"]["w4_gptq"]
    assert m["differing_answers"] == 0 and m["served_exact_match"] == m["inprocess_exact_match"] == gen["w4_gptq"]["exact_match"]
    assert m["infer_next_token_matches"] and m["infer_client"] == "tritonclient"
    assert [lv["concurrency"] for lv in m["levels"]] == [1, 3]
    for lv in m["levels"]:
        assert lv["differing_answers"] == 0 and lv["requests"] == 24 and lv["tokens"] > 0
        assert 0 < lv["ttft_p50_ms"] <= lv["latency_p99_ms"]
    assert metrics["serving"]["exit_code"] == 0, "cairn-serve must exit cleanly on SIGTERM"
    assert "served exact match" in stdout and "end to end" in stdout
    assert (run_dir / "serving" / "lm_w4_gptq" / "1").is_dir() and (run_dir / "serving" / "lm_w4_gptq_next_token" / "1").is_dir()


def _check_served_repository(run_dir, metrics, _stdout):
    """A real tritonclient /infer call and streamed generates equal to the exported generator run alone."""
    import lm_generate
    import lm_serve

    from cairn import serving

    repo = run_dir / "serving"
    # the exported generator, loaded in-process, is the reference for the served tokens
    loaded = serving.load(str(repo / "lm_w4_gptq" / "1"))
    assert loaded.max_length == metrics["generation"]["max_length"] and loaded.eos_token_ids == (2,)
    prompts = [lm_generate.problem_prompt(t)[0] for t in ("12+34=46", "9+9=81", "55+7=26")]
    with lm_serve.ServerProcess(repo, timeout=300) as server:
        nxt, client = lm_serve.infer_next_token(server.port, "lm_w4_gptq_next_token", prompts, loaded.max_length)
        assert client == "tritonclient" and nxt.shape == (3,)
        engine = serving.GenerationEngine(loaded, serving.GenerationConfig(num_slots=4, prefill_batch=2)).start()
        try:
            conn = lm_serve.http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            for p, first in zip(prompts, nxt):
                streamed = lm_serve.stream_one(conn, "lm_w4_gptq", p, 5)
                alone = engine.generate(p, serving.SamplingParams(max_new_tokens=5)).token_ids
                assert streamed["ids"] == alone and (streamed["ids"] or [2])[0] == int(first)
                assert streamed["finish_reason"] in ("stop", "length") and streamed["ttft"] <= streamed["latency"]
            conn.close()
        finally:
            engine.stop()
        assert server.stop() == 0
