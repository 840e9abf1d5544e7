"""A Hugging Face tokenizer exported inside a generative model directory: written under
``tokenizer/``, covered by the manifest's hashes, loaded back as the model's ``tokenizer``
(chat template included), and used for ``tokenize`` / ``detokenize``."""

from __future__ import annotations

import pathlib

import gen_testlib as g
import pytest

from cairn import serving
from cairn.core_array import read_checksummed_json
from cairn.serving import ModelFormatError, ModelIntegrityError, Tokenizer

TOKENIZERS = pathlib.Path(__file__).parent / "fixtures" / "tokenizers"
CHAT = [{"role": "user", "content": "what is the 2nd?"}]
def _export(tmp_path, tokenizer, **kw) -> str:
    return serving.export_generator(g.prefill, g.decode, g.init_params(0), tmp_path / "m", cache_specs=g.cache_specs(),
                                    vocab_size=g.VOCAB_SIZE, max_length=g.MAX_LENGTH, tokenizer=tokenizer,
                                    max_batch_size=2, **kw)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[str, Tokenizer]:
    tmp = tmp_path_factory.mktemp("tok")
    folder = g.char_tokenizer(tmp)
    return _export(tmp, folder), Tokenizer.from_pretrained(folder)


def test_tokenizer_round_trips_through_the_model_directory(exported):
    path, tok = exported
    files = sorted(p.name for p in (pathlib.Path(path) / "tokenizer").iterdir())
    assert "tokenizer.json" in files
    manifest = read_checksummed_json(pathlib.Path(path) / "manifest.json")
    assert manifest["generation"]["tokenizer"] == "tokenizer"
    assert "tokenizer/tokenizer.json" in manifest["files"]
    model = serving.load_generator(path)
    text = "the abc, 12 0."
    assert tok.encode(text)[3:6] == [g.VOCAB.index(" "), g.VOCAB.index("ab"), g.VOCAB.index("c")]
    assert model.tokenizer.encode(text) == tok.encode(text)
    assert model.tokenize(text) == tok.encode(text)
    assert model.detokenize(tok.encode(text)) == tok.decode(tok.encode(text), skip_special_tokens=True)
    assert model.tokenizer.apply_chat_template(CHAT) == "<bos>user: what is the 2nd?<eos><bos>assistant: "
    # no eos ids given: the tokenizer's
    assert model.eos_token_ids == (g.EOS_ID,)


def test_python_generator_takes_the_same_tokenizer(tmp_path):
    tok = Tokenizer.from_pretrained(g.char_tokenizer(tmp_path))
    model = serving.PythonGenerator(g.prefill, g.decode, g.init_params(0), cache_specs=g.cache_specs(),
                                    vocab_size=g.VOCAB_SIZE, max_length=g.MAX_LENGTH, tokenizer=tok)
    assert model.tokenizer is tok and model.has_text
    assert model.tokenize("abc") == tok.encode("abc")


def test_an_altered_tokenizer_file_is_refused_by_name(tmp_path):
    path = pathlib.Path(_export(tmp_path, g.char_tokenizer(tmp_path)))
    target = path / "tokenizer" / "tokenizer.json"
    target.write_text(target.read_text().replace('"<eos>"', '"<EOS>"', 1))
    with pytest.raises(ModelIntegrityError, match="tokenizer/tokenizer.json"):
        serving.load_generator(path)


def test_a_tokenizer_with_more_ids_than_the_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer has \d+ ids .*vocab_size=40"):
        _export(tmp_path, TOKENIZERS / "bpe_chatml")
    assert not (tmp_path / "m").exists()


def test_a_bad_tokenizer_argument_is_refused(tmp_path):
    with pytest.raises(TypeError, match="tokenizer must be a cairn.serving.Tokenizer or a tokenizer folder"):
        _export(tmp_path, 42)
    with pytest.raises(FileNotFoundError):
        _export(tmp_path, tmp_path / "no-such-folder")
    assert not (tmp_path / "m").exists()


def test_a_manifest_naming_a_missing_tokenizer_folder_is_a_format_error(tmp_path):
    info = serving._genexport.GenerationInfo(g.VOCAB_SIZE, g.MAX_LENGTH, g.cache_specs(), tokenizer="tokenizer")
    with pytest.raises(ModelFormatError, match="the model's tokenizer does not load"):
        serving._genexport.load_tokenizer(str(tmp_path), info)
    with pytest.raises(ValueError, match="tokenizer must name a folder"):
        serving._genexport.GenerationInfo(g.VOCAB_SIZE, g.MAX_LENGTH, g.cache_specs(), tokenizer="../x")
