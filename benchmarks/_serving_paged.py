"""The paged KV cache's figures for ``benchmarks/serving.py --section openai``.

The model is the generation benchmark's LM (``_serving_generate_model``: a Llama-shaped
``cairn.llm.CausalLM``, d 256, 4 layers of 4 query / 2 key-value heads, vocabulary 512,
float32, random weights) with a longer context, run in process through
``cairn.llm.as_generator(..., block_size=16)`` (the same prefill, decode and paged programs
``export_for_serving`` writes), driven by ``GenerationEngine`` directly (no HTTP: these
figures are about the cache, the route's own cost is the OpenAI row's business).

* **Prefix caching, time to first token** (max_length 1024, ``kv_layout="paged"``,
  ``prefill_chunk=512``, 4 slots): every request is one shared 512-token system prompt
  followed by its own 16-48 token user turn, ``max_tokens=1``; requests one at a time
  (after one warm-up request that leaves the system prompt in the cache). TTFT p50 with
  ``enable_prefix_caching`` on against off (off prefills all 528-560 tokens; on, only the
  user turn: the 32 system blocks are shared). The two engines run side by side and the
  requests alternate between them, so the machine's load hits both alike.
* **Concurrent sequences at max_length 4096** in the same KV memory: the contiguous layout
  with 4 slots (4 rows of 4096 positions = 16384 token slots) against the paged layout with
  ``num_blocks = 16384 / 16 = 1024`` and 64 slots. 64 requests submitted at once, prompts
  uniform in 32-1024 tokens and ``max_tokens`` in 16-512 (``ignore_eos``, greedy); the
  figure is the most sequences running at once (slots holding an admitted request) while
  the queue was not empty, polled every 5 ms over ``CAPACITY_SECONDS`` of the run.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BLOCK = 16
SYSTEM_LEN, USER_LEN = 512, (16, 48)
CAPACITY_LEN, CAPACITY_ROWS = 4096, 4
CAPACITY_PROMPT, CAPACITY_NEW = (32, 1024), (16, 512)
CAPACITY_SECONDS = 20.0


def generator(max_length: int) -> Any:
    """The benchmark LM at ``max_length`` positions, with its paged program."""
    from _serving_generate_model import LMConfig, model

    from cairn import llm

    cfg = LMConfig(max_length=max_length)
    return llm.as_generator(model(cfg), max_length=max_length, eos_token_ids=(), block_size=BLOCK, name="lm")


def prefix_ttft(quick: bool) -> dict:
    """TTFT p50 (ms) of shared-system-prompt requests, prefix caching on and off.

    Both engines run side by side and the requests alternate between them (off, on, off,
    on, ...), so the machine's load, which swings by several times here, hits both alike."""
    from cairn import serving

    gen = generator(1024)
    rng = np.random.default_rng(7)
    system = [int(t) for t in rng.integers(1, gen.vocab_size, SYSTEM_LEN)]
    n = 12 if quick else 40
    turns = [[int(t) for t in rng.integers(1, gen.vocab_size, int(rng.integers(*USER_LEN)))] for _ in range(n + 1)]
    engines = {}
    for key, caching in (("off", False), ("on", True)):
        cfg = serving.GenerationConfig(num_slots=4, prefill_batch=1, kv_layout="paged", prefill_chunk=512,
                                       enable_prefix_caching=caching)
        engines[key] = serving.GenerationEngine(gen, cfg).start()
    try:
        ttft: dict[str, list[float]] = {"off": [], "on": []}
        for eng in engines.values():
            eng.generate(system + turns[0], serving.SamplingParams(1))  # the system prompt into the cache
        for turn in turns[1:]:
            for key, eng in engines.items():
                ttft[key].append(eng.generate(system + turn, serving.SamplingParams(1)).time_to_first_token)
        stats = {key: eng.stats() for key, eng in engines.items()}
    finally:
        for eng in engines.values():
            eng.stop(drain=False)
    out = {}
    for key in ("off", "on"):
        out[f"ttft_p50_ms_{key}"] = float(np.median(ttft[key])) * 1e3
        out[f"hit_rate_{key}"] = stats[key]["prefix_cache_hit_rate"]
        print(f"  prefix caching {key:3s}: TTFT p50 {out[f'ttft_p50_ms_{key}']:8.1f} ms over {n} requests; "
              f"prefix-cache hit rate {stats[key]['prefix_cache_hit_rate']:.2f}", flush=True)
    out["ttft_off_over_on"] = out["ttft_p50_ms_off"] / out["ttft_p50_ms_on"]
    return out


def _capacity_run(gen: Any, config: Any, work: list, seconds: float) -> dict:
    """Submit ``work`` at once; the most live sequences while requests were still waiting
    (the engine's counters polled every 5 ms from another thread)."""
    from cairn import serving

    peak, done = [0], threading.Event()
    with serving.GenerationEngine(gen, config).start(precompile=False) as eng:
        def poll() -> None:
            while not done.wait(0.005):
                s = eng.stats()
                if s["queue"]:
                    peak[0] = max(peak[0], s["active_slots"])

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        reqs = [eng.submit(p, serving.SamplingParams(k, ignore_eos=True)) for p, k in work]
        done.wait(seconds)
        done.set()
        watcher.join()
        for r in reqs:
            r.cancel()
    return {"peak_sequences": peak[0]}


def capacity(quick: bool) -> dict:
    """Most concurrent sequences, contiguous rows against paged blocks in the same memory."""
    from cairn import serving

    gen = generator(CAPACITY_LEN)
    rng = np.random.default_rng(11)
    work = [([int(t) for t in rng.integers(1, gen.vocab_size, int(rng.integers(*CAPACITY_PROMPT)))],
             int(rng.integers(*CAPACITY_NEW))) for _ in range(64)]
    seconds = CAPACITY_SECONDS / (2 if quick else 1)
    blocks = CAPACITY_ROWS * CAPACITY_LEN // BLOCK
    contiguous = serving.GenerationConfig(num_slots=CAPACITY_ROWS, prefill_batch=1, max_queue=1024)
    paged = serving.GenerationConfig(num_slots=64, prefill_batch=4, max_queue=1024, kv_layout="paged",
                                     prefill_chunk=512, num_blocks=blocks)
    out = {"kv_token_slots": CAPACITY_ROWS * CAPACITY_LEN}
    for name, cfg in (("contiguous", contiguous), ("paged", paged)):
        r = _capacity_run(gen, cfg, work, seconds)
        out[f"{name}_sequences"] = r["peak_sequences"]
        print(f"  {name:10s}: {r['peak_sequences']:3d} sequences at once in {out['kv_token_slots']} token slots", flush=True)
    out["paged_over_contiguous"] = out["paged_sequences"] / max(1, out["contiguous_sequences"])
    return out
