"""Streaming detokenization: the pieces IncrementalDecoder emits join to the full decode, for
any id sequence (hypothesis), on byte-level BPE (characters split over tokens), SentencePiece
byte fallback (runs of <0xNN> tokens) and a Unigram model with transformers' space clean-up."""

from __future__ import annotations

import json
import pathlib

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cairn.serving import Tokenizer

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "tokenizers"
NAMES = ("bpe_llama3style", "bpe_chatml", "spm_gemmastyle", "spm_unigram")
TOKS = {name: Tokenizer.from_pretrained(FIXTURES / name) for name in NAMES}
STRINGS = json.loads((FIXTURES / "strings.json").read_text(encoding="utf-8"))


def _interesting(tok: Tokenizer) -> list[int]:
    """Ids that stress the decoder: byte tokens, specials, and tokens that alone are not
    whole characters."""
    special = list(tok.backend_tokenizer.get_added_tokens_decoder())
    partial = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    return sorted(set(special + partial + list(tok._byte_token_ids())))


def _ids(name: str) -> st.SearchStrategy[list[int]]:
    tok = TOKS[name]
    return st.lists(st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(_interesting(tok))), max_size=40)


def _stream(tok: Tokenizer, ids: list[int], skip: bool, prompt: list[int] | None = None) -> list[str]:
    return list(tok.decode_stream(ids, skip_special_tokens=skip, prompt_ids=prompt or ()))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans())
def test_stream_joins_to_full_decode_for_any_ids(name, data, skip):
    tok = TOKS[name]
    ids = data.draw(_ids(name))
    pieces = _stream(tok, ids, skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert all(pieces)


@pytest.mark.parametrize("name", NAMES)
def test_stream_of_real_text_never_emits_a_broken_character(name):
    tok = TOKS[name]
    for s in STRINGS[::7]:
        ids = tok.encode(s)
        pieces = _stream(tok, ids, False)
        assert "".join(pieces) == tok.decode(ids)
        if "\ufffd" not in tok.decode(ids):
            assert not any("\ufffd" in p for p in pieces), (s, pieces)


def test_emoji_split_over_byte_level_tokens_arrives_whole():
    tok = TOKS["bpe_chatml"]
    ids = tok.encode("ok 🤖🚀 done", add_special_tokens=False)
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 2  # the emoji really are split
    dec = tok.incremental_decoder()
    pieces = [dec.step(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == "ok 🤖🚀 done" == dec.text
    assert all("\ufffd" not in p for p in pieces)


def test_byte_fallback_run_waits_for_its_end():
    tok = TOKS["spm_gemmastyle"]
    ids = tok.encode("a 🤖", add_special_tokens=False)
    robot = [i for i in ids if i in tok._byte_token_ids()]
    assert len(robot) == 4  # four <0xNN> tokens
    dec = tok.incremental_decoder()
    out = [dec.step(i) for i in ids]
    assert out[-4:] == ["", "", "", ""]  # a later byte token could still make the run invalid
    assert "".join(out) + dec.flush() == "a 🤖"


def test_prompt_ids_keep_the_leading_space_of_the_continuation():
    tok = TOKS["spm_gemmastyle"]
    prompt, full = tok.encode("Hello"), tok.encode("Hello world again")
    assert full[: len(prompt)] == prompt
    cont = full[len(prompt):]  # what a model would generate after the prompt: "▁world", ...
    assert tok.decode(cont) == "world again"  # alone, the first space is stripped
    assert "".join(_stream(tok, cont, False, prompt)) == " world again"


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
@example(data=None)
def test_stream_after_a_prompt_adds_what_the_ids_add(name, data):
    tok = TOKS[name]
    if data is None:
        a, b = STRINGS[40], STRINGS[41]
    else:
        a, b = data.draw(st.sampled_from(STRINGS)), data.draw(st.sampled_from(STRINGS))
    prompt, cont = tok.encode(a), tok.encode(b, add_special_tokens=False)
    before, full = tok.decode(prompt), tok.decode(prompt + cont)
    if not full.startswith(before) or tok._cleans_up(None):
        return  # the continuation rewrites the prompt's text: no "added text" to compare with
    assert "".join(_stream(tok, cont, False, prompt)) == full[len(before):]


def test_clean_up_in_the_stream_matches_the_full_decode():
    tok = TOKS["spm_unigram"]
    text = "I do n't know , he 's here . ' ok ' n ' t"
    ids = tok.encode(text)
    assert "".join(_stream(tok, ids, False)) == tok.decode(ids) != tok.decode(ids, clean_up_tokenization_spaces=False)


def test_skip_special_tokens_in_the_stream():
    tok = TOKS["bpe_llama3style"]
    ids = tok.apply_chat_template([{"role": "user", "content": "hi 🤖"}], tokenize=True)
    assert "".join(_stream(tok, ids, True)) == tok.decode(ids, skip_special_tokens=True)
    assert "<|eot_id|>" in "".join(_stream(tok, ids, False))
