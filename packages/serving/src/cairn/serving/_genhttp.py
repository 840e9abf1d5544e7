"""The HTTP side of generation: request bodies, answers and server-sent events.

``POST /v2/models/{m}/generate`` and ``/generate_stream`` take Triton's generate-extension
JSON, ``{"text_input": str}`` or ``{"input_ids": [int, ...]}`` plus ``"parameters"`` (the
sampling options of :meth:`SamplingParams.from_json`; as in Triton's TensorRT-LLM
examples they may also be top-level keys). :func:`parse_generate` turns a body
into a prompt and its sampling parameters (``ValueError`` naming the field otherwise);
:class:`GenerationRelay` carries one request's events from the engine thread to the event
loop, where they become the JSON answer or one SSE event per token.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from cairn.serving._generate import after_event_batch
from cairn.serving._genexport import detokenize, tokenize
from cairn.serving._http import Response, Stream
from cairn.serving._http import json_response as _json
from cairn.serving._protocol import ProtocolError, loads_json
from cairn.serving._sampling import SamplingParams

_BODY_KEYS = ("text_input", "input_ids", "parameters", "stream")
_SAMPLING_KEYS = tuple(sorted({f.name for f in dataclasses.fields(SamplingParams)} | {"max_tokens", "stop"}))


class _EventPump:
    """Hands engine events to one event loop with one wake-up per batch of events.

    An engine step emits an event for every busy slot; waking the loop once per event
    (``call_soon_threadsafe`` writes the loop's self-pipe and hands over the GIL each time)
    cost about as much as the step's sampling. Events queue here in order and the loop
    drains them all in one callback; ``put`` schedules a drain only when none is pending,
    and inside the engine's :func:`~cairn.serving._generate.event_batch` only at its end (a
    drain that ran mid-step, while the engine was still recording rows, made a c=64 step
    wake the loop about 5 times).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: collections.deque[tuple[Callable[[Any], None], Any]] = collections.deque()
        self._lock = threading.Lock()
        self._pending = False

    def put(self, deliver: Callable[[Any], None], event: Any) -> None:
        """Queue ``deliver(event)`` to run on the loop (any thread). Inside the engine's
        batch of a step's events, the loop is woken once, when the batch ends."""
        self._queue.append((deliver, event))
        with self._lock:
            if self._pending:
                return
            self._pending = True
        after_event_batch(self._wake)

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed (server stopped without draining): nobody to tell
            self._queue.clear()

    def _drain(self) -> None:
        with self._lock:
            self._pending = False  # an event queued from now on schedules another drain
        while self._queue:
            deliver, event = self._queue.popleft()
            deliver(event)


_PUMPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _EventPump] = weakref.WeakKeyDictionary()
_PUMPS_LOCK = threading.Lock()


def _pump(loop: asyncio.AbstractEventLoop) -> _EventPump:
    with _PUMPS_LOCK:
        pump = _PUMPS.get(loop)
        if pump is None:
            pump = _PUMPS[loop] = _EventPump(loop)
        return pump


def parse_generate(body: bytes | memoryview, model: Any) -> tuple[list[int], SamplingParams]:
    """Parse a generate request body for ``model`` (a GenerativeModel).

    Args:
      body: the JSON body: exactly one of ``text_input`` (a string; needs the model's
        vocabulary; the model's ``bos_token_id``, when set, is prepended) and ``input_ids``
        (a non-empty list of token ids), and optionally ``parameters`` (an object) and
        sampling keys at the top level (not the same key in both). A boolean ``stream``
        (top level or in ``parameters``, as Triton clients send it) is ignored: the route
        decides.
      model: the model (its vocabulary and ``bos_token_id``).

    Returns:
      ``(prompt token ids, SamplingParams)``.

    Raises:
      ValueError: malformed JSON (a bare ``NaN`` and JSON nested too deeply included), an
        unknown key, a missing or ill-typed field, text on a model without vocabulary, or
        bad sampling parameters (each naming the field).
    """
    try:
        obj = loads_json(body)
    except ProtocolError as e:
        raise ValueError(e.message) from None
    try:
        return _parse_object(obj, model)
    except RecursionError:  # a deep value (under json's limit) reached a repr
        raise ValueError("request body is JSON nested too deeply") from None


@dataclasses.dataclass(frozen=True)
class ParseTarget:
    """What :func:`parse_generate` reads of a model, small enough to send to a worker process."""

    name: str
    vocabulary: tuple[str | None, ...] | None
    bos_token_id: int | None
    tokenizer: Any = None  # the model's Tokenizer (it pickles), if any

    @classmethod
    def of(cls, model: Any) -> ParseTarget:
        vocab = model.vocabulary
        return cls(model.name, None if vocab is None else tuple(vocab), getattr(model, "bos_token_id", None),
                   getattr(model, "tokenizer", None))


def _parse_object(obj: Any, model: Any) -> tuple[list[int], SamplingParams]:
    if not isinstance(obj, dict):
        raise ValueError(f"request body must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_BODY_KEYS) - set(_SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} in the request body (known: {[*_BODY_KEYS, *_SAMPLING_KEYS]})")
    if ("text_input" in obj) == ("input_ids" in obj):
        raise ValueError("give exactly one of 'text_input' (a string) and 'input_ids' (a list of token ids)")
    prompt = _prompt_ids(obj, model)
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise ValueError(f"parameters must be a JSON object, got {type(params).__name__}")
    top = {k: v for k, v in obj.items() if k in _SAMPLING_KEYS}
    both = sorted(set(top) & set(params))
    if both:
        raise ValueError(f"{both} given both at the top level and in parameters; give each once")
    for where in (obj, params):
        if not isinstance(where.get("stream", False), bool):
            raise ValueError(f"stream must be true or false, got {where['stream']!r}")
    return prompt, _sampling({**top, **{k: v for k, v in params.items() if k != "stream"}}, model)


def _prompt_ids(obj: dict[str, Any], model: Any) -> list[int]:
    if "text_input" in obj:
        text = obj["text_input"]
        if not isinstance(text, str):
            raise ValueError(f"text_input must be a string, got {type(text).__name__}")
        tok = getattr(model, "tokenizer", None)
        if tok is not None:
            return tok.encode(text)
        if model.vocabulary is None:
            raise ValueError(f"text_input: model '{model.name}' has no vocabulary; send input_ids (token ids) instead")
        return tokenize(text, model.vocabulary, getattr(model, "bos_token_id", None))
    ids = obj["input_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("input_ids must be a list of integer token ids")
    return list(ids)


def _sampling(params: dict[str, Any], model: Any) -> SamplingParams:
    try:
        text_stops = getattr(model, "tokenizer", None) is not None  # stop strings match the detokenized text
        return SamplingParams.from_json(params, vocabulary=model.vocabulary, text_stops=text_stops)
    except (TypeError, ValueError) as e:  # TypeError: a field of the wrong JSON type
        raise ValueError(f"parameters: {e}") from None


class GenerationRelay:
    """One generate request's events, carried from the engine thread to the event loop.

    Args:
      loop: the server's event loop.
      base: the fields every answer carries (``model_name``, ``model_version``).
      vocabulary: token id -> text, or None (no ``text_output`` then, unless the engine's
        events carry text: a model with a tokenizer).
      prompt_len: the prompt's length (for ``usage``).
      streaming: answer with SSE events (through :meth:`attach`) instead of :attr:`future`.
      done: called on the loop when the request finished: ``(finish_reason, tokens, ttft)``.
      started: ``time.perf_counter()`` when the request arrived (time to first token counts
        from it; default: now).
      headers: headers every answer carries (``X-Request-Id``).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        base: dict[str, Any],
        vocabulary: Sequence[str | None] | None,
        prompt_len: int,
        streaming: bool,
        done: Callable[[str, int, float | None], None],
        started: float | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        self.base, self.vocabulary, self.prompt_len = base, vocabulary, prompt_len
        self._pump = _pump(loop)
        self.streaming = streaming
        self.done = done
        self.started = time.perf_counter() if started is None else started
        self.tokens: list[int] = []
        self.pieces: list[str] | None = None  # the events' text, when the engine sends it (a tokenizer)
        self.tail: str | None = None  # the final event's text
        self.first_token: float | None = None
        self.future: asyncio.Future[Response] = loop.create_future()  # the plain answer
        self.headers = headers or []
        self.stream: Stream | None = None
        self._backlog: list[Any] = []
        self.finished = False

    def on_event(self, event: Any) -> None:
        """The engine's callback (engine thread): hand the event to the loop (batched with
        the step's other events, in order)."""
        self._pump.put(self._deliver, event)

    def attach(self, stream: Stream) -> None:
        """:class:`StreamResponse` start: write what arrived so far, then each event as it comes."""
        self.stream = stream
        backlog, self._backlog = self._backlog, []
        for event in backlog:
            self._deliver(event)

    def _deliver(self, event: Any) -> None:
        if self.finished:
            return
        if self.streaming and self.stream is None:  # the head is not written yet
            self._backlog.append(event)
            return
        token = getattr(event, "token_id", None)
        if token is not None:
            token = int(token)
            if self.first_token is None:
                self.first_token = time.perf_counter() - self.started
            self.tokens.append(token)
            text = self._piece(event, [token])
            if self.stream is not None:
                self._write({**self.base, "text_output": text, "output_ids": [token], "index": event.index})
        elif event.finished:
            self.tail = self._piece(event, [])
        if event.finished:
            self._finish(event.finish_reason or "error", getattr(event, "error", None))

    def _piece(self, event: Any, ids: list[int]) -> str | None:
        """The event's text (the engine's, when it decodes), else from the vocabulary."""
        text = getattr(event, "text", None)
        if text is not None and (self.pieces is not None or self.vocabulary is None):
            if self.pieces is None:
                self.pieces = []
            self.pieces.append(text)
            return text
        return self._text(ids) if ids else None

    def _text(self, ids: list[int]) -> str | None:
        if self.pieces is not None:
            return "".join(self.pieces)
        return None if self.vocabulary is None else detokenize(ids, self.vocabulary)

    def _write(self, obj: dict[str, Any]) -> None:
        if obj.get("text_output", "") is None:
            del obj["text_output"]
        assert self.stream is not None
        self.stream.write(b"data: " + json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n\n")

    def answer(self) -> dict[str, Any]:
        """The non-streamed answer."""
        out = {**self.base}
        text = self._text(self.tokens)
        if text is not None:
            out["text_output"] = text
        out["output_ids"] = list(self.tokens)
        out["usage"] = self._usage()
        return out

    def _usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_len, "completion_tokens": len(self.tokens)}

    def _error(self, error: str | None) -> str:
        detail = f": {error}" if error else ""
        return f"model '{self.base['model_name']}' failed while generating this request{detail}"

    def _finish(self, reason: str, error: str | None = None) -> None:
        self.finished = True
        self.done(reason, len(self.tokens), self.first_token)
        if self.stream is not None:
            final = {**self.base, "finish_reason": reason, "usage": self._usage()}  # not answer(): no detokenizing
            if self.tail:
                final["text_output"] = self.tail  # text held back until the end (a partial stop string)
            if reason == "error":
                final["error"] = self._error(error)
            self._write(final)
            self.stream.end()
        elif self.future.done():
            return
        elif reason == "error":
            self.future.set_result(_json(500, {"error": self._error(error)}, self.headers))
        else:
            self.future.set_result(_json(200, {**self.answer(), "finish_reason": reason}, self.headers))
