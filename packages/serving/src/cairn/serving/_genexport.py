"""Generative models: the ``GenerativeModel`` protocol the engine runs, in-process
(:class:`PythonGenerator`) and exported (:func:`export_generator`; loaded back as a
:class:`~cairn.serving.LoadedGenerator`), plus tokenizing over a token vocabulary.

A generative model is two pure functions over ``params`` and a flat KV cache
``{name: array}`` batched along axis 0:

- ``prefill(params, tokens (b, p), lengths (b,)) -> (logits (b, vocab), cache)``, the
  logits at position ``lengths - 1`` and every cache entry ``(b, max_length, ...)``;
- ``decode(params, tokens (b,), positions (b,), cache) -> (logits (b, vocab), cache)``,
  writing the token's keys/values at ``positions`` and returning the next-token logits;
- optionally ``paged(params, tokens (b, t), positions (b,), lengths (b,), block_tables (b,
  w), pool) -> (logits (b, vocab), pool)``: the paged KV layout (``GenerationConfig(
  kv_layout="paged")``). ``pool`` is ``{name: (num_blocks, block_size, *per-token
  shape)}``; row ``b`` runs ``lengths[b]`` tokens (right-padded to ``t``) at positions
  ``positions[b] ..``, writes their keys and values into the blocks its table names and
  attends over them, and gets the logits after its last token (``t = 1``: a decode step;
  more: a prefill chunk; ``lengths[b] = 0``: a padding row that writes nothing);
- optionally ``score(params, tokens (b, p), lengths (b,)) -> float32 (b, p)``: the
  log-probability of each prompt token given those before it (0 at position 0; positions
  at or past ``lengths`` are ignored), for prompt log-probabilities (OpenAI's ``echo``).

The device-level methods keep the cache as ``jax.Array`` (donated to each decode step);
only the logits go to the host.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from cairn.core_array import ArraySpec
from cairn.serving._export import Signature, export_signatures
from cairn.serving._hashing import MANIFEST, ModelFormatError
from cairn.serving._tokenizer import Tokenizer

__all__ = [
    "GenerativeModel",
    "GenerationInfo",
    "PythonGenerator",
    "export_generator",
    "exported_device_fns",
    "tokenize",
    "detokenize",
    "PREFILL",
    "DECODE",
    "SCORE",
    "PAGED",
]

PREFILL, DECODE, SCORE, PAGED = "prefill", "decode", "score", "paged"
_CACHE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")
DEFAULT_MAX_BATCH = 256


@runtime_checkable
class GenerativeModel(Protocol):
    """What the :class:`~cairn.serving.GenerationEngine` runs.

    Attributes:
      name: the model name.
      vocab_size: logits per position.
      max_length: cache positions (prompt plus generated tokens).
      eos_token_ids: tokens that end a sequence.
      vocabulary: token id -> text (``None`` entries: no text), or ``None``.
      cache_specs: per-row spec of every cache entry.
      bos_token_id: optional, read with ``getattr``: prepended to tokenized text.
      max_batch_size: optional, read with ``getattr``: the most slots.

    The methods take and return ``jax.Array``: ``init_cache(n)`` zeros for ``n`` rows;
    ``prefill(tokens, lengths)`` and ``decode(tokens, positions, cache)`` as the module
    docstring says (``decode`` may donate ``cache``).
    """

    name: str
    vocab_size: int
    max_length: int
    eos_token_ids: tuple[int, ...]
    vocabulary: tuple[str | None, ...] | None
    cache_specs: Mapping[str, ArraySpec]

    def init_cache(self, num_slots: int) -> dict[str, Any]:
        """A zero cache for ``num_slots`` rows.

        Args:
          num_slots: the number of rows.

        Returns:
          ``{name: array (num_slots, *spec.shape)}``, one entry per ``cache_specs`` item.
        """

    def prefill(self, tokens: Any, lengths: Any) -> tuple[Any, dict[str, Any]]:
        """Run the prompts: the logits at the last prompt position and the filled cache.

        Args:
          tokens: ``(b, p)`` int32 prompt tokens, padded past each row's length.
          lengths: ``(b,)`` int32 prompt lengths.

        Returns:
          ``(logits (b, vocab_size), cache)``, every cache entry ``(b, max_length, ...)``.
        """

    def decode(self, tokens: Any, positions: Any, cache: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        """One decode step: write each row's token at its position and return the next-token logits.

        Args:
          tokens: ``(b,)`` int32, the last token of each row.
          positions: ``(b,)`` int32, the position each token is written at.
          cache: the cache dict, every entry ``(b, max_length, ...)`` (may be donated).

        Returns:
          ``(logits (b, vocab_size), cache)``.
        """


# --- tokenizing ---


@functools.lru_cache(maxsize=16)
def _index(vocabulary: tuple[str | None, ...]) -> tuple[dict[str, int], int]:
    """text -> the lowest token id with that text, and the longest text's length."""
    index: dict[str, int] = {}
    for i, s in enumerate(vocabulary):
        if s and s not in index:
            index[s] = i
    return index, max((len(s) for s in index), default=0)


def tokenize(text: str, vocabulary: Sequence[str | None], bos_token_id: int | None = None) -> list[int]:
    """Token ids of ``text`` by greedy longest match over the vocabulary's strings
    (``bos_token_id`` first when given).

    Args:
      text: the text to tokenize.
      vocabulary: token id to text (None: no text); longest matches win.
      bos_token_id: prepended when given.

    Raises:
      ValueError: a character no vocabulary string starts with at that point, naming it
        and its offset; or ``text`` that is not a string.

    >>> tokenize("abc", ["a", "b", "ab", "c"], bos_token_id=9)
    [9, 2, 3]
    >>> tokenize("ax", ["a"])
    Traceback (most recent call last):
    ...
    ValueError: cannot tokenize text_input: character 'x' at offset 1 is not in the vocabulary
    """
    if not isinstance(text, str):
        raise ValueError(f"text_input must be a string, got {type(text).__name__}")
    index, longest = _index(tuple(vocabulary))
    out = [] if bos_token_id is None else [int(bos_token_id)]
    i = 0
    while i < len(text):
        for n in range(min(longest, len(text) - i), 0, -1):
            tok = index.get(text[i : i + n])
            if tok is not None:
                out.append(tok)
                i += n
                break
        else:
            raise ValueError(f"cannot tokenize text_input: character {text[i]!r} at offset {i} is not in the vocabulary")
    return out


def detokenize(token_ids: Sequence[int], vocabulary: Sequence[str | None]) -> str:
    """The concatenated text of ``token_ids`` (tokens without text add nothing).

    Args:
      token_ids: the ids to join.
      vocabulary: token id to text (None: no text).

    Raises:
      ValueError: a token id outside the vocabulary.

    >>> detokenize([2, 0, 3], [None, "a", "ab", "c"])
    'abc'
    """
    out = []
    for t in token_ids:
        if not 0 <= int(t) < len(vocabulary):
            raise ValueError(f"token id {t} is outside the vocabulary (0..{len(vocabulary) - 1})")
        out.append(vocabulary[int(t)] or "")
    return "".join(out)


# --- what a generator is: the manifest's "generation" section ---


def _token_ids(name: str, ids: Any, vocab_size: int) -> tuple[int, ...]:
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= int(t) < vocab_size:
            raise ValueError(f"{name}: {t!r} is not a token id in 0..{vocab_size - 1}")
        out.append(int(t))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class GenerationInfo:
    """What the engine needs to know about a generative model (the manifest's
    ``"generation"`` section).

    Raises:
      ValueError: naming the field that is inconsistent.
    """

    vocab_size: int
    max_length: int
    cache_specs: Mapping[str, ArraySpec]
    eos_token_ids: tuple[int, ...] = ()
    vocabulary: tuple[str | None, ...] | None = None
    bos_token_id: int | None = None
    tokenizer: str | None = None  # the model directory's tokenizer folder (relative), if it has one
    block_size: int | None = None  # tokens per KV block of the paged layout, when the model has one

    def __post_init__(self) -> None:
        for k in ("vocab_size", "max_length"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 2:
                raise ValueError(f"{k} must be an integer >= 2, got {v!r}")
        if not isinstance(self.cache_specs, Mapping) or not self.cache_specs:
            raise ValueError("cache_specs must be a non-empty dict {name: ArraySpec} (per-row specs)")
        for n, s in self.cache_specs.items():
            if not isinstance(n, str) or not _CACHE_NAME.match(n):
                raise ValueError(f"cache_specs: name {n!r} must match {_CACHE_NAME.pattern}")
            if not isinstance(s, ArraySpec) or s.is_symbolic:
                raise ValueError(f"cache_specs[{n!r}] must be a concrete per-row ArraySpec, got {s!r}")
        object.__setattr__(self, "cache_specs", dict(self.cache_specs))
        object.__setattr__(self, "eos_token_ids", _token_ids("eos_token_ids", self.eos_token_ids, self.vocab_size))
        if self.bos_token_id is not None:
            object.__setattr__(self, "bos_token_id", _token_ids("bos_token_id", [self.bos_token_id], self.vocab_size)[0])
        if self.vocabulary is not None:
            vocab = tuple(self.vocabulary)
            if len(vocab) != self.vocab_size or not all(v is None or isinstance(v, str) for v in vocab):
                raise ValueError(f"vocabulary must hold vocab_size={self.vocab_size} strings or None, got {len(vocab)} entries")
            object.__setattr__(self, "vocabulary", vocab)
        bs = self.block_size
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int | np.integer) or bs < 1):
            raise ValueError(f"block_size must be a positive integer or None, got {bs!r}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not _CACHE_NAME.match(self.tokenizer)):
            raise ValueError(f"tokenizer must name a folder inside the model directory, got {self.tokenizer!r}")

    def to_json(self) -> dict:
        """The manifest section."""
        return {
            "vocab_size": int(self.vocab_size), "max_length": int(self.max_length),
            "eos_token_ids": list(self.eos_token_ids), "bos_token_id": self.bos_token_id,
            "vocabulary": None if self.vocabulary is None else list(self.vocabulary),
            "tokenizer": self.tokenizer,
            "cache": {n: s.to_json() for n, s in self.cache_specs.items()},
            "prefill_signature": PREFILL, "decode_signature": DECODE,
            **({} if self.block_size is None else {"paged_signature": PAGED, "block_size": int(self.block_size)}),
        }

    @classmethod
    def from_json(cls, d: Any) -> GenerationInfo:
        """Parse the manifest section.

        Raises:
          ModelFormatError: a malformed section, naming what is wrong.
        """
        try:
            if not isinstance(d, dict):
                raise ValueError("must be an object")
            specs = {str(n): ArraySpec.from_json(s) for n, s in d["cache"].items()}
            vocab = d.get("vocabulary")
            return cls(int(d["vocab_size"]), int(d["max_length"]), specs, tuple(d.get("eos_token_ids") or ()),
                       None if vocab is None else tuple(vocab), d.get("bos_token_id"), d.get("tokenizer"),
                       d.get("block_size"))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ModelFormatError(f"{MANIFEST}: 'generation' section is malformed ({type(e).__name__}: {e})", MANIFEST) from None


class GeneratorBase:
    """The attributes and helpers every generator shares (set from a :class:`GenerationInfo`)."""

    name: str
    info: GenerationInfo
    tokenizer: Tokenizer | None = None  # the Hugging Face tokenizer exported with the model, if any

    def _set_info(self, info: GenerationInfo) -> None:
        self.info = info
        self.vocab_size = int(info.vocab_size)
        self.max_length = int(info.max_length)
        self.eos_token_ids = info.eos_token_ids
        self.bos_token_id = info.bos_token_id
        self.vocabulary = info.vocabulary
        self.cache_specs = dict(info.cache_specs)
        self.block_size = info.block_size

    @property
    def has_paged(self) -> bool:
        """Whether the model runs the paged KV layout (it was given a ``paged`` function)."""
        return getattr(self, "_paged", None) is not None and self.block_size is not None

    def init_pool(self, num_blocks: int) -> dict[str, Any]:
        """A zero paged KV pool of ``num_blocks`` blocks: ``{name: (num_blocks, block_size, *per-token shape)}``.

        Args:
          num_blocks: blocks in the pool (each holds ``block_size`` tokens of every cache entry).

        Raises:
          ValueError: the model has no paged layout.
        """
        import jax.numpy as jnp

        if not self.has_paged:
            raise ValueError(f"model {self.name!r} has no paged KV layout (export it with paged=... and block_size=...)")
        assert self.block_size is not None
        return {n: jnp.zeros((num_blocks, self.block_size, *s.shape[1:]), s.numpy_dtype) for n, s in self.cache_specs.items()}

    def paged_step(self, tokens: Any, positions: Any, lengths: Any, block_tables: Any,
                   pool: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Device-level paged step (module docstring); ``pool`` is donated.

        Args:
          tokens: ``(b, t)`` int32 tokens, row ``b``'s first ``lengths[b]`` real (right-padded).
          positions: ``(b,)`` int32 position of each row's first token.
          lengths: ``(b,)`` int32 tokens each row runs (0: a padding row that writes nothing).
          block_tables: ``(b, w)`` int32 pool blocks of each row, in order.
          pool: the KV pool (:meth:`init_pool`'s layout), donated.

        Returns:
          ``(logits (b, vocab) after each row's last token, the updated pool)``.

        Raises:
          ValueError: the model has no paged layout.
        """
        if not self.has_paged:
            raise ValueError(f"model {self.name!r} has no paged KV layout (export it with paged=... and block_size=...)")
        return self._paged(tokens, positions, lengths, block_tables, dict(pool))  # type: ignore[attr-defined]

    def init_cache(self, num_slots: int) -> dict[str, Any]:
        """A zero cache of ``num_slots`` rows on the device.

        Args:
          num_slots: the number of rows.
        """
        import jax.numpy as jnp

        return {n: jnp.zeros((num_slots, *s.shape), s.numpy_dtype) for n, s in self.cache_specs.items()}

    @property
    def has_text(self) -> bool:
        """Whether the model turns text into tokens and back (a tokenizer or a vocabulary)."""
        return self.tokenizer is not None or self.vocabulary is not None

    def tokenize(self, text: str) -> list[int]:
        """``text`` to token ids: through the model's tokenizer (its post-processor adds the
        special tokens), else over its vocabulary (BOS first when the model has one).

        Args:
          text: the text to tokenize.

        Raises:
          ValueError: the model has neither, or a character its vocabulary cannot tokenize.
        """
        if self.tokenizer is not None:
            return self.tokenizer.encode(text)
        if self.vocabulary is None:
            raise ValueError(f"model {self.name!r} has no tokenizer or vocabulary; send input_ids instead of text_input")
        return tokenize(text, self.vocabulary, self.bos_token_id)

    @property
    def has_score(self) -> bool:
        """Whether the model scores prompts (it was given a ``score`` function)."""
        return getattr(self, "_score", None) is not None

    def score(self, tokens: Any, lengths: Any) -> np.ndarray:
        """Log-probability of each token of ``tokens (b, p)`` given those before it, as
        float32 ``(b, p)`` on the host (0 at position 0; rows are right-padded to
        ``lengths``).

        Args:
          tokens: ``(b, p)`` int32 token ids, right-padded.
          lengths: ``(b,)`` int32 row lengths (positions at or past them are ignored).

        Raises:
          ValueError: the model was exported without a ``score`` function.
        """
        fn = getattr(self, "_score", None)
        if fn is None:
            raise ValueError(f"model {self.name!r} has no score function (export it with score=...) to give "
                             "prompt log-probabilities")
        return np.asarray(fn(tokens, lengths))

    def detokenize(self, token_ids: Sequence[int]) -> str | None:
        """The text of ``token_ids`` (special tokens left out when a tokenizer decodes), or
        ``None`` when the model has neither a tokenizer nor a vocabulary.

        Args:
          token_ids: the ids to turn into text.
        """
        if self.tokenizer is not None:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        return None if self.vocabulary is None else detokenize(token_ids, self.vocabulary)


TOKENIZER_DIR = "tokenizer"


def as_tokenizer(tokenizer: Tokenizer | str | os.PathLike) -> Tokenizer:
    """A :class:`Tokenizer`, or the folder to read one from (:meth:`Tokenizer.from_pretrained`).

    Raises:
      TypeError: neither. FileNotFoundError, ValueError: as :meth:`Tokenizer.from_pretrained`.
    """
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, str | os.PathLike):
        return Tokenizer.from_pretrained(tokenizer)
    raise TypeError(f"tokenizer must be a cairn.serving.Tokenizer or a tokenizer folder, got {type(tokenizer).__name__}")


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """The files :meth:`Tokenizer.save_pretrained` writes, as ``{"tokenizer/<file>": bytes}``
    for a model directory."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="cairn-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        out = {}
        for root, _, files in os.walk(tmp):
            for f in files:
                full = os.path.join(root, f)
                rel = os.path.relpath(full, tmp).replace(os.sep, "/")
                with open(full, "rb") as fh:
                    out[f"{TOKENIZER_DIR}/{rel}"] = fh.read()
    return out


def load_tokenizer(root: str, info: GenerationInfo) -> Tokenizer | None:
    """The tokenizer folder a model directory holds (its manifest names it), or ``None``.

    Raises:
      ModelFormatError: the folder is missing or does not read as a tokenizer (named).
    """
    if info.tokenizer is None:
        return None
    folder = os.path.join(root, info.tokenizer)
    try:
        return Tokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{folder}: the model's tokenizer does not load ({type(e).__name__}: {e})", info.tokenizer) from None


# --- checking the user's functions ---


def _check_outputs(what: str, out: Any, b: int, info: GenerationInfo) -> None:
    if not isinstance(out, tuple | list) or len(out) != 2 or not isinstance(out[1], Mapping):
        raise ValueError(f"{what} must return (logits, cache dict), got {type(out).__name__}")
    logits, cache = out
    if tuple(logits.shape) != (b, info.vocab_size) or np.dtype(logits.dtype) != np.float32:
        raise ValueError(f"{what}: logits must be float32 {(b, info.vocab_size)}, got {logits.dtype} {tuple(logits.shape)}")
    if set(cache) != set(info.cache_specs):
        raise ValueError(f"{what}: cache entries {sorted(cache)} differ from cache_specs {sorted(info.cache_specs)}")
    for n, s in info.cache_specs.items():
        got = (tuple(cache[n].shape), np.dtype(cache[n].dtype))
        if got != ((b, *s.shape), s.numpy_dtype):
            raise ValueError(f"{what}: cache[{n!r}] is {got[1]} {got[0]}, cache_specs says {s.dtype} {(b, *s.shape)}")


def _check_paged(paged: Callable, params: Any, info: GenerationInfo) -> None:
    """Trace ``paged`` abstractly over a 3-block pool and check its outputs."""
    import jax

    if info.block_size is None:
        raise ValueError("a paged function needs block_size (tokens per KV block)")
    b, t, nb, i32, sds = 2, min(4, info.max_length), 3, np.int32, jax.ShapeDtypeStruct
    w = -(-info.max_length // info.block_size)
    pool = {n: sds((nb, info.block_size, *s.shape[1:]), s.numpy_dtype) for n, s in info.cache_specs.items()}
    out = jax.eval_shape(paged, params, sds((b, t), i32), sds((b,), i32), sds((b,), i32), sds((b, w), i32), pool)
    if not isinstance(out, tuple | list) or len(out) != 2 or not isinstance(out[1], Mapping):
        raise ValueError(f"paged must return (logits, pool dict), got {type(out).__name__}")
    logits, got = out
    if tuple(logits.shape) != (b, info.vocab_size) or np.dtype(logits.dtype) != np.float32:
        raise ValueError(f"paged: logits must be float32 {(b, info.vocab_size)}, got {logits.dtype} {tuple(logits.shape)}")
    for n, x in pool.items():
        if n not in got or (tuple(got[n].shape), np.dtype(got[n].dtype)) != (x.shape, np.dtype(x.dtype)):
            have = None if n not in got else f"{got[n].dtype} {tuple(got[n].shape)}"
            raise ValueError(f"paged: pool[{n!r}] must come back as {x.dtype} {x.shape}, got {have}")


def check_functions(prefill: Callable, decode: Callable, params: Any, info: GenerationInfo,
                    score: Callable | None = None, paged: Callable | None = None) -> None:
    """Trace the functions abstractly (no compute) and check their outputs' shapes.

    Raises:
      ValueError: naming the function and the output that disagrees with the specs.
    """
    import jax

    b, p, i32 = 2, min(4, info.max_length), np.int32
    sds = jax.ShapeDtypeStruct
    _check_outputs("prefill", jax.eval_shape(prefill, params, sds((b, p), i32), sds((b,), i32)), b, info)
    cache = {n: sds((b, *s.shape), s.numpy_dtype) for n, s in info.cache_specs.items()}
    _check_outputs("decode", jax.eval_shape(decode, params, sds((b,), i32), sds((b,), i32), cache), b, info)
    if paged is not None:
        _check_paged(paged, params, info)
    if score is not None:
        out = jax.eval_shape(score, params, sds((b, p), i32), sds((b,), i32))
        if not hasattr(out, "shape") or tuple(out.shape) != (b, p) or np.dtype(out.dtype) != np.float32:
            got = f"{out.dtype} {tuple(out.shape)}" if hasattr(out, "shape") else type(out).__name__
            raise ValueError(f"score must return float32 log-probabilities shaped like tokens {(b, p)}, got {got}")


# --- in process ---


class PythonGenerator(GeneratorBase):
    """A :class:`GenerativeModel` from in-process ``prefill``/``decode`` functions, jitted
    with ``params`` held on the device (the cache donated to every decode step).

    Args:
      prefill: the prefill function (module docstring).
      decode: the decode function (module docstring).
      params: their weights.
      cache_specs: per-row ``{name: ArraySpec}`` of the cache.
      vocab_size: as :func:`export_generator`.
      max_length: as :func:`export_generator`.
      eos_token_ids: as :func:`export_generator`.
      vocabulary: as :func:`export_generator`.
      bos_token_id: as :func:`export_generator`.
      tokenizer: as :func:`export_generator`.
      score: as :func:`export_generator`.
      paged: as :func:`export_generator`.
      block_size: as :func:`export_generator`.
      name: the model name.

    Raises:
      ValueError: inconsistent settings, or functions whose outputs disagree with them.
    """

    def __init__(self, prefill: Callable, decode: Callable, params: Any, *, cache_specs: Mapping[str, ArraySpec],
                 vocab_size: int, max_length: int, eos_token_ids: Sequence[int] = (),
                 vocabulary: Sequence[str | None] | None = None, bos_token_id: int | None = None,
                 tokenizer: Tokenizer | str | os.PathLike | None = None, name: str = "generator",
                 score: Callable | None = None, paged: Callable | None = None,
                 block_size: int | None = None) -> None:
        import jax

        tok = None if tokenizer is None else as_tokenizer(tokenizer)
        info = GenerationInfo(vocab_size, max_length, cache_specs, _eos_ids(eos_token_ids, tok, vocab_size),
                              None if vocabulary is None else tuple(vocabulary), bos_token_id,
                              None if tok is None else TOKENIZER_DIR, _block_size(paged, block_size))
        check_functions(prefill, decode, params, info, score, paged)
        self.name = name
        self._set_info(info)
        self.tokenizer = tok
        self.params = jax.device_put(params)
        self._prefill = jax.jit(prefill)
        self._decode = jax.jit(decode, donate_argnums=(3,))
        if score is not None:
            jitted = jax.jit(score)
            self._score = lambda tokens, lengths: jitted(self.params, tokens, lengths)
        if paged is not None:
            step = jax.jit(paged, donate_argnums=(5,))
            self._paged = lambda *args: step(self.params, *args)

    def prefill(self, tokens: Any, lengths: Any) -> tuple[Any, dict[str, Any]]:
        """Device-level prefill (see :class:`GenerativeModel`).

        Args:
          tokens: ``(b, p)`` int32 prompt tokens.
          lengths: ``(b,)`` int32 prompt lengths.

        Returns:
          ``(logits (b, vocab_size), cache)``.
        """
        return self._prefill(self.params, tokens, lengths)

    def decode(self, tokens: Any, positions: Any, cache: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Device-level decode step; ``cache`` is donated.

        Args:
          tokens: ``(b,)`` int32, the last token of each row.
          positions: ``(b,)`` int32, where each token is written.
          cache: the device cache (donated).

        Returns:
          ``(logits (b, vocab_size), cache)``.
        """
        return self._decode(self.params, tokens, positions, dict(cache))

    def __repr__(self) -> str:
        return f"PythonGenerator({self.name!r}, vocab_size={self.vocab_size}, max_length={self.max_length})"


# --- exported ---


def exported_device_fns(prefill_exp: Any, decode_exp: Any, names: Sequence[str]) -> tuple[Callable, Callable]:
    """Jitted ``prefill(weights, tokens, lengths)`` and ``decode(weights, tokens,
    positions, cache)`` calling deserialized ``jax.export.Exported`` signatures, the
    cache a dict of device arrays (donated to decode)."""
    import jax

    def prefill(weights: dict, tokens: Any, lengths: Any) -> tuple[Any, dict]:
        out = prefill_exp.call(weights, {"tokens": tokens, "lengths": lengths})
        return out["logits"], {n: out[f"cache/{n}"] for n in names}

    def decode(weights: dict, tokens: Any, positions: Any, cache: dict) -> tuple[Any, dict]:
        inputs = {"tokens": tokens, "positions": positions, **{f"cache/{n}": cache[n] for n in names}}
        out = decode_exp.call(weights, inputs)
        return out["logits"], {n: out[f"cache/{n}"] for n in names}

    return jax.jit(prefill), jax.jit(decode, donate_argnums=(3,))


def exported_paged_fn(paged_exp: Any, names: Sequence[str]) -> Callable:
    """Jitted ``paged(weights, tokens, positions, lengths, block_tables, pool)`` calling a
    deserialized ``paged`` signature, the pool donated."""
    import jax

    def paged(weights: dict, tokens: Any, positions: Any, lengths: Any, block_tables: Any, pool: dict) -> tuple[Any, dict]:
        inputs = {"tokens": tokens, "positions": positions, "lengths": lengths, "block_tables": block_tables,
                  **{f"cache/{n}": pool[n] for n in names}}
        out = paged_exp.call(weights, inputs)
        return out["logits"], {n: out[f"cache/{n}"] for n in names}

    return jax.jit(paged, donate_argnums=(5,))


def _block_size(paged: Callable | None, block_size: int | None) -> int | None:
    """``block_size`` checked against ``paged``: both or neither."""
    if (paged is None) != (block_size is None):
        raise ValueError("paged and block_size go together: give both (the paged KV layout) or neither, "
                         f"got paged={'a function' if paged is not None else None} and block_size={block_size!r}")
    return block_size


def _signatures(prefill: Callable, decode: Callable, info: GenerationInfo, max_batch_size: int,
                score: Callable | None = None, paged: Callable | None = None) -> dict[str, Signature]:
    names = list(info.cache_specs)

    def prefill_sig(params: Any, inputs: dict) -> dict:
        logits, cache = prefill(params, inputs["tokens"], inputs["lengths"])
        return {"logits": logits, "cache": {n: cache[n] for n in names}}

    def decode_sig(params: Any, inputs: dict) -> dict:
        cache = {n: inputs[f"cache/{n}"] for n in names}
        logits, cache = decode(params, inputs["tokens"], inputs["positions"], cache)
        return {"logits": logits, "cache": {n: cache[n] for n in names}}

    p_bound = (f"p <= {info.max_length}",)
    pre = {"tokens": ArraySpec(("b", "p"), "int32", constraints=p_bound), "lengths": ArraySpec(("b",), "int32")}
    dec = {"tokens": ArraySpec(("b",), "int32"), "positions": ArraySpec(("b",), "int32")}
    dec.update({f"cache/{n}": ArraySpec(("b", *s.shape), s.dtype) for n, s in info.cache_specs.items()})
    out = {PREFILL: Signature(prefill_sig, pre, max_batch_size, [max_batch_size]),
           DECODE: Signature(decode_sig, dec, max_batch_size, [max_batch_size])}
    if score is not None:
        def score_sig(params: Any, inputs: dict) -> dict:
            return {"logprobs": score(params, inputs["tokens"], inputs["lengths"])}

        out[SCORE] = Signature(score_sig, dict(pre), max_batch_size, [max_batch_size])
    if paged is not None:
        out[PAGED] = _paged_signature(paged, info)
    return out


def _paged_signature(paged: Callable, info: GenerationInfo) -> Signature:
    """The ``paged`` signature: batch ``b``, chunk ``t`` and pool size ``num_blocks`` symbolic
    (no batching by the server: the engine calls it with fixed shapes)."""
    names, bs = list(info.cache_specs), info.block_size
    assert bs is not None
    w = -(-info.max_length // bs)

    def paged_sig(params: Any, inputs: dict) -> dict:
        pool = {n: inputs[f"cache/{n}"] for n in names}
        logits, pool = paged(params, inputs["tokens"], inputs["positions"], inputs["lengths"], inputs["block_tables"], pool)
        return {"logits": logits, "cache": {n: pool[n] for n in names}}

    specs = {"tokens": ArraySpec(("b", "t"), "int32", constraints=(f"t <= {info.max_length}",)),
             "positions": ArraySpec(("b",), "int32"), "lengths": ArraySpec(("b",), "int32"),
             "block_tables": ArraySpec(("b", w), "int32")}
    specs.update({f"cache/{n}": ArraySpec(("num_blocks", bs, *s.shape[1:]), s.dtype) for n, s in info.cache_specs.items()})
    return Signature(paged_sig, specs, 0)


def export_generator(
    prefill: Callable,
    decode: Callable,
    params: Any,
    path: str | os.PathLike,
    *,
    cache_specs: Mapping[str, ArraySpec],
    vocab_size: int,
    max_length: int,
    eos_token_ids: Sequence[int] = (),
    vocabulary: Sequence[str | None] | None = None,
    bos_token_id: int | None = None,
    platforms: Sequence[str] | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH,
    tokenizer: Tokenizer | str | os.PathLike | None = None,
    score: Callable | None = None,
    paged: Callable | None = None,
    block_size: int | None = None,
    overwrite: bool = False,
) -> str:
    """Export a generative model: signatures ``prefill`` (inputs ``tokens (b, p)``,
    ``lengths (b,)``) and ``decode`` (``tokens (b,)``, ``positions (b,)``, ``cache/<name>``)
    sharing ``params`` (``QArray`` leaves packed), with a ``"generation"`` manifest section.
    :func:`cairn.serving.load` returns a :class:`~cairn.serving.LoadedGenerator` for it.

    Args:
      prefill: the prefill function (module docstring).
      decode: the decode function (module docstring).
      params: their weights (any core_array tree).
      path: the model directory to create.
      cache_specs: per-row spec of each cache entry, ``{"k0": ArraySpec((max_length,
        heads, head_dim), "float32"), ...}``.
      vocab_size: logits per position.
      max_length: cache positions.
      eos_token_ids: tokens that end a sequence; default the tokenizer's
        (:attr:`Tokenizer.eos_token_ids`) when one is given.
      vocabulary: token id -> text (``None`` for ids without text), for ``text_input``.
      bos_token_id: prepended to tokenized text.
      platforms: as :func:`cairn.serving.export`.
      max_batch_size: the largest batch (engine slots) either signature takes.
      tokenizer: a :class:`Tokenizer` (or the Hugging Face tokenizer folder to read one
        from), written into the model directory's ``tokenizer/`` folder, chat template
        included, and covered by the manifest's hashes; the loaded model's ``tokenizer``.
      score: optional ``score(params, tokens (b, p), lengths (b,)) -> float32 (b, p)``,
        each prompt token's log-probability given those before it (0 at position 0),
        exported as a third signature ``"score"``; the loaded model's :meth:`score` (the
        server's prompt log-probabilities, OpenAI's ``echo`` with ``logprobs``).
      paged: optional ``paged(params, tokens, positions, lengths, block_tables, pool)``
        (module docstring), exported as a signature ``"paged"`` with the pool's size
        symbolic: the engine's paged KV layout (``GenerationConfig(kv_layout="paged")``).
      block_size: tokens per KV block of ``paged``'s pool (given with ``paged``).
      overwrite: replace an existing ``path``.

    Returns:
      The absolute path of the model directory.

    Raises:
      ValueError: inconsistent settings, functions whose outputs disagree with them,
        or a function JAX cannot export.
      FileExistsError: ``path`` exists and ``overwrite`` is false.
    """
    tok = None if tokenizer is None else as_tokenizer(tokenizer)
    info = GenerationInfo(vocab_size, max_length, cache_specs, _eos_ids(eos_token_ids, tok, vocab_size),
                          None if vocabulary is None else tuple(vocabulary), bos_token_id,
                          None if tok is None else TOKENIZER_DIR, _block_size(paged, block_size))
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
    check_functions(prefill, decode, params, info, score, paged)
    return export_signatures(_signatures(prefill, decode, info, max_batch_size, score, paged), params, path,
                             platforms=platforms, overwrite=overwrite, extra={"generation": info.to_json()},
                             files=None if tok is None else tokenizer_files(tok))


def _eos_ids(eos_token_ids: Sequence[int], tok: Tokenizer | None, vocab_size: int) -> tuple[int, ...]:
    """The eos ids given, else the tokenizer's; checks the tokenizer fits the model's logits."""
    ids = tuple(eos_token_ids)
    if tok is not None and len(tok) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tok)} ids but the model's vocab_size={vocab_size}: "
                         "it is not this model's tokenizer")
    return tuple(tok.eos_token_ids) if not ids and tok is not None else ids
