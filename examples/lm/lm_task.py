"""The embedded default task: multi-digit addition written as text, and its tokenizer.

A problem reads ``"372+59=134"``: the operands most-significant digit first, the sum
written *least*-significant digit first (372 + 59 = 431), so that a left-to-right model
can produce each digit with the carry it just computed; this is the usual way small
transformers are taught addition. Every problem has one exact answer, so held-out
exact-match accuracy is a real score. Chance is 10^-(digits of the answer).

The job tokenizes with a BPE it trains on this corpus (lm_tokenizer); ``tokenizer.kind =
"byte"`` keeps the earlier byte tokenizer defined here: bytes shifted by 3 (0 = padding,
1 = beginning, 2 = end of text), the vocabulary padded to 320 entries. Both keep ids 0, 1, 2
for padding, beginning and end.
"""

from __future__ import annotations

import numpy as np

PAD, BOS, EOS = 0, 1, 2
VOCAB_SIZE = 320  # 256 byte values + 3 special tokens, padded to a multiple of 64
EQUALS = ord("=") + 3
NEWLINE = ord("\n") + 3


def _operands(rng: np.random.Generator, n: int, max_digits: int) -> tuple[np.ndarray, np.ndarray]:
    # digits drawn uniformly per operand so that short and long numbers are equally common
    digits_a = rng.integers(1, max_digits + 1, n)
    digits_b = rng.integers(1, max_digits + 1, n)
    a = rng.integers(0, 10**digits_a)
    b = rng.integers(0, 10**digits_b)
    return a, b


def is_held_out(a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray | bool:
    """A fixed ~1/16 of all problems is never trained on: the held-out evaluation set."""
    h = (np.asarray(a, np.uint64) * np.uint64(0x9E3779B1) + np.asarray(b, np.uint64) * np.uint64(0x85EBCA77))
    return ((h >> np.uint64(7)) & np.uint64(15)) == 0


def problem_text(a: int, b: int) -> str:
    return f"{a}+{b}={str(a + b)[::-1]}"


def make_problems(num: int, max_digits: int, seed: int, held_out: bool) -> list[str]:
    """``num`` distinct-by-construction problems from the train or the held-out split."""
    rng = np.random.default_rng([seed, 1 if held_out else 0])
    out: list[str] = []
    while len(out) < num:
        a, b = _operands(rng, 2 * (num - len(out)) + 64, max_digits)
        keep = is_held_out(a, b) == held_out
        out.extend(problem_text(int(x), int(y)) for x, y in zip(a[keep], b[keep]))
    return out[:num]


def encode(text: str | bytes) -> np.ndarray:
    """Byte tokens of ``text`` (no special tokens)."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, np.uint8).astype(np.int32) + 3


def decode(tokens: np.ndarray) -> str:
    t = np.asarray(tokens)
    t = t[t >= 3] - 3
    return bytes(t.astype(np.uint8)).decode("utf-8", errors="replace")


class ByteCodec:
    """The byte tokenizer's task-facing form (`encode`, `decode`, `equals_id`), the interface
    of ``lm_tokenizer.Codec`` (the job's BPE)."""

    equals_id = EQUALS
    newline_id = NEWLINE

    def encode(self, text: str | bytes) -> np.ndarray:
        return encode(text)

    def decode(self, ids: np.ndarray) -> str:
        return decode(ids)


BYTES = ByteCodec()

# the chat form of a problem (post-training and serving): a system prompt shared by every
# request (the server's prefix cache holds it once), the question, the answer as pretrained
SYSTEM_PROMPT = "Add the two numbers and write the sum with its digits reversed."


def question(text: str) -> str:
    """``"372+59=134"`` -> ``"What is 372+59?"``."""
    return f"What is {text.split('=', 1)[0]}?"


def worksheet(text: str) -> str:
    """A problem as a worked question under the system prompt's instruction, the pretraining
    corpus' second form (the chat form adds only the role markers to it)::

        Add the two numbers and write the sum with its digits reversed.
        What is 372+59?
        134
    """
    return f"{SYSTEM_PROMPT}\n{question(text)}\n{text.split('=', 1)[1]}"


def mix_forms(texts: list[str], share: float, seed: int) -> list[str]:
    """``texts`` with a ``share`` of them, chosen by ``seed``, written as `worksheet` s."""
    pick = np.random.default_rng([seed, 7]).random(len(texts)) < share
    return [worksheet(t) if p else t for t, p in zip(texts, pick)]


def chat_messages(text: str, with_answer: bool = True) -> list[dict[str, str]]:
    """The conversation of one problem: system prompt, question and (``with_answer``) the answer."""
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question(text)}]
    return msgs + ([{"role": "assistant", "content": text.split("=", 1)[1]}] if with_answer else [])


def example_from_text(text: str | bytes, seq_len: int, answer_only: bool,
                      codec: ByteCodec | None = None) -> dict[str, np.ndarray]:
    """One training example: ``inputs`` = BOS + text, ``targets`` = text + EOS, ``weights``.

    With ``answer_only`` (the addition task) only the tokens after ``=`` (a `worksheet`:
    after its last line break) and the end token carry loss: the operands are random, so
    predicting them teaches nothing. Text longer
    than ``seq_len`` is cut. ``codec``: the tokenizer (default bytes; ``lm_tokenizer.Codec``).
    """
    codec = BYTES if codec is None else codec
    toks = codec.encode(text)[: seq_len - 1]
    inputs = np.concatenate([[BOS], toks]).astype(np.int32)
    targets = np.concatenate([toks, [EOS]]).astype(np.int32)
    if answer_only:
        eq = np.flatnonzero(toks == codec.equals_id)
        if not eq.size:
            eq = np.flatnonzero(toks == codec.newline_id)[-1:]
        start = int(eq[0]) + 1 if eq.size else 0
        weights = (np.arange(targets.size) >= start).astype(np.float32)
    else:
        weights = np.ones(targets.size, np.float32)
    return {"inputs": inputs, "targets": targets, "weights": weights}


def eval_batch(texts: list[str], seq_len: int, codec: ByteCodec | None = None) -> dict[str, np.ndarray]:
    """Unpacked, right-padded evaluation rows with answer-only weights."""
    n = len(texts)
    out = {
        "inputs": np.zeros((n, seq_len), np.int32),
        "targets": np.zeros((n, seq_len), np.int32),
        "weights": np.zeros((n, seq_len), np.float32),
        "segment_ids": np.zeros((n, seq_len), np.int32),
        "positions": np.zeros((n, seq_len), np.int32),
    }
    for i, t in enumerate(texts):
        ex = example_from_text(t, seq_len, answer_only=True, codec=codec)
        L = ex["inputs"].size
        for k in ("inputs", "targets", "weights"):
            out[k][i, :L] = ex[k]
        out["segment_ids"][i, :L] = 1
        out["positions"][i, :L] = np.arange(L)
    return out
