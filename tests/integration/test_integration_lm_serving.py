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
    # plain prompts here (test_integration_lm_stages.py runs the post-training stages and chat prompts)
    "posttrain.enabled=false",
]


def _cfg(*extra):
    return lm_config.load_config(LM / "config.toml", [*TINY, *extra])


@pytest.fixture(scope="module")
def tiny():
    """A randomly initialised tiny model (a cairn.llm CausalLM) and its config."""
    import lm_model

    cfg = _cfg()
    return cfg, lm_model.build(cfg, 3)


def _model_logits(model, tokens):
    return np.asarray(model(jnp.asarray(tokens)), np.float64)


def test_the_served_functions_are_the_trained_model(tiny):
    """The recipe trains, generates and serves one object: the prefill/decode the export
    writes give the training forward pass's logits, each row at its own position."""
    from cairn import llm

    _, model = tiny
    fns = llm.serving_functions(model, 24)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 130, (3, 20)).astype(np.int32)
    ref = _model_logits(model, tokens)
    lengths = np.array([4, 7, 1], np.int32)
    prompts = np.where(np.arange(8)[None] < lengths[:, None], tokens[:, :8], 0).astype(np.int32)  # padding is ignored
    logits, cache = jax.jit(fns.prefill)(fns.params, jnp.asarray(prompts), jnp.asarray(lengths))
    assert cache["k0"].shape == (3, 24, 2, 8)
    tol = 1e-5 * np.abs(ref).max()
    np.testing.assert_allclose(logits, ref[np.arange(3), lengths - 1], atol=tol)
    decode = jax.jit(fns.decode)
    pos = lengths.copy()
    for _ in range(12):
        logits, cache = decode(fns.params, jnp.asarray(tokens[np.arange(3), pos]), jnp.asarray(pos), cache)
        np.testing.assert_allclose(logits, ref[np.arange(3), pos], atol=tol)
        pos += 1


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_greedy_generation_equals_argmax_of_the_full_forward_and_ignores_other_rows(tiny):
    import lm_generate

    _, model = tiny
    prompts = [[1, 20, 21, 22], [1, 40], [1, 50, 51, 52, 53, 54, 55], [1, 60, 61]]
    together = lm_generate.greedy(model, prompts, 6, 24, batch=4)
    alone = [lm_generate.greedy(model, [p], 6, 24, batch=1)[0] for p in prompts]
    assert together == alone
    for prompt, got in zip(prompts, together):
        seq, want = list(prompt), []
        while len(want) < 6 and 2 not in want:  # no cache: the whole sequence again each step, until the end token
            want.append(int(np.argmax(_model_logits(model, np.asarray([seq + want], np.int32))[0, -1])))
        assert got == want


def test_problem_prompt_and_the_tokenizer():
    import lm_generate
    import lm_task

    prompt, answer = lm_generate.problem_prompt("372+59=134")
    assert prompt[0] == lm_task.BOS and lm_task.decode(np.array(prompt)) == "372+59=" and answer == "134"
    tok = lm_generate.tokenizer()
    # the task's byte tokenizer, as a Hugging Face tokenizer: the same ids, any text
    for text in ("12+3=", "héllo ✓", " a  b"):
        assert tok.encode(text) == [lm_task.BOS, *lm_task.encode(text).tolist()]
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    assert len(tok) <= lm_task.VOCAB_SIZE and tok.eos_token_ids == (lm_task.EOS,)
    assert lm_generate.answers_text([[lm_task.encode("43")[0], lm_task.encode("43")[1], lm_task.EOS]]) == ["43"]


def test_awq_scales_are_held_and_what_the_model_cannot_hold_is_refused_not_dropped(tiny):
    """AWQ adds ``<name>_awq_scale`` beside each weight: the variant holds it (its forward
    divides it out); a parameter the model has no place for must fail, never be dropped."""
    import lm_quant

    from cairn import llm

    _, model = tiny
    params = llm.serving_functions(model, model.config.max_position_embeddings).params
    hidden = model.config.hidden_size
    params["layers"][0]["mlp"]["up"]["kernel_awq_scale"] = np.full(hidden, 2.0, np.float32)
    held = lm_quant._with_params(model, params)
    assert float(held.layers[0].mlp.up.kernel_awq_scale[...][0]) == 2.0
    params["embed"]["embedding_awq_scale"] = np.ones(hidden, np.float32)  # the lookup and tied head apply no scale
    with pytest.raises(ValueError, match="embedding_awq_scale"):
        lm_quant._with_params(model, params)


# w4_gptq (15 s) runs in tests_slow: CI's 10-minute budget; the packed int4 path is also in tests/serving
@pytest.mark.parametrize("method", ["w8", pytest.param("w4_gptq", marks=pytest.mark.slow),
                                    pytest.param("w4_awq", marks=pytest.mark.slow)])
def test_quantized_variants_hold_packed_qarrays_and_stay_close(tiny, method):
    import lm_generate
    import lm_quant

    from cairn import nn
    from cairn.core_array import QArray

    cfg, model = tiny
    batches = lm_quant.calibration_batches(cfg, 2)
    v = lm_quant.quantize_variant(method, model, batches, tile=16)
    params = nn.state(v.model, nn.Param).to_pure_dict()
    qs = [x for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QArray)) if isinstance(x, QArray)]
    assert len(qs) == 6 * cfg.model.num_layers  # q k v gate up down of every layer (o reaches its dot reshaped)
    assert not isinstance(params["embed"]["embedding"], QArray)  # tied with the head: stays float
    q = params["layers"][0]["mlp"]["up"]["kernel"]
    if method == "w8":
        assert q.qtype == "int8" and q.packed_length is None
    else:
        assert q.qtype == "int4" and q.qvalue.dtype == np.uint8 and q.qvalue.shape == (32, 32) and q.packed_length == 64
    float_bytes = sum(int(np.prod(x.shape)) * 4 for x in qs)
    assert lm_quant.param_bytes(qs) < float_bytes * (0.3 if method == "w8" else 0.22)  # int8 / packed int4 + scales
    assert v.param_bytes < lm_quant.float_variant(model).param_bytes
    assert isinstance(model.layers[0].mlp.up.kernel[...], jax.Array), "the float model is unchanged"
    tokens = np.array([[1, 20, 21, 22, 23]], np.int32)
    got, ref = _model_logits(v.model, tokens)[0, -1], _model_logits(model, tokens)[0, -1]
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert 0 < rel < (0.05 if method == "w8" else 0.5), rel
    assert lm_generate.max_length(cfg) == 16  # BOS 2+2 digits = 5 new tokens, next power of two


def test_skip_reasons_and_the_report_of_a_stopped_run():
    import lm_production
    import lm_report

    assert lm_production.skip_reason(_cfg()) is None
    assert "all false" in lm_production.skip_reason(_cfg("quant.enabled=false", "serve.enabled=false"))
    # post-training alone still runs after pretraining
    assert lm_production.skip_reason(_cfg("quant.enabled=false", "serve.enabled=false", "posttrain.enabled=true")) is None
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
    _check_the_printed_requests_succeed(*served)


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
    # issue 31: the machine's load next to the speeds, a latency plot per concurrency level
    assert "machine load" in stdout and len(metrics["loadavg"]) == 3
    for lv in m["levels"]:
        assert len(lv["latencies_ms"]) == len(lv["ttfts_ms"]) == 24 and len(lv["loadavg"]) == 3
        assert np.percentile(lv["latencies_ms"], 50) == pytest.approx(lv["latency_p50_ms"], abs=1e-2)
    assert metrics["serving"]["latency_plot"] == str(run_dir / "serving_latency.png")
    assert (run_dir / "serving_latency.png").stat().st_size > 1000 and (run_dir / "loss_curve.png").is_file()


def _check_served_repository(run_dir, metrics, _stdout):
    """A real tritonclient /infer call and streamed generates equal to the exported generator run alone."""
    import lm_generate
    import lm_serve

    from cairn import serving

    repo = run_dir / "serving"
    assert (repo / "lm_w4_gptq" / "1" / "tokenizer" / "tokenizer.json").is_file()  # the tokenizer travels
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


def _check_the_printed_requests_succeed(run_dir, metrics, stdout):
    """What the job prints at the end (issue 31): the cairn-serve command on its repository, a
    curl request and an openai-client request; run as printed (the port swapped for a free
    one) against the served model, both answer what the model answered in process."""
    import shlex

    import lm_serve

    block = stdout.split("=== try it ===", 1)[1].splitlines()
    serve = next(shlex.split(x) for x in block if x.strip().startswith("cairn-serve "))
    curl = next(shlex.split(x) for x in block if x.strip().startswith("curl "))
    client = next(shlex.split(x) for x in block if x.strip().startswith("python -c "))
    assert serve[serve.index("--model-repository") + 1] == str(run_dir / "serving") and "--port" in serve
    t = metrics["serving"]["try"]
    assert t["model"] == "lm_w4_gptq" and t["answer"] == t["answer"].strip()
    with lm_serve.ServerProcess(run_dir / "serving", timeout=300) as server:
        here = f"127.0.0.1:{server.port}"
        res = subprocess.run([a.replace("127.0.0.1:8000", here) for a in curl], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr
        body = json.loads(res.stdout)
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == t["answer"], body
        pytest.importorskip("openai")
        res = subprocess.run([sys.executable, *[a.replace("127.0.0.1:8000", here) for a in client[1:]]],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.strip() == t["answer"]
