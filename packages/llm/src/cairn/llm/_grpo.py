"""Group Relative Policy Optimization: :class:`GRPOTrainer` samples ``num_generations``
completions per prompt with ``cairn.llm.generate`` and the current weights, scores them with
the user's reward functions, turns the rewards into group-relative advantages and takes
``num_iterations`` clipped policy-gradient updates on each batch of rollouts, with a KL
penalty to the reference policy (``cairn.optim.losses.clipped_policy_loss``).

The reference: with LoRA, the base model without its adapters (no second copy of the
weights); without LoRA, a frozen copy of the initial weights (twice the parameter memory),
or none when ``beta == 0``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn import data as cdata
from cairn import nn
from cairn.llm._generate import generate
from cairn.llm._model import CausalLM
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

__all__ = ["GRPOConfig", "GRPOTrainer"]

RewardFn = Callable[[list[Any], list[str], list[Mapping[str, Any]]], Sequence[float]]
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclasses.dataclass(frozen=True)
class GRPOConfig(TrainerConfig):
    """How :class:`GRPOTrainer` trains.

    Args:
      steps: batches of rollouts (each gives ``num_iterations`` optimizer steps).
      prompts_per_batch: prompts per batch.
      num_generations: completions per prompt (the group), >= 2.
      max_new_tokens: the most tokens sampled per completion.
      temperature: the sampling temperature (> 0).
      top_k: sample among the ``k`` most likely tokens (0: off).
      top_p: nucleus sampling threshold (1: off).
      num_iterations: optimizer steps per batch of rollouts (GRPO's mu); the clipped ratio
        keeps the later ones close to the sampling policy.
      grad_accum_steps: micro-batches each optimizer step's rollouts are split into.
      clip_epsilon: the ratio's clip range below 1 (and above, unless ``clip_epsilon_high``).
      clip_epsilon_high: the clip range above 1; above ``clip_epsilon`` is DAPO's
        clip-higher. None uses ``clip_epsilon``.
      beta: the weight of the KL penalty to the reference (0: none).
      kl_estimator: Schulman's KL estimator ``"k1"``, ``"k2"`` or ``"k3"`` (unbiased and
        non-negative).
      aggregation: how per-token losses become the batch loss (``"seq-mean-token-mean"``:
        the GRPO paper; ``"token-mean"``: DAPO; ``"seq-mean-token-sum-norm"``: Dr. GRPO).
      normalize_std: divide advantages by the group's reward std (off: Dr. GRPO).
      learning_rate: the default optimizer's peak learning rate (its schedule spans
        ``steps * num_iterations`` optimizer steps).
      warmup_steps: its linear warmup steps.
      weight_decay: its decoupled weight decay.
      max_grad_norm: its global-norm gradient clipping; None for none.
      lora: train LoRA adapters (the reference is the base without them); ``None``: every weight.
      save_every: checkpoint interval, in batches of rollouts.
      max_to_keep: how many checkpoints to keep.
      log_every: batches of rollouts between metrics lines.
      seed: the prompt order and sampling seed.
    """

    steps: int
    prompts_per_batch: int = 8
    num_generations: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    num_iterations: int = 1
    grad_accum_steps: int = 1
    clip_epsilon: float = 0.2
    clip_epsilon_high: float | None = None
    beta: float = 0.04
    kl_estimator: str = "k3"
    aggregation: str = "seq-mean-token-mean"
    normalize_std: bool = True
    learning_rate: float = 1e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    lora: LoraSettings | None = dataclasses.field(default_factory=LoraSettings)
    save_every: int = 10
    max_to_keep: int = 2
    log_every: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        self._check_positive("steps", "prompts_per_batch", "max_new_tokens", "num_iterations", "grad_accum_steps",
                             "save_every", "max_to_keep", "log_every")
        if isinstance(self.num_generations, bool) or not isinstance(self.num_generations, int) or self.num_generations < 2:
            raise ValueError(f"GRPOConfig.num_generations must be an integer >= 2 (a group), got {self.num_generations!r}")
        if (self.prompts_per_batch * self.num_generations) % self.grad_accum_steps:
            raise ValueError(f"GRPOConfig: prompts_per_batch * num_generations = "
                             f"{self.prompts_per_batch * self.num_generations} is not divisible by "
                             f"grad_accum_steps = {self.grad_accum_steps}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"GRPOConfig.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if not self.temperature > 0:
            raise ValueError(f"GRPOConfig.temperature must be > 0 (the group needs different samples), got {self.temperature!r}")


def token_logprobs(model: Any, inputs: jax.Array, targets: jax.Array, temperature: float = 1.0,
                   start: int = 0) -> jax.Array:
    """``log p(targets[t] | inputs[:start+t+1])`` per position from ``start`` under
    ``softmax(logits / temperature)`` (the distribution the completions were sampled from),
    float32 ``[B, T - start]`` for ``inputs [B, T]`` and ``targets [B, T - start]``.

    The whole row is attended to, but the vocabulary projection and softmax run only from
    ``start`` (no completion begins before it: the prompt positions carry no loss).
    """
    logp = jax.nn.log_softmax(window_logits(model, inputs, start) / temperature, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def _aggregate_sums(per_token: jax.Array, mask: jax.Array, how: str, max_new: int) -> tuple[jax.Array, jax.Array]:
    """``(sum, count)`` whose ratio, summed over micro-batches, is the batch loss ``how`` says."""
    m = mask.astype(jnp.float32)
    n = jnp.sum(m, axis=-1)
    if how == "token-mean":
        return jnp.sum(per_token * m), jnp.sum(m)
    per_seq = jnp.sum(per_token * m, axis=-1)
    if how == "seq-mean-token-mean":
        per_seq = per_seq / jnp.maximum(n, 1.0)
    elif how == "seq-mean-token-sum-norm":
        per_seq = per_seq / max_new
    return jnp.sum(per_seq), jnp.float32(per_token.shape[0])


def _policy_loss(cfg: GRPOConfig, start: int = 0) -> Callable:
    """The micro-batch loss of the update: rows' ``targets``, ``mask`` and log-probs hold the
    positions from ``start`` on (their ``inputs`` the whole row)."""

    def micro_loss(policy: Any, base: Any, mb: dict) -> tuple:
        lp = token_logprobs(policy, mb["inputs"], mb["targets"], cfg.temperature, start)
        # one update per batch of rollouts: the weights are still those that sampled, so the
        # sampling log-probabilities are lp itself (ratio 1, no separate forward pass for them)
        old = jax.lax.stop_gradient(lp) if cfg.num_iterations == 1 else mb["old_logprobs"]
        out = losses.clipped_policy_loss(
            lp, old, mb["advantages"], mb["mask"], clip_epsilon=cfg.clip_epsilon,
            clip_epsilon_high=cfg.clip_epsilon_high, ref_logprobs=mb["ref_logprobs"] if cfg.beta else None,
            beta=cfg.beta, kl_estimator=cfg.kl_estimator, aggregation=cfg.aggregation)
        total, count = _aggregate_sums(out.per_token_loss, mb["mask"], cfg.aggregation, cfg.max_new_tokens)
        # the micro-batch's kl and clip fraction, weighted like its loss (the step divides by the count)
        return total, count, {"kl": out.kl * count, "clip_fraction": (out.clip_fraction_low + out.clip_fraction_high) * count}

    return micro_loss


class _Indices:
    """The prompt pipeline yields example indices (the examples stay Python objects)."""

    def __call__(self, index: int, _: Any) -> np.ndarray:
        return np.asarray(index, np.int64)


class GRPOTrainer:
    """GRPO on a :class:`CausalLM` with the user's reward functions.

    Args:
      model: the policy to train (usually an SFT result).
      tokenizer: its tokenizer (message prompts go through its chat template).
      prompts: examples ``{"prompt": str | [messages], ...}``; every other field is passed
        to the reward functions (e.g. the reference answer).
      reward_fns: callables ``fn(prompts, completions, examples) -> rewards`` (one float per
        completion); the reward of a completion is their sum (times ``reward_weights``).
      config: :class:`GRPOConfig`.
      run_dir: checkpoints, ``metrics.jsonl``, ``loss.png``; resumes as
        :class:`~cairn.llm.SFTTrainer` does (rollouts are seeded by the step, so a resumed
        run samples the same completions).
      reward_weights: one weight per reward function (default 1 each).
      optimizer: a cairn.optim / Optax gradient transformation instead of the default.
    """

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, prompts: Sequence[Mapping[str, Any]],
                 reward_fns: RewardFn | Sequence[RewardFn], config: GRPOConfig, run_dir: str | os.PathLike, *,
                 reward_weights: Sequence[float] | None = None, optimizer: Any = None) -> None:
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}")
        self.reward_fns = [reward_fns] if callable(reward_fns) else list(reward_fns)
        if not self.reward_fns or not all(callable(f) for f in self.reward_fns):
            raise TypeError("reward_fns must be a callable or a non-empty list of callables")
        self.reward_weights = [1.0] * len(self.reward_fns) if reward_weights is None else [float(w) for w in reward_weights]
        if len(self.reward_weights) != len(self.reward_fns):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} entries for {len(self.reward_fns)} reward functions")
        self.config, self.tokenizer, self.prompts = config, tokenizer, list(prompts)
        self._prompt_ids = [self._encode(i, ex) for i, ex in enumerate(self.prompts)]
        # one compiled update shape: the longest prompt plus a full completion
        self._width = max(len(p) for p in self._prompt_ids) + config.max_new_tokens
        # no completion starts before the shortest prompt's end: the update's log-probs (and the
        # vocabulary projection under them) begin there
        self._start = min(len(p) for p in self._prompt_ids) - 1
        limit = model.config.max_position_embeddings
        too_long = [i for i, p in enumerate(self._prompt_ids) if len(p) + config.max_new_tokens > limit]
        if too_long:
            i = too_long[0]
            raise ValueError(f"prompt {i}: {len(self._prompt_ids[i])} tokens plus max_new_tokens={config.max_new_tokens} "
                             f"exceed the model's context of {limit} positions ({len(too_long)} prompts do)")
        self.trainable = Trainable(model, config.lora)
        self._reference = self._make_reference(model)
        tx = optimizer if optimizer is not None else default_optimizer(
            config.learning_rate, config.steps * config.num_iterations, config.warmup_steps, config.weight_decay,
            config.max_grad_norm)
        self.optimizer = nn.Optimizer(self.trainable.model, tx, wrt=self.trainable.wrt)
        ds = cdata.MapDataset.source(self.prompts).map_with_index(_Indices()).shuffle(seed=config.seed).repeat(None)
        self.data_iter = iter(ds.to_iter_dataset().batch(config.prompts_per_batch, drop_remainder=True))
        self.run = TrainerRun(run_dir, self.trainable, self.optimizer, self.data_iter, config.to_json(),
                              save_every=config.save_every, max_to_keep=config.max_to_keep)
        self.step = self.run.resume()
        self._update = accumulating_step(self.trainable, _policy_loss(config, self._start))
        self._logprobs = nn.jit(token_logprobs, static_argnums=(3, 4))

    def _encode(self, index: int, example: Mapping[str, Any]) -> list[int]:
        p = example.get("prompt") if isinstance(example, Mapping) else None
        if isinstance(p, str):
            return self.tokenizer.encode(p)
        if isinstance(p, list) and p:
            return self.tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
        raise ValueError(f"prompt {index}: expected {{'prompt': text or a list of messages, ...}}, got {example!r:.80}")

    def _make_reference(self, model: CausalLM) -> Any:
        if self.config.beta == 0:
            return None
        if self.trainable.provider is not None:
            return self.trainable.model  # the base, called without the adapters
        graphdef, state = nn.split(model)
        return nn.merge(graphdef, jax.tree.map(jnp.copy, state))

    def runner(self) -> Any:
        """The trained model to call or ``generate`` with (through the adapters with LoRA)."""
        return self.trainable.runner()

    def rewards(self, prompts: list[Any], completions: list[str], examples: list[Mapping[str, Any]]) -> np.ndarray:
        """``[len(completions), len(reward_fns)]`` rewards, checked.

        Args:
          prompts: the prompt of each completion.
          completions: the completions' texts.
          examples: the example each completion came from.

        Raises:
          ValueError: a reward function returned the wrong number of rewards or a
            non-finite one (naming the function and the completion).
          RuntimeError: a reward function raised (naming it and the step; the checkpoints
            already written are untouched).
        """
        cols = []
        for fn in self.reward_fns:
            name = getattr(fn, "__name__", repr(fn))
            try:
                r = np.asarray(fn(prompts, completions, examples), np.float64)
            except Exception as e:
                self.run.manager.wait_until_finished()  # what was saved is committed before we stop
                raise RuntimeError(f"reward function {name} raised at step {self.step + 1} "
                                   f"({type(e).__name__}: {e}); the last checkpoint is step "
                                   f"{self.run.manager.latest_step()}") from e
            if r.shape != (len(completions),):
                raise ValueError(f"reward function {name} returned shape {r.shape} for {len(completions)} completions")
            bad = np.flatnonzero(~np.isfinite(r))
            if bad.size:
                raise ValueError(f"reward function {name} returned {r[bad[0]]} for completion {int(bad[0])} "
                                 f"({completions[bad[0]]!r:.60}); rewards must be finite")
            cols.append(r)
        return np.stack(cols, 1)

    def _rollouts(self, indices: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Sample the group of each prompt, score it, and build the update's rows."""
        cfg, g = self.config, self.config.num_generations
        examples = [self.prompts[int(i)] for i in indices for _ in range(g)]
        ids = [self._prompt_ids[int(i)] for i in indices for _ in range(g)]
        seeds = [int(s) for s in np.random.SeedSequence([cfg.seed, self.step]).generate_state(len(ids))]
        out = generate(self.runner(), ids, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                       top_p=cfg.top_p, seed=seeds, tokenizer=self.tokenizer, return_logprobs=False)
        raw = self.rewards([ex["prompt"] for ex in examples], list(out.text or []), examples)
        reward = raw @ np.asarray(self.reward_weights)
        adv = np.asarray(losses.group_relative_advantages(jnp.asarray(reward, jnp.float32), g,
                                                          normalize_std=cfg.normalize_std))
        seq = np.zeros((len(ids), self._width), np.int32)
        mask = np.zeros((len(ids), self._width - 1), np.float32)
        for r, (p, c) in enumerate(zip(ids, out.tokens)):
            seq[r, : len(p) + len(c)] = p + list(c)
            mask[r, len(p) - 1: len(p) - 1 + len(c)] = 1.0
        s = self._start
        rows = {"inputs": seq[:, :-1], "targets": seq[:, 1 + s:], "mask": mask[:, s:], "advantages": adv.astype(np.float32)}
        if cfg.num_iterations > 1:  # later updates need the sampling policy's log-probs (one is at ratio 1)
            rows["old_logprobs"] = np.asarray(self._logprobs(self.runner(), rows["inputs"], rows["targets"],
                                                             cfg.temperature, s))
        rows["ref_logprobs"] = (np.zeros(rows["mask"].shape, np.float32) if self._reference is None
                                else np.asarray(self._logprobs(self._reference, rows["inputs"], rows["targets"], cfg.temperature, s)))
        # the share of groups whose rewards differ: only those give a non-zero advantage (a learning signal)
        stats = {"reward": float(reward.mean()), "reward_std": float(reward.std()),
                 "groups_nonzero_std": float(np.mean(reward.reshape(-1, g).std(axis=1) > 0)),
                 "completion_length": float(np.mean([len(c) for c in out.tokens]))}
        stats.update({f"reward_{getattr(f, '__name__', i)}": float(raw[:, i].mean()) for i, f in enumerate(self.reward_fns)})
        return rows, stats

    def train(self, stop_after: int | None = None) -> dict[str, Any]:
        """Run until ``config.steps`` batches of rollouts (or ``stop_after``); returns the last
        metrics line (also in ``metrics.jsonl``).

        Args:
          stop_after: stop after this many batches of rollouts (saving a checkpoint there); None
            runs to ``config.steps``.
        """
        cfg, last, blocked = self.config, {}, 0.0
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        while self.step < end:
            line = self._iterate(log=(self.step + 1) % cfg.log_every == 0 or self.step + 1 == end)
            if line is not None:
                last = {**line, "checkpoint_blocked_s": blocked}
                self.run.log(last)
            blocked += self.run.maybe_save(self.step, force=self.step == end)
        self.run.manager.wait_until_finished()
        return last

    def _iterate(self, log: bool) -> dict[str, Any] | None:
        """One batch of rollouts and its ``num_iterations`` updates; with ``log``, its metrics
        line (``step_time_s``: from the rollout to the update's metrics on the host)."""
        cfg, t0 = self.config, time.perf_counter()
        rows, stats = self._rollouts(next(self.data_iter))
        t_roll = time.perf_counter() - t0
        split = {k: v.reshape(cfg.grad_accum_steps, -1, *v.shape[1:]) for k, v in rows.items()}
        for _ in range(cfg.num_iterations):
            out = self._update(self.trainable.model, self.optimizer, split)
        self.step += 1
        if not log:
            return None
        out = {k: float(v) for k, v in jax.device_get(out).items()}
        return {"step": self.step, **stats, "loss": out["loss"], "kl": out["kl"], "clip_fraction": out["clip_fraction"],
                "grad_norm": out["grad_norm"], "rollout_s": t_roll, "step_time_s": time.perf_counter() - t0}

    def evaluate(self, examples: Sequence[Mapping[str, Any]], *, temperature: float = 0.0, num_samples: int = 1,
                 seed: int = 0, max_new_tokens: int | None = None) -> float:
        """The mean reward of completions of ``examples``' prompts: greedy, or ``num_samples``
        each at ``temperature`` (seeded, so two evaluations of the same weights agree).

        Args:
          examples: dicts with a ``"prompt"`` (and whatever the reward functions read).
          temperature: 0 decodes greedily; > 0 samples.
          num_samples: completions per prompt.
          seed: the first sampling seed (completion ``i`` uses ``seed + i``).
          max_new_tokens: the most tokens per completion; None uses ``config.max_new_tokens``.
        """
        ids = [self._encode(i, ex) for i, ex in enumerate(examples) for _ in range(num_samples)]
        rows = [ex for ex in examples for _ in range(num_samples)]
        out = generate(self.runner(), ids, max_new_tokens or self.config.max_new_tokens, temperature=temperature,
                       seed=list(range(seed, seed + len(ids))), tokenizer=self.tokenizer, return_logprobs=False)
        raw = self.rewards([ex["prompt"] for ex in rows], list(out.text or []), rows)
        return float((raw @ np.asarray(self.reward_weights)).mean())

    def close(self) -> None:
        """Wait for the last checkpoint and release the run directory."""
        self.run.close()
