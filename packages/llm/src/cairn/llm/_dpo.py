"""Preference optimization: :class:`DPOTrainer` trains a :class:`~cairn.llm.CausalLM` on
``{"prompt", "chosen", "rejected"}`` pairs with the DPO family of losses of
``cairn.optim.losses`` (sigmoid DPO, cDPO through ``label_smoothing``, IPO, SimPO, ORPO).

The reference policy: with LoRA it is the base model without its adapters, run in the same
step (no second copy of the weights); without LoRA the reference log-probabilities are
computed once, before training, with the initial weights.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn import data as cdata
from cairn import nn
from cairn.llm._model import CausalLM
from cairn.llm._sft_data import sft_example
from cairn.llm._trainer import (
    LoraSettings,
    Trainable,
    TrainerConfig,
    TrainerRun,
    accumulating_step,
    default_optimizer,
    window_logits,
)
from cairn.optim import losses
from cairn.serving import Tokenizer

__all__ = ["DPOConfig", "DPOTrainer", "preference_dataset"]

LOSS_TYPES = ("sigmoid", "ipo", "simpo", "orpo")
SIDES = ("chosen", "rejected")
FIELDS = ("inputs", "targets", "weights")


@dataclasses.dataclass(frozen=True)
class DPOConfig(TrainerConfig):
    """How :class:`DPOTrainer` trains.

    Args:
      steps: optimizer steps of the run.
      batch_size: preference pairs per micro-batch.
      grad_accum_steps: micro-batches per step.
      seq_len: tokens per prompt + completion (longer ones are cut at the end).
      loss_type: ``"sigmoid"`` (DPO; ``label_smoothing`` > 0 is cDPO), ``"ipo"``,
        ``"simpo"`` or ``"orpo"`` (the last two use no reference).
      beta: the loss's beta (DPO's KL strength; IPO's tau; SimPO's reward scale; ORPO's lambda).
      label_smoothing: cDPO's label-flip probability (sigmoid loss only).
      simpo_gamma: SimPO's target reward margin.
      learning_rate: the default optimizer's peak learning rate (AdamW).
      warmup_steps: its linear warmup steps.
      weight_decay: its decoupled weight decay.
      max_grad_norm: its global-norm gradient clipping; None for none.
      lora: train LoRA adapters (the reference is then the base without them); ``None``
        trains every weight (reference log-probabilities precomputed).
      save_every: checkpoint interval in steps.
      max_to_keep: how many checkpoints to keep.
      log_every: steps between metrics lines.
      seed: the data shuffle seed.
    """

    steps: int
    batch_size: int = 8
    grad_accum_steps: int = 1
    seq_len: int = 256
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    learning_rate: float = 5e-5
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
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"DPOConfig.loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"DPOConfig.label_smoothing applies to loss_type='sigmoid' only, not {self.loss_type!r}")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference policy (DPO, IPO; not SimPO, ORPO)."""
        return self.loss_type in ("sigmoid", "ipo")


def _empty(completion: Any) -> bool:
    if isinstance(completion, str):
        return not completion.strip()
    if isinstance(completion, list):
        return not any(isinstance(m, Mapping) and str(m.get("content") or "").strip() for m in completion)
    return False


def _pair(tokenizer: Tokenizer, example: Mapping[str, Any], seq_len: int, where: str) -> dict[str, np.ndarray]:
    """One pair as right-padded ``chosen_*`` and ``rejected_*`` rows."""
    if not isinstance(example, Mapping) or not all(k in example for k in ("prompt", *SIDES)):
        got = sorted(example) if isinstance(example, Mapping) else type(example).__name__
        raise ValueError(f"{where}: expected a dict with 'prompt', 'chosen' and 'rejected', got {got}")
    out = {}
    for side in SIDES:
        if _empty(example[side]):
            raise ValueError(f"{where}: the {side} completion is empty; a preference needs two real answers")
        row = sft_example(tokenizer, {"prompt": example["prompt"], "completion": example[side]}, seq_len,
                          where=f"{where} ({side})")
        n = len(row["inputs"])
        for k in FIELDS:
            out[f"{side}_{k}"] = np.pad(row[k], (0, seq_len - n))
    return out


class _ToPair:
    def __init__(self, tokenizer: Tokenizer, seq_len: int, reference: np.ndarray | None) -> None:
        self.tokenizer, self.seq_len, self.reference = tokenizer, seq_len, reference

    def __call__(self, index: int, example: Mapping[str, Any]) -> dict:
        row = _pair(self.tokenizer, example, self.seq_len, f"example {index}")
        if self.reference is not None:
            row["ref_chosen"], row["ref_rejected"] = self.reference[index].astype(np.float32)
        return row


def preference_dataset(examples: Sequence[Mapping[str, Any]] | Any, tokenizer: Tokenizer, *, seq_len: int,
                       batch_size: int, seed: int = 0, num_epochs: int | None = None,
                       reference: np.ndarray | None = None) -> cdata.IterDataset:
    """Preference pairs -> shuffled (each epoch), tokenized, padded, batched rows.

    Args:
      examples: ``{"prompt", "chosen", "rejected"}`` dicts, each text (the prompt with the
        tokenizer's special tokens, each completion then EOS) or message lists (the chat
        template; the loss on the completion's assistant messages).
      tokenizer: the model's tokenizer.
      seq_len: tokens per row (prompt + completion; longer pairs are cut at the end).
      batch_size: pairs per batch.
      seed: the shuffle seed.
      num_epochs: passes over the data (``None``: endless).
      reference: ``[len(examples), 2]`` reference log-probabilities (chosen, rejected) to
        carry along, by example.

    Returns:
      A cairn.data ``IterDataset`` of ``{"chosen_inputs", "chosen_targets", "chosen_weights",
      "rejected_..." [batch_size, seq_len]}`` (plus ``ref_chosen``, ``ref_rejected``
      ``[batch_size]``), whose iterator checkpoints its position.
    """
    ds = cdata.MapDataset.source(examples).map_with_index(_ToPair(tokenizer, seq_len, reference))
    return ds.shuffle(seed=seed).repeat(num_epochs).to_iter_dataset().batch(batch_size, drop_remainder=True)


def _logps(model: Any, mb: dict, average: bool, start: int = 0) -> tuple[jax.Array, jax.Array]:
    """Sequence log-probabilities of the chosen and rejected completions (one forward pass);
    the logits from ``start`` on only (no completion target comes before it)."""
    ids = jnp.concatenate([mb["chosen_inputs"], mb["rejected_inputs"]])
    targets = jnp.concatenate([mb["chosen_targets"], mb["rejected_targets"]])[:, start:]
    weights = jnp.concatenate([mb["chosen_weights"], mb["rejected_weights"]])[:, start:]
    lp = losses.sequence_logprobs(window_logits(model, ids, start), targets, weights, average=average)
    b = mb["chosen_inputs"].shape[0]
    return lp[:b], lp[b:]


def window_start(tokenizer: Tokenizer, examples: Sequence[Mapping[str, Any]], seq_len: int) -> int:
    """The first row position whose target is a completion token in any of ``examples``' pairs
    (the shortest prompt's end): the logits before it carry no loss."""
    start = seq_len
    for i, ex in enumerate(examples):
        row = _pair(tokenizer, ex, seq_len, f"example {i}")
        for side in SIDES:
            start = min(start, int(np.argmax(row[f"{side}_weights"] > 0)))
    return start


def _preference_loss(cfg: DPOConfig, start: int = 0) -> Any:
    """``micro_loss(policy, base, mb)`` of the configured loss (see ``accumulating_step``),
    scoring the logits from ``start`` on (see :func:`window_start`)."""

    def micro_loss(policy: Any, base: Any, mb: dict) -> tuple:
        average = cfg.loss_type in ("simpo", "orpo")
        chosen, rejected = _logps(policy, mb, average, start)
        if cfg.loss_type == "sigmoid" or cfg.loss_type == "ipo":
            if "ref_chosen" in mb:
                ref_c, ref_r = mb["ref_chosen"], mb["ref_rejected"]
            else:
                ref_c, ref_r = jax.lax.stop_gradient(_logps(base, mb, False, start))
            out = (losses.dpo_loss(chosen, rejected, ref_c, ref_r, beta=cfg.beta, label_smoothing=cfg.label_smoothing)
                   if cfg.loss_type == "sigmoid" else losses.ipo_loss(chosen, rejected, ref_c, ref_r, beta=cfg.beta))
        elif cfg.loss_type == "simpo":
            out = losses.simpo_loss(chosen, rejected, beta=cfg.beta, gamma=cfg.simpo_gamma)
        else:
            out = losses.orpo_loss(chosen, rejected, beta=cfg.beta)
        n = jnp.float32(chosen.shape[0])
        metrics = {"rewards_chosen": jnp.sum(out.chosen_rewards), "rewards_rejected": jnp.sum(out.rejected_rewards),
                   "reward_margin": jnp.sum(out.margins), "reward_accuracy": jnp.sum(out.accuracies),
                   "logp_chosen": jnp.sum(chosen), "logp_rejected": jnp.sum(rejected)}
        return jnp.sum(out.loss), n, metrics

    return micro_loss


class DPOTrainer:
    """Preference optimization of a :class:`CausalLM` (DPO, cDPO, IPO, SimPO, ORPO).

    Args:
      model: the model to train (usually the SFT result); with LoRA its adapters are added in
        place, and the base without them is the reference.
      tokenizer: its tokenizer.
      train_data: ``{"prompt", "chosen", "rejected"}`` examples (:func:`preference_dataset`).
      config: :class:`DPOConfig`.
      run_dir: checkpoints, ``metrics.jsonl`` and ``loss.png``; resumes as
        :class:`~cairn.llm.SFTTrainer` does.
      optimizer: a cairn.optim / Optax gradient transformation instead of the default.
    """

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, train_data: Sequence[Mapping[str, Any]],
                 config: DPOConfig, run_dir: str | os.PathLike, *, optimizer: Any = None) -> None:
        if not isinstance(config, DPOConfig):
            raise TypeError(f"config must be a DPOConfig, got {type(config).__name__}")
        self.config, self.tokenizer = config, tokenizer
        self.trainable = Trainable(model, config.lora)
        # no completion target comes before the shortest prompt's end: the step's logits start there
        self._start = window_start(tokenizer, train_data, config.seq_len)
        reference = None
        if config.needs_reference and config.lora is None:
            reference = self._reference_logps(train_data)  # before any update: the initial weights
        tx = optimizer if optimizer is not None else default_optimizer(
            config.learning_rate, config.steps, config.warmup_steps, config.weight_decay, config.max_grad_norm)
        self.optimizer = nn.Optimizer(self.trainable.model, tx, wrt=self.trainable.wrt)
        self.data_iter = iter(preference_dataset(train_data, tokenizer, seq_len=config.seq_len,
                                                 batch_size=config.batch_size, seed=config.seed, reference=reference))
        self.run = TrainerRun(run_dir, self.trainable, self.optimizer, self.data_iter, config.to_json(),
                              save_every=config.save_every, max_to_keep=config.max_to_keep)
        self.step = self.run.resume()
        self._train_step = accumulating_step(self.trainable, _preference_loss(config, self._start))

    def runner(self) -> Any:
        """The trained model to call or ``generate`` with (through the adapters with LoRA)."""
        return self.trainable.runner()

    def _reference_logps(self, examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """``[n, 2]`` summed log-probabilities of each pair under the current weights."""
        return self.sequence_logps(examples, model=self.trainable.model)

    def sequence_logps(self, examples: Sequence[Mapping[str, Any]], *, model: Any = None,
                       average: bool = False) -> np.ndarray:
        """``[n, 2]`` log-probabilities (chosen, rejected) of each pair's completions under
        ``model`` (default the trained one), summed or length-averaged over their tokens.

        Args:
          examples: ``{"prompt", "chosen", "rejected"}`` dicts.
          model: the model to score with; None uses the trained one.
          average: average over each completion's tokens instead of summing.
        """
        model = self.runner() if model is None else model
        start = window_start(self.tokenizer, examples, self.config.seq_len)
        fn = nn.jit(lambda m, mb: _logps(m, mb, average, start))
        b, out = self.config.batch_size, []
        for start in range(0, len(examples), b):
            rows = [_pair(self.tokenizer, ex, self.config.seq_len, f"example {start + i}")
                    for i, ex in enumerate(examples[start:start + b])]
            rows += [rows[-1]] * (b - len(rows))  # one compiled shape
            mb = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}
            c, r = fn(model, mb)
            out.append(np.stack([np.asarray(c), np.asarray(r)], 1))
        return np.concatenate(out)[: len(examples)]

    def preference_accuracy(self, examples: Sequence[Mapping[str, Any]]) -> float:
        """The share of pairs whose chosen completion the trained model finds more likely than
        the rejected one (summed log-probabilities).

        Args:
          examples: ``{"prompt", "chosen", "rejected"}`` dicts, as for training.
        """
        lp = self.sequence_logps(examples)
        return float(np.mean(lp[:, 0] > lp[:, 1]))

    def train(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train until ``config.steps`` (or ``stop_after``); returns the last metrics line.

        Args:
          stop_after: stop at this step (before ``config.steps``), saving a checkpoint there; None
            runs to the end.
        """
        cfg, last, blocked = self.config, {}, 0.0
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        t0, since = time.perf_counter(), self.step
        while self.step < end:
            micro = [next(self.data_iter) for _ in range(cfg.grad_accum_steps)]
            batch = {k: np.stack([m[k] for m in micro]) for k in micro[0]}
            out = self._train_step(self.trainable.model, self.optimizer, batch)
            self.step += 1
            if self.step % cfg.log_every == 0 or self.step == end:
                out = {k: float(v) for k, v in jax.device_get(out).items()}
                last = {"step": self.step, **{k: v for k, v in out.items() if k != "count"}, "pairs": out["count"],
                        "step_time_s": (time.perf_counter() - t0) / (self.step - since), "checkpoint_blocked_s": blocked}
                self.run.log(last)
                t0, since = time.perf_counter(), self.step
            blocked += self.run.maybe_save(self.step, force=self.step == end)
        self.run.manager.wait_until_finished()
        return last

    def close(self) -> None:
        """Wait for the last checkpoint and release the run directory."""
        self.run.close()
