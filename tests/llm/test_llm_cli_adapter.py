"""``cairn-llm serve BASE --adapter ADAPTER``: a PEFT LoRA adapter (here the one peft 0.21
itself wrote for the llama fixture, tests/llm/fixtures/peft/llama) merged into the base,
exported under a cache key that includes the adapter's files, and served; adapters that do
not fit the base are refused by name before anything is exported."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_llm_cli import _args, _checkpoint  # tests/llm is on sys.path (conftest)

from cairn import llm, nn
from cairn.llm import _cli

PEFT = pathlib.Path(__file__).parent / "fixtures" / "peft"


def _adapter(tmp_path, variant="llama", name="adapter", edit_config=None, edit_tensors=None) -> pathlib.Path:
    """A copy of peft's adapter for ``variant``, optionally edited."""
    folder = tmp_path / name
    folder.mkdir()
    config = json.loads((PEFT / variant / "adapter_config.json").read_text())
    tensors = load_file(str(PEFT / variant / "adapter_model.safetensors"))
    if edit_config:
        edit_config(config)
    if edit_tensors:
        edit_tensors(tensors)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_the_cache_key_follows_the_adapter_files(tmp_path, monkeypatch):
    exports = []

    def fake_export(args, name, repo):  # what prepare checks for: <repo>/<name>/1/manifest.json
        exports.append((args.adapter, name))
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "manifest.json").write_text("{}")

    monkeypatch.setattr(_cli, "_export", fake_export)
    base, a = _checkpoint(tmp_path), _adapter(tmp_path, name="a")
    plain = _cli.prepare(_args(base, tmp_path))
    with_a = _cli.prepare(_args(base, tmp_path, adapter=str(a)))
    assert with_a != plain and (with_a / "a" / "1" / "manifest.json").is_file()  # named after the adapter's folder
    assert _cli.prepare(_args(base, tmp_path, adapter=str(a))) == with_a and len(exports) == 2  # reused
    b = _adapter(tmp_path, name="b", edit_tensors=lambda t: t.update(
        {k: v * 2 for k, v in t.items() if k.endswith("layers.0.self_attn.q_proj.lora_B.weight")}))
    with_b = _cli.prepare(_args(base, tmp_path, adapter=str(b), name="a"))
    assert with_b not in (plain, with_a) and len(exports) == 3  # same name, other adapter contents: a new export
    assert _cli.adapter_digest(a) != _cli.adapter_digest(b)
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        _cli.adapter_digest(tmp_path / "llama")


@pytest.mark.parametrize("setup, match", [
    # shapes from a wider base: the tensor and both shapes are named
    (lambda p: _adapter(p, edit_tensors=lambda t: t.update(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 40), np.float32)})),
     r"layers\.0\.self_attn\.q_proj \(layers/0/attn/q/kernel\): lora_A \(4, 40\) / lora_B \(32, 4\), "
     r"expected \[r, in\] = \(4, 32\)"),
    # a target module this family has not (GPT-2's fused projection)
    (lambda p: _adapter(p, edit_config=lambda c: c["target_modules"].append("c_attn")),
     r"target module 'c_attn' is not a module of this 'llama' model"),
    # a target module listed whose tensors are missing
    (lambda p: _adapter(p, edit_tensors=lambda t: [t.pop(k) for k in list(t) if ".v_proj." in k]),
     r"target module 'v_proj' is in target_modules but the file has no lora_A/lora_B tensor"),
    # a tensor of a layer the base does not have
    (lambda p: _adapter(p, edit_tensors=lambda t: t.update(
        {"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": np.zeros((4, 32), np.float32),
         "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": np.zeros((32, 4), np.float32)})),
     r"no LoRA A/B of a projection.*layers\.7\.self_attn\.q_proj\.lora_A"),
    # peft's adapter for the qwen2 fixture: same shapes, another base model
    (lambda p: _adapter(p, variant="qwen2"),
     r"trained on base_model_name_or_path='qwen2', but the base .*llama is called \['llama'\]; .*--allow-base-mismatch"),
    (lambda p: p / "no-such-adapter", r"no adapter_config.json"),
])
def test_adapters_that_do_not_fit_the_base_are_refused_by_name(tmp_path, capsys, setup, match):
    base, adapter = _checkpoint(tmp_path), setup(tmp_path)
    cache = tmp_path / "cache"
    assert _cli.main(["serve", str(base), "--adapter", str(adapter), "--cache-dir", str(cache), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err, re.S), err
    assert not cache.exists() or not [p for p in cache.iterdir() if p.name != "xla"]  # nothing exported


def test_a_base_mismatch_can_be_overridden(tmp_path, monkeypatch):
    base, adapter = _checkpoint(tmp_path), _adapter(tmp_path, variant="qwen2")
    args = _args(base, tmp_path, adapter=str(adapter), allow_base_mismatch=True)
    model = llm.from_pretrained(base)
    merged = _cli._merge_adapter(model, args)
    want = llm.merge_lora(model, llm.load_lora(adapter, model))
    got, ref = jax.tree.leaves(nn.state(merged, nn.Param)), jax.tree.leaves(nn.state(want, nn.Param))
    assert len(got) == len(ref) and all(np.array_equal(a, b) for a, b in zip(got, ref))
    assert not all(np.array_equal(a, b) for a, b in zip(got, jax.tree.leaves(nn.state(model, nn.Param))))


def _start(argv: list[str]) -> tuple[subprocess.Popen, str, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "cairn.llm._cli", *argv], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines: list[str] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"serving on (http://[\d.]+:\d+)", line)
        if m:
            threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
            return proc, m.group(1), lines
    proc.kill()
    raise AssertionError("cairn-llm serve did not start:\n" + "".join(lines))


@pytest.mark.slow  # a subprocess exports, compiles and serves the model (a minute or more on 2 cores)
def test_served_adapter_answers_equal_the_merged_model_in_process(tmp_path):
    import openai

    base, adapter = _checkpoint(tmp_path), _adapter(tmp_path)
    proc, url, lines = _start(["serve", str(base), "--adapter", str(adapter), "--cache-dir", str(tmp_path / "cache"),
                               "--max-length", "32", "--max-batch-size", "2", "--port", "0", "--num-slots", "2",
                               "--prefill-batch", "1"])
    try:
        assert url.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == ["adapter"]
        prompts = [[3, 8, 12, 40], [5, 6, 7, 8, 9, 10], [60, 2 + 1, 70]]
        served = [client.completions.create(model="adapter", prompt=p, max_tokens=8, temperature=0) for p in prompts]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines)
    tok = llm.Tokenizer.from_pretrained(base)
    model = llm.from_pretrained(base)
    merged = llm.merge_lora(model, llm.load_lora(adapter, model))
    want = llm.generate(merged, prompts, 8, tokenizer=tok, return_logprobs=False)
    plain = llm.generate(model, prompts, 8, tokenizer=tok, return_logprobs=False)
    assert [s.choices[0].text for s in served] == list(want.text)
    assert [s.usage.completion_tokens for s in served] == [len(t) for t in want.tokens]
    assert list(plain.text) != list(want.text)  # the adapter changes the answers
