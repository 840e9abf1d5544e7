"""Post-training speed and memory: cairn.llm's DPO step, GRPO iteration and rollouts against
the loops a user would write by hand, on the same model, batch and sequence lengths.

- DPO step (full fine-tuning, reference log-probabilities precomputed): ``DPOTrainer``'s step
  against a plain ``jax.jit(jax.value_and_grad(...))`` loop over the same ``CausalLM`` with
  the same loss (``cairn.optim.losses.dpo_loss``) and AdamW.
- Rollouts: ``generate`` (KV cache, ``lax.while_loop``) against a per-token Python loop that
  runs the jitted full forward over a fixed-size buffer for every new token.
- GRPO iteration (rollout + update), ours only.
- Memory: the bytes of base weights a LoRA DPO trainer holds, against the model's own.

google-tunix is the peer the issue names; it is not run here (its trainers take its own model
classes, and building the same model there is out of this script's scope), so the table says
"not measured" for it.

Run: ``python benchmarks/posttrain.py [--quick]``. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from cairn import llm, nn, optim
from cairn.optim import losses


def _model(vocab: int, hidden: int, layers: int) -> llm.CausalLM:
    cfg = llm.LlmConfig("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                        num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64),
                        head_dim=32)
    return llm.CausalLM(cfg, rngs=nn.Rngs(0))


def _tokenizer(vocab: int) -> llm.Tokenizer:
    import tokenizers

    pieces = ["<pad>", "<s>", "</s>", *[chr(0x100 + i) for i in range(vocab - 3)]]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE({p: i for i, p in enumerate(pieces)}, []))
    backend.decoder = tokenizers.decoders.Fuse()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in pieces[:3]])
    return llm.Tokenizer(backend, {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"})


def _pairs(n: int, vocab: int, prompt: int, completion: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    text = lambda k: "".join(chr(0x100 + int(i)) for i in rng.integers(0, vocab - 3, k))  # noqa: E731
    return [{"prompt": text(prompt), "chosen": text(completion), "rejected": text(completion)} for _ in range(n)]


def _timed(fn, repeats: int) -> float:
    fn()  # compile
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


def dpo_steps(args: argparse.Namespace) -> dict[str, float]:
    tok, pairs = _tokenizer(args.vocab), _pairs(64, args.vocab, args.prompt, args.completion)
    seq = args.prompt + args.completion + 2
    cfg = llm.DPOConfig(steps=1000, batch_size=args.batch, seq_len=seq, lora=None, learning_rate=1e-5,
                        max_grad_norm=None, save_every=10_000, log_every=10_000)
    with tempfile.TemporaryDirectory() as d:
        trainer = llm.DPOTrainer(_model(args.vocab, args.hidden, args.layers), tok, pairs, cfg, d)
        batch = {k: v[None] for k, v in next(trainer.data_iter).items()}
        ours = _timed(lambda: jax.block_until_ready(trainer._train_step(trainer.trainable.model, trainer.optimizer, batch)),
                      args.repeats)
        trainer.close()
    # the obvious loop: pure params, jit(value_and_grad), AdamW by tree_map
    model = _model(args.vocab, args.hidden, args.layers)
    graphdef, params = nn.split(model)
    tx = optim.adamw(1e-5)
    opt_state = tx.init(params)
    mb = {k: jnp.asarray(v[0]) for k, v in batch.items()}

    def loss_fn(p, b):
        m = nn.merge(graphdef, p)
        ids = jnp.concatenate([b["chosen_inputs"], b["rejected_inputs"]])
        lp = losses.sequence_logprobs(m(ids), jnp.concatenate([b["chosen_targets"], b["rejected_targets"]]),
                                      jnp.concatenate([b["chosen_weights"], b["rejected_weights"]]))
        n = b["chosen_inputs"].shape[0]
        return losses.dpo_loss(lp[:n], lp[n:], b["ref_chosen"], b["ref_rejected"]).loss.mean()

    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        updates, s = tx.update(g, s, p)
        return optim.apply_updates(p, updates), s, loss

    state = {"p": params, "s": opt_state}

    def plain():
        state["p"], state["s"], loss = step(state["p"], state["s"], mb)
        jax.block_until_ready(loss)

    return {"dpo_step_s": ours, "dpo_step_plain_jax_s": _timed(plain, args.repeats)}


def rollouts(args: argparse.Namespace) -> dict[str, float]:
    model = _model(args.vocab, args.hidden, args.layers)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, args.vocab, args.prompt)) for _ in range(args.batch)]
    new = args.new_tokens
    t = _timed(lambda: llm.generate(model, prompts, new, return_logprobs=False), 2)
    ours = args.batch * new / t
    fwd = nn.jit(lambda m, ids: m(ids))
    width = args.prompt + new

    def loop():
        buf = np.zeros((args.batch, width), np.int32)
        buf[:, : args.prompt] = np.asarray(prompts)
        for i in range(args.prompt, width):
            logits = fwd(model, jnp.asarray(buf))
            buf[:, i] = np.asarray(jnp.argmax(logits[:, i - 1], -1))
        return buf

    t_loop = _timed(loop, 1)
    return {"rollout_tokens_per_s": ours, "rollout_loop_tokens_per_s": args.batch * new / t_loop}


def grpo_iteration(args: argparse.Namespace) -> dict[str, float]:
    tok = _tokenizer(args.vocab)
    rng = np.random.default_rng(2)
    prompts = [{"prompt": "".join(chr(0x100 + int(i)) for i in rng.integers(0, args.vocab - 3, args.prompt))} for _ in range(64)]
    cfg = llm.GRPOConfig(steps=3, prompts_per_batch=max(1, args.batch // 4), num_generations=4,
                         max_new_tokens=args.new_tokens, beta=0.04, save_every=10_000)
    with tempfile.TemporaryDirectory() as d:
        trainer = llm.GRPOTrainer(_model(args.vocab, args.hidden, args.layers), tok, prompts,
                                  lambda p, c, e: [float(len(x)) for x in c], cfg, d)
        trainer.train(stop_after=1)  # compile
        t = time.perf_counter()
        trainer.train()
        dt = (time.perf_counter() - t) / 2
        trainer.close()
    return {"grpo_iteration_s": dt}


def lora_memory(args: argparse.Namespace) -> dict[str, float]:
    tok, pairs = _tokenizer(args.vocab), _pairs(16, args.vocab, args.prompt, args.completion)
    model = _model(args.vocab, args.hidden, args.layers)
    base = sum(x.nbytes for x in jax.tree.leaves(nn.state(model, nn.Param)))
    with tempfile.TemporaryDirectory() as d:
        trainer = llm.DPOTrainer(model, tok, pairs, llm.DPOConfig(steps=1, batch_size=4,
                                                                  seq_len=args.prompt + args.completion + 2), d)
        # every Param (LoRAParam derives from it) minus the adapters: the base weights held
        frozen = sum(x.nbytes for x in jax.tree.leaves(nn.state(trainer.trainable.model, nn.Param))) - sum(
            x.nbytes for x in jax.tree.leaves(nn.state(trainer.trainable.model, nn.LoRAParam)))
        trainer.close()
    return {"base_bytes": float(base), "dpo_lora_base_bytes_held": float(frozen)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small model, for a smoke run")
    args = ap.parse_args()
    big = not args.quick
    args.vocab, args.hidden, args.layers = (2048, 512, 4) if big else (256, 64, 2)
    args.batch, args.prompt, args.completion, args.new_tokens = (8, 64, 64, 64) if big else (4, 16, 16, 16)
    args.repeats = 5 if big else 2
    r = {**dpo_steps(args), **rollouts(args), **grpo_iteration(args), **lora_memory(args)}
    print(f"model: llama-shaped, vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers; batch {args.batch}, "
          f"prompt {args.prompt}, completion {args.completion}; {jax.devices()[0].platform}, load {_load()}")
    rows = [("DPO step (full FT)", f"{r['dpo_step_s'] * 1e3:.1f} ms", f"plain JAX loop {r['dpo_step_plain_jax_s'] * 1e3:.1f} ms"),
            ("rollout tokens/s", f"{r['rollout_tokens_per_s']:.0f}", f"per-token loop {r['rollout_loop_tokens_per_s']:.0f}"),
            ("GRPO iteration", f"{r['grpo_iteration_s']:.2f} s", "google-tunix: not measured"),
            ("DPO+LoRA base bytes", f"{r['dpo_lora_base_bytes_held'] / 2**20:.1f} MiB", f"model {r['base_bytes'] / 2**20:.1f} MiB")]
    for row in rows:
        print(f"{row[0]:<22} {row[1]:>12}   {row[2]}")
    ratios = {"dpo_step_vs_plain_jax": r["dpo_step_plain_jax_s"] / r["dpo_step_s"],
              "rollout_vs_token_loop": r["rollout_tokens_per_s"] / r["rollout_loop_tokens_per_s"],
              "lora_base_copies": r["dpo_lora_base_bytes_held"] / r["base_bytes"]}
    print(json.dumps({"benchmark": "posttrain", **{k: round(v, 4) for k, v in {**r, **ratios}.items()}}))


def _load() -> str:
    try:
        import os

        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "n/a"


if __name__ == "__main__":
    sys.exit(main())
