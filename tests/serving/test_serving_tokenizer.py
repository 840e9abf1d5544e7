"""cairn.serving.Tokenizer against transformers: ids, decodes, padded batches and chat prompts
recorded by tests/serving/fixtures/make_tokenizer_fixtures.py (transformers' AutoTokenizer on four
tokenizers trained in that session), plus save/load round trips and errors. No torch, no
transformers here."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

from cairn.serving import ChatTemplateError, Tokenizer

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "tokenizers"
NAMES = ("bpe_llama3style", "bpe_chatml", "spm_gemmastyle", "spm_unigram")
STRINGS = json.loads((FIXTURES / "strings.json").read_text(encoding="utf-8"))
_CASES: dict[str, dict] = {}
USER = [{"role": "user", "content": "hi"}]


def cases(name: str) -> dict:
    if name not in _CASES:
        _CASES[name] = json.loads((FIXTURES / name / "cases.json").read_text(encoding="utf-8"))
    return _CASES[name]


@pytest.fixture(params=NAMES)
def name(request) -> str:
    return request.param


@pytest.fixture
def tok(name) -> Tokenizer:
    return Tokenizer.from_pretrained(FIXTURES / name)


def test_fixtures_cover_thousands_of_strings():
    assert len(STRINGS) >= 2000
    assert sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file()) < 2_000_000
    assert any("\U0001f916" in s for s in STRINGS) and any("   " in s for s in STRINGS)
    assert any("<|im_start|>" in s and s != "<|im_start|>" for s in STRINGS)


def test_ids_equal_transformers(name, tok):
    expected = cases(name)["ids"]
    got = [tok.encode(s) for s in STRINGS]
    mismatched = [(s, g, e) for s, g, e in zip(STRINGS, got, expected) if g != e]
    assert not mismatched, f"{len(mismatched)} strings differ, first: {mismatched[0]}"


def test_ids_without_special_tokens_equal_transformers(name, tok):
    expected = cases(name)["ids_no_special"]
    assert [tok.encode(s, add_special_tokens=False) for s in STRINGS[: len(expected)]] == expected


def test_special_tokens_and_sizes_equal_transformers(name, tok):
    c = cases(name)
    assert len(tok) == c["len"] and tok.vocab_size == c["vocab_size"]
    assert tok.special_tokens_map == c["special_tokens_map"]
    assert sorted(tok.all_special_ids) == c["all_special_ids"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        c["bos_token_id"], c["eos_token_id"], c["pad_token_id"], c["unk_token_id"])
    assert tok.padding_side == c["padding_side"]


def test_pad_token_only_in_the_config_is_added_as_transformers_does():
    tok = Tokenizer.from_pretrained(FIXTURES / "spm_gemmastyle")
    raw = json.loads((FIXTURES / "spm_gemmastyle" / "tokenizer.json").read_text())
    assert "<pad>" not in {t["content"] for t in raw["added_tokens"]}
    assert tok.pad_token_id == len(tok) - 1 == cases("spm_gemmastyle")["pad_token_id"]
    assert tok.encode("a<pad>b", add_special_tokens=False).count(tok.pad_token_id) == 1


def test_decode_equals_transformers(name, tok):
    c = cases(name)
    for d in c["decodes"]:
        ids = c["ids"][d["index"]]
        assert tok.decode(ids) == d["text"], ids
        assert tok.decode(ids, skip_special_tokens=True) == d["skip"], ids
    for d in c["random_decodes"]:
        assert tok.decode(d["ids"]) == d["text"], d["ids"]
        assert tok.decode(d["ids"], skip_special_tokens=True) == d["skip"], d["ids"]
    assert tok.batch_decode([d["ids"] for d in c["random_decodes"][:5]]) == [
        d["text"] for d in c["random_decodes"][:5]]


def test_clean_up_spaces_follows_transformers_per_model_kind():
    # both configs ask for the clean-up; transformers 5 applies it to the Unigram model only
    bpe, uni = Tokenizer.from_pretrained(FIXTURES / "bpe_llama3style"), Tokenizer.from_pretrained(FIXTURES / "spm_unigram")
    text = "I do n't know , he 's here ."
    assert bpe.decode(bpe.encode(text, add_special_tokens=False)) == text
    assert uni.decode(uni.encode(text, add_special_tokens=False)) == "I don't know, he's here."
    assert uni.decode(uni.encode(text, add_special_tokens=False), clean_up_tokenization_spaces=False) == text


@pytest.mark.parametrize("name", ["bpe_llama3style", "bpe_chatml", "spm_gemmastyle"])
def test_lossless_tokenizers_round_trip_every_string(name):
    tok = Tokenizer.from_pretrained(FIXTURES / name)
    strings = STRINGS
    if name.startswith("spm"):  # the normalizer prepends "▁" to the text after a special token too
        strings = [s for s in STRINGS if not any(t in s for t in tok.all_special_tokens)]
        assert len(strings) > 1500
    for s in strings:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s


def test_convert_ids_to_tokens_equals_transformers(name, tok):
    c = cases(name)
    assert [tok.convert_ids_to_tokens(ids) for ids in c["ids"][:50]] == c["tokens"]
    ids = c["ids"][7]
    assert tok.convert_ids_to_tokens(ids[0]) == c["tokens"][7][0]
    assert tok.convert_tokens_to_ids(c["tokens"][7]) == ids


def test_padded_batches_equal_transformers(name, tok):
    for b in cases(name)["batches"]:
        kwargs = {k: b[k] for k in ("padding_side", "padding", "max_length", "truncation") if k in b}
        out = tok(b["texts"], **kwargs)
        np.testing.assert_array_equal(out["input_ids"], np.array(b["input_ids"]))
        np.testing.assert_array_equal(out["attention_mask"], np.array(b["attention_mask"]))
        assert out["input_ids"].dtype == np.int32


def test_batch_encode_shapes_and_masks():
    tok = Tokenizer.from_pretrained(FIXTURES / "bpe_chatml")
    texts = ["a", "hello world and more", ""]
    rows = [tok.encode(t) for t in texts]
    out = tok.batch_encode(texts, padding_side="right", pad_to_multiple_of=8)
    assert out["input_ids"].shape == (3, 8)
    for i, row in enumerate(rows):
        assert out["input_ids"][i, : len(row)].tolist() == row
        assert out["attention_mask"][i].tolist() == [1] * len(row) + [0] * (8 - len(row))
        assert (out["input_ids"][i, len(row):] == tok.pad_token_id).all()
    single = tok("hello world")
    assert single["input_ids"].shape == (1, len(tok.encode("hello world")))
    truncated = tok.encode("hello world and more", truncation=True, max_length=2)
    assert truncated == rows[1][:2]


def test_truncation_keeps_the_special_tokens():
    tok = Tokenizer.from_pretrained(FIXTURES / "bpe_llama3style")
    full = tok.encode("hello world and more text")
    assert tok.encode("hello world and more text", truncation=True, max_length=3) == full[:3]
    assert full[0] == tok.bos_token_id
    tok.truncation_side = "left"
    assert tok.encode("hello world and more text", truncation=True, max_length=3) == [full[0], *full[-2:]]


def test_chat_templates_equal_transformers(name, tok):
    for case in cases(name)["chat"]:
        messages, kwargs = case["messages"], case["kwargs"]
        if "masked" in case:
            got = tok.apply_chat_template(messages, tokenize=True, return_assistant_tokens_mask=True, **kwargs)
            assert got == case["masked"], case["name"]
            assert 0 < sum(got["assistant_masks"]) < len(got["input_ids"])
            continue
        if "error" in case:
            with pytest.raises(ChatTemplateError) as err:
                tok.apply_chat_template(messages, **kwargs)
            reference = case["error"].split(": ", 1)[1]
            assert reference in str(err.value), case["name"]
            continue
        assert tok.apply_chat_template(messages, **kwargs) == case["text"], case["name"]
        assert tok.apply_chat_template(messages, tokenize=True, **kwargs) == case["ids"], case["name"]


def test_assistant_masks_cover_exactly_the_generation_blocks():
    tok = Tokenizer.from_pretrained(FIXTURES / "bpe_chatml")
    convs = [cases("bpe_chatml")["chat"][0]["messages"] + [{"role": "assistant", "content": "Bonjour 🤖"}]] * 2
    out = tok.apply_chat_template(convs, tokenize=True, return_assistant_tokens_mask=True, chat_template="sft",
                                  add_generation_prompt=False)
    ids, mask = out["input_ids"][1], out["assistant_masks"][1]
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Bonjour 🤖<|im_end|>"
    with pytest.raises(ChatTemplateError, match="no {% generation %} block"):
        tok.apply_chat_template(convs[0], tokenize=True, return_assistant_tokens_mask=True)
    with pytest.raises(ValueError, match="needs tokenize=True"):
        tok.apply_chat_template(convs[0], return_assistant_tokens_mask=True, chat_template="sft")


def test_raise_exception_gives_the_templates_message_exactly():
    tok = Tokenizer.from_pretrained(FIXTURES / "bpe_llama3style")
    with pytest.raises(ChatTemplateError) as err:
        tok.apply_chat_template([{"role": "critic", "content": "x"}])
    assert str(err.value) == "Unknown role: critic"


def test_chat_batch_and_default_generation_prompt():
    tok = Tokenizer.from_pretrained(FIXTURES / "bpe_chatml")
    convs = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    texts = tok.apply_chat_template(convs)
    assert texts == [tok.apply_chat_template(c) for c in convs]
    assert all(t.endswith("<|im_start|>assistant\n") for t in texts)
    assert tok.apply_chat_template(convs, tokenize=True) == [tok.encode(t, add_special_tokens=False) for t in texts]


def test_eos_token_ids_join_generation_config():
    tok = Tokenizer.from_pretrained(FIXTURES / "bpe_llama3style")
    eot, eot_text = tok.convert_tokens_to_ids("<|eot_id|>"), tok.convert_tokens_to_ids("<|end_of_text|>")
    assert tok.eos_token_id == eot
    assert tok.eos_token_ids == (eot, eot_text)
    assert Tokenizer.from_pretrained(FIXTURES / "bpe_chatml").eos_token_ids == (
        cases("bpe_chatml")["eos_token_id"],)


def test_save_pretrained_round_trips(name, tok, tmp_path):
    written = tok.save_pretrained(tmp_path / "out")
    again = Tokenizer.from_pretrained(tmp_path / "out")
    assert [again.encode(s) for s in STRINGS] == cases(name)["ids"]
    assert (len(again), again.special_tokens_map, again.eos_token_ids, again.padding_side) == (
        len(tok), tok.special_tokens_map, tok.eos_token_ids, tok.padding_side)
    assert again.chat_template == tok.chat_template
    for case in cases(name)["chat"]:
        if "text" in case:
            assert again.apply_chat_template(case["messages"], **case["kwargs"]) == case["text"]
    assert str(tmp_path / "out" / "tokenizer.json") in written
    if tok.chat_template is not None:
        assert (tmp_path / "out" / "chat_template.jinja").exists() == (
            not isinstance(tok.chat_template, dict) or "default" in tok.chat_template)


def test_settings_changed_after_loading_are_saved(tmp_path):
    tok = Tokenizer.from_pretrained(FIXTURES / "bpe_llama3style")
    assert tok.pad_token is None
    tok.pad_token, tok.padding_side = tok.eos_token, "left"
    batch = tok(["a", "a longer text"])
    assert batch["input_ids"][0, 0] == tok.eos_token_id and batch["attention_mask"][0, 0] == 0
    with pytest.raises(ValueError, match="'<absent>' is not in the vocabulary"):
        tok.pad_token = "<absent>"
    tok.save_pretrained(tmp_path)
    again = Tokenizer.from_pretrained(tmp_path)
    assert (again.pad_token, again.padding_side) == ("<|eot_id|>", "left")
    np.testing.assert_array_equal(again(["a", "a longer text"])["input_ids"], batch["input_ids"])


def test_chat_template_file_wins_over_config_and_json_is_last(tmp_path):
    shutil.copytree(FIXTURES / "spm_unigram", tmp_path / "t")
    (tmp_path / "t" / "chat_template.jinja").write_text("{{ messages | length }} from jinja")
    assert Tokenizer.from_pretrained(tmp_path / "t").apply_chat_template([{"role": "user", "content": "x"}]) == "1 from jinja"
    config = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "t" / "chat_template.jinja").unlink()
    (tmp_path / "t" / "chat_template.json").write_text(json.dumps({"chat_template": "json {{ bos_token is defined }}"}))
    assert Tokenizer.from_pretrained(tmp_path / "t").apply_chat_template([{"role": "user", "content": "x"}]) == "json False"


def test_no_chat_template_names_where_it_looked(tmp_path):
    shutil.copy(FIXTURES / "bpe_chatml" / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ChatTemplateError, match="no chat template") as err:
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert str(tmp_path) in str(err.value) and "tokenizer_config.json" in str(err.value)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ messages[0].content }}!") == "x!"


def test_missing_or_broken_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer folder"):
        Tokenizer.from_pretrained(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        Tokenizer.from_pretrained(tmp_path / "empty")
    assert str(tmp_path / "empty" / "tokenizer.json") in str(err.value)
    shutil.copy(FIXTURES / "bpe_chatml" / "tokenizer.json", tmp_path / "empty" / "tokenizer.json")
    (tmp_path / "empty" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_pretrained(tmp_path / "empty")
    (tmp_path / "empty" / "tokenizer_config.json").unlink()
    (tmp_path / "empty" / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ValueError, match="tokenizer.json could not be read"):
        Tokenizer.from_pretrained(tmp_path / "empty")


def test_bad_encode_arguments_say_what_was_expected():
    tok = Tokenizer.from_pretrained(FIXTURES / "bpe_llama3style")  # no pad token
    with pytest.raises(ValueError, match="needs a pad token"):
        tok(["a", "a longer text"])
    assert tok(["same", "same"])["input_ids"].shape[0] == 2
    with pytest.raises(ValueError, match="padding=False"):
        tok(["a", "a longer text"], padding=False)
    with pytest.raises(ValueError, match="padding_side"):
        tok("a", padding_side="middle")
    with pytest.raises(ValueError, match="max_length"):
        tok.encode("a", truncation=True, max_length=0)
    with pytest.raises(TypeError, match="must be a str"):
        tok.encode(["a"])
    with pytest.raises(TypeError, match="list of strings"):
        tok.batch_encode("a")
    with pytest.raises(ValueError, match=r"token id 905 is outside this tokenizer's vocabulary \[0, 905\)"):
        tok.decode([1, 905])
    with pytest.raises(ValueError, match="token id -1"):
        tok.incremental_decoder().step(-1)
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([])


def test_special_token_strings_and_stream_extend():
    tok = Tokenizer.from_pretrained(FIXTURES / "spm_gemmastyle")
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == ("<bos>", "<eos>", "<unk>", "<pad>")
    assert tok.additional_special_tokens == ["<start_of_turn>", "<end_of_turn>"]
    ids = tok.encode("Hello 🤖 world")
    dec = tok.incremental_decoder()
    assert dec.extend(ids[:4]) + dec.extend(ids[4:]) + dec.flush() == tok.decode(ids) == dec.text


def test_split_special_tokens_encodes_them_as_text(tmp_path):
    shutil.copytree(FIXTURES / "bpe_chatml", tmp_path / "t")
    config = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    tok = Tokenizer.from_pretrained(tmp_path / "t")
    assert tok.backend_tokenizer.encode_special_tokens
    ids = tok.encode("<|im_start|>")
    assert len(ids) > 1 and tok.convert_tokens_to_ids("<|im_start|>") not in ids
    assert tok.decode(ids) == "<|im_start|>"


def test_older_layouts_special_tokens_map_and_named_extra_tokens(tmp_path):
    shutil.copy(FIXTURES / "bpe_chatml" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"extra_special_tokens": {"image_token": "<image>"}}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False}, "pad_token": "<|endoftext|>"}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    image = tok.convert_tokens_to_ids("<image>")
    assert image == len(tok) - 1 and tok.encode("a<image>b").count(image) == 1  # added, as transformers does
    assert image in tok.all_special_ids
    # transformers 5.24 on this folder: {'eos_token': '<|im_end|>', 'pad_token': '<|endoftext|>', 'image_token': '<image>'}
    assert tok.special_tokens_map == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "image_token": "<image>"}
    assert tok.apply_chat_template(USER, chat_template="{{ image_token }}{{ bos_token is defined }}") == "<image>False"
