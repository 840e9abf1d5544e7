"""google-tunix's side of benchmarks/posttrain.py: its Llama3 model (flax nnx) built with the
config of the Cairn model, the Cairn model's weights copied in, and Tunix's own ``DPOTrainer``
step and ``GRPOLearner`` iteration timed on the same batch and sequence lengths.

Imported only by posttrain.py, and only where google-tunix is installed (``nox -s
bench_posttrain``); it is never a dependency of a Cairn package.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.models.llama3 import model as tunix_llama
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout
from tunix.sft.dpo import dpo_trainer

from cairn import llm, nn
from cairn.core_array import flatten_with_paths

# Tunix 0.1.7's Llama3 attention calls apply_rope without the config's rope_theta, so its
# rotary base is always 1e6: the Cairn model of the benchmark uses the same base.
ROPE_THETA = 1_000_000.0


def tunix_model(model: llm.CausalLM) -> tunix_llama.Llama3:
    """Tunix's Llama3 of ``model``'s config holding a copy of ``model``'s weights (float32)."""
    cfg = model.config
    if cfg.model_type != "llama" or cfg.tie_word_embeddings or dict(cfg.rope).get("rope_theta") != ROPE_THETA:
        raise ValueError(f"tunix_model: needs an untied llama with rope_theta={ROPE_THETA}, got {cfg}")
    tcfg = tunix_llama.ModelConfig(
        num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size, num_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_key_value_heads, rope_theta=int(ROPE_THETA), norm_eps=cfg.rms_norm_eps)
    t = tunix_llama.Llama3(tcfg, rngs=nnx.Rngs(0))
    ours = flatten_with_paths(nn.state(model, nn.Param))
    names = {"embed/embedding": "embedder/input_embedding", "norm/scale": "final_norm/w", "lm_head/kernel": "lm_head/w"}
    per_layer = {"input_norm/scale": "input_layernorm/w", "mlp_norm/scale": "post_attention_layernorm/w",
                 "attn/q/kernel": "attn/q_proj/w", "attn/k/kernel": "attn/k_proj/w", "attn/v/kernel": "attn/v_proj/w",
                 "attn/o/kernel": "attn/o_proj/w", "mlp/gate/kernel": "mlp/gate_proj/kernel",
                 "mlp/up/kernel": "mlp/up_proj/kernel", "mlp/down/kernel": "mlp/down_proj/kernel"}
    for i in range(cfg.num_hidden_layers):
        names.update({f"layers/{i}/{a}": f"layers/{i}/{b}" for a, b in per_layer.items()})
    if sorted(names) != sorted(ours):
        raise ValueError(f"tunix_model: unmapped Cairn weights {sorted(set(ours) ^ set(names))}")
    for src, dst in names.items():
        node: Any = t
        *parents, leaf = dst.split("/")
        for part in parents:
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        var = getattr(node, leaf)
        if tuple(var.value.shape) != tuple(ours[src].shape):
            raise ValueError(f"tunix_model: {src} {ours[src].shape} -> {dst} {var.value.shape}")
        var.value = jnp.asarray(ours[src], jnp.float32)
    return t


def check_logits(model: llm.CausalLM, t: tunix_llama.Llama3, vocab: int) -> float:
    """The largest |logit difference| of the two models on one random batch (the mapping's check)."""
    ids = jnp.asarray(np.random.default_rng(0).integers(3, vocab, (2, 12)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((12, 12), bool)), (2, 12, 12))
    theirs, _ = t(ids, pos, None, mask)
    return float(jnp.max(jnp.abs(theirs - model(ids))))


class TokenizerShim:
    """The five methods Tunix's TokenizerAdapter asks of a tokenizer, over a Cairn Tokenizer."""

    def __init__(self, tok: llm.Tokenizer) -> None:
        self.tok = tok

    def encode(self, text: Any, **_: Any) -> list[int]:
        return self.tok.encode(str(text), add_special_tokens=False)  # Tunix passes numpy string scalars

    def decode(self, ids: Any, **_: Any) -> str:
        return self.tok.decode([int(i) for i in ids])

    def bos_id(self) -> int:
        return self.tok.bos_token_id

    def eos_id(self) -> int:
        return self.tok.eos_token_id

    def pad_id(self) -> int:
        return self.tok.pad_token_id


def dpo_step_fn(model: llm.CausalLM, batch: int, prompt: int, completion: int) -> Callable[[], Any]:
    """One step of Tunix's ``DPOTrainer`` (its ``nnx.jit``-ed step, AdamW, the reference
    log-probabilities computed once beforehand as Cairn's are) on ``batch`` pairs of a
    ``prompt``-token prompt and ``completion``-token completions, as a function that runs one
    step and waits for it (the caller times it, interleaved with Cairn's)."""
    vocab = model.config.vocab_size
    policy, reference = tunix_model(model), tunix_model(model)
    cfg = dpo_trainer.DPOTrainingConfig(eval_every_n_steps=10**6, max_steps=10**6, beta=0.1,
                                        pbar_description=None)
    trainer = dpo_trainer.DPOTrainer(policy, reference, optax.adamw(1e-5), cfg)
    rng = np.random.default_rng(0)
    ids = lambda n: jnp.asarray(rng.integers(3, vocab, (batch, n)), jnp.int32)  # noqa: E731
    ones = lambda n: jnp.ones((batch, n), jnp.int32)  # noqa: E731
    example = trainer._prepare_inputs(dpo_trainer.TrainingInput(
        prompt_ids=ids(prompt), prompt_mask=ones(prompt), chosen_ids=ids(completion), chosen_mask=ones(completion),
        rejected_ids=ids(completion), rejected_mask=ones(completion)))
    step, _ = trainer.jit_train_and_eval_step()
    return lambda: jax.block_until_ready(step(example)[0])


def grpo_iterations(model: llm.CausalLM, tok: llm.Tokenizer, prompts: list[str], *, prompts_per_batch: int,
                    num_generations: int, max_new_tokens: int, prompt_len: int, iterations: int,
                    reward: Callable[..., Any], between: Callable[[], None]) -> tuple[list[float], float]:
    """Tunix's ``GRPOLearner`` (vanilla rollout engine: its own sampler with a KV cache) on
    ``model``'s weights, full fine-tuning with a frozen reference copy and ``beta = 0.04``:
    the seconds of each of ``iterations`` iterations (rollout + reference/old log-probs +
    update) after two that compile (the second one still traces), and the mean completion
    length. ``between()`` runs after every iteration, while the learner waits for its next
    batch (Cairn's iteration goes there: the two alternate, so both see the same load)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={r: mesh for r in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
                                        rl_cluster_lib.Role.ROLLOUT)},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adamw(1e-5), eval_every_n_steps=10**6, max_steps=2 + iterations,
            pbar_description=None),
        rollout_config=base_rollout.RolloutConfig(
            # Tunix's sampler puts a BOS before each prompt: one position more than Cairn's prompt
            max_tokens_to_generate=max_new_tokens, max_prompt_length=prompt_len + 1, temperature=1.0, top_p=1.0,
            kv_cache_size=prompt_len + 1 + max_new_tokens))
    with mesh:
        cluster = rl_cluster_lib.RLCluster(actor=tunix_model(model), reference=tunix_model(model),
                                           tokenizer=TokenizerShim(tok), cluster_config=cluster_config)
        lengths: list[int] = []

        def reward_fn(prompts, completions, **_):
            lengths.extend(len(tok.encode(c, add_special_tokens=False)) for c in completions)
            return [float(r) for r in reward(prompts, completions, None)]

        learner = grpo_learner.GRPOLearner(
            rl_cluster=cluster, reward_fns=reward_fn,
            algo_config=grpo_learner.GRPOConfig(num_generations=num_generations, num_iterations=1, beta=0.04,
                                                epsilon=0.2))
        times: list[float] = []
        resumed = [0.0]

        def batches():
            # the learner pulls batch k + 1 (in its data thread, its trainer waiting) when
            # iteration k is done; the first pull comes before iteration 0
            for i in itertools.count():
                if i:
                    times.append(time.perf_counter() - resumed[0])
                    between()
                j = (i * prompts_per_batch) % len(prompts)
                resumed[0] = time.perf_counter()
                # an array, as a grain batch is (a list's strings would each be repeated num_generations times)
                yield {"prompts": np.asarray((prompts * 2)[j: j + prompts_per_batch])}

        learner.train(batches())
        times.append(time.perf_counter() - resumed[0])
    # iterations 0 and 1 compile
    return times[2: 2 + iterations], float(np.mean(lengths[2 * prompts_per_batch * num_generations:]))
