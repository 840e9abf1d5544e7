"""The main job's stages (examples/lm, issue 32): the BPE tokenizer it trains, the hand-over
through Hugging Face checkpoints, SFT and GRPO with LoRA, serving over OpenAI's API; a second
run into the same directory and SIGTERM inside every stage after pretraining (SFT, GRPO,
quantize, export, serve)."""

from __future__ import annotations

import json
import pathlib
import pickle
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LM = ROOT / "examples" / "lm"
sys.path.insert(0, str(LM))

import lm_config  # noqa: E402
import lm_task  # noqa: E402

# the whole job at a small config: pretraining, hand-over, SFT, GRPO, quantization, serving
TINY = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.mlp_dim=64", "data.seq_len=64", "data.batch_size=8", "data.num_train=600",
    "data.num_eval=24", "data.max_digits=2", "data.num_shards=2", "optim.warmup_steps=2",
    "train.steps=12", "train.log_every=4", "checkpoint.every=12", "train.progress=false",
    "data.num_workers=0", "quant.tile_size=16", "quant.calibration_batches=2",
    "serve.max_new_tokens=5", "serve.num_slots=4", "serve.prefill_batch=2", "serve.concurrency=[1, 3]",
    "serve.openai_streamed=8", "posttrain.num_train=200", "posttrain.sft_steps=6", "posttrain.grpo_steps=4",
    "posttrain.save_every=2", "posttrain.sft_batch_size=8", "posttrain.grpo_prompts=4",
    "posttrain.hf_shard_size=\"40KB\"",
]
NO_PRODUCTION = ["quant.enabled=false", "serve.enabled=false"]


def _corpus(n: int = 300) -> list[str]:
    import jinja2
    import lm_tokenizer

    texts = lm_task.make_problems(n, 3, 0, held_out=False)
    tpl = jinja2.Environment().from_string(lm_tokenizer.CHAT_TEMPLATE)
    return texts + [tpl.render(messages=lm_task.chat_messages(t), bos_token="", eos_token="<eos>") for t in texts]


def test_the_bpe_splits_digits_keeps_the_task_ids_and_round_trips(tmp_path):
    import lm_tokenizer

    corpus = _corpus()
    tok = lm_tokenizer.train_bpe(corpus, 320, pad_to=384)
    assert len(tok) == 384 and tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "<bos>", "<eos>"]
    assert tok.eos_token_ids == (lm_task.EOS,)
    question = lm_task.question("372+59=134")
    pieces = tok.convert_ids_to_tokens(tok.encode(question, add_special_tokens=False))
    assert [p for p in pieces if p.isdigit()] == list("37259"), pieces  # one digit per token
    assert "What" in pieces and len(pieces) < len(question)  # merges learned on the corpus' words
    for text in ("372+59=134", "über 9 + 1?", question, "\t tabs and  spaces"):
        ids = tok.encode(text)
        assert ids[0] == lm_task.BOS and tok.decode(ids, skip_special_tokens=True) == text
    # the chat form: BOS, system, user, the assistant's turn opened; the answer closed by <eos>
    prompt = tok.apply_chat_template(lm_task.chat_messages("12+30=24", False), add_generation_prompt=True)
    assert prompt == f"<bos><|system|>{lm_task.SYSTEM_PROMPT}\n<|user|>What is 12+30?\n<|assistant|>"
    full = tok.apply_chat_template(lm_task.chat_messages("12+30=24"), add_generation_prompt=False)
    assert full == prompt + "24<eos>"
    # the reserved ids that fill the embedding decode to nothing
    assert tok.decode([383, *tok.encode("7", add_special_tokens=False)], skip_special_tokens=True) == "7"
    # the data workers' form: pickled, the same ids without specials; '=' a token of its own
    codec = pickle.loads(pickle.dumps(lm_tokenizer.Codec.of(tok)))
    assert codec.encode("12+30=").tolist() == tok.encode("12+30=", add_special_tokens=False)
    assert codec.decode(codec.encode("12+30=")) == "12+30=" and codec.equals_id == tok.convert_tokens_to_ids("=")
    ex = lm_task.example_from_text("12+30=24", 16, answer_only=True, codec=codec)
    assert ex["weights"].sum() == 3 and ex["targets"][-1] == lm_task.EOS  # "2", "4" and the end token
    # saved with the run and read back by a resumed one: the same tokenizer, not trained again
    path = tmp_path / "tokenizer"
    first, trained = lm_tokenizer.load_or_train(path, corpus, 320, 384)
    again, trained_again = lm_tokenizer.load_or_train(path, corpus, 320, 384)
    assert trained and not trained_again and again.encode(question) == first.encode(question)
    # another corpus (the data settings changed) is not served the old tokenizer
    _, retrained = lm_tokenizer.load_or_train(path, corpus[:50], 320, 384)
    assert retrained
    assert (path / "chat_template.jinja").read_text() == lm_tokenizer.CHAT_TEMPLATE


def test_a_vocabulary_too_small_for_the_bytes_is_refused():
    import lm_tokenizer

    with pytest.raises(ValueError, match="vocab_size 100"):
        lm_tokenizer.train_bpe(["1+1=2"], 100)


@pytest.mark.parametrize("overrides, key", [
    (["tokenizer.kind=words"], "tokenizer.kind"),
    (["tokenizer.vocab_size=200"], "tokenizer.vocab_size"),
    (["tokenizer.kind=byte"], "posttrain.enabled"),  # chats need the BPE's markers
    (["posttrain.grpo_generations=1"], "posttrain.grpo_generations"),
    (["posttrain.sft_steps=0"], "posttrain.sft_steps"),
    (["posttrain.grpo_beta=-1.0"], "posttrain.grpo_beta"),
    (["serve.kv_layout=ring"], "serve.kv_layout"),
    (["serve.block_size=7"], "serve.block_size"),
])
def test_bad_stage_config_names_the_key(overrides, key):
    with pytest.raises(lm_config.ConfigError, match=key.replace(".", r"\.")):
        lm_config.load_config(LM / "config.toml", overrides)


def test_the_byte_tokenizer_keeps_the_earlier_job():
    cfg = lm_config.load_config(LM / "config.toml", ["tokenizer.kind=byte", "posttrain.enabled=false"])
    assert lm_config.vocab_size(cfg) == lm_task.VOCAB_SIZE == 320
    assert lm_config.vocab_size(lm_config.load_config(LM / "config.toml", ["tokenizer.vocab_size=300"])) == 320


def test_the_exact_answer_reward():
    import lm_posttrain

    ex = [{"answer": "24"}, {"answer": "24"}, {"answer": "5"}]
    assert lm_posttrain.exact_answer([None] * 3, [" 24", "240", ""], ex) == [1.0, 0.0, 0.0]


@pytest.mark.slow  # builds and compiles a model: over 3 s on a loaded 2-core machine
def test_the_hand_over_is_a_sharded_hugging_face_checkpoint_that_loads_back(tmp_path):
    import jax.numpy as jnp
    import lm_model
    import lm_posttrain
    import lm_tokenizer

    cfg = lm_config.load_config(LM / "config.toml", TINY)
    model = lm_model.build(cfg, 0)
    tok = lm_tokenizer.train_bpe(_corpus(100), 300, lm_config.vocab_size(cfg))
    out = lm_posttrain.handover(model, tok, tmp_path, "40KB")
    path = pathlib.Path(out["path"])
    assert out["shards"] > 1 and (path / "model.safetensors.index.json").is_file()
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(out["files"]) | {
        p.name for p in path.iterdir()}
    loaded, loaded_tok = lm_posttrain.load_hf(path)
    ids = jnp.asarray([tok.encode("What is 12+30?")])
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(model(ids)))
    assert loaded_tok.apply_chat_template(lm_task.chat_messages("1+2=3", False)) == tok.apply_chat_template(
        lm_task.chat_messages("1+2=3", False))
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"


# --- the whole job through the command line (slow: a minute or more each on 2 cores) ---


def _cli(run_dir: pathlib.Path, *extra: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(LM / "train.py"), "--set", *TINY, f'run.dir="{run_dir}"', *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_job_end_to_end_and_a_real_openai_call(tmp_path):
    out = _cli(tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads((tmp_path / "metrics.json").read_text())
    p = m["posttrain"]
    assert m["tokenizer"]["kind"] == "bpe" and (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    assert p["handover"]["shards"] > 1
    for stage in ("pretrained", "sft", "grpo"):  # each stage's Hugging Face directory, sharded, with the tokenizer
        d = tmp_path / "hf" / stage
        assert (d / "model.safetensors.index.json").is_file() and (d / "tokenizer.json").is_file(), stage
    for stage in ("sft", "grpo"):
        assert 0.0 <= p[stage]["heldout_exact_match"] <= 1.0 and (tmp_path / stage / "loss.png").is_file()
        assert p[stage]["steps"] == {"sft": 6, "grpo": 4}[stage]
    # GRPO logs the share of groups whose rewards differ (only those carry an advantage)
    spread = [v for _, v in p["grpo"]["groups_nonzero_std"]]
    assert len(spread) == 4 and all(0.0 <= v <= 1.0 for v in spread), spread
    assert (tmp_path / "loss_curves.png").stat().st_size > 1000 and (tmp_path / "serving_latency.png").is_file()
    gen = m["generation"]
    assert gen["prompts"] == "chat" and set(gen["variants"]) == {"float", "w8", "w4_gptq"}
    srv = m["serving"]["models"]["w4_gptq"]
    assert srv["differing_answers"] == 0 and srv["infer_next_token_matches"] and srv["infer_client"] == "tritonclient"
    assert srv["openai"]["chat"]["differing_answers"] == 0 and srv["openai"]["chat"]["requests"] == 24
    assert srv["openai"]["chat_stream"]["differing_answers"] == 0 and srv["openai"]["chat_stream"]["requests"] == 8
    assert srv["prefix_cache"]["prefix_cache_hit_rate"] > 0.3  # the system prompt's blocks are shared
    assert [lv["differing_answers"] for lv in srv["levels"]] == [0, 0]
    assert m["serving"]["exit_code"] == 0 and "=== try it ===" in out.stdout
    assert "chat/completions" in out.stdout and "cairn-serve --model-repository" in out.stdout
    _openai_call_against_the_export(tmp_path, m)
    # a second run into the same directory: refused at once, naming the choices; --resume: finished
    again = _cli(tmp_path, timeout=300)
    assert again.returncode == 2 and "already holds checkpoints" in again.stderr and "--resume" in again.stderr
    resumed = subprocess.run([sys.executable, str(LM / "train.py"), "--resume", "--set", *TINY,
                              f'run.dir="{tmp_path}"'], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0 and "already finished" in resumed.stdout, resumed.stderr[-2000:]


def _openai_call_against_the_export(run_dir: pathlib.Path, metrics: dict) -> None:
    """cairn-serve on the exported repository, asked the try-it question through the official
    client: the answer the model gave in process."""
    openai = pytest.importorskip("openai")
    import lm_serve

    t = metrics["serving"]["try"]
    with lm_serve.ServerProcess(run_dir / "serving", timeout=300) as server:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
        got = client.chat.completions.create(model=t["model"], messages=t["messages"], max_tokens=t["max_tokens"],
                                             temperature=0)
        assert got.choices[0].message.content.strip() == t["answer"]
        streamed = client.chat.completions.create(model=t["model"], messages=t["messages"], max_tokens=t["max_tokens"],
                                                  temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices).strip() == t["answer"]
        client.close()
        assert server.stop() == 0


def _signalled(run_dir: pathlib.Path, anchor: str, argv: list[str] | None = None) -> tuple[int, list[str]]:
    """The CLI (default: without production steps), SIGTERM sent when a line starts with ``anchor``."""
    argv = argv or [sys.executable, str(LM / "train.py"), "--set", *TINY, *NO_PRODUCTION, f'run.dir="{run_dir}"']
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        sent = False
        for line in proc.stdout:
            lines.append(line.rstrip())
            if not sent and line.startswith(anchor):
                sent = True
                proc.send_signal(signal.SIGTERM)

    reader = threading.Thread(target=read)
    reader.start()
    proc.wait(timeout=1200)
    reader.join()
    return proc.returncode, lines


def _safetensors(d: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.safetensors"))}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_sigterm_in_a_post_training_stage_exits_75_and_the_same_command_resumes_it(tmp_path, stage):
    import lm_cli

    rc, lines = _signalled(tmp_path / "run", f"{stage}: LoRA")
    assert rc == 75, lines[-10:]
    marker = json.loads((tmp_path / "run" / lm_cli.PREEMPTED_FILE).read_text())
    assert marker["stage"] == stage and 0 < marker["stage_step"] < {"sft": 6, "grpo": 4}[stage], marker
    assert any(x.startswith(f"preempted: {stage} step") for x in lines)
    # the same command again (no --resume): the stage resumes from its checkpoint
    out = subprocess.run([sys.executable, str(LM / "train.py"), "--set", *TINY, *NO_PRODUCTION,
                          f'run.dir="{tmp_path / "run"}"'], capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{stage}: LoRA" in out.stderr and "resumed from step" in out.stderr
    assert not (tmp_path / "run" / lm_cli.PREEMPTED_FILE).exists()
    got = json.loads((tmp_path / "run" / "metrics.json").read_text())["posttrain"]
    assert got[stage]["resumed_from"] == marker["stage_step"]
    # bit-identical to a run that was never interrupted
    ref = _cli(tmp_path / "ref", *NO_PRODUCTION)
    assert ref.returncode == 0, ref.stderr[-3000:]
    for s in ("sft", "grpo"):
        assert _safetensors(tmp_path / "run" / "hf" / s) == _safetensors(tmp_path / "ref" / "hf" / s), s


def _serving_processes(repo: pathlib.Path) -> list[int]:
    """The pids of processes whose command line names ``repo`` (a cairn-serve left running)."""
    pids = []
    for d in pathlib.Path("/proc").iterdir():
        try:
            if d.name.isdigit() and str(repo) in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


# the line after which each production step is under way (the signal lands inside it)
PRODUCTION_ANCHORS = (("quantize", "grpo: held-out exact match"), ("export", "serving: exporting"),
                      ("serve", "serving: exported"))


@pytest.mark.slow
def test_sigterm_in_quantize_export_and_serve_exits_75_and_the_same_command_does_the_step_again(tmp_path):
    import lm_cli

    run = tmp_path / "run"
    for stage, anchor in PRODUCTION_ANCHORS:  # one preemption in each step, each start resuming the last
        argv = [sys.executable, str(LM / "train.py"), "--set", *TINY, f'run.dir="{run}"']
        rc, lines = _signalled(run, anchor, argv)
        assert rc == 75, (stage, lines[-10:])
        marker = json.loads((run / lm_cli.PREEMPTED_FILE).read_text())
        assert marker["stage"] == stage and marker["stage_step"] is None and marker["step"] == 12, marker
        assert any(x.startswith(f"preempted during {stage}") for x in lines), lines[-5:]
        assert not (run / "metrics.json").exists()  # the report is written by the run that finishes
        assert not _serving_processes(run / "serving")  # the server was stopped on the way out
        # what is committed stays: the post-training stages are not trained again
        assert (run / "grpo" / "stage.json").is_file() and (run / "hf" / "grpo" / "config.json").is_file()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming:" in out.stdout and not (run / lm_cli.PREEMPTED_FILE).exists()
    got = json.loads((run / "metrics.json").read_text())
    assert got["posttrain"]["sft"]["skipped"] and got["posttrain"]["grpo"]["skipped"]
    # the same outputs as a run never interrupted
    ref_dir = tmp_path / "ref"
    ref = _cli(ref_dir)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = json.loads((ref_dir / "metrics.json").read_text())
    assert _safetensors(run / "hf" / "grpo") == _safetensors(ref_dir / "hf" / "grpo")
    for name in ("float", "w8", "w4_gptq"):
        g, w = got["generation"]["variants"][name], want["generation"]["variants"][name]
        assert (g["exact_match"], g["param_bytes"]) == (w["exact_match"], w["param_bytes"]), name
    srv, ref_srv = got["serving"]["models"]["w4_gptq"], want["serving"]["models"]["w4_gptq"]
    assert srv["differing_answers"] == 0 and srv["served_exact_match"] == ref_srv["served_exact_match"]
    assert srv["openai"]["chat"]["differing_answers"] == 0 and got["serving"]["exit_code"] == 0
    assert got["serving"]["try"]["answer"] == want["serving"]["try"]["answer"]
    assert sorted(p.relative_to(run) for p in (run / "serving").rglob("*")) == sorted(
        p.relative_to(ref_dir) for p in (ref_dir / "serving").rglob("*"))
