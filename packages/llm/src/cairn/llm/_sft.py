"""Supervised fine-tuning: :class:`SFTTrainer` trains a :class:`~cairn.llm.CausalLM` on
chat-formatted (or prompt/completion) examples, the loss on completion tokens only, with
packing, gradient accumulation, LoRA/QLoRA or full fine-tuning, and checkpoints that resume
bit-identically.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from cairn import nn
from cairn.llm._generate import generate
from cairn.llm._model import CausalLM
from cairn.llm._sft_data import sft_dataset
from cairn.llm._trainer import (
    LoraSettings,
    Trainable,
    TrainerConfig,
    TrainerRun,
    accumulating_step,
    default_optimizer,
    token_nll_sum,
)
from cairn.serving import Tokenizer

__all__ = ["SFTConfig", "SFTTrainer"]

BATCH_KEYS = ("inputs", "targets", "weights", "segment_ids", "positions")


@dataclasses.dataclass(frozen=True)
class SFTConfig(TrainerConfig):
    """How :class:`SFTTrainer` trains.

    Args:
      steps: optimizer steps of the run (the learning-rate schedule spans them; a resumed
        run continues to the same number).
      batch_size: rows per micro-batch.
      grad_accum_steps: micro-batches per optimizer step (the loss is the mean over every completion token of all of them, exactly as one
        batch ``grad_accum_steps`` times larger).
      seq_len: tokens per row (longer examples are cut at the end).
      packing: first-fit pack several examples per row (they do not attend to each other).
      learning_rate: the default optimizer's peak learning rate (AdamW, linear warmup,
        cosine decay to 10%).
      warmup_steps: its linear warmup steps.
      weight_decay: its decoupled weight decay.
      max_grad_norm: its global-norm gradient clipping; None for none.
      lora: train LoRA adapters (:class:`LoraSettings`); ``None`` trains every weight.
      save_every: checkpoint interval in steps.
      max_to_keep: how many checkpoints to keep.
      log_every: steps between metrics lines.
      seed: the data shuffle seed.
    """

    steps: int
    batch_size: int = 8
    grad_accum_steps: int = 1
    seq_len: int = 256
    packing: bool = True
    learning_rate: float = 2e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    lora: LoraSettings | None = dataclasses.field(default_factory=LoraSettings)
    save_every: int = 50
    max_to_keep: int = 2
    log_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        self._check_positive("steps", "batch_size", "grad_accum_steps", "seq_len", "save_every", "max_to_keep", "log_every")
        if not (self.learning_rate > 0 and np.isfinite(self.learning_rate)):
            raise ValueError(f"SFTConfig.learning_rate must be a positive number, got {self.learning_rate!r}")


def _stack(batches: list[dict]) -> dict[str, np.ndarray]:
    return {k: np.stack([np.asarray(b[k]) for b in batches]) for k in BATCH_KEYS}


class SFTTrainer:
    """Supervised fine-tuning of a :class:`CausalLM` on chat or prompt/completion examples.

    Args:
      model: the model to train (``from_pretrained`` or fresh); with LoRA its adapters are
        added in place and the base weights stay frozen.
      tokenizer: its tokenizer (the chat template formats conversational examples).
      train_data: a sequence of examples (``{"messages": [...]}`` or ``{"prompt",
        "completion"}``; see :func:`cairn.llm.sft_example`).
      config: :class:`SFTConfig`.
      run_dir: where checkpoints, ``metrics.jsonl`` and ``loss.png`` go; a directory holding
        a checkpoint of the same config resumes from it.
      optimizer: a cairn.optim / Optax gradient transformation instead of the default.

    >>> # trainer = SFTTrainer(model, tok, examples, SFTConfig(steps=200), "runs/sft")
    >>> # trainer.train(); merged = merge_lora(trainer.runner())
    """

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, train_data: Sequence[Mapping[str, Any]] | Any,
                 config: SFTConfig, run_dir: str | os.PathLike, *, optimizer: Any = None) -> None:
        if not isinstance(config, SFTConfig):
            raise TypeError(f"config must be an SFTConfig, got {type(config).__name__}")
        self.config, self.tokenizer = config, tokenizer
        self.trainable = Trainable(model, config.lora)
        tx = optimizer if optimizer is not None else default_optimizer(
            config.learning_rate, config.steps, config.warmup_steps, config.weight_decay, config.max_grad_norm)
        self.optimizer = nn.Optimizer(self.trainable.model, tx, wrt=self.trainable.wrt)
        self.data_iter = iter(sft_dataset(train_data, tokenizer, seq_len=config.seq_len, batch_size=config.batch_size,
                                          packing=config.packing, seed=config.seed))
        self.run = TrainerRun(run_dir, self.trainable, self.optimizer, self.data_iter, config.to_json(),
                              save_every=config.save_every, max_to_keep=config.max_to_keep)
        self.step = self.run.resume()
        self._train_step = accumulating_step(self.trainable, _sft_loss)

    def runner(self) -> Any:
        """The trained model to call or ``generate`` with (through the adapters with LoRA);
        ``merge_lora(trainer.runner())`` folds them in for ``save_pretrained``."""
        return self.trainable.runner()

    def train(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train until ``config.steps`` (or step ``stop_after``, saving a checkpoint there, as
        a preempted run would); returns the last metrics line (also in ``metrics.jsonl``).

        Args:
          stop_after: stop at this step, saving a checkpoint there (as a preempted run would); None
            runs to ``config.steps``.
        """
        cfg, last = self.config, {}
        window_tokens, window_s, blocked = 0.0, 0.0, 0.0
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        while self.step < end:
            t0 = time.perf_counter()
            batch = _stack([next(self.data_iter) for _ in range(cfg.grad_accum_steps)])
            out = self._train_step(self.trainable.model, self.optimizer, batch)
            self.step += 1
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                out = jax.device_get(out)
                window_s += time.perf_counter() - t0
                window_tokens += float(out["count"])
                last = {"step": self.step, "loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]),
                        "completion_tokens": float(out["count"]), "tokens_per_s": window_tokens / max(window_s, 1e-9),
                        "checkpoint_blocked_s": blocked}
                self.run.log(last)
                window_tokens, window_s = 0.0, 0.0
            else:
                window_s += time.perf_counter() - t0
            blocked += self.run.maybe_save(self.step, force=self.step == end)
        self.run.manager.wait_until_finished()
        return last

    def exact_match(self, examples: Sequence[Mapping[str, Any]], max_new_tokens: int = 32) -> float:
        """The share of conversational examples whose last assistant message the model
        reproduces exactly (greedy generation after the chat template of the turns before it,
        compared with surrounding whitespace stripped).

        Args:
          examples: conversational examples (``{"messages": [...]}`` ending with an assistant
            message).
          max_new_tokens: the most tokens generated per example.

        Raises:
          ValueError: an example without messages ending in an assistant message.
        """
        prompts, answers = [], []
        for i, ex in enumerate(examples):
            msgs = ex.get("messages") if isinstance(ex, Mapping) else None
            if not msgs or msgs[-1].get("role") != "assistant":
                raise ValueError(f"exact_match: example {i} needs 'messages' ending with an assistant message")
            prompts.append(self.tokenizer.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True))
            answers.append(str(msgs[-1]["content"]).strip())
        out = generate(self.runner(), prompts, max_new_tokens, tokenizer=self.tokenizer)
        got = [t.strip() for t in (out.text or [])]
        return float(np.mean([g == a for g, a in zip(got, answers)]))

    def close(self) -> None:
        """Wait for the last checkpoint and release the run directory."""
        self.run.close()


def _sft_loss(policy: Any, base: Any, mb: dict) -> tuple:
    logits = policy(mb["inputs"], positions=mb["positions"], segment_ids=mb["segment_ids"])
    total, count = token_nll_sum(logits, mb["targets"], mb["weights"])
    return total, count, {}
