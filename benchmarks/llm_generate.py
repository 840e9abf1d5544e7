"""cairn.llm.generate: the decode loop as a ``lax.while_loop`` against a Python loop over the same
jitted step, on this machine's CPU.

Two random models (Llama-shaped): "tiny" (the test fixtures' size: hidden 32, 3 layers,
vocab 96) and "small" (hidden 512, 8 heads / 4 kv heads, MLP 1536, 4 layers, vocab 8192).
For each, a batch of ragged prompts (4 rows, 7 to 32 tokens) generates 128 new tokens,
greedy and sampled (temperature 0.8, top-p 0.9); the time of a whole ``generate`` call
(prefill included, compilation excluded: one warm-up call first) is the best of
``--repeats`` calls, the two loops alternating. Every row runs to the length limit (no stop ids), so both loops do
the same work. Prints a table and ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

from cairn import llm, nn

MODELS = {
    "tiny": dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8),
    "small": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64),
}
PROMPTS = [list(range(3, 3 + n)) for n in (7, 32, 19, 12)]


def _time(model, new: int, repeats: int, **kw) -> dict[str, float]:
    """Best time of a whole call per loop; the two loops alternate, so load on the machine
    falls on both alike (the minimum is the least disturbed run)."""
    def call(loop: str) -> float:
        start = time.perf_counter()
        out = llm.generate(model, PROMPTS, new, decode_loop=loop, stop_token_ids=[], **kw)
        assert all(len(t) == new for t in out.tokens)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"while_loop": [], "python": []}
    for loop in times:
        call(loop)  # compile
    for _ in range(repeats):
        for loop in times:
            times[loop].append(call(loop))
    return {loop: min(t) for loop, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for name, shape in MODELS.items():
        model = llm.CausalLM(llm.LlmConfig("llama", **shape), rngs=nn.Rngs(0))
        for mode, kw in (("greedy", {}), ("sampled", {"temperature": 0.8, "top_p": 0.9, "seed": 1})):
            t = _time(model, args.new, args.repeats, **kw)
            tokens = args.new * len(PROMPTS)
            rows.append({"model": name, "mode": mode, "while_loop_s": t["while_loop"], "python_s": t["python"],
                         "while_loop_tok_s": tokens / t["while_loop"], "python_tok_s": tokens / t["python"],
                         "python_over_while": t["python"] / t["while_loop"]})
    print(f"{'model':6} {'mode':8} {'while_loop tok/s':>17} {'python tok/s':>13} {'python/while time':>18}")
    for r in rows:
        print(f"{r['model']:6} {r['mode']:8} {r['while_loop_tok_s']:17.0f} {r['python_tok_s']:13.0f} "
              f"{r['python_over_while']:18.2f}")
    print(json.dumps({"benchmark": "llm_generate", "new_tokens": args.new, "batch": len(PROMPTS), "results": rows}))


if __name__ == "__main__":
    main()
