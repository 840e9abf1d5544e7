"""Export the trained model's variants through cairn.serving and serve them with the CLI.

``export_repository`` writes a model repository under ``<run.dir>/serving``:

- ``lm_<variant>/1``: a generator written by ``cairn.llm.export_for_serving``: the prefill and
  decode of the trained ``CausalLM`` itself (``QArray`` weights of lm_quant's ``w8`` /
  ``w4_*`` kept quantized, int4 packed), weights as arguments, symbolic batch, and the task's
  tokenizer inside the model directory so the server answers text;
  ``lm_<variant>/config.json`` sets the continuous batcher's slots;
- ``lm_<variant>_next_token/1``: a plain batchable model (next-token logits and argmax of
  right-padded rows) for the Open Inference Protocol's ``/infer`` (tritonclient).

``ServerProcess`` starts ``cairn-serve`` on a free loopback port in a subprocess and stops it
with SIGTERM (always, also on errors); ``load_test`` sends every held-out problem to
``/generate_stream`` from ``c`` client threads and measures tokens/s, time to first token and
latency; ``generate_all`` collects the answers of plain ``/generate`` calls.
"""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import lm_generate
import lm_quant
import lm_task
import numpy as np

from cairn import llm, serving
from cairn.core_array import ArraySpec


def model_name(variant: str) -> str:
    return f"lm_{variant}"


def export_generator(variant: lm_quant.Variant, max_length: int, repo: pathlib.Path, *, num_slots: int,
                     prefill_batch: int, tokenizer: llm.Tokenizer | None = None, block_size: int | None = None) -> str:
    """Export ``variant`` with ``cairn.llm.export_for_serving`` into ``repo/lm_<name>/1`` (the
    run's ``tokenizer`` with its chat template inside it; default the byte tokenizer), and
    write ``repo/lm_<name>/config.json`` with the engine's slots; ``block_size``: the paged
    KV layout (a pool of blocks, prefix caching) with blocks of that many tokens."""
    name = model_name(variant.name)
    path = llm.export_for_serving(variant.model, tokenizer or lm_generate.tokenizer(), repo, name,
                                  max_length=max_length, eos_token_ids=(lm_task.EOS,), overwrite=True,
                                  block_size=block_size)
    gen: dict[str, Any] = {"num_slots": num_slots, "prefill_batch": prefill_batch}
    if block_size:
        gen.update(kv_layout="paged", prefill_chunk=max_length)
    config = {"generation": gen}
    (repo / name / "config.json").write_text(json.dumps(config, indent=2))
    return path


def export_next_token(variant: lm_quant.Variant, max_length: int, repo: pathlib.Path) -> str:
    """Export the plain ``/infer`` model: ``tokens (b, max_length)``, ``lengths (b,)`` -> ``logits``, ``next_token``."""
    fns = llm.serving_functions(variant.model, max_length)

    def next_token(params: Any, inputs: dict[str, Any]) -> dict[str, Any]:
        logits, _ = fns.prefill(params, inputs["tokens"], inputs["lengths"])
        return {"logits": logits, "next_token": jnp.argmax(logits, axis=-1).astype(jnp.int32)}

    specs = {"tokens": ArraySpec(("b", max_length), "int32"), "lengths": ArraySpec(("b",), "int32")}
    return serving.export(next_token, fns.params, specs, repo / f"{model_name(variant.name)}_next_token" / "1",
                          max_batch_size=8, batch_buckets=(8,), overwrite=True)  # one shape: quick to start


def export_repository(variants: dict[str, lm_quant.Variant], names: Sequence[str], max_length: int,
                      repo: pathlib.Path, *, num_slots: int, prefill_batch: int, tokenizer: llm.Tokenizer | None = None,
                      block_size: int | None = None) -> dict[str, Any]:
    """Export every variant in ``names`` (generator + next-token model) into a fresh ``repo``; sizes and timing."""
    t0 = time.perf_counter()
    if repo.exists():  # this run's models only: an earlier run's would be served (and loaded) too
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    out: dict[str, Any] = {"repository": str(repo), "models": {}}
    for name in names:
        gen_path = export_generator(variants[name], max_length, repo, num_slots=num_slots, prefill_batch=prefill_batch,
                                    tokenizer=tokenizer, block_size=block_size)
        infer_path = export_next_token(variants[name], max_length, repo)
        out["models"][name] = {"generator": model_name(name), "next_token": f"{model_name(name)}_next_token",
                               "bytes": _dir_bytes(gen_path), "path": gen_path, "next_token_path": infer_path}
    out["export_s"] = time.perf_counter() - t0
    return out


def _dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())


# --- the server process ---


class ServerProcess:
    """``cairn-serve --model-repository REPO --port 0`` in a subprocess; a context manager."""

    def __init__(self, repo: pathlib.Path, *, timeout: float = 180.0) -> None:
        self.repo, self.timeout = repo, timeout
        # the slots and prefill batch come from each model's config.json
        self.cmd = [sys.executable, "-m", "cairn.serving._cli", "--model-repository", str(repo), "--host", "127.0.0.1",
                    "--port", "0"]
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.log: list[str] = []
        self._ready = threading.Event()
        self.startup_s = float("nan")

    def __enter__(self) -> ServerProcess:
        t0 = time.perf_counter()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        threading.Thread(target=self._drain, daemon=True).start()
        try:
            if not self._ready.wait(self.timeout) or self.port is None:
                raise RuntimeError(f"cairn-serve did not report 'serving on' within {self.timeout:.0f} s; "
                                   f"last log lines: {self.log[-5:]}")
            self._wait_models_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            del self.log[:-200]
            if self.port is None and "serving on http://" in line:
                self.port = int(line.split("serving on http://", 1)[1].split(":")[1].split('"')[0].split("/")[0])
                self._ready.set()
        self._ready.set()  # exited: wake the waiter

    def _wait_models_ready(self, t0: float) -> None:
        while True:
            status, _ = self.request("GET", "/v2/health/ready")
            if status == 200:
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"cairn-serve exited with {self.proc.returncode}; last log lines: {self.log[-5:]}")
            if time.perf_counter() - t0 > self.timeout:
                raise RuntimeError(f"cairn-serve not ready within {self.timeout:.0f} s; last log lines: {self.log[-5:]}")
            time.sleep(0.2)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One JSON request on a fresh connection: ``(status, decoded JSON or text)``."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except OSError:
            return 0, None
        finally:
            conn.close()
        try:
            return resp.status, json.loads(data) if data else None
        except ValueError:
            return resp.status, data.decode(errors="replace")

    def stop(self) -> int | None:
        """SIGTERM, wait (SIGKILL after 30 s); the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __exit__(self, *_: object) -> None:
        self.stop()


# --- clients ---


def _post(conn: http.client.HTTPConnection, path: str, body: dict) -> http.client.HTTPResponse:
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn.getresponse()


def stream_one(conn: http.client.HTTPConnection, model: str, prompt: Sequence[int], max_new_tokens: int) -> dict[str, Any]:
    """One ``/generate_stream`` request: its token ids, time to first token and latency (seconds)."""
    t0 = time.perf_counter()
    resp = _post(conn, f"/v2/models/{model}/generate_stream",
                 {"input_ids": list(prompt), "parameters": {"max_tokens": max_new_tokens}})
    if resp.status != 200:
        raise RuntimeError(f"/generate_stream answered {resp.status}: {resp.read()[:300]!r}")
    ids: list[int] = []
    ttft = float("nan")
    finish = None
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data:"):
            continue
        event = json.loads(line[5:])
        if event.get("output_ids"):
            if not ids:
                ttft = time.perf_counter() - t0
            ids.extend(int(t) for t in event["output_ids"])
        if event.get("finish_reason"):
            finish = event["finish_reason"]
    resp.read()
    return {"ids": ids, "ttft": ttft, "latency": time.perf_counter() - t0, "finish_reason": finish}


def generate_one(conn: http.client.HTTPConnection, model: str, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """One plain ``/generate`` request: the generated token ids."""
    resp = _post(conn, f"/v2/models/{model}/generate", {"input_ids": list(prompt), "parameters": {"max_tokens": max_new_tokens}})
    body = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"/generate answered {resp.status}: {body[:300]!r}")
    return [int(t) for t in json.loads(body)["output_ids"]]


def _run_clients(port: int, concurrency: int, n: int, work: Any) -> tuple[list[Any], float]:
    """``work(conn, i)`` for i in range(n) from ``concurrency`` threads (one keep-alive connection each)."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []
    counter = iter(range(n))
    lock = threading.Lock()

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            while not errors:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                results[i] = work(conn, i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
        finally:
            conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(min(concurrency, n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, time.perf_counter() - t0


def _answers(ids_list: Sequence[Sequence[int]], codec: Any = None) -> list[str]:
    return lm_generate.answers_text([[t for t in ids if t != lm_task.EOS] for ids in ids_list], codec)


def load_test(port: int, model: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, concurrency: int,
              codec: Any = None) -> dict[str, Any]:
    """Every prompt through ``/generate_stream`` from ``concurrency`` clients: throughput, TTFT, latency, answers."""
    results, wall = _run_clients(port, concurrency, len(prompts),
                                 lambda conn, i: stream_one(conn, model, prompts[i], max_new_tokens))
    tokens = sum(len(r["ids"]) for r in results)
    ttft = np.array([r["ttft"] for r in results]) * 1e3
    lat = np.array([r["latency"] for r in results]) * 1e3
    return {
        "concurrency": concurrency, "requests": len(prompts), "tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall, "requests_per_s": len(prompts) / wall,
        "ttft_p50_ms": float(np.nanpercentile(ttft, 50)), "ttft_p99_ms": float(np.nanpercentile(ttft, 99)),
        "latency_p50_ms": float(np.percentile(lat, 50)), "latency_p99_ms": float(np.percentile(lat, 99)),
        # every request's, for the latency plot; and the machine's load while they ran
        "latencies_ms": [round(float(x), 3) for x in lat], "ttfts_ms": [round(float(x), 3) for x in ttft],
        "loadavg": list(os.getloadavg()),
        "answers": _answers([r["ids"] for r in results], codec),
    }


def generate_all(port: int, model: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, concurrency: int,
                 codec: Any = None) -> list[str]:
    """Answers of plain ``/generate`` calls for every prompt."""
    results, _ = _run_clients(port, concurrency, len(prompts),
                              lambda conn, i: generate_one(conn, model, prompts[i], max_new_tokens))
    return _answers(results, codec)


def openai_chat(port: int, model: str, conversations: Sequence[list[dict]], max_tokens: int, concurrency: int, *,
                stream: bool) -> list[str]:
    """Greedy answers of OpenAI chat completions through the official ``openai`` client
    (``stream``: server-sent chunks, joined), ``concurrency`` requests at a time."""
    import concurrent.futures

    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)

    def one(messages: list[dict]) -> str:
        if not stream:
            out = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
            return out.choices[0].message.content or ""
        chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    try:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(one, conversations))
    finally:
        client.close()


def prefix_cache_stats(server: ServerProcess, model: str) -> dict[str, Any]:
    """The engine's prefix-cache counters from ``/v2/models/{model}/stats`` (paged layout; empty otherwise)."""
    _, body = server.request("GET", f"/v2/models/{model}/stats")
    stack = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "prefix_cache_hit_rate" in node:
                return {k: node[k] for k in ("prefix_cache_hit_rate", "prefix_cache_hit_tokens",
                                             "prefix_cache_query_tokens", "kv_layout", "block_size") if k in node}
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return {}


def infer_next_token(port: int, model: str, prompts: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, str]:
    """Greedy next tokens of ``prompts`` from the ``/infer`` model; (tokens, the client used).

    Through tritonclient's HTTP client when it is installed (the test environment has it),
    else a plain Open Inference Protocol JSON request.
    """
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    try:
        import tritonclient.http as httpclient
    except ImportError:
        return _infer_json(port, model, tokens, lengths), "json"
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        inputs = [httpclient.InferInput("tokens", list(tokens.shape), "INT32"),
                  httpclient.InferInput("lengths", list(lengths.shape), "INT32")]
        inputs[0].set_data_from_numpy(tokens)
        inputs[1].set_data_from_numpy(lengths)
        result = client.infer(model, inputs, outputs=[httpclient.InferRequestedOutput("next_token")])
        return np.asarray(result.as_numpy("next_token")), "tritonclient"
    finally:
        client.close()


def _infer_json(port: int, model: str, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    body = {"inputs": [{"name": "tokens", "shape": list(tokens.shape), "datatype": "INT32", "data": tokens.ravel().tolist()},
                       {"name": "lengths", "shape": list(lengths.shape), "datatype": "INT32", "data": lengths.tolist()}],
            "outputs": [{"name": "next_token"}]}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        resp = _post(conn, f"/v2/models/{model}/infer", body)
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"/infer answered {resp.status}: {data[:300]!r}")
    finally:
        conn.close()
    out = {o["name"]: o for o in json.loads(data)["outputs"]}["next_token"]
    return np.asarray(out["data"], np.int32).reshape(out["shape"])
