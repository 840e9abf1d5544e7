"""Shared helpers of the tests/llm suites: the committed transformers fixtures, loaded once."""

from __future__ import annotations

import functools
import pathlib

import numpy as np

from cairn import llm, nn

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
VARIANTS = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.npz").exists())


@functools.cache
def load(variant: str) -> llm.CausalLM:
    return llm.from_pretrained(FIXTURES / variant)


def reference(variant: str) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids [2, 12] int32, transformers' logits [2, 12, vocab] float32)``."""
    with np.load(FIXTURES / variant / "reference.npz") as z:
        return z["input_ids"], z["logits"]


@nn.jit
def forward(model: llm.CausalLM, ids):
    return model(ids)


@nn.jit
def extend(model: llm.CausalLM, ids, cache, lengths):
    return model(ids, cache=cache, lengths=lengths)


# --- post-training: a tiny chat task the trainers' tests learn ---

LETTERS = "abcdefghijklmnopqrstuvwxyz"
CHAT_PIECES = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "\n", " ", *LETTERS]
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
                 "{% else %}<|assistant|>{{ m['content'] }}</s>{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_tokenizer(template: str = CHAT_TEMPLATE) -> llm.Tokenizer:
    """One token per letter, specials ``<pad> <s> </s> <|user|> <|assistant|>``, a chat template."""
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.BPE({p: i for i, p in enumerate(CHAT_PIECES)}, []))
    backend.decoder = tokenizers.decoders.Fuse()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in CHAT_PIECES[:5]])
    return llm.Tokenizer(backend, {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}, chat_template=template)


def successor(word: str) -> str:
    """Each letter shifted by one (``"abz" -> "bca"``): the task the chat examples teach."""
    return "".join(LETTERS[(LETTERS.index(c) + 1) % 26] for c in word)


def successor_chats(n: int, seed: int = 0, length: int = 3) -> list[dict]:
    """``n`` conversations: the user sends a random word, the assistant its successor."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list(LETTERS), length)) for _ in range(n)]
    return [{"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": successor(w)}]} for w in words]


def tiny_chat_model(seed: int = 0, hidden: int = 64, layers: int = 1) -> llm.CausalLM:
    cfg = llm.LlmConfig("llama", vocab_size=len(CHAT_PIECES), hidden_size=hidden, intermediate_size=2 * hidden,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4)
    return llm.CausalLM(cfg, rngs=nn.Rngs(seed))


def predecessor(word: str) -> str:
    """Each letter shifted back by one: the rejected answer of the preference pairs."""
    return "".join(LETTERS[(LETTERS.index(c) - 1) % 26] for c in word)


def successor_preferences(n: int, seed: int = 0, length: int = 3) -> list[dict]:
    """``n`` chat preference pairs: the successor word chosen over the predecessor word."""
    return [{"prompt": ex["messages"][:1],
             "chosen": ex["messages"][1:],
             "rejected": [{"role": "assistant", "content": predecessor(ex["messages"][0]["content"])}]}
            for ex in successor_chats(n, seed, length)]
