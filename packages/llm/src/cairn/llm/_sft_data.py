"""Supervised fine-tuning data: chat or prompt/completion examples to token rows with a loss
mask on the completion, and the cairn.data pipeline that packs and batches them.

An example is one of (the layouts TRL's SFT trainer reads, so datasets move over):

- conversational: ``{"messages": [{"role": ..., "content": ...}, ...]}``; the loss covers
  every assistant turn (the ``{% generation %}`` blocks when the chat template has them,
  else each assistant message's rendered text, end-of-turn tokens included);
- prompt/completion: ``{"prompt": str, "completion": str}`` (plain text: the prompt with the
  tokenizer's special tokens, the completion, then EOS) or ``{"prompt": [messages],
  "completion": [messages]}`` (conversational, the loss on the completion's messages).

A row is ``{"inputs", "targets", "weights"}``: ``targets`` is ``inputs`` shifted by one and
``weights`` is 1 where the target is a completion token, so the loss is
``sum(weights * nll) / sum(weights)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cairn import data as cdata
from cairn.serving import Tokenizer

__all__ = ["sft_dataset", "sft_example"]


def _render(tokenizer: Tokenizer, messages: Sequence[Any], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt)


def _assistant_spans(tokenizer: Tokenizer, messages: Sequence[Any], first: int, where: str) -> tuple[str, list]:
    """The conversation's text and the character spans of its assistant turns from message
    ``first`` on: each turn's text is what rendering it adds to the conversation before it."""
    text = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if i < first or not isinstance(m, Mapping) or m.get("role") != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], True)) if i else 0
        end_text = _render(tokenizer, messages[: i + 1], False)
        if not text.startswith(end_text) or start > len(end_text):
            raise ValueError(f"{where}: the chat template does not render the conversation up to message {i} as a "
                             "prefix of the whole (it rewrites earlier turns); add {% generation %} blocks to the "
                             "template to mark the assistant's text, or use prompt/completion examples")
        spans.append((start, len(end_text)))
    return text, spans


def _chat_ids(tokenizer: Tokenizer, messages: Sequence[Any], first: int, where: str) -> tuple[list[int], list[int]]:
    if not messages or not all(isinstance(m, Mapping) and "role" in m for m in messages):
        raise ValueError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} dicts")
    if not any(m.get("role") == "assistant" for m in messages[first:]):
        raise ValueError(f"{where}: no assistant message to learn from")
    if first == 0 and "{% generation" in (tokenizer.get_chat_template() or "").replace("{%-", "{%"):
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=False, tokenize=True,
                                            return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])
    text, spans = _assistant_spans(tokenizer, messages, first, where)
    enc = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    mask = [int(any(s < b and e > a for a, b in spans)) for s, e in enc.offsets]
    return list(enc.ids), mask


def _text_ids(tokenizer: Tokenizer, prompt: str, completion: str, where: str) -> tuple[list[int], list[int]]:
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ValueError(f"{where}: prompt and completion must both be strings or both be message lists")
    eos = tokenizer.eos_token_ids
    if not eos:
        raise ValueError(f"{where}: the tokenizer has no eos token to end the completion with")
    p = tokenizer.encode(prompt)
    c = tokenizer.encode(completion, add_special_tokens=False) + [int(eos[0])]
    return p + c, [0] * len(p) + [1] * len(c)


def sft_example(tokenizer: Tokenizer, example: Mapping[str, Any], seq_len: int, *, where: str = "example") -> dict:
    """One example as a row of at most ``seq_len`` tokens (longer ones are cut at the end).

    Args:
      tokenizer: the model's tokenizer (its chat template for conversational examples).
      example: ``{"messages"}`` or ``{"prompt", "completion"}`` (module docstring).
      seq_len: the most tokens in the row.
      where: how errors name the example (e.g. ``"example 12"``).

    Returns:
      ``{"inputs": int32 [n], "targets": int32 [n], "weights": float32 [n]}``, ``n <= seq_len``.

    Raises:
      ValueError: an example of neither layout, with no completion tokens, or whose chat
        template cannot mark the assistant's text; named by ``where``.
    """
    if not isinstance(example, Mapping):
        raise ValueError(f"{where}: expected a dict with 'messages' or 'prompt' and 'completion', got {type(example).__name__}")
    if "messages" in example:
        ids, mask = _chat_ids(tokenizer, example["messages"], 0, where)
    elif "prompt" in example and "completion" in example:
        prompt, completion = example["prompt"], example["completion"]
        if isinstance(prompt, list) and isinstance(completion, list):
            ids, mask = _chat_ids(tokenizer, [*prompt, *completion], len(prompt), where)
        else:
            ids, mask = _text_ids(tokenizer, prompt, completion, where)
    else:
        raise ValueError(f"{where}: expected the key 'messages', or 'prompt' and 'completion'; got {sorted(example)}")
    ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
    if len(ids) < 2 or not any(mask[1:]):
        raise ValueError(f"{where}: no completion token to train on within seq_len={seq_len} "
                         f"({len(ids)} tokens kept; a prompt that fills the row leaves none)")
    return {"inputs": np.asarray(ids[:-1], np.int32), "targets": np.asarray(ids[1:], np.int32),
            "weights": np.asarray(mask[1:], np.float32)}


class _ToRow:
    """``sft_example`` as a picklable map function (worker processes)."""

    def __init__(self, tokenizer: Tokenizer, seq_len: int) -> None:
        self.tokenizer, self.seq_len = tokenizer, seq_len

    def __call__(self, index: int, example: Mapping[str, Any]) -> dict:
        return sft_example(self.tokenizer, example, self.seq_len, where=f"example {index}")


class _Pad:
    """One example per row, right-padded to ``seq_len`` (segment 1, padding segment 0)."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def __call__(self, row: dict) -> dict:
        n, t = len(row["inputs"]), np.arange(self.seq_len)
        out = {k: np.pad(v, (0, self.seq_len - n)) for k, v in row.items()}
        out["segment_ids"] = (t < n).astype(np.int32)
        out["positions"] = np.where(t < n, t, 0).astype(np.int32)
        return out


def _packed(row: dict) -> dict:
    return {"inputs": row["inputs"], "targets": row["targets"], "weights": row["weights"].astype(np.float32),
            "segment_ids": row["inputs_segment_ids"].astype(np.int32), "positions": row["inputs_positions"].astype(np.int32)}


def sft_dataset(examples: Sequence[Mapping[str, Any]] | Any, tokenizer: Tokenizer, *, seq_len: int, batch_size: int,
                packing: bool = True, seed: int = 0, num_epochs: int | None = None) -> cdata.IterDataset:
    """Examples -> shuffled (each epoch), tokenized, packed (or padded), batched rows.

    Args:
      examples: a sequence of examples (or any cairn.data source of them).
      tokenizer: the model's tokenizer.
      seq_len: tokens per row.
      batch_size: rows per batch.
      packing: first-fit pack several examples per row (``segment_ids`` and per-example
        ``positions`` keep them from attending to each other); else one example per row,
        right-padded.
      seed: the shuffle seed.
      num_epochs: passes over the data (``None``: endless).

    Returns:
      A cairn.data ``IterDataset`` of ``{"inputs", "targets", "weights", "segment_ids",
      "positions"}`` ``[batch_size, seq_len]`` batches; its iterator checkpoints its position
      (save it with the model to resume bit-identically).
    """
    for name, v in (("seq_len", seq_len), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"sft_dataset: {name} must be a positive integer, got {v!r}")
    # tokenized lazily, on access; indexed before the shuffle so errors name the example
    ds = cdata.MapDataset.source(examples).map_with_index(_ToRow(tokenizer, seq_len))
    it = ds.shuffle(seed=seed).repeat(num_epochs).to_iter_dataset()
    if packing:
        it = cdata.FirstFitPackIterDataset(it, length_struct={k: seq_len for k in ("inputs", "targets", "weights")},
                                           num_packing_bins=max(2, batch_size), shuffle_bins=False).map(_packed)
    else:
        it = it.map(_Pad(seq_len))
    return it.batch(batch_size, drop_remainder=True)
