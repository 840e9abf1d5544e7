"""Hugging Face tokenizer folders: ``tokenizer.json`` through the ``tokenizers`` library,
special tokens and chat templates from the files beside it, and streaming detokenization.

A folder as checkpoints ship it (what `Tokenizer.from_pretrained` reads and
`Tokenizer.save_pretrained` writes)::

    tokenizer.json                      the tokenizer itself (required)
    tokenizer_config.json               special tokens, padding side, chat_template
    special_tokens_map.json             older special-token file (read when the config has no
                                        added_tokens_decoder)
    chat_template.jinja                 the chat template (newer layout; wins over the config's)
    additional_chat_templates/*.jinja   more templates, by name (e.g. tool_use)
    chat_template.json                  {"chat_template": ...} (processor layout; last resort)
    generation_config.json              eos_token_id: the ids generation stops on

Encoding and decoding follow transformers' fast tokenizers, so ids are the same: named special
tokens missing from ``tokenizer.json`` are added as special tokens; the post-processor of
``tokenizer.json`` alone decides which special tokens ``encode`` adds (transformers 5 ignores
the config's ``add_bos_token`` / ``add_eos_token`` too); ``clean_up_tokenization_spaces``
applies to non-BPE models only, as transformers 5 does.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken

from cairn.serving._chat_template import ChatTemplateError, render_chat, render_chat_with_spans

__all__ = ["IncrementalDecoder", "Tokenizer"]

_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_TEMPLATE_DIR = "additional_chat_templates"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# characters that no clean-up pattern contains: the clean-up of text split at one is exact per piece
_CLEANUP_ALPHABET = frozenset(" .?!,'ntmsver")


def clean_up_tokenization(text: str) -> str:
    """Drop the space before punctuation and English contractions (" ." -> ".",
    " n't" -> "n't"), as older WordPiece/SentencePiece tokenizers' decode did.

    >>> clean_up_tokenization("I do n't know , he 's here .")
    "I don't know, he's here."
    """
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text


def _content(value: Any) -> str | None:
    """A special token from a config: a string, or an AddedToken dict with ``content``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"a special token is a string or a dict with 'content', got {value!r}")


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def _read_templates(folder: pathlib.Path, config: Mapping[str, Any]) -> tuple[str | dict[str, str] | None, str]:
    """The chat template(s) of a folder and the file they came from, in transformers' order:
    chat_template.jinja (+ additional_chat_templates/) over the config's over chat_template.json."""
    found: dict[str, str] = {}
    origin = ""
    if (folder / "chat_template.jinja").is_file():
        found["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        origin = str(folder / "chat_template.jinja")
    extra = sorted((folder / _TEMPLATE_DIR).glob("*.jinja")) if (folder / _TEMPLATE_DIR).is_dir() else []
    for path in extra:
        found[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
        origin = origin or str(folder / _TEMPLATE_DIR)
    if found:
        return (found["default"] if list(found) == ["default"] else found), origin
    value, name = config.get("chat_template"), "tokenizer_config.json"
    if value is None:
        value, name = _chat_template_json(folder), "chat_template.json"
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        value = {item["name"]: item["template"] for item in value}
    if value is not None:
        return value, str(folder / name)
    return None, ""


def _chat_template_json(folder: pathlib.Path) -> Any:
    path = folder / "chat_template.json"
    return _read_json(path).get("chat_template") if path.is_file() else None


def _special_token(key: str) -> property:
    """A named special token: reads give its text (None when unset); an assignment such as
    ``tok.pad_token = tok.eos_token`` must name a token of the vocabulary."""
    return property(lambda self: self._special[key], lambda self, value: self._set_special(key, value),
                    doc=f"The {key.replace('_', ' ')} (text), or None.")


class Tokenizer:
    """A Hugging Face tokenizer: ``tokenizer.json`` run by the ``tokenizers`` library, with the
    special tokens, padding side and chat template of its folder. Names follow transformers'
    (``encode``, ``decode``, ``batch_decode``, ``apply_chat_template``, ``eos_token_id``...).

    Usually loaded with `from_pretrained`; built here from a tiny in-memory model:

    Args:
      backend: the ``tokenizers.Tokenizer`` (what ``tokenizer.json`` holds).
      config: the contents of ``tokenizer_config.json`` (special tokens, padding and truncation
        side, clean-up...); None for none.
      chat_template: the jinja2 chat template, or ``{name: template}`` when there are several; None
        for none.
      chat_template_origin: where the template came from, named in error messages.
      generation_config: the contents of ``generation_config.json`` (extra EOS ids...); None for
        none.
      name_or_path: the folder it was loaded from, named in messages.

    >>> from tokenizers import decoders, models, pre_tokenizers
    >>> backend = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hello": 2, "world": 3},
    ...                                                 unk_token="<unk>"))
    >>> backend.pre_tokenizer, backend.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    >>> tok = Tokenizer(backend, {"eos_token": "</s>", "unk_token": "<unk>"},
    ...                 chat_template="{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}")
    >>> tok.encode("hello world"), tok.eos_token_id
    ([2, 3], 1)
    >>> tok.decode([2, 3, 1]), tok.decode([2, 3, 1], skip_special_tokens=True)
    ('hello world </s>', 'hello world')
    >>> tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
    [2, 1]
    """

    def __init__(self, backend: tokenizers.Tokenizer, config: Mapping[str, Any] | None = None, *,
                 chat_template: str | Mapping[str, str] | None = None, chat_template_origin: str = "",
                 generation_config: Mapping[str, Any] | None = None, name_or_path: str = "") -> None:
        self._backend = backend
        self._config = dict(config or {})
        self.chat_template = dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
        self._template_origin = chat_template_origin or "the tokenizer's chat_template"
        self._generation_config = dict(generation_config or {})
        self.name_or_path = name_or_path
        cfg = self._config
        extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
        # model-specific named tokens ("image_token": "<image>", as keys or as a dict of extra
        # tokens) join the named ones, as in transformers 5: templates see them by name
        named = {k: v for k, v in cfg.items() if k.endswith("_token") and k not in _NAMED and isinstance(v, str)}
        named.update(extra if isinstance(extra, Mapping) else {})
        self._special = {k: _content(cfg.get(k)) for k in _NAMED} | {k: _content(v) for k, v in named.items()}
        self._extra_special = [] if isinstance(extra, Mapping) else [_content(t) for t in extra]
        self.padding_side = cfg.get("padding_side", "right")
        self.truncation_side = cfg.get("truncation_side", "right")
        self.model_max_length = cfg.get("model_max_length")
        self.clean_up_tokenization_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        self._cleanup_bpe = bool(cfg.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))
        self._add_missing_tokens()
        backend.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
        self._byte_ids: frozenset[int] | None = None

    # --- loading and saving ---
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a tokenizer folder (see the module docstring for the files read).

        Raises FileNotFoundError naming the path when the folder or its ``tokenizer.json`` is
        missing, ValueError naming the file when one is not valid JSON.

        Args:
          path: the tokenizer folder (with ``tokenizer.json``).
        """
        folder = pathlib.Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"no tokenizer folder at {folder}")
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} not found: cairn.serving.Tokenizer reads the tokenizers-library "
                                    "file tokenizer.json (SentencePiece .model or vocab.txt folders need converting "
                                    "with transformers first)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # the Rust side raises a bare Exception
            raise ValueError(f"{tokenizer_file} could not be read by the tokenizers library: {err}") from err
        config_file = folder / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        special_map_file = folder / "special_tokens_map.json"
        if "added_tokens_decoder" not in config and special_map_file.is_file():
            config.update(_read_json(special_map_file))  # the older layout: this file names the tokens
        template, origin = _read_templates(folder, config)
        gen_file = folder / "generation_config.json"
        generation = _read_json(gen_file) if gen_file.is_file() else {}
        return cls(backend, config, chat_template=template, chat_template_origin=origin,
                   generation_config=generation, name_or_path=str(folder))

    def save_pretrained(self, path: str | os.PathLike) -> list[str]:
        """Write the folder back: ``tokenizer.json``, ``tokenizer_config.json`` (with the added
        tokens), the chat template(s) as ``chat_template.jinja`` (+ ``additional_chat_templates/``)
        and ``generation_config.json`` when one was read and ``path`` has none (a model's own
        save writes that file). Returns the files written. ``from_pretrained`` of the folder
        encodes, decodes and renders exactly as this tokenizer does.

        Args:
          path: the folder to write (created if missing).
        """
        folder = pathlib.Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        written = [folder / "tokenizer.json", folder / "tokenizer_config.json"]
        self._backend.save(str(written[0]))
        config = {k: v for k, v in self._config.items() if k != "chat_template"}
        config.update(padding_side=self.padding_side, truncation_side=self.truncation_side,
                      clean_up_tokenization_spaces=self.clean_up_tokenization_spaces)
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        for key, value in self._special.items():  # write back tokens set after loading
            if value != _content(config.get(key)):
                config[key] = value
        config["added_tokens_decoder"] = {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in sorted(self._backend.get_added_tokens_decoder().items())}
        written[1].write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        templates = self.chat_template if isinstance(self.chat_template, dict) else (
            {"default": self.chat_template} if self.chat_template is not None else {})
        for name, text in templates.items():
            target = folder / ("chat_template.jinja" if name == "default" else f"{_TEMPLATE_DIR}/{name}.jinja")
            target.parent.mkdir(exist_ok=True)
            target.write_text(text, encoding="utf-8")
            written.append(target)
        gen_file = folder / "generation_config.json"
        if self._generation_config and not gen_file.exists():
            gen_file.write_text(json.dumps(self._generation_config, indent=2) + "\n", encoding="utf-8")
            written.append(gen_file)
        return [str(p) for p in written]

    def _add_missing_tokens(self) -> None:
        """Add what the config declares but tokenizer.json lacks, as transformers does: its
        added_tokens_decoder entries, then the named and extra special tokens."""
        present = {t.content for t in self._backend.get_added_tokens_decoder().values()}
        for _, entry in sorted(((int(i), e) for i, e in (self._config.get("added_tokens_decoder") or {}).items()),
                               key=lambda ie: ie[0]):
            token = AddedToken(**{k: v for k, v in entry.items() if k != "__type"})
            if token.content not in present:
                (self._backend.add_special_tokens if token.special else self._backend.add_tokens)([token])
                present.add(token.content)
        for content in [*self._special.values(), *self._extra_special]:
            if content is not None and content not in present:
                self._backend.add_special_tokens([AddedToken(content, special=True, normalized=False)])
                present.add(content)

    # --- vocabulary and special tokens ---
    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer:
        """The ``tokenizers.Tokenizer`` doing the work (transformers' name)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, without added tokens (``len(tok)`` counts those too)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _set_special(self, key: str, value: str | None) -> None:
        if value is not None and self._backend.token_to_id(value) is None:
            raise ValueError(f"{key} {value!r} is not in the vocabulary; add it first with "
                             f"tok.backend_tokenizer.add_special_tokens([{value!r}])")
        self._special[key] = value

    bos_token = _special_token("bos_token")
    eos_token = _special_token("eos_token")
    unk_token = _special_token("unk_token")
    pad_token = _special_token("pad_token")
    bos_token_id = property(lambda self: self._id(self._special["bos_token"]))
    eos_token_id = property(lambda self: self._id(self._special["eos_token"]))
    unk_token_id = property(lambda self: self._id(self._special["unk_token"]))
    pad_token_id = property(lambda self: self._id(self._special["pad_token"]))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id generation stops on: the tokenizer's ``eos_token_id`` and those of
        ``generation_config.json`` (Llama 3 Instruct stops on both end-of-text and end-of-turn)."""
        ids = [] if self.eos_token_id is None else [self.eos_token_id]
        gen = self._generation_config.get("eos_token_id")
        ids += [gen] if isinstance(gen, int) else list(gen or [])
        return tuple(dict.fromkeys(int(i) for i in ids))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set (``bos_token``, ``eos_token``, ..., and
        model-specific ones such as ``image_token``): the variables a chat template sees."""
        return {k: v for k, v in self._special.items() if v is not None}

    @property
    def additional_special_tokens(self) -> list[str]:
        return [t for t in self._extra_special if t is not None]

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.additional_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in (self._id(t) for t in self.all_special_tokens) if i is not None]

    def convert_ids_to_tokens(self, ids: int | Sequence[int],
                              skip_special_tokens: bool = False) -> str | None | list[str | None]:
        """Ids to token strings (None for an id outside the vocabulary).

        Args:
          ids: one id or a sequence of ids.
          skip_special_tokens: leave the special tokens out (for a sequence).
        """
        if isinstance(ids, (int, np.integer)):
            return self._backend.id_to_token(int(ids))
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in special]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """Token strings to ids; a token not in the vocabulary gives ``unk_token_id`` (None
        when there is no unknown token).

        Args:
          tokens: one token string or a sequence of them.
        """
        if isinstance(tokens, str):
            found = self._backend.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]  # type: ignore[misc]

    # --- encoding ---
    def _encode_one(self, text: str, add_special_tokens: bool, max_length: int | None) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text to encode must be a str, got a {type(text).__name__}")
        if max_length is None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        encoding = self._backend.encode(text, add_special_tokens=False)
        room = max_length - (self._backend.num_special_tokens_to_add(False) if add_special_tokens else 0)
        if room < 0:
            raise ValueError(f"max_length={max_length} leaves no room: the special tokens alone take "
                             f"{max_length - room}")
        encoding.truncate(room, direction=self.truncation_side)
        return self._backend.post_process(encoding, None, add_special_tokens).ids

    def _truncation_length(self, truncation: bool, max_length: int | None) -> int | None:
        if not truncation:
            return None
        length = max_length if max_length is not None else self.model_max_length
        if length is None:
            raise ValueError("truncation=True needs max_length (this tokenizer's config has no model_max_length)")
        return int(length)

    def encode(self, text: str, add_special_tokens: bool = True, *, truncation: bool = False,
               max_length: int | None = None) -> list[int]:
        """Token ids of ``text``, with the special tokens the post-processor adds (a BOS for
        Llama-style tokenizers) unless ``add_special_tokens=False``. With ``truncation``, at
        most ``max_length`` ids (special tokens included), cut on ``truncation_side``.

        Args:
          text: the text to encode.
          add_special_tokens: let the post-processor add its special tokens (a BOS...).
          truncation: cut to ``max_length`` ids on ``truncation_side``.
          max_length: the most ids with ``truncation`` (special tokens included); None uses
            ``model_max_length``.
        """
        return self._encode_one(text, add_special_tokens, self._truncation_length(truncation, max_length))

    def __call__(self, text: str | Sequence[str], *, add_special_tokens: bool = True,
                 padding: bool | str = True, truncation: bool = False, max_length: int | None = None,
                 pad_to_multiple_of: int | None = None, padding_side: str | None = None) -> dict[str, np.ndarray]:
        """Encode a string or a batch into ``{"input_ids", "attention_mask"}``, int32 arrays of
        shape ``[batch, length]`` (a single string is a batch of one).

        ``padding``: True or ``"longest"`` pads to the longest row, ``"max_length"`` to
        ``max_length``, False requires rows of equal length. Pads go on ``padding_side``
        (default: the config's ``padding_side``, else right) with ``pad_token_id`` and mask 0.
        """
        texts = [text] if isinstance(text, str) else list(text)
        rows = [self._encode_one(t, add_special_tokens, self._truncation_length(truncation, max_length))
                for t in texts]
        side = padding_side or self.padding_side
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
        longest = max((len(r) for r in rows), default=0)
        if padding == "max_length":
            if max_length is None:
                raise ValueError("padding='max_length' needs max_length")
            width = max(int(max_length), longest)
        elif padding in (True, "longest"):
            width = longest
        elif padding in (False, "do_not_pad"):
            if any(len(r) != longest for r in rows):
                raise ValueError(f"rows have different lengths {sorted({len(r) for r in rows})} and padding=False; "
                                 "pass padding=True to pad them into one array")
            width = longest
        else:
            raise ValueError(f"padding must be True, False, 'longest' or 'max_length', got {padding!r}")
        if pad_to_multiple_of:
            width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
        if any(len(r) < width for r in rows) and self.pad_token_id is None:
            raise ValueError("padding needs a pad token, and this tokenizer has none (no pad_token in "
                             "tokenizer_config.json); pass padding=False or set one, e.g. "
                             "tok.pad_token = tok.eos_token")
        ids = np.full((len(rows), width), self.pad_token_id or 0, dtype=np.int32)
        mask = np.zeros((len(rows), width), dtype=np.int32)
        for i, row in enumerate(rows):
            cols = slice(width - len(row), width) if side == "left" else slice(0, len(row))
            ids[i, cols], mask[i, cols] = row, 1
        return {"input_ids": ids, "attention_mask": mask}

    def batch_encode(self, texts: Sequence[str], **kwargs: Any) -> dict[str, np.ndarray]:
        """``self(texts, **kwargs)``: a padded batch with its attention mask.

        Args:
          texts: the strings to encode (a list, not one string).
          kwargs: passed to ``__call__`` (``padding``, ``truncation``, ``max_length``...).

        Raises:
          TypeError: ``texts`` is a single string.
        """
        if isinstance(texts, str):
            raise TypeError("batch_encode takes a list of strings; use encode() for one string")
        return self(texts, **kwargs)

    # --- decoding ---
    def _cleans_up(self, override: bool | None) -> bool:
        on = self.clean_up_tokenization_spaces if override is None else override
        # transformers skips the clean-up for BPE models, where it would delete real spaces
        return bool(on) and (type(self._backend.model).__name__ != "BPE" or self._cleanup_bpe)

    def decode(self, ids: int | Sequence[int] | np.ndarray, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """The text of ``ids`` (the tokenizers library's decoder, then the config's
        clean-up). ``skip_special_tokens`` drops the tokens the tokenizer marks special.

        Args:
          ids: one id, a sequence of ids or an array (flattened).
          skip_special_tokens: drop the tokens marked special.
          clean_up_tokenization_spaces: apply the clean-up (None: the config's setting).

        Raises:
          ValueError: an id outside the vocabulary.
        """
        ids = [int(ids)] if isinstance(ids, (int, np.integer)) else [int(i) for i in np.asarray(ids).reshape(-1)]
        self._check_ids(ids)
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._cleans_up(clean_up_tokenization_spaces) else text

    def _check_ids(self, ids: Sequence[int]) -> None:
        # the tokenizers library drops unknown ids without a word; a wrong id is a bug upstream
        if ids and (min(ids) < 0 or max(ids) >= len(self)):
            bad = next(i for i in ids if i < 0 or i >= len(self))
            raise ValueError(f"token id {bad} is outside this tokenizer's vocabulary [0, {len(self)}) "
                             f"({self.name_or_path or 'in memory'})")

    def batch_decode(self, sequences: Iterable[Sequence[int]] | np.ndarray, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        """:meth:`decode` of each sequence.

        Args:
          sequences: the id sequences (or a 2-D array, one row each).
          skip_special_tokens: drop the tokens marked special.
          clean_up_tokenization_spaces: apply the clean-up (None: the config's setting).
        """
        return [self.decode(s, skip_special_tokens, clean_up_tokenization_spaces) for s in sequences]

    def incremental_decoder(self, skip_special_tokens: bool = False, prompt_ids: Sequence[int] = ()) -> IncrementalDecoder:
        """A decoder for ids that arrive one at a time (see `IncrementalDecoder`).

        Args:
          skip_special_tokens: drop the tokens marked special.
          prompt_ids: the prompt's ids, when decoding continues a prompt.
        """
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)

    def decode_stream(self, ids: Iterable[int], skip_special_tokens: bool = False,
                      prompt_ids: Sequence[int] = ()) -> Iterator[str]:
        """Yield the text of ``ids`` as they arrive, in non-empty pieces that never split a
        character; the pieces join to ``decode(ids)`` (or, after ``prompt_ids``, to the text
        the ids add to the prompt's).

        Args:
          ids: the token ids, as they arrive.
          skip_special_tokens: drop the tokens marked special.
          prompt_ids: the prompt's ids, when the stream continues a prompt.
        """
        decoder = self.incremental_decoder(skip_special_tokens, prompt_ids)
        for token_id in ids:
            piece = decoder.step(token_id)
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail

    def _byte_token_ids(self) -> frozenset[int]:
        if self._byte_ids is None:
            self._byte_ids = frozenset(i for t, i in self._backend.get_vocab(with_added_tokens=False).items()
                                       if _BYTE_TOKEN.fullmatch(t))
        return self._byte_ids

    # --- chat ---
    def get_chat_template(self, chat_template: str | None = None, tools: Sequence[Any] | None = None) -> str:
        """The template text to render: ``chat_template`` by name (when the folder has several)
        or as text, else ``tool_use`` when tools are given and there is one, else the default.

        Args:
          chat_template: a template name (of several) or template text; None picks the default.
          tools: the tools of the request; with them, a ``tool_use`` template is preferred.

        Raises:
          ChatTemplateError: no template, or several and none chosen.
        """
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None:
                return own.get(chat_template, chat_template)
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ChatTemplateError(f"{self._template_origin} has several chat templates and none named 'default'; "
                                    f"pass chat_template= one of {sorted(own)}")
        if chat_template is not None:
            return chat_template
        if own is None:
            folder = self.name_or_path or "this tokenizer's folder"
            raise ChatTemplateError(f"no chat template: looked in {folder} for chat_template.jinja, "
                                    "additional_chat_templates/, the chat_template key of tokenizer_config.json "
                                    "and chat_template.json; pass chat_template= (jinja2 text) or set "
                                    "tok.chat_template")
        return own

    def apply_chat_template(self, messages: Sequence[Any] | Sequence[Sequence[Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: Sequence[Any] | None = None, *,
                            documents: Sequence[Any] | None = None, chat_template: str | None = None,
                            continue_final_message: bool | str = False, return_assistant_tokens_mask: bool = False,
                            **kwargs: Any) -> Any:
        """Render a conversation (a list of ``{"role", "content"}`` dicts), or a batch of
        them, into the prompt the model was trained on, as transformers does.

        ``add_generation_prompt`` appends the opening of an assistant turn. ``tools`` are
        JSON-schema dicts. Extra keyword arguments become template variables (they override
        the special tokens of the same name). Returns the text, or with ``tokenize=True`` its
        ids (``encode(text, add_special_tokens=False)``: the template writes its own BOS).
        With ``return_assistant_tokens_mask=True`` (and ``tokenize=True``) it returns
        ``{"input_ids": ids, "assistant_masks": mask}``: mask 1 on every token that overlaps
        a ``{% generation %}`` block of the template (the assistant's text, for SFT losses).

        Raises ChatTemplateError when there is no template (naming the places looked in),
        when it does not render, or when it calls ``raise_exception`` (with its message).

        Args:
          messages: a conversation (a list of ``{"role", "content"}`` dicts), or a list of
            conversations.
          add_generation_prompt: append the opening of an assistant turn.
          tokenize: return token ids instead of text.
          tools: tool definitions (JSON-schema dicts) passed to the template; None for none.
          documents: retrieval documents passed to the template; None for none.
          chat_template: a template name (of this tokenizer's several) or template text; None uses
            the default.
          continue_final_message: leave the final message open so the model continues it: True
            continues its ``content``, a string names the field to continue
            (``"reasoning_content"``...).
          return_assistant_tokens_mask: also return the mask of assistant tokens (needs
            ``tokenize=True``).
          kwargs: more template variables.

        Raises:
          ValueError: an empty conversation, or a mask asked for without ``tokenize``.
        """
        if not messages:
            raise ValueError("apply_chat_template got an empty conversation; give at least one message")
        if return_assistant_tokens_mask and not tokenize:
            raise ValueError("return_assistant_tokens_mask=True needs tokenize=True (the mask is per token)")
        batched = isinstance(messages[0], (list, tuple))
        source = self.get_chat_template(chat_template, tools)
        origin = self._template_origin if source is not chat_template else "the chat_template argument"
        options: dict[str, Any] = dict(
            origin=origin, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, variables={**self.special_tokens_map, **kwargs})
        convs = messages if batched else [messages]
        if return_assistant_tokens_mask:
            if not _GENERATION_TAG.search(source):
                raise ChatTemplateError(f"return_assistant_tokens_mask=True, but {origin} has no "
                                        "{% generation %} block to mark the assistant's text")
            out: list[Any] = [self._masked(*render_chat_with_spans(source, conv, **options)) for conv in convs]
            if batched:
                return {key: [row[key] for row in out] for key in ("input_ids", "assistant_masks")}
            return out[0]
        texts = [render_chat(source, conv, **options) for conv in convs]
        out = [self.encode(t, add_special_tokens=False) for t in texts] if tokenize else texts
        return out if batched else out[0]

    def _masked(self, text: str, spans: list[tuple[int, int]]) -> dict[str, list[int]]:
        encoding = self._backend.encode(text, add_special_tokens=False)
        mask = [int(any(start < b and end > a for a, b in spans)) for start, end in encoding.offsets]
        return {"input_ids": list(encoding.ids), "assistant_masks": mask}


class IncrementalDecoder:
    """Detokenize ids one at a time, for streaming: `step` returns only text that is final.

    Decoding a token alone is wrong in general: byte-level BPE splits one character's UTF-8
    bytes over several tokens, SentencePiece's byte-fallback tokens (``<0xE2>``) form a
    character only as a run, and the decoder strips a leading space from the first token only.
    So each step decodes a short window of recent ids twice (with and without the new ones)
    and emits the difference, holding it back while the text ends in an incomplete character
    (U+FFFD) or the last id is a byte-fallback token (the run may continue). The window moves
    forward whenever text is emitted, so a step costs O(window), not O(sequence).

    The pieces of `step` plus `flush` always join to ``tok.decode(ids)`` (with the
    tokenizer's clean-up, applied piecewise between characters the clean-up never touches).
    With ``prompt_ids``, the decoder starts after a prompt: the first piece keeps the space a
    SentencePiece token carries after it.

    Args:
      tokenizer: the :class:`Tokenizer` whose ``decode`` the pieces add up to.
      skip_special_tokens: leave special (added) tokens out of the text.
      prompt_ids: the prompt's ids, when decoding starts after a prompt: they give the first
        piece its context; their own text is not emitted.

    >>> from tokenizers import decoders, models
    >>> bytes_model = tokenizers.Tokenizer(models.BPE({"<0xF0>": 0, "<0x9F>": 1, "<0xA4>": 2, "<0x96>": 3,
    ...                                                "a": 4}, [], byte_fallback=True))
    >>> bytes_model.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    >>> dec = IncrementalDecoder(Tokenizer(bytes_model))
    >>> [dec.step(i) for i in [4, 0, 1, 2, 3, 4]]  # "a", the four bytes of a robot emoji, "a"
    ['a', '', '', '', '', '🤖a']
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False, prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        backend = tokenizer.backend_tokenizer
        self._skip = frozenset(i for i, t in backend.get_added_tokens_decoder().items()
                               if t.special) if skip_special_tokens else frozenset()
        self._bytes = tokenizer._byte_token_ids()
        self._ids = [int(i) for i in prompt_ids if int(i) not in self._skip]
        # window: text of ids[prefix:read] was already emitted (or belongs to the prompt)
        self._prefix = max(0, len(self._ids) - 6)
        self._read = len(self._ids)
        self._cleanup = tokenizer._cleans_up(None)
        self._pending = ""  # emitted-raw text awaiting clean-up (only when clean-up is on)
        self.text = ""

    def _window(self, stop: int | None = None) -> str:
        return self._tok.backend_tokenizer.decode(self._ids[self._prefix:stop], skip_special_tokens=False)

    def step(self, token_id: int) -> str:
        """Add one id; return the text that is now final (often ``""``).

        Args:
          token_id: the next token id.

        Raises:
          ValueError: an id outside the vocabulary.
        """
        token_id = int(token_id)
        self._tok._check_ids([token_id])
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        if token_id in self._bytes:
            return ""  # a byte-fallback run may continue; its text is not final yet
        before, after = self._window(self._read), self._window()
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return self._emit(after[len(before):], final=False)

    def extend(self, ids: Iterable[int]) -> str:
        """:meth:`step` over ``ids``; the text that became final, joined.

        Args:
          ids: token ids, in order.
        """
        return "".join(self.step(i) for i in ids)

    def flush(self) -> str:
        """The rest of the text (end of the stream), incomplete characters included as U+FFFD."""
        before, after = self._window(self._read), self._window()
        self._prefix = self._read = len(self._ids)
        return self._emit(after[len(before):], final=True)

    def _emit(self, raw: str, final: bool) -> str:
        if self._cleanup:
            text = self._pending + raw
            cut = len(text) if final else next((i + 1 for i in range(len(text) - 1, -1, -1)
                                                if text[i] not in _CLEANUP_ALPHABET), 0)
            self._pending = text[cut:]
            raw = clean_up_tokenization(text[:cut])
        self.text += raw
        return raw
