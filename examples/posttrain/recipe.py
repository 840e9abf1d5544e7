"""Post-training recipe on generated data: SFT, then GRPO from the SFT checkpoint, and DPO with
LoRA from the same checkpoint, each scored on held-out prompts, with metrics and plots in the
run directory.

The task: the user sends a word, the assistant answers with each letter shifted by one
("abc" -> "bcd"). The tokenizer has one token per letter and a chat template; the model is a
small Llama-shaped cairn.llm model trained from scratch by the SFT stage. Nothing is
downloaded.

    python examples/posttrain/recipe.py --run-dir /tmp/posttrain [--small]

Prints one line per stage and writes ``<run-dir>/{sft,dpo,grpo}/`` (checkpoints,
``metrics.jsonl``, ``loss.png``) and ``<run-dir>/summary.json``. A second run into the same
directory resumes each stage from its checkpoints.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import tokenizers

from cairn import llm, nn

LETTERS = "abcdefghijklmnopqrstuvwxyz"
PIECES = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "\n", *LETTERS]
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
            "{% else %}<|assistant|>{{ m['content'] }}</s>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tokenizer() -> llm.Tokenizer:
    backend = tokenizers.Tokenizer(tokenizers.models.BPE({p: i for i, p in enumerate(PIECES)}, []))
    backend.decoder = tokenizers.decoders.Fuse()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in PIECES[:5]])
    return llm.Tokenizer(backend, {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}, chat_template=TEMPLATE)


def shift(word: str, by: int) -> str:
    return "".join(LETTERS[(LETTERS.index(c) + by) % 26] for c in word)


def words(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(LETTERS), 3)) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", default="/tmp/cairn-posttrain")
    ap.add_argument("--small", action="store_true", help="fewer steps (a smoke run)")
    args = ap.parse_args()
    run, tok, scale = pathlib.Path(args.run_dir), tokenizer(), 0.5 if args.small else 1.0
    train_w, held_w = words(600, 0), words(64, 1)
    chats = [{"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": shift(w, 1)}]} for w in train_w]
    held_chats = [{"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": shift(w, 1)}]} for w in held_w]
    cfg = llm.LlmConfig("llama", vocab_size=len(PIECES), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = llm.CausalLM(cfg, rngs=nn.Rngs(0))
    summary = {}

    # 1. SFT, full fine-tuning of the fresh model, deliberately short: a partial policy
    sft = llm.SFTTrainer(model, tok, chats, llm.SFTConfig(steps=int(40 * scale) or 1, batch_size=16, seq_len=64,
                                                          learning_rate=3e-3, lora=None), run / "sft")
    sft.train()
    summary["sft_exact_match"] = sft.exact_match(held_chats, 6)
    llm.plot_metrics(run / "sft")
    sft.close()
    print(f"SFT  exact match {summary['sft_exact_match']:.2f}")

    # 2. DPO with LoRA: a preference the SFT policy knows nothing of, so it starts near a coin
    #    flip: the word shifted by three letters preferred over the word shifted by five (SFT
    #    taught a shift by one, so both answers are equally foreign to it)
    def pair(c: dict) -> dict:
        word = c["messages"][0]["content"]
        return {"prompt": c["messages"][:1], "chosen": [{"role": "assistant", "content": shift(word, 3)}],
                "rejected": [{"role": "assistant", "content": shift(word, 5)}]}

    pairs, held_pairs = [pair(c) for c in chats], [pair(c) for c in held_chats]
    dpo = llm.DPOTrainer(model, tok, pairs, llm.DPOConfig(steps=int(30 * scale) or 1, batch_size=16, seq_len=16,
                                                          beta=0.1, learning_rate=1e-3), run / "dpo")
    summary["dpo_preference_accuracy_before"] = dpo.preference_accuracy(held_pairs)
    dpo.train()
    summary["dpo_preference_accuracy"] = dpo.preference_accuracy(held_pairs)
    llm.plot_metrics(run / "dpo", ("loss", "reward_accuracy"))
    dpo.close()
    print(f"DPO  held-out preference accuracy {summary['dpo_preference_accuracy_before']:.2f} -> "
          f"{summary['dpo_preference_accuracy']:.2f}")

    # 3. GRPO, reward "exact answer", from the SFT checkpoint (a fresh model restored from it)
    model = llm.CausalLM(cfg, rngs=nn.Rngs(0))
    llm.SFTTrainer(model, tok, chats, llm.SFTConfig(steps=int(40 * scale) or 1, batch_size=16, seq_len=64,
                                                    learning_rate=3e-3, lora=None), run / "sft").close()
    prompts = [{"prompt": c["messages"][:1], "answer": c["messages"][1]["content"]} for c in chats]
    held = [{"prompt": c["messages"][:1], "answer": c["messages"][1]["content"]} for c in held_chats]

    def exact(prompts, completions, examples):
        return [float(c.strip() == ex["answer"]) for c, ex in zip(completions, examples)]

    grpo = llm.GRPOTrainer(model, tok, prompts, exact, llm.GRPOConfig(
        steps=int(100 * scale) or 1, prompts_per_batch=16, num_generations=4, max_new_tokens=5, temperature=0.8,
        learning_rate=2e-4, beta=0.04, lora=None, num_iterations=2), run / "grpo")
    summary["grpo_exact_match_before"] = grpo.evaluate(held)
    grpo.train()
    summary["grpo_exact_match"] = grpo.evaluate(held)
    llm.plot_metrics(run / "grpo", ("reward", "kl"))
    grpo.close()
    print(f"GRPO held-out exact match {summary['grpo_exact_match_before']:.2f} -> {summary['grpo_exact_match']:.2f}")
    (run / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
