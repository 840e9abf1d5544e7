"""Generation with the trained model: ``cairn.llm.generate``, the task's tokenizer, exact match.

The model is a ``cairn.llm.CausalLM``, so generation is cairn.llm's (batched prefill of the
right-padded prompts, then one compiled decode step per token with each row at its own
position in the KV cache); the same model is exported for serving (lm_serve). ``exact_match``
scores held-out addition problems by generating the answer greedily (not by teacher forcing).

``tokenizer()`` is the task's byte tokenizer as a real ``cairn.llm.Tokenizer`` (built with the
``tokenizers`` library): the 256 byte values at ids 3..258, ``<pad>`` ``<bos>`` ``<eos>`` at 0,
1, 2 and a post-processor that puts ``<bos>`` first, so its ids are exactly
``[BOS] + lm_task.encode(text)``. It travels inside the exported model, so the server
tokenizes text itself.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import lm_task
import numpy as np
import tokenizers

from cairn import llm

SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids lm_task.PAD, BOS, EOS


def max_length(cfg: Any) -> int:
    """The KV cache's positions per row: the longest addition prompt plus
    ``serve.max_new_tokens``, rounded up to a power of two, at most ``data.seq_len`` (the
    trained context); with post-training (chat prompts: a system prompt and the question)
    the whole trained context."""
    if cfg.posttrain.enabled:
        return cfg.data.seq_len
    longest = 1 + 2 * cfg.data.max_digits + 2 + cfg.serve.max_new_tokens  # BOS a + b = answer
    return min(cfg.data.seq_len, bucket(longest, 1 << 30))


def bucket(n: int, cap: int) -> int:
    """The next power of two >= n, at most ``cap``."""
    return min(cap, 1 << max(0, (n - 1).bit_length()))


def _byte_chars() -> list[str]:
    """The printable character that stands for each byte value in a byte-level vocabulary
    (the ``tokenizers`` ByteLevel convention: printable Latin-1 bytes as themselves, the
    others moved to U+0100 onwards in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(moved)) for b in range(256)]


@functools.cache
def tokenizer() -> llm.Tokenizer:
    """The task's byte tokenizer (module docstring) as a ``cairn.llm.Tokenizer``."""
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({c: 3 + b for b, c in enumerate(_byte_chars())})
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens([tokenizers.AddedToken(s, special=True) for s in SPECIALS])
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", lm_task.BOS)])
    return llm.Tokenizer(backend, {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"})


def problem_prompt(text: str, codec: Any = None) -> tuple[list[int], str]:
    """``"372+59=134"`` -> (BOS + tokens of ``"372+59="``, ``"134"``); ``codec``: the
    tokenizer (default: bytes)."""
    codec = lm_task.BYTES if codec is None else codec
    head, answer = text.split("=", 1)
    return [lm_task.BOS, *codec.encode(head + "=").tolist()], answer


def chat_prompt(tok: llm.Tokenizer, text: str) -> tuple[list[int], str]:
    """The chat form of a problem (``lm_task.chat_messages``) through ``tok``'s chat template,
    ready for the answer: (ids, the expected answer)."""
    return tok.apply_chat_template(lm_task.chat_messages(text, False), add_generation_prompt=True,
                                   tokenize=True), text.split("=", 1)[1]


def answers_text(token_lists: Sequence[Sequence[int]], codec: Any = None) -> list[str]:
    """The text of each answer (an end token, if any, dropped)."""
    codec = lm_task.BYTES if codec is None else codec
    return [codec.decode(np.asarray([t for t in ids if t != lm_task.EOS], np.int32)) for ids in token_lists]


def greedy(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, length: int, batch: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` by ``cairn.llm.generate``, ``batch`` rows at a time
    (each row stops at its end token, kept as its last token)."""
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch):
        res = llm.generate(model, [list(p) for p in prompts[start : start + batch]], max_new_tokens,
                           stop_token_ids=[lm_task.EOS], max_length=length, return_logprobs=False)
        out.extend(res.tokens)
    return out


def exact_match(model: Any, texts: Sequence[str], max_new_tokens: int, length: int,
                batch: int = 16, codec: Any = None, chat: llm.Tokenizer | None = None) -> tuple[float, list[str]]:
    """Held-out exact match by greedy generation: (fraction right, the generated answers).

    The prompt is the problem up to ``=`` (``codec``: its tokenizer, default bytes), or with
    ``chat`` (a tokenizer with the chat template) the problem's chat form (`chat_prompt`).
    """
    if not texts:
        return float("nan"), []
    prompts, expected = zip(*(chat_prompt(chat, t) if chat is not None else problem_prompt(t, codec) for t in texts))
    got = answers_text(greedy(model, list(prompts), max_new_tokens, length, batch), codec)
    return sum(g == e for g, e in zip(got, expected)) / len(texts), got
