"""``cairn-llm serve``: the checkpoint's cache key, flags passed on to cairn-serve, clear
errors, and (once cairn.llm has ``export_for_serving``) one export reused across starts
and served to the official ``openai`` client."""

import argparse
import pathlib
import shutil

import pytest
import tokenizers

import cairn.llm
from cairn.llm import _cli
from cairn.serving import Tokenizer

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "llama"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


def _checkpoint(tmp_path) -> pathlib.Path:
    """The llama fixture with a word-level tokenizer over its 96 ids (and a chat template)."""
    path = tmp_path / "llama"
    shutil.copytree(FIXTURE, path)
    words = ["<unk>", "<s>", "</s>", *[chr(c) for c in range(ord("a"), ord("a") + 26)],
             *[f"w{i}" for i in range(96 - 29)]]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in words[:3]])
    tok = Tokenizer(backend, {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}, chat_template=TEMPLATE)
    tok.save_pretrained(path)
    return path


def _args(path, tmp_path, **kw) -> argparse.Namespace:
    args = _cli.parser().parse_args(["serve", str(path), "--cache-dir", str(tmp_path / "cache"), "--max-length", "32",
                                     "--max-batch-size", "2"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_the_cache_key_follows_the_files_and_the_options(tmp_path):
    path = _checkpoint(tmp_path)
    key = _cli.checkpoint_key(path, {"max_length": 32})
    assert key == _cli.checkpoint_key(path, {"max_length": 32}) and len(key) == 32
    assert key != _cli.checkpoint_key(path, {"max_length": 64})
    (path / "config.json").write_text((path / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert key != _cli.checkpoint_key(path, {"max_length": 32})
    with pytest.raises(FileNotFoundError, match="no config.json"):
        _cli.checkpoint_key(tmp_path, {})


def test_bad_invocations_fail_before_exporting(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(_cli, "_export", lambda *a: calls.append(a))
    assert _cli.main(["serve", str(FIXTURE), "--cache-dir", str(tmp_path), "--no-such-flag"]) == 2
    assert _cli.main(["serve", str(FIXTURE), "--model-repository", str(tmp_path)]) == 2
    assert "do not pass --model-repository" in capsys.readouterr().err
    assert _cli.main(["serve", str(tmp_path / "missing"), "--cache-dir", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli.main(["serve", str(FIXTURE), "--quantize", "int3"])
    assert calls == []


def test_without_export_for_serving_the_error_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.delattr(cairn.llm, "export_for_serving", raising=False)
    assert _cli.main(["serve", str(_checkpoint(tmp_path)), "--cache-dir", str(tmp_path / "c"), "--port", "0"]) == 2
    assert "no export_for_serving" in capsys.readouterr().err
    assert not any((tmp_path / "c").iterdir())  # nothing half written


@pytest.mark.slow
def test_serve_exports_once_and_speaks_openai(tmp_path, monkeypatch):
    if not hasattr(cairn.llm, "export_for_serving"):
        pytest.skip("cairn.llm.export_for_serving is not in this tree yet")
    import openai

    from cairn import serving

    path = _checkpoint(tmp_path)
    calls = []
    real = cairn.llm.export_for_serving
    monkeypatch.setattr(cairn.llm, "export_for_serving", lambda *a, **k: calls.append(1) or real(*a, **k))
    repo = _cli.prepare(_args(path, tmp_path))
    assert _cli.prepare(_args(path, tmp_path)) == repo and len(calls) == 1  # the second start reuses the export
    assert (repo / "llama" / "1" / "manifest.json").is_file()
    with serving.serve(repo, generation=serving.GenerationConfig(num_slots=2, prefill_batch=1)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == ["llama"]
        out = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "a b"}], max_tokens=4,
                                             temperature=0)
        assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_quantize_int8_exports_int8_matrices_and_a_prompt_scorer(tmp_path):
    from cairn import serving

    path = _checkpoint(tmp_path)
    _cli._export(_args(path, tmp_path, quantize="int8"), "m", tmp_path / "repo")
    model = serving.load_generator(tmp_path / "repo" / "m" / "1")
    # the loaded weights are flat: a QArray appears as <path>/qvalue and <path>/scale
    qvalues = {p: x for p, x in model.weights.items() if p.endswith("/qvalue")}
    assert qvalues and all("/mlp/" in p or "/attn/" in p for p in qvalues)
    assert {str(x.dtype) for x in qvalues.values()} == {"int8"}
    assert model.has_score  # echo + logprobs on the OpenAI route
