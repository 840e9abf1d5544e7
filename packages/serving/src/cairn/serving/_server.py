"""The inference server: Open Inference Protocol v2 routes over :mod:`cairn.serving._http`.

Everything that touches the live model table runs on one asyncio event loop (in a
background thread for :func:`serve`, in the main thread for the CLI); models run on a
worker pool shared by every model's :class:`~cairn.serving._batcher.DynamicBatcher`;
loading (which compiles) runs on its own thread so serving goes on meanwhile. A request
is routed and queued in one step on the loop, so a hot reload (a new version swapped
in, the old one drained) neither drops nor fails a request.

A generative model (a :class:`~cairn.serving._generate.GenerativeModel`, e.g. what
``load`` returns for a directory written by ``export_generator``) gets a
:class:`~cairn.serving._generate.GenerationEngine` (its own decode-loop thread) instead of
a batcher, and answers ``/generate`` and ``/generate_stream`` instead of ``/infer``; one
with a tokenizer also answers OpenAI's ``/v1/completions`` and ``/v1/chat/completions``
(:mod:`cairn.serving._openai`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hmac
import importlib.metadata
import itertools
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from cairn.serving._batcher import (
    BatchingConfig,
    DynamicBatcher,
    ModelError,
    QueueFull,
    Unavailable,
)
from cairn.serving._generate import GenerationConfig, GenerationEngine, prompt_bucket
from cairn.serving._genexport import GenerativeModel
from cairn.serving._genhttp import GenerationRelay, ParseTarget, parse_generate
from cairn.serving._http import HttpLimits, HttpServer, Request, Response, StreamResponse
from cairn.serving._http import json_response as _json
from cairn.serving._metrics import Metrics
from cairn.serving._model import batch_dim, validate_inputs
from cairn.serving._offload import OFFLOAD_BYTES, Offloader
from cairn.serving._openai import (
    OpenAIError,
    OpenAIRelay,
    OpenAIRequest,
    choice_seed,
    error_body,
    load_body,
    parse_chat,
    parse_completion,
)
from cairn.serving._protocol import (
    InferRequest,
    ProtocolError,
    decode_request,
    encode_response,
    loads_json,
    oip_datatype,
)
from cairn.serving._repository import ModelConfig, ModelRepository, ModelSet

access_log = logging.getLogger("cairn.serving.access")
log = logging.getLogger("cairn.serving")

try:
    _VERSION = importlib.metadata.version("cairn-serving")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    _VERSION = "0"

_EXTENSIONS = ["binary_tensor_data", "model_repository", "model_configuration", "statistics", "parameters", "metrics", "generate"]
_OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
_OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models")


class HttpError(Exception):
    """An error answer: HTTP status, reason, extra headers."""

    def __init__(self, status: int, message: str, headers: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


@dataclasses.dataclass
class _Version:
    name: str
    version: int
    model: Any
    batcher: DynamicBatcher | None  # None for a generative model
    config: ModelConfig
    batch_dim: str | None
    labels: tuple[tuple[str, str], ...]
    engine: GenerationEngine | None = None  # a generative model's engine
    loaded: int = dataclasses.field(default_factory=lambda: int(time.time()))  # OpenAI's "created"

    async def close(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Answer what is queued and running (or cancel it: ``drain=False``), then stop."""
        if self.batcher is not None:
            if drain:
                await self.batcher.close()
            else:
                self.batcher._closed = True
        if self.engine is not None:  # stop() joins the engine thread: not on the loop
            await asyncio.get_running_loop().run_in_executor(None, functools.partial(self.engine.stop, drain=drain, timeout=timeout))


def _tensor_meta(name: str, spec: Any, batched: bool) -> dict[str, Any]:
    try:
        datatype = oip_datatype(spec.dtype)
    except ValueError:
        datatype = str(spec.dtype).upper()
    shape = [-1 if isinstance(d, str) else int(d) for d in spec.shape]
    if batched and shape:
        shape[0] = -1
    return {"name": name, "datatype": datatype, "shape": shape}


class App:
    """The server's state and routes (event-loop thread only)."""

    def __init__(self, source: ModelRepository | ModelSet, *, token: str | None, limits: HttpLimits, workers: int) -> None:
        self.source = source
        self.token = token
        self.metrics = Metrics()
        self.live: dict[str, dict[int, _Version]] = {}
        self.status: dict[str, tuple[str, str]] = {}
        self.executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="cairn-serving-worker")
        self.loading = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cairn-serving-load")
        self.offload = Offloader()  # big JSON bodies: parsed and written in worker processes
        self.http = HttpServer(self.handle, self.finished, limits)
        self.ready = False
        self.stopped = asyncio.Event()
        self._locks: dict[str, asyncio.Lock] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(4).hex()

    async def start(self, host: str, port: int) -> int:
        """Load every model the source has (failures are logged and shown in the index), then listen."""
        for name in self.source.names():
            try:
                await self.load_model(name)
            except HttpError as e:
                log.error("model %s: %s", name, e.message)
        bound = await self.http.start(host, port)
        self.ready = True
        return bound

    async def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop listening; with ``drain``, answer in-flight requests first (up to ``timeout`` s)."""
        self.ready = False
        if drain:
            if not await self.http.drain(timeout):
                log.warning("drain timed out with %d requests in flight", self.http.in_flight)
        await self.http.close()
        await asyncio.gather(*(v.close(drain=False) for versions in self.live.values() for v in versions.values()))
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.loading.shutdown(wait=False, cancel_futures=True)
        self.offload.shutdown()
        self.stopped.set()

    # --- model table ---

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def _make_version(self, name: str, version: int, model: Any, config: ModelConfig) -> _Version:
        labels = (("model", name), ("version", str(version)))
        metrics = self.metrics
        if isinstance(model, GenerativeModel):
            engine = GenerationEngine(model, config.generation)
            await asyncio.get_running_loop().run_in_executor(self.loading, engine.start)  # may compile
            return _Version(name, version, model, None, config, None, labels, engine)

        def observe(rows: int, padded: int, compute: float, waits: list[float]) -> None:
            metrics.count.inc(labels, rows)
            metrics.execs.inc(labels)
            metrics.compute_time.observe(labels, compute)
            metrics.batch_size.observe(labels, rows)
            metrics.padded_size.observe(labels, padded)
            for w in waits:
                metrics.queue_time.observe(labels, w)

        batcher = DynamicBatcher(model, config.batching, self.executor, observe)
        dim = batch_dim(model.inputs) if batcher.batchable else None
        return _Version(name, version, model, batcher, config, dim, labels)

    async def load_model(self, name: str) -> None:
        """(Re)load ``name`` from the source per its version policy; new versions are swapped
        in once loaded, versions the policy no longer selects drain in the background.

        Raises:
          HttpError: 404 unknown model; 400 a bad config or a version that failed to load.
        """
        async with self._lock(name):
            try:
                available = self.source.versions(name)
                config = self.source.config(name)
            except KeyError as e:
                raise HttpError(404, str(e.args[0])) from None
            except ValueError as e:
                self.status[name] = ("UNAVAILABLE", str(e))
                raise HttpError(400, f"failed to load '{name}': {e}") from None
            wanted = config.version_policy.select(available)
            if not wanted:
                reason = f"no version of '{name}' matches its version policy {config.version_policy.to_json()} (available: {available})"
                self.status.setdefault(name, ("UNAVAILABLE", reason))
                raise HttpError(400, reason)
            current = self.live.get(name, {})
            fresh, failures = {v: current[v] for v in wanted if v in current}, []
            for v in wanted:
                if v in fresh:
                    continue
                loop = asyncio.get_running_loop()
                try:
                    model = await loop.run_in_executor(self.loading, self.source.load, name, v)
                    fresh[v] = await self._make_version(name, v, model, config)
                except Exception as e:  # noqa: BLE001 - reported per version
                    failures.append(f"version {v}: {type(e).__name__}: {e}")
            if fresh:
                self.live[name] = fresh  # the swap: one assignment on the loop thread
                self.status[name] = ("READY", "")
                for v, old in current.items():
                    if v not in fresh:
                        self._retire(old)
            if failures:
                reason = f"failed to load '{name}': {'; '.join(failures)}"
                if not fresh:
                    self.status[name] = ("UNAVAILABLE", reason)
                raise HttpError(400, reason)

    def _retire(self, version: _Version) -> None:
        task = asyncio.get_running_loop().create_task(version.close())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def unload_model(self, name: str) -> None:
        """Stop routing to ``name`` and wait for its queued requests to be answered.

        Raises:
          HttpError: 404 when the model is neither loaded nor in the source.
        """
        async with self._lock(name):
            current = self.live.pop(name, None)
            if current is None and name not in self.source.names():
                raise HttpError(404, f"model '{name}' is not in the repository")
            self.status[name] = ("UNAVAILABLE", "unloaded")
            await asyncio.gather(*(v.close() for v in (current or {}).values()))

    def resolve(self, name: str, version: str | None) -> _Version:
        """The version a request names (the newest loaded one when None).

        Raises:
          HttpError: 404 for an unknown model or version.
        """
        versions = self.live.get(name)
        if not versions:
            known = name in self.status
            raise HttpError(404, f"model '{name}' is {'not loaded' if known else 'unknown'}; loaded models: {sorted(self.live)}")
        if version is None:
            return versions[max(versions)]
        if not version.isdigit() or int(version) not in versions:
            raise HttpError(404, f"model '{name}' has no loaded version '{version}' (loaded: {sorted(versions)})")
        return versions[int(version)]

    # --- routing ---

    def handle(self, req: Request) -> Response | StreamResponse | asyncio.Future[Any]:
        """Route one request (see the Endpoints section of docs/serving.md)."""
        rid = req.headers.get("x-request-id", "")
        if not rid or len(rid) > 200 or not rid.isprintable():
            rid = f"{self._id_prefix}-{next(self._ids)}"
        headers = [("X-Request-Id", rid)]
        openai = req.path.startswith("/v1/")
        try:
            if self.token is not None and req.path not in _OPEN_PATHS:
                self._authorize(req)
            result = self.openai_route(req, headers) if openai else self._route(req, headers)
        except OpenAIError as e:
            return _json(e.status, error_body(e.status, e.message, e.param, e.code), headers + e.headers)
        except HttpError as e:
            if openai:
                code = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}.get(e.status)
                return _json(e.status, error_body(e.status, e.message, None, code), headers + e.headers)
            return _json(e.status, {"error": e.message}, headers + e.headers)
        except ProtocolError as e:
            return _json(e.status, error_body(e.status, e.message) if openai else {"error": e.message}, headers)
        return result

    def _authorize(self, req: Request) -> None:
        got = req.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
            raise HttpError(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')", [("WWW-Authenticate", "Bearer")])

    def _route(self, req: Request, headers: list[tuple[str, str]]) -> Response | StreamResponse | asyncio.Future[Any]:
        path, method = req.path, req.method
        if path in ("/v2/models", "/v2/models/"):  # the index by GET (Triton has only POST /v2/repository/index)
            _method(method, "GET")
            return _json(200, self.index(_query_flag(req.query, "ready")), headers)
        if path.startswith("/v2/models/"):
            return self._model_route(req, headers)
        if path == "/v2/health/live":
            _method(method, "GET")
            return _json(200, {"live": True}, headers)
        if path == "/v2/health/ready":
            _method(method, "GET")
            ready = self.ready and not self.http.draining
            return _json(200 if ready else 503, {"ready": ready}, headers)
        if path in ("/v2", "/v2/"):
            _method(method, "GET")
            return _json(200, {"name": "cairn-serving", "version": _VERSION, "extensions": _EXTENSIONS}, headers)
        if path == "/metrics":
            _method(method, "GET")
            return Response(200, self.render_metrics(), "text/plain; version=0.0.4; charset=utf-8", headers)
        if path == "/v2/repository/index":
            _method(method, "POST")
            return _json(200, self.index(_ready_only(req.body)), headers)
        parts = path.split("/")
        if len(parts) == 6 and parts[:4] == ["", "v2", "repository", "models"] and parts[5] in ("load", "unload"):
            _method(method, "POST")
            name = unquote(parts[4])
            op = self.load_model(name) if parts[5] == "load" else self.unload_model(name)
            return asyncio.ensure_future(_admin(op, headers))
        raise HttpError(404, f"no route for {method} {path[:200]}")

    def _model_route(self, req: Request, headers: list[tuple[str, str]]) -> Response | StreamResponse | asyncio.Future[Any]:
        parts = req.path.split("/")[3:]
        name, rest, version = unquote(parts[0]), parts[1:], None
        if len(rest) >= 2 and rest[0] == "versions":
            version, rest = rest[1], rest[2:]
        action = rest[0] if len(rest) == 1 else ("" if not rest else None)
        if action == "infer":
            _method(req.method, "POST")
            return self.infer(req, name, version, headers)
        if action in ("generate", "generate_stream"):
            _method(req.method, "POST")
            return self.generate(req, name, version, headers, stream=action == "generate_stream")
        if action == "ready":
            _method(req.method, "GET")
            try:
                self.resolve(name, version)
            except HttpError as e:
                return _json(400, {"name": name, "ready": False, "error": e.message}, headers)
            return _json(200, {"name": name, "ready": True}, headers)
        if action in ("", "config"):
            _method(req.method, "GET")
            if name == "stats" and action == "" and version is None and "stats" not in self.live:
                return _json(200, {"model_stats": self.statistics(None, None)}, headers)  # Triton's /v2/models/stats
            live = self.resolve(name, version)
            meta = self.metadata(live) if action == "" else self.model_config(live)
            return _json(200, meta, headers)
        if action == "stats":
            _method(req.method, "GET")
            self.resolve(name, version)
            return _json(200, {"model_stats": self.statistics(name, version)}, headers)
        raise HttpError(404, f"no route for {req.method} {req.path[:200]}")

    # --- the OpenAI API ---

    def openai_route(self, req: Request, headers: list[tuple[str, str]]) -> Response | StreamResponse | asyncio.Future[Any]:
        """``/v1/models``, ``/v1/models/{id}``, ``/v1/completions``, ``/v1/chat/completions``."""
        path = req.path.rstrip("/")
        if path == "/v1/models":
            _method(req.method, "GET")
            cards = [self._model_card(v[max(v)]) for _, v in sorted(self.live.items()) if self._speaks_openai(v[max(v)])]
            return _json(200, {"object": "list", "data": cards}, headers)
        if path.startswith("/v1/models/"):
            _method(req.method, "GET")
            return _json(200, self._model_card(self._openai_model(unquote(path[len("/v1/models/"):]))), headers)
        if path in ("/v1/chat/completions", "/v1/completions"):
            _method(req.method, "POST")
            return self.openai_generate(req, headers, chat=path == "/v1/chat/completions")
        raise OpenAIError(404, f"no route for {req.method} {req.path[:200]} (the OpenAI routes: /v1/models, "
                          "/v1/completions, /v1/chat/completions)", code="not_found")

    @staticmethod
    def _speaks_openai(live: _Version) -> bool:
        return live.engine is not None and getattr(live.model, "tokenizer", None) is not None

    def _model_card(self, live: _Version) -> dict[str, Any]:
        return {"id": live.name, "object": "model", "created": live.loaded, "owned_by": "cairn",
                "max_model_len": int(live.model.max_length)}

    def _openai_model(self, name: Any) -> _Version:
        """The newest loaded version of ``name``, if it has a tokenizer (OpenAIError otherwise)."""
        if not isinstance(name, str) or not name:
            raise OpenAIError(400, f"model must name a served model (GET /v1/models lists them), got {name!r}", "model",
                              "invalid_value")
        versions = self.live.get(name)
        if not versions:
            raise OpenAIError(404, f"The model `{name}` does not exist (served: "
                              f"{sorted(n for n, v in self.live.items() if self._speaks_openai(v[max(v)]))})",
                              "model", "model_not_found")
        live = versions[max(versions)]
        if not self._speaks_openai(live):
            what = "is not a generative model" if live.engine is None else "has no tokenizer (export it with tokenizer=...)"
            raise OpenAIError(400, f"model '{name}' {what}; the OpenAI routes need a generative model with a tokenizer",
                              "model", "model_not_supported")
        return live

    def openai_generate(self, req: Request, headers: list[tuple[str, str]], chat: bool) -> StreamResponse | asyncio.Future[Any]:
        """Parse, validate and submit one OpenAI request (``n`` engine requests per prompt). A
        body over 1 MiB is parsed, and its chat template rendered, on the worker pool."""
        if len(req.body) > OFFLOAD_BYTES:
            return asyncio.ensure_future(self._openai_offloaded(req, headers, chat))
        obj = load_body(req.body)
        live = self._openai_model(obj.get("model"))
        try:
            request = (parse_chat if chat else parse_completion)(obj, live.model.tokenizer)
        except OpenAIError:
            self.metrics.gen_failure.inc((*live.labels, ("reason", "bad_request")))
            raise
        return self._openai_parsed(req, live, request, headers)

    async def _openai_offloaded(self, req: Request, headers: list[tuple[str, str]], chat: bool) -> Response | StreamResponse:
        loop = asyncio.get_running_loop()
        try:
            obj = await loop.run_in_executor(self.executor, load_body, req.body)
            live = self._openai_model(obj.get("model"))
            parse = parse_chat if chat else parse_completion
            request = await loop.run_in_executor(self.executor, parse, obj, live.model.tokenizer)
            live = self._openai_model(request.model)  # again: a reload may have swapped versions meanwhile
            answer = self._openai_parsed(req, live, request, headers)
        except OpenAIError as e:
            return _json(e.status, error_body(e.status, e.message, e.param, e.code), headers + e.headers)
        return answer if isinstance(answer, StreamResponse) else await answer

    def _openai_parsed(self, req: Request, live: _Version, request: OpenAIRequest,
                       headers: list[tuple[str, str]]) -> StreamResponse | asyncio.Future[Any]:
        limits = self._max_tokens(live, request)
        if request.echo and request.logprobs is not None:
            if not live.model.has_score:
                raise OpenAIError(400, f"echo with logprobs needs the prompt's log-probabilities, and model '{live.name}' "
                                  "was exported without a score function (export_generator(..., score=...))", "echo",
                                  "unsupported_parameter")
            return asyncio.ensure_future(self._openai_scored(req, live, request, limits, headers))
        return self._openai_submit(req, live, request, limits, headers, None)

    def _max_tokens(self, live: _Version, request: OpenAIRequest) -> list[int]:
        """Per prompt, the tokens each choice may generate (OpenAIError when the prompt does not fit)."""
        m, cfg, out = live.model, live.config.generation, []
        param = "messages" if request.kind == "chat" else "prompt"
        for ids in request.prompts:
            room = m.max_length - len(ids)
            if room < 1:
                raise OpenAIError(400, f"the prompt is {len(ids)} tokens, more than model '{live.name}' takes: its context "
                                  f"is {m.max_length} tokens (prompt and completion together)", param, "context_length_exceeded")
            k = request.max_tokens
            if k is None:
                k = room if request.kind == "chat" else min(16, room)
                k = min(k, cfg.max_new_tokens_limit or k)
            out.append(k)
        return out

    async def _openai_scored(self, req: Request, live: _Version, request: OpenAIRequest, limits: list[int],
                             headers: list[tuple[str, str]]) -> Response | StreamResponse:
        """Score the prompts on the worker pool (echo + logprobs), then submit."""
        loop = asyncio.get_running_loop()
        try:
            scores = await loop.run_in_executor(self.executor, _score_prompts, live.model, request.prompts)
            answer = self._openai_submit(req, live, request, limits, headers, scores)
        except OpenAIError as e:
            return _json(e.status, error_body(e.status, e.message, e.param, e.code), headers + e.headers)
        except Exception as e:  # noqa: BLE001 - the model failed on this prompt
            return _json(500, error_body(500, f"model '{live.name}' failed to score the prompt: {type(e).__name__}: {e}"), headers)
        return answer if isinstance(answer, StreamResponse) else await answer

    def _openai_submit(self, req: Request, live: _Version, request: OpenAIRequest, limits: list[int],
                       headers: list[tuple[str, str]], scores: list[list[float]] | None) -> StreamResponse | asyncio.Future[Response]:
        assert live.engine is not None
        relay = OpenAIRelay(asyncio.get_running_loop(), request, live.model.tokenizer, live.name, headers,
                            self._gen_done(live, req.started), scores, req.started)
        if request.max_tokens == 0:  # echo only: the prompt scored, nothing generated
            relay.scored_only()
            return relay.future
        try:
            for p, (ids, k) in enumerate(zip(request.prompts, limits)):
                for j in range(request.n):
                    params = dataclasses.replace(request.params, max_new_tokens=k, seed=choice_seed(request.params.seed, j))
                    relay.cancels.append(live.engine.submit(ids, params, relay.on_event(p * request.n + j)).cancel)
        except QueueFull as e:
            relay.cancel()
            self.metrics.gen_failure.inc((*live.labels, ("reason", "queue_full")))
            raise OpenAIError(429, f"model '{live.name}' is overloaded: {e}", code="rate_limit_exceeded",
                              headers=[("Retry-After", str(getattr(e, "retry_after", 1)))]) from None
        except Unavailable as e:
            relay.cancel()
            raise OpenAIError(503, f"model '{live.name}' is not taking requests: {e}", headers=[("Retry-After", "1")]) from None
        except ValueError as e:
            relay.cancel()
            self.metrics.gen_failure.inc((*live.labels, ("reason", "bad_request")))
            raise OpenAIError(400, str(e), "max_tokens" if "max_new_tokens" in str(e) else None, "invalid_value") from None
        self.metrics.gen_prompt_tokens.inc(live.labels, sum(len(ids) for ids in request.prompts) * request.n)
        req.on_disconnect = relay.cancel  # a client gone mid-generation frees its slots
        if request.stream:
            return StreamResponse(relay.attach, headers=headers)
        return relay.future

    # --- endpoints ---

    def metadata(self, live: _Version) -> dict[str, Any]:
        """OIP model metadata (a symbolic or batch dimension is -1)."""
        m, batched = live.model, live.batch_dim is not None
        if live.engine is not None:
            return _generator_metadata(live, [str(v) for v in sorted(self.live.get(live.name, {}))])
        return {
            "name": live.name,
            "versions": [str(v) for v in sorted(self.live.get(live.name, {}))],
            "platform": getattr(m, "platform", "jax"),
            "inputs": [_tensor_meta(k, s, batched) for k, s in m.inputs.items()],
            "outputs": [_tensor_meta(k, s, batched) for k, s in m.outputs.items()],
        }

    def model_config(self, live: _Version) -> dict[str, Any]:
        """A Triton-style model configuration (dims without the batch axis when batched)."""
        b, cfg = live.batcher, live.config.batching
        if b is None:
            return _generator_config(live, self.metadata(live))

        def dims(meta: dict[str, Any]) -> dict[str, Any]:
            shape = meta["shape"][1:] if b.batchable else meta["shape"]
            return {"name": meta["name"], "data_type": "TYPE_" + meta["datatype"], "dims": shape}

        meta = self.metadata(live)
        return {
            "name": live.name,
            "platform": meta["platform"],
            "max_batch_size": b.max_batch_size if b.batchable else 0,
            "input": [dims(t) for t in meta["inputs"]],
            "output": [dims(t) for t in meta["outputs"]],
            "version_policy": live.config.version_policy.to_json(),
            "dynamic_batching": {
                "enabled": b.batchable,
                "batch_buckets": list(b.buckets),
                "max_queue_delay_microseconds": int(cfg.max_queue_delay * 1e6),
                "max_queue_size": cfg.max_queue_size,
                "max_concurrent_batches": cfg.max_concurrent_batches,
            },
        }

    def statistics(self, name: str | None, version: str | None) -> list[dict[str, Any]]:
        """Triton's statistics extension (what ``get_inference_statistics`` and perf_analyzer
        read), from the metrics: counts and total nanoseconds per phase."""
        m, out = self.metrics, []
        for model, versions in sorted(self.live.items()):
            for v, live in sorted(versions.items()):
                if (name is not None and model != name) or (version is not None and str(v) != version):
                    continue
                labels = live.labels
                phase = functools.partial(_phase, labels=labels)
                if live.engine is not None:
                    out.append(_generator_stats(m, live))
                    continue
                failures = sum(c for k, c in m.failure.values.items() if k[:2] == labels)
                out.append({
                    "name": model,
                    "version": str(v),
                    "inference_count": int(m.count.values.get(labels, 0)),
                    "execution_count": int(m.execs.values.get(labels, 0)),
                    "inference_stats": {
                        "success": phase(m.request_time),
                        "fail": {"count": int(failures), "ns": 0},
                        "queue": phase(m.queue_time),
                        "compute_infer": phase(m.compute_time),
                    },
                })
        return out

    def index(self, ready_only: bool) -> list[dict[str, Any]]:
        """The repository index: one row per loaded version, one per model not loaded."""
        rows: list[dict[str, Any]] = []
        for name in sorted(set(self.source.names()) | set(self.live) | set(self.status)):
            versions = self.live.get(name)
            if versions:
                rows.extend({"name": name, "version": str(v), "state": "READY", "reason": ""} for v in sorted(versions))
            elif not ready_only:
                state, reason = self.status.get(name, ("UNAVAILABLE", "not loaded"))
                rows.append({"name": name, "state": state, "reason": reason})
        return rows

    def render_metrics(self) -> bytes:
        """The /metrics body (queue sizes sampled now)."""
        m = self.metrics
        for gauge in (m.queue_size, m.gen_queue, m.gen_active, m.prefix_queries, m.prefix_hits, m.kv_usage,
                      m.preemptions):
            gauge.values.clear()  # (the prefix-cache and preemption counters are the engines' own running totals)
        for versions in self.live.values():
            for v in versions.values():
                if v.batcher is not None:
                    m.queue_size.set(v.labels, v.batcher.queued)
                if v.engine is not None:
                    stats = v.engine.stats()
                    m.gen_queue.set(v.labels, stats.get("queue", 0))
                    m.gen_active.set(v.labels, stats.get("active_slots", 0))
                    if stats.get("kv_layout") == "paged":
                        m.prefix_queries.values[v.labels] = stats["prefix_cache_query_tokens"]
                        m.prefix_hits.values[v.labels] = stats["prefix_cache_hit_tokens"]
                        m.kv_usage.set(v.labels, stats["kv_cache_usage"])
                        m.preemptions.values[v.labels] = stats["preemptions"]
        return m.render()

    def infer(self, req: Request, name: str, version: str | None, headers: list[tuple[str, str]]) -> asyncio.Future[Response]:
        """Validate, queue, and answer one inference request (a big JSON body is parsed in
        a worker process, so the loop goes on serving meanwhile)."""
        live = self.resolve(name, version)
        if live.batcher is None:
            self.metrics.failure.inc((*live.labels, ("reason", "bad_request")))
            raise HttpError(400, f"model '{name}' is a generative model: use POST /v2/models/{name}/generate (or /generate_stream), not /infer")
        try:
            header_length = _header_length(req)
            if (len(req.body) if header_length is None else header_length) > OFFLOAD_BYTES:
                return asyncio.ensure_future(self._infer_offloaded(req, live, version, header_length, headers))
            decoded = decode_request(req.body, header_length)
        except ProtocolError as e:
            self.metrics.failure.inc((*live.labels, ("reason", "bad_request")))
            raise HttpError(e.status, e.message) from None
        return self._submit(live, decoded, req, headers)

    async def _infer_offloaded(self, req: Request, live: _Version, version: str | None, header_length: int | None, headers: list[tuple[str, str]]) -> Response:
        try:
            decoded = await self.offload.run(decode_request, req.body, header_length)
        except ProtocolError as e:
            self.metrics.failure.inc((*live.labels, ("reason", "bad_request")))
            return _json(e.status, {"error": e.message}, headers)
        try:
            live = self.resolve(live.name, version)  # again: a reload may have swapped versions meanwhile
            return await self._submit(live, decoded, req, headers)
        except HttpError as e:
            return _json(e.status, {"error": e.message}, headers + e.headers)

    def _submit(self, live: _Version, decoded: InferRequest, req: Request, headers: list[tuple[str, str]]) -> asyncio.Future[Response]:
        """Validate decoded inputs against ``live`` and queue them; the future of the answer."""
        assert live.batcher is not None
        try:
            for wanted in decoded.outputs or ():
                if wanted not in live.model.outputs:
                    raise ProtocolError(400, f"requested output '{wanted}' is not an output of model '{live.name}' (outputs: {sorted(live.model.outputs)})")
            arrays, env = validate_inputs(live.model.inputs, decoded.inputs, live.batcher.max_batch_size if live.batch_dim else 0)
        except (ProtocolError, ValueError) as e:
            self.metrics.failure.inc((*live.labels, ("reason", "bad_request")))
            raise HttpError(getattr(e, "status", 400), getattr(e, "message", str(e))) from None
        rows = env[live.batch_dim] if live.batch_dim else 1
        try:
            fut = live.batcher.submit(arrays, rows)
        except QueueFull as e:
            self.metrics.failure.inc((*live.labels, ("reason", "queue_full")))
            raise HttpError(503, f"model '{live.name}' is overloaded: {e}", [("Retry-After", str(e.retry_after))]) from None
        except Unavailable as e:  # pragma: no cover - routing and submit share one loop step
            raise HttpError(503, str(e), [("Retry-After", "1")]) from None
        out: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        answer = dataclasses.replace(decoded, inputs={})  # what encoding needs (not the inputs)
        fut.add_done_callback(functools.partial(self._answer, out, live, answer, headers, req.started))
        return out

    def generate(self, req: Request, name: str, version: str | None, headers: list[tuple[str, str]], stream: bool) -> StreamResponse | asyncio.Future[Any]:
        """Validate and submit one generate request; its answer, or its event stream (a big
        body is parsed, and its text tokenized, in a worker process)."""
        live = self.resolve(name, version)
        if live.engine is None:
            raise HttpError(400, f"model '{name}' is not a generative model: use POST /v2/models/{name}/infer")
        if len(req.body) > OFFLOAD_BYTES:
            return asyncio.ensure_future(self._generate_offloaded(req, live, version, headers, stream))
        try:
            prompt, params = parse_generate(req.body, live.model)
        except ValueError as e:
            self.metrics.gen_failure.inc((*live.labels, ("reason", "bad_request")))
            raise HttpError(400, str(e)) from None
        return self._start_generation(req, live, prompt, params, headers, stream)

    async def _generate_offloaded(self, req: Request, live: _Version, version: str | None, headers: list[tuple[str, str]], stream: bool) -> Response | StreamResponse:
        try:
            prompt, params = await self.offload.run(parse_generate, req.body, ParseTarget.of(live.model))
        except ValueError as e:
            self.metrics.gen_failure.inc((*live.labels, ("reason", "bad_request")))
            return _json(400, {"error": str(e)}, headers)
        try:
            live = self.resolve(live.name, version)  # again: a reload may have swapped versions meanwhile
            if live.engine is None:
                raise HttpError(400, f"model '{live.name}' is not a generative model: use POST /v2/models/{live.name}/infer")
            answer = self._start_generation(req, live, prompt, params, headers, stream)
        except HttpError as e:
            return _json(e.status, {"error": e.message}, headers + e.headers)
        return answer if isinstance(answer, StreamResponse) else await answer

    def _gen_done(self, live: _Version, started: float) -> Any:
        """The callback that records a finished generation request in the metrics."""
        m = self.metrics

        def done(reason: str, tokens: int, ttft: float | None) -> None:
            m.gen_requests.inc((*live.labels, ("finish_reason", reason)))
            m.gen_tokens.inc(live.labels, tokens)
            m.gen_time.observe(live.labels, time.perf_counter() - started)
            if ttft is not None:
                m.gen_ttft.observe(live.labels, ttft)

        return done

    def _start_generation(self, req: Request, live: _Version, prompt: list[int], params: Any, headers: list[tuple[str, str]], stream: bool) -> StreamResponse | asyncio.Future[Response]:
        """Submit a parsed generate request to ``live``'s engine; its answer or event stream."""
        m, name, started = self.metrics, live.name, req.started
        assert live.engine is not None
        done = self._gen_done(live, started)
        base = {"model_name": live.name, "model_version": str(live.version)}
        vocab = None if getattr(live.model, "tokenizer", None) is not None else live.model.vocabulary  # else the engine's text
        relay = GenerationRelay(asyncio.get_running_loop(), base, vocab, len(prompt), stream, done, started, headers)
        try:
            request = live.engine.submit(prompt, params, relay.on_event)
        except QueueFull as e:
            m.gen_failure.inc((*live.labels, ("reason", "queue_full")))
            retry = str(getattr(e, "retry_after", 1))
            raise HttpError(503, f"model '{name}' is overloaded: {e}", [("Retry-After", retry)]) from None
        except Unavailable as e:
            raise HttpError(503, f"model '{name}' is not taking requests: {e}", [("Retry-After", "1")]) from None
        except ValueError as e:
            m.gen_failure.inc((*live.labels, ("reason", "bad_request")))
            raise HttpError(400, str(e)) from None
        m.gen_prompt_tokens.inc(live.labels, len(prompt))
        req.on_disconnect = request.cancel  # a client gone mid-generation frees its slot
        if stream:
            return StreamResponse(relay.attach, headers=headers)
        return relay.future

    def _answer(self, out: asyncio.Future[Response], live: _Version, decoded: InferRequest, headers: list[tuple[str, str]], started: float, fut: asyncio.Future[Any]) -> None:
        if out.done():
            return
        m = self.metrics
        try:
            outputs, _ = fut.result()
        except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - every accepted request is answered
            m.failure.inc((*live.labels, ("reason", "model_error")))
            why = str(e) if isinstance(e, ModelError) else f"{type(e).__name__}: {e}"
            out.set_result(_json(500, {"error": f"model '{live.name}' version {live.version} failed: {why}"}, headers))
            return
        encode = functools.partial(encode_response, live.name, str(live.version), decoded, outputs)
        if _json_bytes(decoded, outputs) > OFFLOAD_BYTES:  # a big JSON answer: written in a worker process
            task = asyncio.ensure_future(self.offload.run(encode))
            task.add_done_callback(functools.partial(self._encoded, out, live, headers, started))
            return
        try:
            encoded = encode()
        except Exception as e:  # noqa: BLE001 - every accepted request is answered
            self._unusable(out, live, headers, e)
            return
        self._send(out, live, headers, started, encoded)

    def _encoded(self, out: asyncio.Future[Response], live: _Version, headers: list[tuple[str, str]], started: float, task: asyncio.Future[Any]) -> None:
        if out.done():
            return
        try:
            encoded = task.result()
        except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - every accepted request is answered
            self._unusable(out, live, headers, e)
            return
        self._send(out, live, headers, started, encoded)

    def _unusable(self, out: asyncio.Future[Response], live: _Version, headers: list[tuple[str, str]], e: BaseException) -> None:
        self.metrics.failure.inc((*live.labels, ("reason", "model_error")))
        out.set_result(_json(500, {"error": f"model '{live.name}' returned unusable outputs: {e}"}, headers))

    def _send(self, out: asyncio.Future[Response], live: _Version, headers: list[tuple[str, str]], started: float, encoded: tuple[bytes, int | None]) -> None:
        body, header_length = encoded
        m = self.metrics
        m.success.inc(live.labels)
        m.request_time.observe(live.labels, time.perf_counter() - started)
        if header_length is None:
            out.set_result(Response(200, body, "application/json", headers))
        else:
            hdrs = [*headers, ("Inference-Header-Content-Length", str(header_length))]
            out.set_result(Response(200, body, "application/octet-stream", hdrs))

    def finished(self, req: Request, response: Response | StreamResponse, nbytes: int) -> None:
        """After each response: the HTTP status counter (and the OpenAI routes') and a JSON access-log line."""
        self.metrics.http.inc((("code", str(response.status)),))
        if req.path.startswith("/v1/"):
            route = next((r for r in _OPENAI_ROUTES if req.path.startswith(r)), "other")
            self.metrics.openai.inc((("route", route), ("code", str(response.status))))
        if access_log.isEnabledFor(logging.INFO):
            rid = next((v for k, v in response.headers if k == "X-Request-Id"), None)
            record = {
                "time": round(time.time(), 6),
                "remote": req.peer,
                "method": req.method,
                "path": req.path,
                "status": response.status,
                "bytes": nbytes,
                "duration_ms": round((time.perf_counter() - req.started) * 1e3, 3),
                "request_id": rid,
            }
            access_log.info(json.dumps(record), extra={"cairn_access": record})


def _score_prompts(model: Any, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt's token log-probabilities (``model.score``, one padded row per prompt)."""
    import numpy as np

    out = []
    for ids in prompts:
        tokens = np.zeros((1, prompt_bucket(len(ids), model.max_length)), np.int32)
        tokens[0, : len(ids)] = ids
        lp = model.score(tokens, np.array([len(ids)], np.int32))
        out.append([float(x) for x in np.asarray(lp)[0, : len(ids)]])
    return out


def _generator_metadata(live: _Version, versions: list[str]) -> dict[str, Any]:
    """A generator's metadata: the generate extension's inputs and outputs."""
    m = live.model
    return {
        "name": live.name,
        "versions": versions,
        "platform": getattr(m, "platform", "jax"),
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}, {"name": "input_ids", "datatype": "INT32", "shape": [-1]}],
        "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [1]}, {"name": "output_ids", "datatype": "INT32", "shape": [-1]}],
        "generation": {
            "vocab_size": int(m.vocab_size),
            "max_length": int(m.max_length),
            "eos_token_ids": [int(t) for t in m.eos_token_ids],
            "has_vocabulary": m.vocabulary is not None,
        },
    }


def _generator_config(live: _Version, meta: dict[str, Any]) -> dict[str, Any]:
    """A generator's Triton-style configuration: its engine settings instead of batching."""

    def tensors(metas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"name": t["name"], "data_type": "TYPE_" + ("STRING" if t["datatype"] == "BYTES" else t["datatype"]), "dims": t["shape"]} for t in metas]

    return {
        "name": live.name,
        "platform": meta["platform"],
        "max_batch_size": 0,
        "input": tensors(meta["inputs"]),
        "output": tensors(meta["outputs"]),
        "version_policy": live.config.version_policy.to_json(),
        "model_transaction_policy": {"decoupled": True},
        "generation": {**live.config.generation.to_json(), **meta["generation"]},
    }


def _generator_stats(m: Metrics, live: _Version) -> dict[str, Any]:
    """A generator's statistics: requests by finish reason, tokens, and the engine's counters."""
    labels = live.labels
    by_reason = {k[2][1]: int(c) for k, c in m.gen_requests.values.items() if k[:2] == labels}
    refused = sum(c for k, c in m.gen_failure.values.items() if k[:2] == labels)
    assert live.engine is not None
    engine = live.engine.stats()  # once: it takes the engine's lock
    return {
        "name": live.name,
        "version": str(live.version),
        "inference_count": sum(by_reason.values()),
        "execution_count": int(engine.get("steps", 0)),
        "inference_stats": {
            "success": _phase(m.gen_time, labels),
            "fail": {"count": int(refused + by_reason.get("error", 0)), "ns": 0},
            "time_to_first_token": _phase(m.gen_ttft, labels),
        },
        "generation_stats": {
            "finish_reasons": by_reason,
            "prompt_tokens": int(m.gen_prompt_tokens.values.get(labels, 0)),
            "output_tokens": int(m.gen_tokens.values.get(labels, 0)),
            "engine": engine,
        },
    }


def _phase(hist: Any, labels: tuple[tuple[str, str], ...]) -> dict[str, int]:
    """A histogram's count and total in nanoseconds (Triton's statistics entries)."""
    row = hist.values.get(labels)
    return {"count": int(sum(row[:-1])) if row else 0, "ns": int((row[-1] if row else 0.0) * 1e9)}


def _method(got: str, want: str) -> None:
    if got != want:
        raise HttpError(405, f"method {got[:20]} not allowed here (use {want})", [("Allow", want)])


def _header_length(req: Request) -> int | None:
    """The ``Inference-Header-Content-Length`` (None: the body is all JSON).

    Raises:
      ProtocolError: (400) not a number, or a ``Content-Encoding`` this server does not read.
    """
    raw = req.headers.get("inference-header-content-length")
    if raw is not None and not raw.isdigit():
        raise ProtocolError(400, f"Inference-Header-Content-Length must be a non-negative integer, got {raw[:30]!r}")
    if req.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
        raise ProtocolError(400, f"Content-Encoding {req.headers['content-encoding'][:30]!r} is not supported")
    return None if raw is None else int(raw)


def _json_bytes(request: InferRequest, outputs: Mapping[str, Any]) -> int:
    """About how large the JSON outputs of an answer are (array bytes, ~3 characters each)."""
    wanted = request.outputs if request.outputs is not None else dict.fromkeys(outputs, request.binary_output)
    return sum(3 * getattr(outputs.get(k), "nbytes", 0) for k, binary in wanted.items() if not binary)


def _query_flag(query: str, name: str) -> bool:
    """Whether the query string sets ``name`` to true (``?ready=true`` or ``?ready=1``)."""
    values = [v for k, _, v in (p.partition("=") for p in query.split("&")) if k == name]
    return bool(values) and values[-1].lower() in ("true", "1")


def _ready_only(body: bytes | memoryview) -> bool:
    if len(body) > OFFLOAD_BYTES:  # parsed on the loop: a few bytes are all it takes
        raise HttpError(400, f"repository index body of {len(body)} bytes: send {{}} or {{\"ready\": true}}")
    body = bytes(body)
    if not body.strip():
        return False
    try:
        obj = loads_json(body, "repository index body")
    except ProtocolError as e:
        raise HttpError(400, f"{e.message} (send {{}} or {{\"ready\": true}})") from None
    return bool(obj.get("ready", False)) if isinstance(obj, dict) else False


async def _admin(op: Any, headers: list[tuple[str, str]]) -> Response:
    try:
        await op
    except HttpError as e:
        return _json(e.status, {"error": e.message}, headers + e.headers)
    return _json(200, {}, headers)


# --- the public server ---


def _as_source(
    models: Any,
    batching: BatchingConfig | Mapping[str, BatchingConfig] | None,
    generation: GenerationConfig | Mapping[str, GenerationConfig] | None = None,
) -> ModelRepository | ModelSet:
    if isinstance(models, ModelRepository | ModelSet):
        return models
    if isinstance(models, str | os.PathLike):
        if isinstance(batching, Mapping) or isinstance(generation, Mapping):
            raise TypeError("per-model batching or generation settings for a repository go in each model's config.json")
        return ModelRepository(Path(models), batching=batching, generation=generation)
    if isinstance(models, Mapping):
        return ModelSet(models, batching, generation)
    if isinstance(models, list | tuple):
        return ModelSet({m.name: m for m in models}, batching, generation)
    if (callable(models) and hasattr(models, "inputs")) or isinstance(models, GenerativeModel):
        return ModelSet({models.name: models}, batching, generation)
    raise TypeError(
        f"serve() takes a repository directory, a ModelRepository, a model, or a dict/list of models; got {type(models).__name__}"
    )


class Server:
    """An inference server (see :func:`serve`); a context manager that stops on exit.

    Args:
      models: what to serve: a repository directory, a :class:`ModelRepository`, a model, or a dict
        or list of models (see :func:`serve`).
      host: the address to bind.
      port: the port; 0 picks a free one.
      token: when given, every route but ``/v2/health/*`` needs ``Authorization: Bearer <token>``.
      batching: :class:`BatchingConfig` for every model, or ``{name: BatchingConfig}``.
      limits: :class:`HttpLimits`; None uses the defaults.
      workers: threads in the pool the models share; None: the CPU count, at least 2.
      drain_timeout: seconds :meth:`stop` waits for in-flight requests.
      poll_interval: re-scan the repository every this many seconds; None never re-scans.
      generation: :class:`GenerationConfig` for every generative model, or ``{name:
        GenerationConfig}``.

    Attributes:
      host, port: where it listens (port is the bound one after start).
      url: ``http://host:port``.
    """

    def __init__(
        self,
        models: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        batching: BatchingConfig | Mapping[str, BatchingConfig] | None = None,
        limits: HttpLimits | None = None,
        workers: int | None = None,
        drain_timeout: float = 30.0,
        poll_interval: float | None = None,
        generation: GenerationConfig | Mapping[str, GenerationConfig] | None = None,
    ) -> None:
        self.source = _as_source(models, batching, generation)
        self.host, self.port = host, port
        self.token = token
        self.limits = limits or HttpLimits()
        self.workers = workers or max(2, os.cpu_count() or 2)
        self.drain_timeout = drain_timeout
        self.poll_interval = poll_interval
        self.app: App | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL (``http://127.0.0.1:PORT``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def _main(self, started: concurrent.futures.Future[None], handle_signals: bool) -> None:
        self._loop = asyncio.get_running_loop()
        self.app = App(self.source, token=self.token, limits=self.limits, workers=self.workers)
        try:
            self.port = await self.app.start(self.host, self.port)
        except BaseException as e:
            await self.app.shutdown(drain=False)
            started.set_exception(e)
            return
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self._shutdown(True)))
        poller = self._loop.create_task(self._poll()) if self.poll_interval else None
        started.set_result(None)
        await self.app.stopped.wait()
        if poller is not None:
            poller.cancel()

    async def _shutdown(self, drain: bool) -> None:
        assert self.app is not None
        if not self.app.stopped.is_set():
            await self.app.shutdown(drain, self.drain_timeout)

    async def _poll(self) -> None:
        """Reload models whose versions on disk changed; load new models; unload removed ones."""
        app = self.app
        assert app is not None and self.poll_interval
        failed: dict[str, tuple] = {}  # a failed load is retried when the directory changes
        while True:
            await asyncio.sleep(self.poll_interval)
            names = set(app.source.names())
            for name in sorted(names):
                fingerprint: tuple = ()
                try:
                    fingerprint = app.source.fingerprint(name)
                    wanted = app.source.config(name).version_policy.select(app.source.versions(name))
                    if set(wanted) == set(app.live.get(name, {})) or app.status.get(name, ("", ""))[1] == "unloaded":
                        continue
                    if failed.get(name) == fingerprint:
                        continue
                    failed.pop(name, None)
                    await app.load_model(name)
                except (HttpError, KeyError, ValueError, OSError) as e:
                    failed[name] = fingerprint
                    log.error("poll: model %s: %s", name, getattr(e, "message", e))
            for name in set(app.live) - names:
                await app.unload_model(name)

    def start(self) -> Server:
        """Start serving in a background thread; return once the port is bound and models are loaded.

        Raises:
          OSError: the address is taken.
        """
        started: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            asyncio.run(self._main(started, handle_signals=False))

        self._thread = threading.Thread(target=run, name="cairn-serving", daemon=True)
        self._thread.start()
        started.result()
        return self

    def run(self) -> None:
        """Serve in this thread until SIGTERM/SIGINT (drains in-flight requests) or :meth:`stop`."""
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        started.add_done_callback(lambda f: None if f.exception() else log.info("serving on %s", self.url))
        asyncio.run(self._main(started, handle_signals=True))
        started.result()

    def _call(self, coro: Any) -> Any:
        if self._loop is None:
            raise RuntimeError("the server is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def load_model(self, name: str) -> None:
        """Load or reload ``name`` (thread-safe; see ``POST /v2/repository/models/{m}/load``).

        Args:
          name: the model's name in the repository.
        """
        assert self.app is not None
        self._call(self.app.load_model(name))

    def unload_model(self, name: str) -> None:
        """Unload ``name`` after its queued requests are answered (thread-safe).

        Args:
          name: the model's name.
        """
        assert self.app is not None
        self._call(self.app.unload_model(name))

    def stop(self, drain: bool = True) -> None:
        """Stop; with ``drain`` answer in-flight requests first. Idempotent.

        Args:
          drain: answer in-flight requests before stopping (up to ``drain_timeout`` seconds).
        """
        if self._loop is None or self._thread is None:
            return
        if self._thread.is_alive():
            try:
                self._call(self._shutdown(drain))
            except RuntimeError:  # the loop already closed
                pass
            self._thread.join(timeout=self.drain_timeout + 5)
        self._loop = None

    def __enter__(self) -> Server:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    models: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    batching: BatchingConfig | Mapping[str, BatchingConfig] | None = None,
    limits: HttpLimits | None = None,
    workers: int | None = None,
    drain_timeout: float = 30.0,
    poll_interval: float | None = None,
    generation: GenerationConfig | Mapping[str, GenerationConfig] | None = None,
) -> Server:
    """Serve models over the Open Inference Protocol v2 (HTTP/1.1) in a background thread.

    Args:
      models: a model repository directory (``<repo>/<model>/<version>/``), a
        :class:`ModelRepository`, a :class:`ServableModel` or :class:`GenerativeModel`
        (served as version 1 under its ``name``), or a dict ``{name: model}`` / list of models.
      host: the address to bind; loopback unless told otherwise.
      port: the port; 0 picks a free one (read ``server.port``).
      token: when given, every route but ``/v2/health/*`` needs ``Authorization: Bearer <token>`` (else 401).
      batching: :class:`BatchingConfig` for every model, or ``{name: BatchingConfig}`` for
        in-memory models (a repository's models read theirs from ``config.json``).
      limits: :class:`HttpLimits` (body size 413, header and body read timeouts 408).
      workers: threads in the pool the models share (default: CPU count, at least 2).
      drain_timeout: seconds :meth:`Server.stop` waits for in-flight requests.
      poll_interval: when set, re-scan the repository every this many seconds and load
        new versions and models (Triton's ``--model-control-mode=poll``).
      generation: :class:`GenerationConfig` for every generative model (slots, prefill
        batch, queue bound), or ``{name: GenerationConfig}`` for in-memory models (a
        repository's models override it with the ``"generation"`` key of ``config.json``).

    Returns:
      The running :class:`Server` (use it as a context manager, or call ``stop()``).

    Raises:
      OSError: the address is taken. TypeError: ``models`` is none of the above.

    >>> import numpy as np
    >>> from cairn.core_array import ArraySpec
    >>> from cairn.serving import PythonModel
    >>> m = PythonModel(lambda d: {"y": d["x"] + 1}, {"x": ArraySpec(("b", 2), "float32")},
    ...                 {"y": ArraySpec(("b", 2), "float32")}, max_batch_size=8, name="inc")
    >>> with serve(m) as server:
    ...     server.url.startswith("http://127.0.0.1:")
    True
    """
    return Server(
        models,
        host=host,
        port=port,
        token=token,
        batching=batching,
        limits=limits,
        workers=workers,
        drain_timeout=drain_timeout,
        poll_interval=poll_interval,
        generation=generation,
    ).start()
