"""Post-training speed and memory: cairn.llm's DPO step, GRPO iteration and rollouts against
google-tunix and the loops a user would write by hand, on the same model, batch and sequence
lengths.

- DPO step (full fine-tuning, AdamW, reference log-probabilities precomputed): ``DPOTrainer``'s
  step against Tunix's ``DPOTrainer`` step and a plain ``jax.jit(jax.value_and_grad(...))``
  loop over the same ``CausalLM`` with the same loss (``cairn.optim.losses.dpo_loss``).
- GRPO iteration (rollout of ``num_generations`` samples per prompt, old and reference
  log-probabilities, one clipped update; full fine-tuning, beta 0.04, AdamW without gradient
  clipping): ``GRPOTrainer`` against
  Tunix's ``GRPOLearner`` with its vanilla rollout engine.
- Rollouts: ``generate`` (KV cache, ``lax.while_loop``) against a per-token Python loop that
  runs the jitted full forward over a fixed-size buffer for every new token.
- Memory: the bytes of base weights a LoRA DPO trainer holds, against the model's own.

Tunix runs on its own Llama3 model class (flax nnx): benchmarks/_posttrain_tunix.py builds it
with the Cairn model's config and copies the Cairn model's random weights in (their logits
agree to float32 rounding, printed). google-tunix is installed only by ``nox -s
bench_posttrain``; where it is missing or fails, the table prints the exception instead of its
numbers, and the plain JAX loop stays the comparison.

Timing: every contender's repeats are interleaved in this one process (ours, theirs, ours...)
and the fastest of each kept, since on a shared machine noise only adds time; the load averages
before and after are printed with the figures.

Run: ``python benchmarks/posttrain.py [--quick] [--repeats N] [--only dpo|grpo]``. Prints a table
and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from cairn import llm, nn, optim
from cairn.optim import losses


def _model(vocab: int, hidden: int, layers: int) -> llm.CausalLM:
    # rope_theta 1e6: the rotary base Tunix's Llama3 always uses (see _posttrain_tunix.py)
    cfg = llm.LlmConfig("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                        num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64),
                        head_dim=32, rope=(("rope_theta", 1_000_000.0), ("rope_type", "default")))
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
    """The fastest of ``repeats`` calls after one that compiles."""
    return _interleaved({"x": fn}, repeats)["x"]


def _interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """The fastest of ``repeats`` calls of each of ``fns`` after one that compiles, the calls
    taken in turn (ours, theirs, ours...) so that every contender sees the same load; the
    minimum, since on a shared machine noise only ever adds time."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: min(v) for k, v in times.items()}


def dpo_steps(args: argparse.Namespace) -> dict[str, float]:
    tok, pairs = _tokenizer(args.vocab), _pairs(64, args.vocab, args.prompt, args.completion)
    seq = args.prompt + args.completion + 2
    cfg = llm.DPOConfig(steps=1000, batch_size=args.batch, seq_len=seq, lora=None, learning_rate=1e-5,
                        max_grad_norm=None, save_every=10_000, log_every=10_000)
    with tempfile.TemporaryDirectory() as d:
        trainer = llm.DPOTrainer(_model(args.vocab, args.hidden, args.layers), tok, pairs, cfg, d)
        batch = {k: v[None] for k, v in next(trainer.data_iter).items()}
        fns = {"dpo_step_s": lambda: jax.block_until_ready(
            trainer._train_step(trainer.trainable.model, trainer.optimizer, batch))}
        fns["dpo_step_plain_jax_s"] = _plain_dpo_step(args, batch)
        tx = _tunix(args, "dpo")
        if tx is not None:
            model = _model(args.vocab, args.hidden, args.layers)
            args.tunix_logit_diff = tx.check_logits(model, tx.tunix_model(model), args.vocab)
            # the same token count per row as ours (inputs are seq - 1 wide): BOS + prompt, then the completion
            step = _try_tunix(args, "dpo", lambda: tx.dpo_step_fn(model, args.batch, args.prompt + 1, seq - 2 - args.prompt))
            if step is not None:
                fns["dpo_step_tunix_s"] = step
        out = _interleaved(fns, args.repeats)
        trainer.close()
    return out


def _plain_dpo_step(args: argparse.Namespace, batch: dict):
    """The obvious loop: pure params, ``jit(value_and_grad)``, AdamW by tree_map, the full logits."""
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

    return plain


def _tunix(args: argparse.Namespace, what: str):
    """The Tunix side (benchmarks/_posttrain_tunix.py), or None with the reason kept in ``args.tunix_errors``."""
    try:
        import _posttrain_tunix
    except Exception as e:  # noqa: BLE001 - any import failure is reported, then the plain loop stands
        args.tunix_errors[what] = f"cannot import google-tunix: {type(e).__name__}: {e}"
        return None
    return _posttrain_tunix


def _try_tunix(args: argparse.Namespace, what: str, fn):
    """``fn()``, or None (the exception printed and kept as the row's answer)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the exception is the row's answer
        traceback.print_exc()
        args.tunix_errors[what] = f"{type(e).__name__}: {e}"
        return None


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
    texts = ["".join(chr(0x100 + int(i)) for i in rng.integers(0, args.vocab - 3, args.prompt)) for _ in range(64)]
    per_batch, g = max(1, args.batch // 4), 4
    reward = lambda p, c, e: [float(len(x)) for x in c]  # noqa: E731 - any reward: the iteration's cost is the same
    # full fine-tuning with a frozen reference copy (beta 0.04) and AdamW without gradient
    # clipping, as Tunix's learner below
    out: dict[str, float] = {}
    cfg = llm.GRPOConfig(steps=10**6, prompts_per_batch=per_batch, num_generations=g,
                         max_new_tokens=args.new_tokens, beta=0.04, lora=None, temperature=1.0, save_every=10_000,
                         log_every=1, max_grad_norm=None)
    with tempfile.TemporaryDirectory() as d:
        trainer = llm.GRPOTrainer(_model(args.vocab, args.hidden, args.layers), tok, [{"prompt": t} for t in texts],
                                  reward, cfg, d)
        ours: list[dict] = []
        # each iteration: rollout to the update's metrics on the host, as train() logs it; the
        # first two compile
        for _ in range(2):
            trainer._iterate(log=True)
        tx = _tunix(args, "grpo")
        if tx is not None:
            def run():
                # Tunix's iterations and ours alternate: one of ours while its learner waits for a batch
                times, length = tx.grpo_iterations(
                    _model(args.vocab, args.hidden, args.layers), tok, texts, prompts_per_batch=per_batch,
                    num_generations=g, max_new_tokens=args.new_tokens, prompt_len=args.prompt, iterations=args.repeats,
                    reward=reward, between=lambda: ours.append(trainer._iterate(log=True)))
                return min(times), length

            theirs = _try_tunix(args, "grpo", run)
            if theirs is not None:
                out["grpo_iteration_tunix_s"], out["grpo_completion_length_tunix"] = theirs
        while len(ours) < args.repeats:  # Tunix did not run (or stopped early): ours alone
            ours.append(trainer._iterate(log=True))
        trainer.close()
    out.update({"grpo_iteration_s": min(x["step_time_s"] for x in ours),
                "grpo_rollout_s": min(x["rollout_s"] for x in ours),
                "grpo_completion_length": float(np.mean([x["completion_length"] for x in ours]))})
    return out


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
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed repeats of each contender, interleaved, the fastest kept (default 7; 2 with --quick)")
    ap.add_argument("--only", choices=("dpo", "grpo"), default=None, help="run one comparison (and the memory row)")
    args = ap.parse_args()
    big = not args.quick
    args.vocab, args.hidden, args.layers = (2048, 512, 4) if big else (256, 64, 2)
    args.batch, args.prompt, args.completion, args.new_tokens = (8, 64, 64, 64) if big else (4, 16, 16, 16)
    args.repeats = args.repeats or (7 if big else 2)
    args.tunix_errors, args.tunix_logit_diff = {}, float("nan")
    load_before = _load()
    r = {**(dpo_steps(args) if args.only != "grpo" else {}), **(rollouts(args) if args.only is None else {}),
         **(grpo_iteration(args) if args.only != "dpo" else {}), **lora_memory(args)}
    print(f"model: llama-shaped, vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers; batch {args.batch}, "
          f"prompt {args.prompt}, completion {args.completion}; {jax.devices()[0].platform}; fastest of {args.repeats} "
          f"interleaved repeats; load (1/5/15 min) {load_before} before, {_load()} after")
    if args.tunix_logit_diff == args.tunix_logit_diff:  # it ran
        print(f"google-tunix {_tunix_version()}: its Llama3 with our weights, max |logit diff| {args.tunix_logit_diff:.2e}")
    for what, why in args.tunix_errors.items():
        print(f"google-tunix did not run ({what}): {why}")
    tunix = lambda key: f"{r[key] * 1e3:.1f} ms" if key in r and r[key] == r[key] else "not run"  # noqa: E731
    rows = [("DPO+LoRA base bytes", f"{r['dpo_lora_base_bytes_held'] / 2**20:.1f} MiB", f"model {r['base_bytes'] / 2**20:.1f} MiB")]
    if "dpo_step_s" in r:
        rows.insert(0, ("DPO step (full FT)", f"{r['dpo_step_s'] * 1e3:.1f} ms",
                        f"google-tunix {tunix('dpo_step_tunix_s')}; plain JAX loop {r['dpo_step_plain_jax_s'] * 1e3:.1f} ms"))
    if "grpo_iteration_s" in r:
        rows.insert(-1, ("GRPO iteration", f"{r['grpo_iteration_s'] * 1e3:.1f} ms",
                         f"google-tunix {tunix('grpo_iteration_tunix_s')} (ours: rollout {r['grpo_rollout_s'] * 1e3:.0f} ms; "
                         f"mean completion {r['grpo_completion_length']:.1f} tokens ours, "
                         f"{r.get('grpo_completion_length_tunix', float('nan')):.1f} theirs)"))
    if "rollout_tokens_per_s" in r:
        rows.insert(-1, ("rollout tokens/s", f"{r['rollout_tokens_per_s']:.0f}", f"per-token loop {r['rollout_loop_tokens_per_s']:.0f}"))
    for row in rows:
        print(f"{row[0]:<22} {row[1]:>12}   {row[2]}")
    ratio = lambda a, b: r[a] / r[b] if a in r and b in r else float("nan")  # noqa: E731
    ratios = {"dpo_step_vs_plain_jax": ratio("dpo_step_plain_jax_s", "dpo_step_s"),
              "dpo_step_vs_tunix": ratio("dpo_step_tunix_s", "dpo_step_s"),
              "grpo_iteration_vs_tunix": ratio("grpo_iteration_tunix_s", "grpo_iteration_s"),
              "rollout_vs_token_loop": ratio("rollout_tokens_per_s", "rollout_loop_tokens_per_s"),
              "lora_base_copies": r["dpo_lora_base_bytes_held"] / r["base_bytes"]}
    print(json.dumps({"benchmark": "posttrain", **{k: round(v, 4) if v == v else None for k, v in {**r, **ratios}.items()},
                      "load": _load(), "tunix_errors": args.tunix_errors}))


def _tunix_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("google-tunix")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _load() -> str:
    """The 1, 5 and 15 minute load averages (what ``uptime`` prints)."""
    try:
        import os

        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


if __name__ == "__main__":
    sys.exit(main())
