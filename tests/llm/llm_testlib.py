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
