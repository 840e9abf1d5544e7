"""The OpenAI route's overhead: ``/v1/chat/completions`` against ``/v2/.../generate_stream``
on the same model in the same server, same prompts, same tokens.

The model is the generation benchmark's LM (``_serving_generate_model``: GQA, d 256, 4
layers, vocabulary 512, max length 256, float32), exported once with
``export_generator(..., tokenizer=...)``: a tokenizer of one character per token (512 ids:
printable ASCII, then code points from U+0100, two UTF-8 bytes each; no special tokens,
so the untrained model's every token has text and the OpenAI route sends one chunk per
token, as ``/generate_stream`` sends one event) with a chat template, so both routes
detokenize through the tokenizer's incremental decoder. One server (this process, 127.0.0.1, port 0), one engine
(``GenerationConfig(num_slots=16, prefill_batch=4)``).

Workload: closed-loop clients in a subprocess (aiohttp), streaming. Each request draws a
prompt of 16-64 tokens and ``max_tokens`` as ``_serving_generate.draw`` does (long-tailed,
mean about 46; ``ignore_eos``; temperature 0.8, top_p 0.95, a seed per request). The
OpenAI client sends ``messages=[{"role": "user", "content": text}]`` (the prompt's text); the
generate client sends ``input_ids``: exactly the ids the chat template renders for that
message, so both routes prefill the same tokens and sample the same ones. tokens/s counts
token events (OpenAI chunks with content, generate events with a token) arriving inside
the window; TTFT is from sending to the first token's event.

The routes alternate (generate, openai, generate, openai, ...) ``ROUNDS`` times per
concurrency and each figure is the median of its rounds, so drift in the machine's load
hits both. Beside the rates (which a loaded machine moves by tens of percent from run to
run) it reports CPU seconds per generated token, of the server (this process: engine
thread and event loop) and of the client process: the route's overhead in a form the
machine's load hardly moves. Prints a table and one JSON line of ratios (openai / generate).

    python benchmarks/serving_openai.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WARMUP = 1.0
MAX_LENGTH = 256  # the LM's (LMConfig.max_length)
CONFIG = {"num_slots": 16, "prefill_batch": 4, "max_queue": 1024}
SAMPLING = {"temperature": 0.8, "top_p": 0.95}
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} | {% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"


def pieces(vocab: int) -> list[str]:
    """Token id -> its one character: printable ASCII, then code points from U+0100."""
    ascii_ = [chr(c) for c in range(0x20, 0x7F)]
    return ascii_ + [chr(0x100 + i) for i in range(vocab - len(ascii_))]


def make_tokenizer(vocab: int) -> Any:
    """One character per token, no special tokens, the chat template ``TEMPLATE``."""
    import tokenizers

    from cairn.serving import Tokenizer

    backend = tokenizers.Tokenizer(tokenizers.models.BPE({p: i for i, p in enumerate(pieces(vocab))}, []))
    backend.decoder = tokenizers.decoders.Fuse()
    return Tokenizer(backend, {}, chat_template=TEMPLATE)


def text_of(ids: list[int], vocab: int) -> str:
    """The text of ``ids``."""
    table = pieces(vocab)
    return "".join(table[i] for i in ids)


# --- load generator (runs in a subprocess) ---


async def _client(session: Any, port: int, route: str, idx: int, tok: Any, clock: dict, out: dict) -> None:
    from _serving_generate import draw

    rng = np.random.default_rng([4321, idx])  # the same request sequence for both routes
    vocab, n = len(tok), 0
    while time.perf_counter() < clock["deadline"]:
        ids, max_tokens = draw(rng, vocab)
        message = [{"role": "user", "content": text_of(ids, vocab)}]
        prompt = tok.encode(tok.apply_chat_template(message), add_special_tokens=False)
        max_tokens = min(max_tokens, MAX_LENGTH - len(prompt))  # the template's tokens must fit too
        seed = idx * 100_000 + n
        n += 1
        if route == "openai":
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            body = {"model": "lm", "messages": message, "max_tokens": max_tokens, "stream": True, "seed": seed,
                    "ignore_eos": True, **SAMPLING}
        else:
            url = f"http://127.0.0.1:{port}/v2/models/lm/generate_stream"
            body = {"input_ids": prompt, "parameters": {"max_tokens": max_tokens, "seed": seed, "ignore_eos": True, **SAMPLING}}
        await _one(session, url, body, route, clock, out)


async def _one(session: Any, url: str, body: dict, route: str, clock: dict, out: dict) -> None:
    warm, deadline = clock["warm"], clock["deadline"]
    t0 = time.perf_counter()
    arrivals: list[float] = []
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            out["errors"] += 1
            await resp.read()
            return
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            t = time.perf_counter()
            if line.strip() == b"data: [DONE]":
                break
            event = json.loads(line[5:])
            if route == "openai":
                choice = event["choices"][0] if event.get("choices") else {}
                if choice.get("finish_reason"):
                    break
                arrivals.append(t)  # one chunk per token here (one character per token)
            else:
                if "finish_reason" in event:
                    break
                arrivals.append(t)
            if t >= deadline:
                break  # leaving closes the connection: the server cancels the request
    out["tokens"] += sum(warm <= t < deadline for t in arrivals)
    if warm <= t0 < deadline and arrivals:
        out["ttft"].append(arrivals[0] - t0)


async def _loadgen(port: int, route: str, concurrency: int, window: float, vocab: int) -> dict:
    import aiohttp

    tok = make_tokenizer(vocab)
    out: dict = {"tokens": 0, "errors": 0, "ttft": []}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None, sock_read=120)) as session:
        start = time.perf_counter()
        clock = {"warm": start + WARMUP, "deadline": start + WARMUP + window}
        await asyncio.gather(*(_client(session, port, route, i, tok, clock, out) for i in range(concurrency)))
    ttft = np.asarray(out["ttft"]) * 1e3
    pct = lambda q: float(np.percentile(ttft, q)) if len(ttft) else float("nan")  # noqa: E731
    return {"tok_s": out["tokens"] / window, "requests": len(ttft), "errors": out["errors"],
            "ttft_p50_ms": pct(50), "ttft_p99_ms": pct(99)}


def run_load(port: int, route: str, concurrency: int, window: float, vocab: int) -> dict:
    """Drive one route from a subprocess; its figures plus the CPU seconds this process (the
    server: engine and event loop) and the client spent per generated token."""
    args = [sys.executable, os.path.abspath(__file__), "--loadgen", json.dumps([port, route, concurrency, window, vocab])]
    before = os.times()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=window + 300)
    after = os.times()
    if proc.returncode:
        raise RuntimeError(f"load generator failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    tokens = max(1.0, out["tok_s"] * window)  # inside the window; the CPU counts cover warm-up too: an upper bound
    out["server_cpu_us_per_token"] = 1e6 * ((after.user - before.user) + (after.system - before.system)) / tokens
    out["client_cpu_us_per_token"] = 1e6 * ((after.children_user - before.children_user)
                                            + (after.children_system - before.children_system)) / tokens
    return out


# --- the measurement ---


def build(root: str) -> tuple[str, int]:
    """Export the LM with its tokenizer into ``root/repo/lm/1``; (repository, vocabulary)."""
    from _serving_generate_model import LMConfig, cache_shapes
    from _serving_generate_model import build as build_lm

    from cairn import serving
    from cairn.core_array import ArraySpec

    cfg = LMConfig()
    prefill, decode, params = build_lm(cfg)
    serving.export_generator(prefill, decode, params, os.path.join(root, "repo", "lm", "1"),
                             cache_specs={n: ArraySpec(s, "float32") for n, s in cache_shapes(cfg).items()},
                             vocab_size=cfg.vocab_size, max_length=cfg.max_length, tokenizer=make_tokenizer(cfg.vocab_size))
    with open(os.path.join(root, "repo", "lm", "config.json"), "w") as f:
        json.dump({"generation": CONFIG}, f)
    return os.path.join(root, "repo"), cfg.vocab_size


def measure(quick: bool) -> list[dict]:
    from cairn import serving

    rounds, window = (2, 4.0) if quick else (3, 10.0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cairn-bench-openai-") as tmp:
        repo, vocab = build(tmp)
        with serving.serve(repo) as server:
            for c in (1, 16):
                got: dict[str, list[dict]] = {"generate": [], "openai": []}
                for _ in range(rounds):
                    for route in ("generate", "openai"):
                        got[route].append(run_load(server.port, route, c, window, vocab))
                for route, runs in got.items():
                    row = {"route": route, "c": c, "errors": sum(r["errors"] for r in runs)}
                    for k in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "server_cpu_us_per_token", "client_cpu_us_per_token"):
                        row[k] = float(np.median([r[k] for r in runs]))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| route | c | tok/s | TTFT p50 / p99 ms | server CPU us/token | client CPU us/token | errors |",
             "|---|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        name = "/v1/chat/completions" if r["route"] == "openai" else "/generate_stream"
        lines.append(f"| {name} | {r['c']} | {r['tok_s']:,.0f} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | "
                     f"{r['server_cpu_us_per_token']:,.0f} | {r['client_cpu_us_per_token']:,.0f} | {r['errors']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 rounds of 4 s per point instead of 3 of 10 s")
    p.add_argument("--loadgen", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.loadgen:
        port, route, c, window, vocab = json.loads(args.loadgen)
        print(json.dumps(asyncio.run(_loadgen(port, route, c, window, vocab))))
        return
    print(f"load average {os.getloadavg()[0]:.2f}; engine {CONFIG}", flush=True)
    rows = measure(args.quick)
    print(table(rows))
    by = {(r["route"], r["c"]): r for r in rows}
    ratios = {f"c{c}_{k}_openai_over_generate": round(by[("openai", c)][k] / by[("generate", c)][k], 3)
              for c in (1, 16) for k in ("tok_s", "ttft_p50_ms", "server_cpu_us_per_token")}
    print(json.dumps({"bench": "serving_openai", **ratios, "load_average": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
