"""The generation section of benchmarks/serving.py: continuous batching against a static
batcher and a one-request-at-a-time loop, through the real server.

One model (``_serving_generate_model``: a GQA decoder LM, d 256, 4 layers, vocabulary 512,
max length 256, float32) is exported once with ``cairn.serving.export_generator`` and
copied into a model repository under three names, each with its own ``config.json``
``"generation"`` section; one ``cairn.serving`` server (in this process, 127.0.0.1, port 0)
serves all three:

* ``continuous``: ``GenerationConfig(scheduler="continuous", num_slots=64, prefill_batch=4,
  admission_delay_steps=12)`` (with more than half the slots busy, waiting prompts are held
  up to 12 steps to fill a prefill group);
* ``static``: the same slots with ``scheduler="static"`` and ``prefill_batch=4`` (a batch is
  admitted only when every slot is free, so it runs until its longest request finishes:
  padded batches of 64, prefilled 4 prompts of one length bucket at a time).
* ``one-at-a-time``: ``num_slots=1, prefill_batch=1``.

Each batcher runs at the prefill batch that serves it best on this CPU. Static (server CPU
per token at c=64, load 15, two runs each): 2.12 / 2.49 ms at 4 rows, 2.41 / 2.79 at 2,
2.56 at 1; it admits 64 prompts at once and fills groups of 4. Continuous, c=64 tok/s on
the quiet host since the decode step got faster (one-query attention, 12 ms a step): 4
rows held up to 12 steps 3101 / 3239 / 3186 / 2974, up to 20 steps 3001 / 2933; 2 rows up
to 6 steps 2800 / 3020, 12 steps 3019 / 3138 / 2890 / 2851, 20 steps 2953 / 2870. A 4-row
prefill costs 2.7 ms a prompt against 3.6 at 2 rows, and groups of 4 hold 3.7 real prompts
of 4 and keep 59 of 64 slots busy (62 with 2), at twice the time to first token at c=64
(75 against 36 ms p50, still far below static's 2 s).

Workload (the same request sequence in every configuration): closed-loop clients (each
sends its next request when the previous one finished) at concurrency 1, 16 and 64, in a
separate process, streaming through ``/generate_stream`` (SSE, one event per token) over
keep-alive HTTP/1.1 connections read by :class:`_Stream` (``SERVING_BENCH_CLIENT=aiohttp``:
through aiohttp, 2.6x the client CPU per token on the same two cores as the server). Prompt lengths uniform in [16, 64] random token ids; ``max_tokens`` long-tailed:
60% uniform in [8, 32], 30% in [33, 96], 10% in [97, 192] (mean about 46), with
``ignore_eos`` so every request generates exactly that many; sampling temperature 0.8,
top_p 0.95, a seed per request.

Each point runs a warm-up, then a measuring window. The warm-up (``_warmup``) is ``WARMUP``
s, or, for the 64-slot engines at c > 1, the decode steps of one static cycle (the expected
longest request of 64) at the step time measured at the start: all clients start at once,
and until the longest requests have turned over, short requests finish (and new prompts are
prefilled) at up to twice the steady rate (measured under load: 0.86 prefills per step in
a 3 s window right after the start against about 0.4 later), which a short window after a
1 s warm-up counted as the continuous batcher's steady state. tokens/s counts the token events
that arrive inside the window; TTFT is measured for the requests sent inside it (followed
to their first token even past its end); TPOT per request is (last - first token
arrival) / (tokens - 1) over the tokens that arrived inside the window (every request
with two or more there); at the window's end the clients disconnect (which cancels their
requests on the server).

``busy slots`` is generated tokens per decode step and ``prompts/prefill`` the real prompts
per prefill call (of ``prefill_batch`` rows), from the engine's counters (statistics
extension). ``ceilings`` are what the model alone allows: the decode step at batch 1 against 64
(``64 * t1 / t64``: continuous over one-at-a-time if nothing but decode steps cost; the
one-at-a-time loop's host time per token, its TPOT minus ``t1``, is printed beside it), and
the workload's static-batching loss (``E[longest of 64] / E[length]``: continuous over
static if prefill and host work cost nothing). On a 2-core CPU a batch-1 decode step of
this model (13 MB of weights, in L3) is already compute-bound, so ``64 * t1 / t64`` is
about 1.5-2.5x, far below the 10x goal, which assumes memory-bound decode (a GPU).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

WARMUP = 1.0
CONCURRENCY = (1, 16, 64)
NUM_SLOTS = 64
PROMPT_LEN = (16, 64)
NEW_TOKENS = ((0.6, 8, 32), (0.3, 33, 96), (0.1, 97, 192))  # (probability, low, high), uniform inside
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "ignore_eos": True}
CONFIGS = {
    # admission_delay_steps: a busy engine waits up to 12 steps to fill a prefill group (module docstring)
    # each at its best prefill batch on this CPU (module docstring)
    "continuous": {"scheduler": "continuous", "num_slots": NUM_SLOTS, "prefill_batch": 4, "admission_delay_steps": 12, "max_queue": 1024},
    "static": {"scheduler": "static", "num_slots": NUM_SLOTS, "prefill_batch": 4, "max_queue": 1024},
    "one-at-a-time": {"scheduler": "continuous", "num_slots": 1, "prefill_batch": 1, "max_queue": 1024},
}
WORKLOAD = (f"closed loop; prompt {PROMPT_LEN[0]}-{PROMPT_LEN[1]} tokens uniform; max_tokens "
            + ", ".join(f"{p:.0%} in [{lo},{hi}]" for p, lo, hi in NEW_TOKENS)
            + f" (ignore_eos); temperature {SAMPLING['temperature']}, top_p {SAMPLING['top_p']}")


def draw(rng: np.random.Generator, vocab: int) -> tuple[list[int], int]:
    """One request: (prompt token ids, max_tokens)."""
    plen = int(rng.integers(PROMPT_LEN[0], PROMPT_LEN[1] + 1))
    u, acc = rng.random(), 0.0
    lo, hi = NEW_TOKENS[-1][1:]
    for p, a, b in NEW_TOKENS:
        acc += p
        if u < acc:
            lo, hi = a, b
            break
    return rng.integers(1, vocab, plen).tolist(), int(rng.integers(lo, hi + 1))


# --- load generator (runs in a subprocess) ---


class _Stream(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of the load generator, read as bytes arrive.

    The load generator shares the server's two cores, and a client library's per-line
    reading (aiohttp: about 70 us of client CPU per streamed token at c=64) charged the
    server that streams the most tokens for the client's own work. Here one callback per
    arriving segment splits HTTP/1.1 chunks and SSE events; an event's arrival time is when
    its bytes arrived. A token event counts; the final event (``finish_reason``) ends the
    request; the terminating chunk frees the connection for the next request."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.transport: Any = None
        self.closed = False
        self._buf = b""
        self._sse = b""
        self._state = "idle"
        self._need = 0
        self.done: asyncio.Future | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._end()

    def send(self, raw: bytes) -> asyncio.Future:
        """Write one request; the future resolves when its response ended (or the connection did)."""
        self.status, self.retry_after, self.finish, self.arrivals = 0, None, None, []
        self._buf, self._sse, self._state = b"", b"", "head"
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self.done

    def _end(self) -> None:
        self._state = "idle"
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter()
        buf = self._buf + data
        while self._state != "idle":
            if self._state == "head":
                i = buf.find(b"\r\n\r\n")
                if i < 0:
                    break
                lines = buf[:i].decode("latin-1").split("\r\n")
                buf = buf[i + 4:]
                self.status = int(lines[0].split()[1])
                headers = dict((k.strip().lower(), v.strip()) for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln))
                self.retry_after = headers.get("retry-after")
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    self._state = "size"
                else:
                    self._state, self._need = "body", int(headers.get("content-length", "0"))
            elif self._state == "body":  # a whole (error) answer
                if len(buf) < self._need:
                    break
                buf = buf[self._need:]
                self._end()
            elif self._state == "size":
                i = buf.find(b"\r\n")
                if i < 0:
                    break
                self._need = int(buf[:i].split(b";")[0], 16)
                buf = buf[i + 2:]
                self._state = "data" if self._need else "trailer"
            elif self._state == "data":
                if len(buf) < self._need + 2:
                    break
                self._events(buf[: self._need], t)
                buf = buf[self._need + 2:]
                if self._state == "data":
                    self._state = "size"
            else:  # trailer: the empty line after the last chunk
                if len(buf) < 2:
                    break
                buf = buf[2:]
                self._end()
        self._buf = buf

    def _events(self, payload: bytes, t: float) -> None:
        self._sse += payload
        *events, self._sse = self._sse.split(b"\n\n")
        for ev in events:
            if not ev.startswith(b"data:"):
                continue
            if b'"finish_reason"' in ev:
                self.finish = json.loads(ev[5:])["finish_reason"]
                continue
            self.arrivals.append(t)
            if t >= self.deadline:  # closing the connection cancels the request on the server
                self.transport.close()
                self._state = "closed"
                self._end()
                return


def _record(out: dict, clock: dict, t0: float, arrivals: list[float], finished: bool, reason: Any) -> None:
    """Account one request: tokens and completions inside the window, TTFT, TPOT."""
    warm, deadline = clock["warm"], clock["deadline"]
    if finished and reason not in ("length", "stop"):
        out["errors"] += 1
        out["statuses"].append(reason)
    if not finished and time.perf_counter() < deadline:
        out["errors"] += 1  # the stream ended without a final event
    out["tokens"] += sum(warm <= t < deadline for t in arrivals)
    out["completed"] += finished and warm <= time.perf_counter() < deadline
    if warm <= t0 < deadline and arrivals:
        out["ttft"].append(arrivals[0] - t0)
    inside = [t for t in arrivals if warm <= t < deadline]
    if len(inside) > 1:  # every request streaming inside the window, whenever it was sent
        out["tpot"].append((inside[-1] - inside[0]) / (len(inside) - 1))


async def _client(port: int, model: str, idx: int, vocab: int, clock: dict, out: dict) -> None:
    """One closed-loop client (:class:`_Stream`): each request when the previous one ended."""
    rng = np.random.default_rng([1234, idx])  # the same request sequence in every configuration
    loop = asyncio.get_running_loop()
    deadline, conn, n = clock["deadline"], None, 0
    head = f"POST /v2/models/{model}/generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    while time.perf_counter() < deadline:
        prompt, max_tokens = draw(rng, vocab)
        body = json.dumps({"input_ids": prompt, "parameters": {"max_tokens": max_tokens, "seed": idx * 100_000 + n,
                                                               **SAMPLING}}).encode()
        n += 1
        if conn is None or conn.closed:
            _, conn = await loop.create_connection(lambda: _Stream(deadline), "127.0.0.1", port)
        t0 = time.perf_counter()
        await conn.send(head.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        if conn.status != 200:
            out["errors"] += 1
            out["statuses"].append(conn.status)
            await asyncio.sleep(float(conn.retry_after or "0.05"))
            continue
        _record(out, clock, t0, conn.arrivals, conn.finish is not None, conn.finish)
    if conn is not None:
        conn.transport.close()


async def _client_aiohttp(session: Any, port: int, model: str, idx: int, vocab: int, clock: dict, out: dict) -> None:
    """:func:`_client` through aiohttp (``SERVING_BENCH_CLIENT=aiohttp``: the reading before)."""
    rng = np.random.default_rng([1234, idx])
    url, deadline, n = f"http://127.0.0.1:{port}/v2/models/{model}/generate_stream", clock["deadline"], 0
    while time.perf_counter() < deadline:
        prompt, max_tokens = draw(rng, vocab)
        body = {"input_ids": prompt, "parameters": {"max_tokens": max_tokens, "seed": idx * 100_000 + n, **SAMPLING}}
        n += 1
        t0 = time.perf_counter()
        arrivals: list[float] = []
        reason = None
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                out["errors"] += 1
                out["statuses"].append(resp.status)
                await resp.read()
                await asyncio.sleep(float(resp.headers.get("Retry-After", "0.05")))
                continue
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                t = time.perf_counter()
                event = json.loads(line[5:])
                if "finish_reason" in event:
                    reason = event["finish_reason"]
                    break
                arrivals.append(t)
                if t >= deadline:
                    break  # leaving the block closes the connection: the server cancels the request
        _record(out, clock, t0, arrivals, reason is not None, reason)


async def _loadgen(port: int, model: str, concurrency: int, window: float, vocab: int, warmup: float = WARMUP) -> dict:
    out: dict = {"tokens": 0, "completed": 0, "errors": 0, "statuses": [], "ttft": [], "tpot": []}
    start = time.perf_counter()
    clock = {"warm": start + warmup, "deadline": start + warmup + window}
    print(json.dumps({"clock": clock}), flush=True)  # the window, for the server's CPU time and counters

    async def cpu_in_window() -> None:  # this process's CPU inside the window: what the clients cost
        await asyncio.sleep(max(0.0, clock["warm"] - time.perf_counter()))
        c0 = time.process_time()
        await asyncio.sleep(max(0.0, clock["deadline"] - time.perf_counter()))
        out["client_cpu_s"] = time.process_time() - c0

    if os.environ.get("SERVING_BENCH_CLIENT", "stream") == "aiohttp":
        import aiohttp

        connector, timeout = aiohttp.TCPConnector(limit=0), aiohttp.ClientTimeout(total=None, sock_read=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(cpu_in_window(), *(_client_aiohttp(session, port, model, i, vocab, clock, out)
                                                    for i in range(concurrency)))
    else:
        await asyncio.gather(cpu_in_window(), *(_client(port, model, i, vocab, clock, out) for i in range(concurrency)))
    ttft, tpot = np.asarray(out["ttft"]) * 1e3, np.asarray(out["tpot"]) * 1e3
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan")  # noqa: E731
    return {
        "tok_s": out["tokens"] / window, "requests": len(ttft), "completed": out["completed"], "errors": out["errors"],
        "statuses": sorted(set(map(str, out["statuses"]))),
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
        "client_cpu_ms_per_token": 1e3 * out.get("client_cpu_s", float("nan")) / max(out["tokens"], 1),
    }


def run_load(port: int, model: str, concurrency: int, window: float, vocab: int, warmup: float = WARMUP) -> dict:
    """Drive ``model``'s /generate_stream with ``concurrency`` closed-loop clients from a subprocess
    (``warmup`` s, then a ``window`` s measurement). Besides the client's figures: this
    process's CPU seconds (the server, every thread) and the engine's counters over the
    window (``cpu_s``, ``counters``); ``time.perf_counter`` is the system's monotonic clock,
    shared with the subprocess."""
    args = [sys.executable, os.path.abspath(__file__), "--loadgen", json.dumps([port, model, concurrency, window, vocab, warmup])]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        marks = {}
        if line.startswith('{"clock"'):
            for name, at in sorted(json.loads(line)["clock"].items(), key=lambda kv: kv[1]):
                time.sleep(max(0.0, at - time.perf_counter()))
                marks[name] = (time.process_time(), engine_counters(port, model))
        out, err = proc.communicate(timeout=warmup + window + 300)
    if proc.returncode:
        raise RuntimeError(f"load generator failed:\n{err[-3000:]}")
    r = json.loads(out.strip().splitlines()[-1])
    if len(marks) == 2:
        (c0, n0), (c1, n1) = marks["warm"], marks["deadline"]
        r["cpu_s"], r["counters"] = c1 - c0, {k: n1[k] - n0[k] for k in n0}
    return r


def engine_counters(port: int, model: str) -> dict[str, int]:
    """The engine's counters from the server's statistics extension (``GET .../stats``)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}/stats", timeout=10) as r:
        stats = json.loads(r.read())["model_stats"][0]
    engine = stats["generation_stats"]["engine"]
    return {k: int(engine.get(k, 0)) for k in ("steps", "prefills", "requests", "tokens")}


# --- model, repository, ceilings ---


def build_repo(root: str) -> tuple[str, Any, dict]:
    """Export the benchmark LM once; a repository with one copy per configuration.

    Returns (repository path, the loaded generator, {"export_s": ...})."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _serving_generate_model import LMConfig, build, cache_shapes

    from cairn import serving
    from cairn.core_array import ArraySpec

    cfg = LMConfig()
    prefill, decode, params = build(cfg)
    t = time.perf_counter()
    path = serving.export_generator(prefill, decode, params, os.path.join(root, "export", "lm", "1"),
                                    cache_specs={n: ArraySpec(s, "float32") for n, s in cache_shapes(cfg).items()},
                                    vocab_size=cfg.vocab_size, max_length=cfg.max_length, eos_token_ids=(0,))
    info = {"export_s": time.perf_counter() - t}
    repo = os.path.join(root, "repo")
    for name, gen in CONFIGS.items():
        shutil.copytree(path, os.path.join(repo, name, "1"))
        with open(os.path.join(repo, name, "config.json"), "w") as f:
            json.dump({"generation": gen}, f)
    return repo, serving.load(path), info


def decode_step_times(model: Any, batches: tuple[int, ...] = (1, NUM_SLOTS), repeat: int = 15) -> dict[int, float]:
    """Median seconds of the loaded generator's decode step (logits fetched) at each batch size."""
    import jax.numpy as jnp

    out = {}
    for b in batches:
        cache = model.init_cache(b)
        tok, pos = jnp.ones(b, jnp.int32), jnp.full(b, model.max_length // 2, jnp.int32)
        logits, cache = model.decode(tok, pos, cache)
        np.asarray(logits)
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            logits, cache = model.decode(tok, pos, cache)
            np.asarray(logits)
            times.append(time.perf_counter() - t)
        out[b] = float(np.median(times))
    return out


def components(model: Any, repeat: int = 15) -> dict[str, float]:
    """The costs of a continuous step's parts, in ms, each the minimum of ``repeat`` runs in
    this process, interleaved (a shared host's load moves medians by several times): a
    prefill of 4 and of 2 prompts of 46-64 tokens (bucket 64, the logits fetched), the
    decode step at ``NUM_SLOTS`` rows (logits fetched) and host sampling of ``NUM_SLOTS``
    rows of its logits (the workload's temperature and top_p), and the ratios prefill /
    decode step that bound continuous over static (docs/serving.md)."""
    import jax
    import jax.numpy as jnp

    from cairn.serving import SamplingParams
    from cairn.serving._sampling import sample_rows  # the engine's sampler

    rng = np.random.default_rng(7)
    groups = {rows: (rng.integers(1, model.vocab_size, (rows, 64)).astype(np.int32),
                     rng.integers(46, 65, rows).astype(np.int32)) for rows in (4, 2)}
    cache = model.init_cache(NUM_SLOTS)
    tok, pos = jnp.ones(NUM_SLOTS, jnp.int32), jnp.full(NUM_SLOTS, model.max_length // 2, jnp.int32)
    params = [SamplingParams(max_new_tokens=256, temperature=SAMPLING["temperature"], top_p=SAMPLING["top_p"])] * NUM_SLOTS
    seeds, index = list(range(NUM_SLOTS)), [3] * NUM_SLOTS
    times: dict[str, list[float]] = {}

    def timed(name: str, t: float) -> None:
        times.setdefault(name, []).append(time.perf_counter() - t)

    for _ in range(repeat + 1):  # the first round compiles
        for rows, (tokens, lengths) in groups.items():
            t = time.perf_counter()
            logits, new = model.prefill(*jax.device_put((tokens, lengths)))
            np.asarray(logits)
            jax.block_until_ready(new)
            timed(f"prefill_{rows}x64_ms", t)
        t = time.perf_counter()
        logits, cache = model.decode(tok, pos, cache)
        host = np.asarray(logits)
        timed("decode_ms", t)
        t = time.perf_counter()
        sample_rows(host, params, seeds, index)
        timed("sample_ms", t)
    out = {k: 1e3 * min(v[1:]) for k, v in times.items()}
    for rows in groups:
        out[f"prefill_{rows}x64_over_decode"] = out[f"prefill_{rows}x64_ms"] / out["decode_ms"]
    out["load_average"] = os.getloadavg()[0]
    return out


def static_loss(batch: int = NUM_SLOTS, trials: int = 2000) -> float:
    """E[longest max_tokens of a batch] / E[max_tokens]: the decode steps a static batcher
    spends per token over a continuous one's, for this workload."""
    rng = np.random.default_rng(0)
    lengths = np.array([[draw(rng, 2)[1] for _ in range(batch)] for _ in range(trials // batch + 40)])
    return float(lengths.max(axis=1).mean() / lengths.mean())


# --- the section ---


def longest_expected(batch: int = NUM_SLOTS, trials: int = 2000) -> float:
    """E[longest max_tokens of a batch]: the decode steps of one static cycle."""
    rng = np.random.default_rng(0)
    return float(np.array([[draw(rng, 2)[1] for _ in range(batch)] for _ in range(trials // batch + 40)]).max(axis=1).mean())


def _window(config: str, c: int, quick: bool, step_s: float = 0.0) -> float:
    """Seconds measured per point: the static batcher under load cycles once per longest
    request of a batch, so its window covers at least two cycles at the decode step time
    ``step_s`` measured at the start (on a loaded machine a 9 s window saw a fraction of
    one cycle: 3 busy slots instead of 16, and a ratio of 8-18x); at c=1 a 64-slot engine
    finishes a request every few seconds, so TTFT needs a longer one."""
    base = 3.0 if quick else 8.0
    if config == "static" and c > 1:
        return max(3 * base, 2 * longest_expected() * step_s)
    return 2 * base if c == 1 and config != "one-at-a-time" else base


def _warmup(config: str, c: int, step_s: float) -> float:
    """Seconds before a point's window: for the 64-slot engines at c > 1, one static cycle of
    decode steps at ``step_s`` (the closed loop's requests have turned over: steady state)."""
    return max(WARMUP, longest_expected() * step_s) if config != "one-at-a-time" and c > 1 else WARMUP


def measure(quick: bool) -> tuple[list[dict], dict]:
    """Run every (configuration, concurrency) point; returns (rows, summary)."""
    from cairn import serving

    # a client leaving mid-stream makes asyncio log "socket.send() raised exception." per write
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    rounds = 1 if quick else 2
    root = tempfile.mkdtemp(prefix="cairn-serving-gen-")
    try:
        # the three engines compile the same shapes (one-at-a-time's differ): compile once
        serving.enable_compilation_cache(os.path.join(root, "xla-cache"))
        repo, model, info = build_repo(root)
        steps = decode_step_times(model)
        parts = components(model)
        print("generate: components (ms, min of 15) " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()), flush=True)
        t = time.perf_counter()
        server = serving.serve(repo, workers=2)
        info["server_start_s"] = time.perf_counter() - t
        samples: dict[tuple[str, int], list[dict]] = {(n, c): [] for n in CONFIGS for c in CONCURRENCY}
        try:
            for _ in range(rounds):
                for name, c in samples:
                    r = run_load(server.port, name, c, _window(name, c, quick, steps[NUM_SLOTS]), model.vocab_size,
                                 _warmup(name, c, steps[NUM_SLOTS]))
                    d = r["counters"]  # over the window
                    r["slots_busy"] = d["tokens"] / max(d["steps"], 1)  # tokens per decode step
                    r["rows_per_prefill"] = d["requests"] / max(d["prefills"], 1)
                    r["prefills_per_step"] = d["prefills"] / max(d["steps"], 1)
                    # the server's CPU (every thread: XLA, engine, event loop) per token that reached a client
                    r["cpu_ms_per_token"] = 1e3 * r["cpu_s"] / max(r["tok_s"] * _window(name, c, quick, steps[NUM_SLOTS]), 1)
                    samples[name, c].append(r)
                    print(f"  gen {name:14s} c={c:<3d} {r['tok_s']:8.0f} tok/s  TPOT p50 {r['tpot_p50_ms']:7.2f} p99 {r['tpot_p99_ms']:7.2f} ms"
                          f"  TTFT p50 {r['ttft_p50_ms']:8.1f} p99 {r['ttft_p99_ms']:8.1f} ms  {r['requests']} req  {r['errors']} err {r['statuses']}"
                          f"  {r['slots_busy']:.1f} slots busy/step  {r['rows_per_prefill']:.1f} prompts/prefill"
                          f"  {r['prefills_per_step']:.2f} prefills/step  {r['cpu_ms_per_token']:.2f} server CPU ms/token"
                          f"  {r['client_cpu_ms_per_token']:.3f} client CPU ms/token"
                          f"  load {os.getloadavg()[0]:.1f}", flush=True)
        finally:
            server.stop(drain=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    keys = ("tok_s", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "slots_busy", "rows_per_prefill",
            "prefills_per_step", "cpu_ms_per_token", "client_cpu_ms_per_token")
    rows = []
    for (name, c), runs in samples.items():
        med = {k: float(np.median([r[k] for r in runs])) for k in keys}
        rows.append({"config": name, "c": c, **med, "requests": sum(r["requests"] for r in runs), "errors": sum(r["errors"] for r in runs)})
    get = {(r["config"], r["c"]): r for r in rows}
    tok = lambda n, c: get[n, c]["tok_s"]  # noqa: E731
    summary = {
        "workload": WORKLOAD,
        "continuous_vs_static_c64": tok("continuous", 64) / tok("static", 64),
        # the same comparison in the server's CPU per delivered token: what a loaded machine moves least
        "continuous_vs_static_c64_cpu": get["static", 64]["cpu_ms_per_token"] / get["continuous", 64]["cpu_ms_per_token"],
        "continuous_vs_one_c64": tok("continuous", 64) / tok("one-at-a-time", 64),
        "ttft_c16_vs_c1_continuous": get["continuous", 16]["ttft_p50_ms"] / get["continuous", 1]["ttft_p50_ms"],
        "ceiling_continuous_vs_one": NUM_SLOTS * steps[1] / steps[NUM_SLOTS],
        "ceiling_continuous_vs_static": static_loss(),
        "decode_step_ms": {str(b): s * 1e3 for b, s in steps.items()},
        "components": {k: round(v, 3) for k, v in parts.items()},
        # one-at-a-time's time per token beyond its decode step: sampling, events, the engine loop
        "one_host_ms_per_token": get["one-at-a-time", 1]["tpot_p50_ms"] - steps[1] * 1e3,
        "errors": sum(r["errors"] for r in rows),
        **{k: round(v, 2) for k, v in info.items()},
    }
    summary["goals"] = {
        "continuous_vs_static_c64 >= 3": summary["continuous_vs_static_c64"] >= 3,
        "continuous_vs_one_c64 >= 10": summary["continuous_vs_one_c64"] >= 10,
        "ttft_c16_vs_c1_continuous < 3": summary["ttft_c16_vs_c1_continuous"] < 3,
    }
    return rows, summary


def table(rows: list[dict]) -> str:
    lines = [f"| {'generate':14s} |   c |  tok/s | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms | TTFT p99 ms | busy slots | prompts/prefill "
             "| prefills/step | server CPU ms/token | client CPU ms/token | requests | errors |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['config']:14s} | {r['c']:3d} | {r['tok_s']:6.0f} | {r['tpot_p50_ms']:11.2f} | {r['tpot_p99_ms']:11.2f} | "
                     f"{r['ttft_p50_ms']:11.1f} | {r['ttft_p99_ms']:11.1f} | {r['slots_busy']:10.1f} | {r['rows_per_prefill']:15.1f} | "
                     f"{r['prefills_per_step']:13.2f} | {r['cpu_ms_per_token']:19.2f} | {r['client_cpu_ms_per_token']:19.3f} | "
                     f"{r['requests']:8d} | {r['errors']:6d} |")
    return "\n".join(lines)


def goals_text(summary: dict) -> str:
    s = summary
    return "\n".join([
        f"workload: {s['workload']}",
        f"continuous / static tokens/s at c=64: {s['continuous_vs_static_c64']:.2f}x (goal >= 3x: "
        f"{'met' if s['goals']['continuous_vs_static_c64 >= 3'] else 'MISSED'}; the workload's ceiling {s['ceiling_continuous_vs_static']:.2f}x; "
        f"in server CPU per token {s['continuous_vs_static_c64_cpu']:.2f}x)",
        f"continuous / one-at-a-time tokens/s at c=64: {s['continuous_vs_one_c64']:.2f}x (goal >= 10x: "
        f"{'met' if s['goals']['continuous_vs_one_c64 >= 10'] else 'MISSED'}; decode steps alone on this machine give "
        f"64 x {s['decode_step_ms']['1']:.2f} ms / {s['decode_step_ms'][str(NUM_SLOTS)]:.2f} ms = {s['ceiling_continuous_vs_one']:.2f}x, "
        f"plus one-at-a-time's {s['one_host_ms_per_token']:.2f} ms host time per token)",
        f"continuous TTFT p50 c=16 / c=1: {s['ttft_c16_vs_c1_continuous']:.2f}x (goal < 3x: "
        f"{'met' if s['goals']['ttft_c16_vs_c1_continuous < 3'] else 'MISSED'})",
    ])


if __name__ == "__main__":
    if "--components" in sys.argv:  # the step's parts only (no server): python _serving_generate.py --components
        _root = tempfile.mkdtemp(prefix="cairn-serving-gen-")
        try:
            print(json.dumps(components(build_repo(_root)[1], repeat=40)))
        finally:
            shutil.rmtree(_root, ignore_errors=True)
    elif len(sys.argv) == 3 and sys.argv[1] == "--loadgen":
        port, model, c, window, vocab, warmup = json.loads(sys.argv[2])
        print(json.dumps(asyncio.run(_loadgen(port, model, c, window, vocab, warmup))))
    else:
        quick = "--quick" in sys.argv
        rows, summary = measure(quick)
        print(table(rows))
        print(goals_text(summary))
        print(json.dumps(summary))
