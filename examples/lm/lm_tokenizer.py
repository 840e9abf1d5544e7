"""The job's tokenizer: a byte-level BPE trained by the job on its own corpus (``tokenizers``).

``train_bpe(texts, vocab_size)`` learns merges on the job's corpus (the addition problems
and the chat-formatted examples of post-training) the way Llama 3 and Qwen tokenizers are
built: byte-level (every byte has a token, so no text is unknown), digits split one per
token (merged numbers would hide the carries the task is about), merges learned on the
rest (``What``, `` is``, the system prompt's words...). Ids 0, 1, 2 are ``<pad>``, ``<bos>``,
``<eos>`` (the task's ``PAD``/``BOS``/``EOS``), then the chat markers; a post-processor puts
``<bos>`` first, and the chat template (`CHAT_TEMPLATE`) renders a conversation.

The result is a ``cairn.llm.Tokenizer``: saved beside the model (``save_pretrained``, with its
chat template), read back with ``from_pretrained`` by the next stage and by ``cairn-serve``.
`Codec` is its picklable, numpy-facing form for the data workers: ``encode`` (no special
tokens), ``decode``, ``equals_id``. ``tokenizer.kind = "byte"`` keeps the earlier byte
tokenizer (``lm_generate.tokenizer``) with the same interface.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import shutil
from collections.abc import Iterable, Sequence

import numpy as np
import tokenizers

from cairn import llm

SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids lm_task.PAD, BOS, EOS
CHAT_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>")
# one turn per line; an assistant turn ends with <eos> (the generation's stop token)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
    "{% else %}<|assistant|>{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS_FILE = "corpus.sha256"  # beside the saved tokenizer: what it was trained on
SPECIAL_MAP = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}


def train_bpe(texts: Iterable[str], vocab_size: int, pad_to: int | None = None) -> llm.Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens learned on ``texts`` (module docstring).

    Args:
      texts: the corpus.
      vocab_size: the most tokens (specials, the 256 bytes and the merges); at least 264.
      pad_to: fill the vocabulary up to this many ids with reserved special tokens
        (``<|reserved_0|>``...), as Llama 3's tokenizer does: the model's embedding has a
        row per id, and every id it can sample decodes (to nothing).

    Raises:
      ValueError: ``vocab_size`` leaves no room for the bytes and the special tokens.
    """
    base = len(SPECIALS) + len(CHAT_MARKERS) + 256
    if vocab_size < base:
        raise ValueError(f"tokenizer.vocab_size {vocab_size} cannot hold the 256 bytes and the "
                         f"{base - 256} special tokens: use at least {base}")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[*SPECIALS, *CHAT_MARKERS], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer=trainer)
    bpe.post_processor = tokenizers.processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 1)])
    size = bpe.get_vocab_size(with_added_tokens=True)
    if pad_to is not None and pad_to > size:
        bpe.add_special_tokens([tokenizers.AddedToken(f"<|reserved_{i}|>", special=True) for i in range(pad_to - size)])
    return llm.Tokenizer(bpe, dict(SPECIAL_MAP), chat_template=CHAT_TEMPLATE)


def load_or_train(path: pathlib.Path, texts: Iterable[str], vocab_size: int,
                  pad_to: int | None = None) -> tuple[llm.Tokenizer, bool]:
    """The tokenizer saved in ``path`` (a resumed run's), else one trained on ``texts`` and
    saved there (``save_pretrained``: ``tokenizer.json``, ``tokenizer_config.json`` with the
    chat template) with a digest of the corpus and sizes (``corpus.sha256``): a tokenizer
    of another corpus is trained again. Returns ``(tokenizer, trained now)``."""
    texts = list(texts)
    digest = hashlib.sha256(json.dumps([vocab_size, pad_to, texts]).encode()).hexdigest()
    stamp = path / CORPUS_FILE
    if (path / "tokenizer.json").is_file() and stamp.is_file() and stamp.read_text().strip() == digest:
        return llm.Tokenizer.from_pretrained(path), False
    tok = train_bpe(texts, vocab_size, pad_to)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tok.save_pretrained(tmp)
    (tmp / CORPUS_FILE).write_text(digest + "\n")
    if path.exists():  # another corpus' (the data settings changed): replaced
        shutil.rmtree(path)
    tmp.replace(path)  # whole or absent: a run stopped mid-save trains it again
    return tok, True


class Codec:
    """A tokenizer's task-facing form, picklable (data workers get the JSON): ``encode``
    without special tokens as an int32 array, ``decode`` without them, ``equals_id``."""

    def __init__(self, tokenizer_json: str) -> None:
        self.tokenizer_json = tokenizer_json

    @classmethod
    def of(cls, tok: llm.Tokenizer) -> Codec:
        return cls(tok.backend_tokenizer.to_str())

    def __getstate__(self) -> dict:
        return {"tokenizer_json": self.tokenizer_json}

    def __setstate__(self, state: dict) -> None:
        self.tokenizer_json = state["tokenizer_json"]

    @functools.cached_property
    def _backend(self) -> tokenizers.Tokenizer:
        return tokenizers.Tokenizer.from_str(self.tokenizer_json)

    @functools.cached_property
    def equals_id(self) -> int:
        """The id of ``=`` (the answer-only loss starts after it)."""
        ids = self.encode("=")
        if ids.size != 1:
            raise ValueError("the tokenizer does not give '=' a token of its own")
        return int(ids[0])

    @functools.cached_property
    def newline_id(self) -> int:
        """The id of a line break (a worksheet's answer follows its last one)."""
        ids = self.encode("\n")
        if ids.size != 1:
            raise ValueError("the tokenizer does not give a line break a token of its own")
        return int(ids[0])

    def encode(self, text: str | bytes) -> np.ndarray:
        """Ids of ``text`` (bytes are UTF-8 text), no special tokens."""
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", errors="replace")
        return np.asarray(self._backend.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``, special tokens dropped."""
        return self._backend.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)


def describe(tok: llm.Tokenizer, sample: str) -> dict:
    """What the report says about a tokenizer: its size and how it splits ``sample``."""
    ids = tok.encode(sample, add_special_tokens=False)
    return {"vocab_size": len(tok), "sample": sample, "sample_tokens": tok.convert_ids_to_tokens(ids),
            "merges": len(json.loads(tok.backend_tokenizer.to_str())["model"].get("merges", []))}
