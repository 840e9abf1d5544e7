"""cairn.serving's server against a bare aiohttp handler doing the same JAX work.

A load generator on loopback (wrk or hey when installed, else the asyncio keep-alive
client below, in its own process so it does not share the server's GIL) runs for a fixed
time at concurrency 1, 16 and 64 and reports throughput and p50/p99 latency for:

* ``bare-aiohttp``: one aiohttp route that parses the OIP JSON, calls the model inline on
  the event loop, and writes the OIP JSON answer (no validation, no queue, no metrics);
* ``cairn-nobatch``: ``cairn.serving.serve`` with batching off (each request alone);
* ``cairn-batch``: the same with dynamic batching, no queue delay;
* ``cairn-batch-1ms`` / ``cairn-batch-5ms``: dynamic batching with a 1 ms (small model)
  or 5 ms (compute model: about a tenth of its batch) max queue delay;
* ``... @400/s``: paced load (16 connections, 400 req/s in all: moderate, well below
  saturation) for the p99 goal, the bare handler beside it as the machine's own noise.

The model is an exported and loaded (``cairn.serving.export``/``load``) float32 MLP:
``small`` (64-256-256-16, JSON bodies) for the overhead comparison, ``compute`` (four
2048x2048 layers, 64 MB of weights, binary bodies: about 12 ms a call at batch 1 and
80 ms at batch 64 here) for the batching gain. Goals: cairn-batch within 10% of the bare
handler at c=16 (ratio >= 0.9), batching >= 5x batch-1 throughput for the compute model at
c=64, p99 under twice the queue delay plus the compute of one full batch at c=16.

The generation section (``benchmarks/_serving_generate.py``, its docstring has the details)
serves one small decoder LM exported with ``export_generator`` under three engine
configurations: continuous batching, a static batcher and one request at a time; closed-loop
streaming clients at concurrency 1, 16 and 64 with mixed prompt and output lengths measure
tokens/s, time per output token and time to first token. Goals: continuous at least 3x the
static batcher's tokens/s at c=64 and 10x one-at-a-time, TTFT at c=16 under 3x its c=1 value.

The OpenAI section (``--section openai``; not part of ``all``, it reruns the generation
section inside it) gathers issue 27's engine goals in one run, on the same LM:
``/v1/chat/completions`` tokens/s within 5% of ``/generate_stream`` at c=16
(``serving_openai.py``); time to first token with a shared 512-token system prompt at least
5x lower with prefix caching than without, and at least 3x as many concurrent sequences at
``max_length`` 4096 with mixed lengths in the paged layout as in contiguous rows of the same
KV memory (``_serving_paged.py``); continuous batching at least 3x static at c=64 (the
generation section).

Prints the tables, then ONE JSON line (the generation figures under ``"generate"``).
``--quick`` runs one round of short points (about a minute per section); the default, three
interleaved rounds of 4 s (medians) for infer and two longer rounds for generate.
``--section infer|generate`` runs one of them. If ``benchmarks/_serving_export.py`` exists
its export and cold-start rows are appended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

QUEUE_DELAY = 0.001
WARMUP = 0.5  # seconds of load before measuring
PACED_RATE = 400.0  # req/s for the moderate-load p99 point (c=16), well below saturation

# --- load generator (runs in a subprocess) ---


class _Conn(asyncio.Protocol):
    """One keep-alive connection sending the same request back to back."""

    def __init__(self, payload: bytes, stats: dict, warm_until: float, deadline: float, done: asyncio.Future, interval: float) -> None:
        self.payload, self.stats, self.warm_until, self.deadline, self.done = payload, stats, warm_until, deadline, done
        self.interval = interval  # > 0: send at most one request per interval (paced load)
        self.buf = b""
        self.t0 = 0.0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        self.t0 = time.perf_counter()
        self.transport.write(self.payload)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1").lower()
        length = int(head.split("\r\ncontent-length:")[1].split("\r\n")[0])
        if len(self.buf) < end + 4 + length:
            return
        now = time.perf_counter()
        status = int(head.split(" ", 2)[1])
        self.buf = self.buf[end + 4 + length :]
        if now > self.warm_until:
            self.stats["lat"].append(now - self.t0)
            self.stats["errors"] += status != 200
        if now < self.deadline:
            wait = self.t0 + self.interval - now
            if wait > 0:
                asyncio.get_running_loop().call_later(wait, self._send)
            else:
                self._send()
        else:
            assert self.transport is not None
            self.transport.close()
            if not self.done.done():
                self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _loadgen(host: str, port: int, payload: bytes, concurrency: int, seconds: float, warmup: float, rate: float) -> dict:
    loop = asyncio.get_running_loop()
    stats: dict = {"lat": [], "errors": 0}
    start = time.perf_counter()
    warm_until, deadline = start + warmup, start + warmup + seconds
    dones = [loop.create_future() for _ in range(concurrency)]
    interval = concurrency / rate if rate > 0 else 0.0
    for d in dones:
        await loop.create_connection(lambda d=d: _Conn(payload, stats, warm_until, deadline, d, interval), host, port)
        if interval:
            await asyncio.sleep(interval / concurrency)  # spread the paced connections out
    await asyncio.gather(*dones)
    lat = np.asarray(stats["lat"]) * 1e3
    return {
        "requests": len(lat),
        "errors": stats["errors"],
        "rps": len(lat) / seconds,
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else float("nan"),
    }


def _request_bytes(path: str, body: bytes, header_length: int | None) -> bytes:
    extra = f"Inference-Header-Content-Length: {header_length}\r\n" if header_length is not None else ""
    head = f"POST {path} HTTP/1.1\r\nHost: bench\r\n{extra}Content-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def run_load(port: int, path: str, body: tuple[bytes, int | None], concurrency: int, seconds: float, rate: float = 0.0) -> dict:
    """Drive ``POST path`` at ``concurrency`` for ``seconds`` (at most ``rate`` req/s when
    > 0) from a separate process."""
    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(_request_bytes(path, *body))
    try:
        args = [sys.executable, __file__, "--loadgen", str(port), f.name, str(concurrency), str(seconds), str(rate)]
        out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=seconds + 120)
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        os.unlink(f.name)


# --- servers under test ---


def _oip_body(x: np.ndarray, binary: bool) -> tuple[bytes, int | None]:
    """An OIP request body: JSON data, or Triton's binary extension (JSON header, then raw
    bytes, outputs asked in binary); returns (body, Inference-Header-Content-Length)."""
    entry = {"name": "x", "shape": list(x.shape), "datatype": "FP32"}
    if not binary:
        return json.dumps({"inputs": [{**entry, "data": x.reshape(-1).tolist()}]}).encode(), None
    entry["parameters"] = {"binary_data_size": x.nbytes}
    head = json.dumps({"inputs": [entry], "parameters": {"binary_data_output": True}}).encode()
    return head + x.tobytes(), len(head)


def start_bare(model: Any) -> tuple[int, Callable[[], None]]:
    """A bare aiohttp app doing the same work inline: parse JSON, run the model, answer JSON."""
    from aiohttp import web

    async def infer(request: web.Request) -> web.Response:
        body = await request.read()
        hl = request.headers.get("Inference-Header-Content-Length")
        req = json.loads(body if hl is None else body[: int(hl)])
        t = req["inputs"][0]
        if hl is None:
            x = np.asarray(t["data"], np.float32).reshape(t["shape"])
        else:
            x = np.frombuffer(body, np.float32, offset=int(hl)).reshape(t["shape"])
        y = model({"x": x})["y"]
        out = {"name": "y", "datatype": "FP32", "shape": list(y.shape)}
        if hl is None:
            head = json.dumps({"model_name": "m", "outputs": [{**out, "data": y.reshape(-1).tolist()}]}, separators=(",", ":"))
            return web.Response(body=head.encode(), content_type="application/json")
        raw = np.ascontiguousarray(y).tobytes()
        head = json.dumps({"model_name": "m", "outputs": [{**out, "parameters": {"binary_data_size": len(raw)}}]}).encode()
        return web.Response(body=head + raw, headers={"Inference-Header-Content-Length": str(len(head))}, content_type="application/octet-stream")

    ready = threading.Event()
    state: dict = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v2/models/m/infer", infer)
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        state["port"] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        state["loop"], state["runner"] = loop, runner
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait()

    def stop() -> None:
        state["loop"].call_soon_threadsafe(state["loop"].stop)
        t.join(10)

    return state["port"], stop


def build_model(root: str, name: str, dims: tuple[int, ...], max_batch: int) -> Any:
    """Export and load an MLP with ``dims`` (float32, tanh), batch buckets the powers of two."""
    import jax.numpy as jnp

    from cairn.core_array import ArraySpec
    from cairn.serving import export, load

    rng = np.random.default_rng(0)
    params = {f"l{i}": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32) for i, (a, b) in enumerate(zip(dims, dims[1:]))}

    def fn(p, inputs):
        h = inputs["x"]
        for i in range(len(p)):
            h = jnp.tanh(h @ p[f"l{i}"])
        return {"y": h}

    spec = {"x": ArraySpec(("b", dims[0]), "float32", constraints=(f"b <= {max_batch}",))}
    path = export(fn, params, spec, os.path.join(root, name, "1"))
    return load(path)


def _configs() -> dict:
    from cairn.serving import BatchingConfig

    return {
        "bare-aiohttp": None,
        "cairn-nobatch": BatchingConfig(enabled=False, max_queue_size=1024),
        "cairn-batch": BatchingConfig(max_queue_delay=0.0, max_queue_size=1024),
        "cairn-batch-1ms": BatchingConfig(max_queue_delay=QUEUE_DELAY, max_queue_size=1024),
        "cairn-batch-5ms": BatchingConfig(max_queue_delay=0.005, max_queue_size=1024),
    }


def _start(model: Any, config: str) -> tuple[int, Callable[[], None]]:
    from cairn.serving import serve

    batching = _configs()[config]
    if batching is None:
        return start_bare(model)
    server = serve({"m": model}, batching=batching, workers=2)
    return server.port, server.stop


def measure(model: Any, points: list[tuple[str, int, float]], seconds: float, binary: bool, rounds: int) -> list[dict]:
    """One row per (server config, concurrency, rate) point (rate 0 = as fast as answered).

    Every server runs at once and the points are interleaved, ``rounds`` times over, each
    row the median of its rounds: on a shared machine the load of other processes drifts,
    and interleaving spreads the drift over all servers instead of whichever ran during it.
    """
    body = _oip_body(np.random.default_rng(1).normal(size=(1, model.inputs["x"].shape[1])).astype(np.float32), binary)
    servers = {config: _start(model, config) for config in dict.fromkeys(name for name, _, _ in points)}
    samples: dict[tuple[str, int, float], list[dict]] = {p: [] for p in points}
    try:
        for _ in range(rounds):
            for point in points:
                config, c, rate = point
                cpu = time.process_time()  # this process is the server (the client is another one)
                r = run_load(servers[config][0], "/v2/models/m/infer", body, c, seconds, rate)
                served = r["requests"] * (seconds + WARMUP) / seconds  # the warm-up's requests cost CPU too
                r["cpu_us"] = (time.process_time() - cpu) / max(served, 1) * 1e6
                samples[point].append(r)
    finally:
        for _, stop in servers.values():
            stop()
    rows = []
    for (config, c, rate), runs in samples.items():
        med = {k: float(np.median([r[k] for r in runs])) for k in ("rps", "p50_ms", "p99_ms", "cpu_us")}
        label = config + (f" @{rate:.0f}/s" if rate else "")
        rows.append({"model": model.name, "server": label, "c": c, "format": "binary" if binary else "json",
                     "errors": sum(r["errors"] for r in runs), **med})
        print(f"  {model.name:8s} {label:22s} c={c:<3d} {med['rps']:9.0f} req/s  p50 {med['p50_ms']:7.2f} ms  p99 {med['p99_ms']:7.2f} ms"
              f"  {med['cpu_us']:6.0f} us CPU/req", flush=True)
    return rows


def compute_time(model: Any, rows: int, repeat: int = 20) -> float:
    """Seconds for one model call at ``rows`` rows (median)."""
    x = np.zeros((rows, model.inputs["x"].shape[1]), np.float32)
    model({"x": x})
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        model({"x": x})
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _table(rows: list[dict]) -> str:
    lines = [f"| {'model':8s} | {'body':6s} | {'server':22s} | {'c':>3s} | {'req/s':>7s} | {'p50 ms':>7s} | {'p99 ms':>7s} | CPU us/req | errors |",
             "|---|---|---|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['model']:8s} | {r['format']:6s} | {r['server']:22s} | {r['c']:3d} | {r['rps']:7.0f} | {r['p50_ms']:7.2f} | "
                     f"{r['p99_ms']:7.2f} | {r['cpu_us']:10.0f} | {r['errors']:6d} |")
    return "\n".join(lines)


def infer_section(quick: bool) -> dict:
    """The infer benchmark (module docstring): prints its rows and table, returns the summary."""
    seconds, rounds = (2.0, 1) if quick else (4.0, 3)
    tools = [t for t in ("wrk", "hey") if shutil.which(t)]
    print(f"load generator: {'asyncio client (no wrk/hey installed)' if not tools else 'asyncio client (' + ', '.join(tools) + ' present)'}; "
          f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}; {seconds:.0f} s per point, {rounds} interleaved round(s)", flush=True)
    root = tempfile.mkdtemp(prefix="cairn-serving-bench-")
    try:
        small = build_model(root, "small", (64, 256, 256, 16), 64)
        heavy = build_model(root, "compute", (2048,) * 5, 64)
        names = ["bare-aiohttp", "cairn-nobatch", "cairn-batch", "cairn-batch-1ms"]
        points = [(n, c, 0.0) for n in names for c in (1, 16, 64)]
        points += [("bare-aiohttp", 16, PACED_RATE), ("cairn-batch", 16, PACED_RATE), ("cairn-batch-1ms", 16, PACED_RATE)]
        rows = measure(small, points, seconds, binary=False, rounds=rounds)
        heavy_names = ["bare-aiohttp", "cairn-nobatch", "cairn-batch", "cairn-batch-5ms"]  # 5 ms: about a tenth of a batch
        rows += measure(heavy, [(n, 64, 0.0) for n in heavy_names], seconds, binary=True, rounds=rounds)
        full_batch = compute_time(small, 16)
        heavy_1, heavy_64 = compute_time(heavy, 1), compute_time(heavy, 64, repeat=5)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(_table(rows))
    get = {(r["model"], r["server"], r["c"]): r for r in rows}
    rps = lambda m, s, c: get[m, s, c]["rps"]  # noqa: E731
    summary = {
        "batch_vs_bare_c16": rps("small", "cairn-batch", 16) / rps("small", "bare-aiohttp", 16),
        "nobatch_vs_bare_c16": rps("small", "cairn-nobatch", 16) / rps("small", "bare-aiohttp", 16),
        "nobatch_vs_bare_c1": rps("small", "cairn-nobatch", 1) / rps("small", "bare-aiohttp", 1),
        "cpu_per_req_vs_bare_c16": get["small", "cairn-batch", 16]["cpu_us"] / get["small", "bare-aiohttp", 16]["cpu_us"],
        "cpu_per_req_nobatch_vs_bare_c16": get["small", "cairn-nobatch", 16]["cpu_us"] / get["small", "bare-aiohttp", 16]["cpu_us"],
        "batching_gain_compute_c64": rps("compute", "cairn-batch", 64) / rps("compute", "cairn-nobatch", 64),
        "batching_gain_compute_c64_5ms": rps("compute", "cairn-batch-5ms", 64) / rps("compute", "cairn-nobatch", 64),
        "batching_ideal_gain_compute": 64 * heavy_1 / heavy_64,  # the model alone: 64 calls at batch 1 vs one at 64
        "batching_cpu_gain_compute_c64": get["compute", "cairn-nobatch", 64]["cpu_us"] / get["compute", "cairn-batch-5ms", 64]["cpu_us"],
        "p99_paced_c16_ms": get["small", f"cairn-batch-1ms @{PACED_RATE:.0f}/s", 16]["p99_ms"],
        "p99_paced_c16_bare_ms": get["small", f"bare-aiohttp @{PACED_RATE:.0f}/s", 16]["p99_ms"],
        "p99_bound_ms": (2 * QUEUE_DELAY + full_batch) * 1e3,
        "errors": sum(r["errors"] for r in rows),
    }
    try:
        from _serving_export import rows as export_rows  # S1's export and cold-start figures

        summary["export"] = export_rows(quick)
    except ImportError:
        pass
    return summary


def generate_section(quick: bool) -> dict:
    """The generation benchmark (benchmarks/_serving_generate.py): prints its rows, table and
    goals, returns the summary (or why it was skipped)."""
    from cairn import serving

    if not hasattr(serving, "export_generator"):
        print("generate: skipped (this cairn.serving has no export_generator)")
        return {"skipped": "cairn.serving has no export_generator"}
    import _serving_generate as gen

    print(f"generate: {gen.WORKLOAD}; load average {os.getloadavg()[0]:.2f}", flush=True)
    rows, summary = gen.measure(quick)
    print(gen.table(rows))
    print(gen.goals_text(summary))
    return summary


def openai_section(quick: bool) -> dict:
    """Issue 27's engine goals in one run (module docstring): prints a table, returns the figures."""
    import _serving_paged as paged
    import serving_openai

    print(f"openai: load average {os.getloadavg()[0]:.2f}", flush=True)
    out: dict[str, Any] = {"load_average_start": round(os.getloadavg()[0], 2)}
    out["prefix"] = paged.prefix_ttft(quick)
    out["capacity"] = paged.capacity(quick)
    rows = serving_openai.measure(quick)
    by = {(r["route"], r["c"]): r for r in rows}
    out["openai_over_generate_tok_s_c16"] = by["openai", 16]["tok_s"] / by["generate", 16]["tok_s"]
    out["generate"] = generate_section(quick)
    goals = [
        ("TTFT, 512-token shared prompt: caching off / on", out["prefix"]["ttft_off_over_on"], 5.0),
        ("concurrent sequences at 4096: paged / contiguous", out["capacity"]["paged_over_contiguous"], 3.0),
        ("tok/s at c=16: /v1/chat/completions / /generate_stream", out["openai_over_generate_tok_s_c16"], 0.95),
        ("tok/s at c=64: continuous / static", out["generate"]["continuous_vs_static_c64"], 3.0),
    ]
    print("| goal | measured | target | |\n|---|--:|--:|---|")
    for name, got, target in goals:
        print(f"| {name} | {got:.2f} | >= {target:g} | {'met' if got >= target else 'MISSED'} |")
    out["goals_met"] = {name: got >= target for name, got, target in goals}
    out["load_average_end"] = round(os.getloadavg()[0], 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one round of short points instead of several longer ones")
    p.add_argument("--section", choices=("all", "infer", "generate", "openai"), default="all",
                   help="run only the infer or the generate benchmark, or the OpenAI / paged-cache goals")
    p.add_argument("--loadgen", nargs=5, metavar=("PORT", "PAYLOAD", "C", "SECONDS", "RATE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.loadgen:
        port, payload, c, seconds, rate = args.loadgen
        with open(payload, "rb") as f:
            data = f.read()
        print(json.dumps(asyncio.run(_loadgen("127.0.0.1", int(port), data, int(c), float(seconds), WARMUP, float(rate)))))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    summary: dict[str, Any] = {"bench": "serving"}
    if args.section in ("all", "infer"):
        summary.update(infer_section(args.quick))
    if args.section in ("all", "generate"):
        summary["generate"] = generate_section(args.quick)
    if args.section == "openai":
        summary["openai"] = openai_section(args.quick)
    summary["load_average"] = round(os.getloadavg()[0], 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
