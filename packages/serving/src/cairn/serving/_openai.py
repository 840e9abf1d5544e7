"""OpenAI's API over the generation engine: ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions``.

:func:`parse_chat` and :func:`parse_completion` turn a request body into an
:class:`OpenAIRequest` (prompt token ids, :class:`SamplingParams`, ``n``, streaming and
log-probability options), raising :class:`OpenAIError` (status 400, naming the field)
otherwise. :class:`OpenAIRelay` gathers the events of a request's engine requests (one
per prompt and choice) on the event loop and writes the answer: one JSON object, or
server-sent events in OpenAI's chunk format ending with ``data: [DONE]``.

Unknown fields answer 400 naming them (as OpenAI does; vLLM ignores them): a typo such as
``temprature`` should not pass silently. Fields OpenAI defines that this server does not
implement (``tools``, ``logit_bias``, ``response_format``, ...) are accepted only at
their default (absent, ``null`` or the no-op value) and answer 400 otherwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import numbers
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from cairn.serving._genhttp import _pump
from cairn.serving._http import Response, Stream
from cairn.serving._protocol import ProtocolError, loads_json
from cairn.serving._sampling import MAX_LOGPROBS, SamplingParams

__all__ = ["OpenAIError", "OpenAIRequest", "OpenAIRelay", "parse_chat", "parse_completion", "error_body", "choice_seed"]

_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "seed", "stop",
           "presence_penalty", "frequency_penalty", "logprobs", "user", "top_k", "ignore_eos", "stop_token_ids"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_IGNORED = {"user", "metadata", "store", "service_tier"}  # accepted and ignored
# OpenAI fields this server does not implement, accepted only at their no-op value
_NOOP = {"logit_bias": ({},), "tools": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},),
         "parallel_tool_calls": (True, False), "functions": ([],), "function_call": ("none",), "suffix": ("",),
         "modalities": (["text"],), "reasoning_effort": (), "audio": (), "prediction": (), "web_search_options": ()}
_ROLES = ("system", "developer", "user", "assistant", "tool")
_MAX_N = 128


class OpenAIError(Exception):
    """An error answer in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or []


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status.

    Args:
      status: the HTTP status.
    """
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The JSON error body OpenAI's clients read.

    Args:
      status: the HTTP status (it picks ``type``). message: what was wrong.
      param: the request field at fault, if one. code: a machine-readable reason.

    >>> error_body(404, "no such model", code="model_not_found")["error"]["type"]
    'invalid_request_error'
    """
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


@dataclasses.dataclass
class OpenAIRequest:
    """A parsed OpenAI request.

    Attributes:
      kind: ``"chat"`` or ``"completion"``. model: the model name asked for.
      prompts: token ids per prompt (a chat has one). prompt_texts: their text (for ``echo``).
      params: the sampling parameters (``seed`` per choice: :func:`choice_seed`).
      n: choices per prompt. stream, include_usage: SSE answer, with a usage chunk.
      logprobs: alternatives per token (``None``: no log-probabilities). echo: the
      prompt's text (and, with ``logprobs``, its log-probabilities) before each choice.
    """

    kind: str
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str]
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    echo: bool = False
    max_tokens: int | None = None  # None: as many as fit (chat), 16 (completions)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice ``choice`` of a request with ``seed``: the seed itself for choice 0,
    a SplitMix64 mix of ``(seed, choice)`` for the others (so ``n`` choices differ and each is
    reproducible); ``None`` stays ``None`` (the engine draws one).

    Args:
      seed: the request's seed, or None. choice: the choice's index within its prompt.

    >>> choice_seed(7, 0), choice_seed(7, 1) == choice_seed(7, 1) != choice_seed(8, 1)
    (7, True)
    """
    from cairn.serving._sampling import _GOLDEN, _M64, _mix64

    if seed is None or choice == 0:
        return seed
    return _mix64((seed + choice * _GOLDEN) & _M64)


# --- parsing ---


def load_body(body: bytes | memoryview | dict) -> dict[str, Any]:
    """The request's JSON object.

    Raises:
      OpenAIError: (400) not JSON, or not an object.
    """
    if isinstance(body, dict):
        return body
    try:
        obj = loads_json(body)
    except ProtocolError as e:
        raise OpenAIError(400, e.message) from None
    if not isinstance(obj, dict):
        raise OpenAIError(400, f"request body must be a JSON object, got {type(obj).__name__}")
    return obj


def _check_fields(obj: dict[str, Any], known: set[str], route: str) -> None:
    for k, v in obj.items():
        if k in known or k in _IGNORED:
            continue
        if k in _NOOP:
            if v is None or v in _NOOP[k]:
                continue
            raise OpenAIError(400, f"{k} is not supported by this server ({route}); leave it out", k, "unsupported_parameter")
        raise OpenAIError(400, f"Unrecognized request argument supplied: {k} ({route} takes: {', '.join(sorted(known))})",
                          k, "unknown_parameter")


def _number(obj: dict, key: str, lo: float, hi: float, default: float) -> float:
    v = obj.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not lo <= float(v) <= hi:
        raise OpenAIError(400, f"{key} must be a number in [{lo}, {hi}], got {v!r}", key, "invalid_value")
    return float(v)


def _integer(obj: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise OpenAIError(400, f"{key} must be an integer {bound}, got {v!r}", key, "invalid_value")
    return v


def _bool(obj: dict, key: str, default: bool = False) -> bool:
    v = obj.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise OpenAIError(400, f"{key} must be true or false, got {v!r}", key, "invalid_value")
    return v


def _stops(obj: dict) -> tuple[str, ...]:
    stop = obj.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 16:
        raise OpenAIError(400, f"stop must be a string or a list of at most 16 strings, got {stop!r}", "stop", "invalid_value")
    return tuple(s for s in stops if s)


def _sampling(obj: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The fields every route shares, as SamplingParams (``max_new_tokens`` set later)."""
    ids = obj.get("stop_token_ids")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise OpenAIError(400, f"stop_token_ids must be a list of token ids, got {ids!r}", "stop_token_ids", "invalid_value")
    return SamplingParams(
        max_new_tokens=max(1, max_tokens or 1),
        temperature=_number(obj, "temperature", 0.0, 2.0, 1.0),
        top_p=_top_p(obj),
        top_k=0 if obj.get("top_k") == -1 else (_integer(obj, "top_k", 0) or 0),  # vLLM's -1: off
        seed=_seed(obj),
        stop_token_ids=tuple(ids or ()),
        ignore_eos=_bool(obj, "ignore_eos"),
        presence_penalty=_number(obj, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_number(obj, "frequency_penalty", -2.0, 2.0, 0.0),
        logprobs=logprobs,
        stop=_stops(obj),
    )


def _seed(obj: dict) -> int | None:
    """The seed: any 64-bit integer, signed or not (a negative one taken modulo 2**64)."""
    seed = _integer(obj, "seed", -(2**63), 2**64 - 1)
    return None if seed is None else seed % 2**64


def _top_p(obj: dict) -> float:
    p = _number(obj, "top_p", 0.0, 1.0, 1.0)
    if p == 0.0:
        raise OpenAIError(400, "top_p must be in (0, 1], got 0", "top_p", "invalid_value")
    return p


def _stream(obj: dict) -> tuple[bool, bool]:
    stream = _bool(obj, "stream")
    opts = obj.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise OpenAIError(400, "stream_options is only allowed with stream: true", "stream_options", "invalid_value")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise OpenAIError(400, f"stream_options must be {{\"include_usage\": bool}}, got {opts!r}", "stream_options", "invalid_value")
    return stream, _bool(opts, "include_usage")


def _common(obj: dict, known: set[str], route: str) -> tuple[str, int, bool, bool]:
    _check_fields(obj, known, route)
    name = obj.get("model")
    if not isinstance(name, str) or not name:
        raise OpenAIError(400, "model must be the name of a served model (GET /v1/models lists them)", "model", "invalid_value")
    n = _integer(obj, "n", 1, _MAX_N) or 1
    return (name, n, *_stream(obj))


def _text_content(i: int, content: Any) -> str:
    """A message's content as text: a string, or a list of ``{"type": "text"}`` parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(400, f"messages[{i}].content[{j}]: only text parts ({{\"type\": \"text\", \"text\": str}}) "
                                  f"are supported, got {str(part)[:80]}", f"messages[{i}].content", "invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    raise OpenAIError(400, f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}",
                      f"messages[{i}].content", "invalid_value")


def _messages(obj: dict) -> list[dict[str, str]]:
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise OpenAIError(400, "messages must be a non-empty list of {\"role\", \"content\"} objects", "messages", "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            got = m.get("role") if isinstance(m, dict) else type(m).__name__
            raise OpenAIError(400, f"messages[{i}] must be an object whose role is one of {list(_ROLES)}, got {got!r}",
                              f"messages[{i}].role", "invalid_value")
        msg = {"role": m["role"], "content": _text_content(i, m.get("content"))}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def parse_chat(body: bytes | memoryview | dict, tokenizer: Any) -> OpenAIRequest:
    """Parse a ``/v1/chat/completions`` body; the chat template renders ``messages``.

    Args:
      body: the JSON body (or its parsed object). tokenizer: the model's :class:`~cairn.serving.Tokenizer`.

    Raises:
      OpenAIError: (400) an unknown or ill-typed field, naming it; a template that fails.
    """
    from cairn.serving._chat_template import ChatTemplateError

    obj = load_body(body)
    name, n, stream, usage = _common(obj, CHAT_FIELDS, "/v1/chat/completions")
    messages = _messages(obj)
    top = _integer(obj, "top_logprobs", 0, MAX_LOGPROBS)
    want = _bool(obj, "logprobs")
    if top is not None and not want:
        raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    max_tokens = _integer(obj, "max_completion_tokens", 1)
    legacy = _integer(obj, "max_tokens", 1)
    if max_tokens is not None and legacy is not None and max_tokens != legacy:
        raise OpenAIError(400, "give max_completion_tokens or max_tokens (its older name), not both", "max_tokens", "invalid_value")
    max_tokens = max_tokens if max_tokens is not None else legacy
    logprobs = (top or 0) if want else None
    params = _sampling(obj, max_tokens, logprobs)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=_bool(obj, "add_generation_prompt", True))
    except (ChatTemplateError, ValueError) as e:
        raise OpenAIError(400, f"the chat template does not render these messages: {e}", "messages", "invalid_value") from None
    ids = tokenizer.encode(text, add_special_tokens=False)  # the template writes its own BOS
    return OpenAIRequest("chat", name, [ids], [text], params, n, stream, usage, logprobs, False, max_tokens)


def _prompts(obj: dict, tokenizer: Any) -> tuple[list[list[int]], list[str]]:
    p = obj.get("prompt")
    if isinstance(p, str):
        p = [p]
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        p = [p]
    if not isinstance(p, list) or not p:
        raise OpenAIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of lists of them",
                          "prompt", "invalid_value")
    ids, texts = [], []
    for i, x in enumerate(p):
        if isinstance(x, str):
            ids.append(tokenizer.encode(x))
            texts.append(x)
        elif isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            bad = [t for t in x if not 0 <= t < len(tokenizer)]
            if bad:
                raise OpenAIError(400, f"prompt[{i}]: token id {bad[0]} is outside the vocabulary (0..{len(tokenizer) - 1})",
                                  "prompt", "invalid_value")
            ids.append(list(x))
            texts.append(tokenizer.decode(x, skip_special_tokens=True))
        else:
            raise OpenAIError(400, f"prompt[{i}] must be a string or a list of token ids, got {type(x).__name__}", "prompt",
                              "invalid_value")
        if not ids[-1]:
            raise OpenAIError(400, f"prompt[{i}] is empty", "prompt", "invalid_value")
    return ids, texts


def parse_completion(body: bytes | memoryview | dict, tokenizer: Any) -> OpenAIRequest:
    """Parse a ``/v1/completions`` body.

    Args:
      body: the JSON body (or its parsed object). tokenizer: the model's :class:`~cairn.serving.Tokenizer`.

    Raises:
      OpenAIError: (400) an unknown or ill-typed field, naming it.
    """
    obj = load_body(body)
    name, n, stream, usage = _common(obj, COMPLETION_FIELDS, "/v1/completions")
    best = _integer(obj, "best_of", 1)
    if best is not None and best != n:
        raise OpenAIError(400, f"best_of {best} != n {n} is not supported (choices are never ranked)", "best_of", "invalid_value")
    ids, texts = _prompts(obj, tokenizer)
    logprobs = _integer(obj, "logprobs", 0, MAX_LOGPROBS)
    echo = _bool(obj, "echo")
    max_tokens = _integer(obj, "max_tokens", 0)
    if max_tokens == 0 and not echo:
        raise OpenAIError(400, "max_tokens must be >= 1 (0 only with echo: true, to score the prompt)", "max_tokens", "invalid_value")
    if max_tokens == 0 and stream:
        raise OpenAIError(400, "max_tokens 0 (scoring the prompt) cannot stream", "max_tokens", "invalid_value")
    params = _sampling(obj, max_tokens, logprobs)
    return OpenAIRequest("completion", name, ids, texts, params, n, stream, usage, logprobs, echo, max_tokens)


# --- answering ---


class TokenTexts:
    """Token id -> (text, UTF-8 bytes) for log-probabilities, cached per tokenizer.

    A byte-level BPE token holding part of a character decodes to U+FFFD; its bytes are
    then read from the token's byte-alphabet spelling (or a ``<0xNN>`` byte-fallback token).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._inverse: dict[str, int] | None = None

    def __call__(self, token: int) -> tuple[str, list[int]]:
        out = self._cache.get(token)
        if out is None:
            text = self._tok.decode([token])
            raw = text.encode()
            if "\ufffd" in text:
                raw = self._raw_bytes(token) or raw
            out = self._cache[token] = (text, list(raw))
        return out

    def _raw_bytes(self, token: int) -> bytes | None:
        piece = self._tok.convert_ids_to_tokens(token) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if self._inverse is None:
            self._inverse = _byte_alphabet()
        if piece and all(c in self._inverse for c in piece):
            return bytes(self._inverse[c] for c in piece)
        return None


_TEXTS: weakref.WeakKeyDictionary[Any, TokenTexts] = weakref.WeakKeyDictionary()


def _token_texts(tokenizer: Any) -> TokenTexts:
    """The tokenizer's :class:`TokenTexts`, shared by its requests (event loop only)."""
    texts = _TEXTS.get(tokenizer)
    if texts is None:
        texts = _TEXTS[tokenizer] = TokenTexts(tokenizer)
    return texts


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> the byte it stands for."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@dataclasses.dataclass
class _Choice:
    index: int
    prompt: int  # which prompt
    pieces: list[str] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    started: bool = False  # a streamed chat choice's first chunk (the role) is written
    chars: int = 0  # characters of text so far (streamed completions' text_offset)


class OpenAIRelay:
    """One OpenAI request's engine events, gathered on the event loop into its answer.

    Args:
      loop: the server's event loop. request: the parsed request. tokenizer: the model's.
      model_name: the ``model`` field of the answers. headers: headers every answer carries.
      done: called on the loop when an engine request finished: ``(finish_reason, tokens, ttft)``.
      prompt_logprobs: per prompt, its tokens' log-probabilities (``echo`` with ``logprobs``).
      started: ``time.perf_counter()`` when the request arrived.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, request: OpenAIRequest, tokenizer: Any, model_name: str,
                 headers: list[tuple[str, str]], done: Callable[[str, int, float | None], None],
                 prompt_logprobs: list[list[float]] | None = None, started: float | None = None) -> None:
        self.request, self.headers, self.done = request, headers, done
        self.texts = _token_texts(tokenizer)
        self._pump = _pump(loop)
        self.prompt_logprobs = prompt_logprobs
        self.started = time.perf_counter() if started is None else started
        chat = request.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + os.urandom(12).hex()
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.model_name = model_name
        self.choices = [_Choice(p * request.n + j, p) for p in range(len(request.prompts)) for j in range(request.n)]
        self.first_token: list[float | None] = [None] * len(self.choices)
        self.future: asyncio.Future[Response] = loop.create_future()
        self.stream: Stream | None = None
        self._backlog: list[tuple[int, Any]] = []
        self.left = len(self.choices)
        self.cancels: list[Callable[[], None]] = []
        self._chunk_head: bytes | None = None  # a streamed chunk's JSON up to its choices, written once

    def on_event(self, choice: int) -> Callable[[Any], None]:
        """The engine callback of choice ``choice`` (engine thread; handed to the loop)."""
        def deliver(event: Any) -> None:
            self._deliver(choice, event)

        return lambda event: self._pump.put(deliver, event)

    def cancel(self) -> None:
        """Cancel every engine request (the client went away)."""
        for c in self.cancels:
            c()

    def attach(self, stream: Stream) -> None:
        """:class:`StreamResponse` start: write what arrived so far, then each event as it comes."""
        self.stream = stream
        backlog, self._backlog = self._backlog, []
        for choice, event in backlog:
            self._deliver(choice, event)

    def _deliver(self, i: int, event: Any) -> None:
        c = self.choices[i]
        if c.finish_reason is not None:
            return
        if self.request.stream and self.stream is None:
            self._backlog.append((i, event))
            return
        token = event.token_id
        if token is not None:
            if self.first_token[i] is None:
                self.first_token[i] = time.perf_counter() - self.started
            c.tokens.append(int(token))
            if event.logprob is not None:
                c.logprobs.append((int(token), event.logprob, event.top_logprobs or []))
        piece = event.text or ""
        c.pieces.append(piece)
        c.chars += len(piece)
        if self.stream is not None and (piece or (token is not None and event.logprob is not None)):
            self._chunk(c, piece, c.logprobs[-1:] if token is not None and event.logprob is not None else [])
        if event.finished:
            self._finished(c, event.finish_reason or "error", event.error)

    def _finished(self, c: _Choice, reason: str, error: str | None) -> None:
        c.finish_reason, c.error = reason, error
        self.left -= 1
        self.done(reason, len(c.tokens), self.first_token[c.index])
        if self.stream is not None and reason in ("stop", "length"):
            self._chunk(c, "", [], reason)
        if self.left == 0:
            self._end()

    def scored_only(self) -> None:
        """Answer without generating (``echo`` with ``max_tokens`` 0): the prompts and their
        log-probabilities."""
        for c in self.choices:
            c.finish_reason = "length"
        self.left = 0
        self._end()

    # --- the answer ---

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.request.prompts)
        completion = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _failure(self) -> _Choice | None:
        return next((c for c in self.choices if c.finish_reason not in ("stop", "length")), None)

    def _end(self) -> None:
        bad = self._failure()
        if self.stream is not None:
            if bad is not None:
                status = 500 if bad.finish_reason == "error" else 503
                self._write(error_body(status, self._why(bad)))
            elif self.request.include_usage:
                self._write({**self._head(), "choices": [], "usage": self.usage()})
            self.stream.write(b"data: [DONE]\n\n")
            self.stream.end()
            return
        if self.future.done():
            return
        if bad is not None:
            status = 500 if bad.finish_reason == "error" else 503
            self.future.set_result(json_response(status, error_body(status, self._why(bad)), self.headers))
            return
        self.future.set_result(json_response(200, self.answer(), self.headers))

    def _why(self, c: _Choice) -> str:
        if c.finish_reason == "error":
            return f"model '{self.model_name}' failed while generating: {c.error or 'unknown error'}"
        return f"the request was cancelled ({c.finish_reason}): the server is stopping or reloading the model"

    def _head(self) -> dict[str, Any]:
        obj = self.object + (".chunk" if self.stream is not None and self.object == "chat.completion" else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name, "system_fingerprint": None}

    def answer(self) -> dict[str, Any]:
        """The non-streamed answer."""
        choices = []
        for c in self.choices:
            text = "".join(c.pieces)
            if self.request.kind == "chat":
                choices.append({"index": c.index, "message": {"role": "assistant", "content": text},
                                "logprobs": self._chat_logprobs(c.logprobs), "finish_reason": c.finish_reason})
            else:
                prefix = self.request.prompt_texts[c.prompt] if self.request.echo else ""
                choices.append({"index": c.index, "text": prefix + text,
                                "logprobs": self._legacy(c, c.logprobs, bool(prefix), len(prefix)),
                                "finish_reason": c.finish_reason})
        return {**self._head(), "choices": choices, "usage": self.usage()}

    def _chunk(self, c: _Choice, piece: str, lps: list, finish: str | None = None) -> None:
        if self.request.kind == "chat":
            delta: dict[str, Any] = {} if finish else {"content": piece}
            if not c.started:
                delta = {"role": "assistant", "content": piece if not finish else ""}
                c.started = True
            choice = {"index": c.index, "delta": delta, "logprobs": self._chat_logprobs(lps) if lps else None,
                      "finish_reason": finish}
        else:
            echo = self.request.prompt_texts[c.prompt] if self.request.echo else ""
            prefix = "" if c.started else echo
            c.started = True
            start = len(echo) + c.chars - len(piece)
            choice = {"index": c.index, "text": prefix + piece, "logprobs": self._legacy(c, lps, bool(prefix), start),
                      "finish_reason": finish}
        if self._chunk_head is None:  # the fields every chunk repeats, serialized once
            head = json.dumps(self._head(), separators=(",", ":"))[:-1]
            self._chunk_head = b"data: " + head.encode() + b',"choices":['
        tail = b'],"usage":null}\n\n' if self.request.include_usage else b"]}\n\n"
        assert self.stream is not None
        self.stream.write(self._chunk_head + json.dumps(choice, separators=(",", ":"), allow_nan=False).encode() + tail)

    def _write(self, obj: dict[str, Any]) -> None:
        assert self.stream is not None
        self.stream.write(b"data: " + json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n\n")

    def _entry(self, token: int, lp: float) -> dict[str, Any]:
        text, raw = self.texts(token)
        return {"token": text, "logprob": _finite(lp), "bytes": raw}

    def _chat_logprobs(self, lps: Sequence[tuple[int, float, list[tuple[int, float]]]]) -> dict[str, Any] | None:
        if self.request.logprobs is None:
            return None
        return {"content": [{**self._entry(t, lp), "top_logprobs": [self._entry(a, b) for a, b in top]} for t, lp, top in lps]}

    def _legacy(self, c: _Choice, lps: Sequence[tuple[int, float, list[tuple[int, float]]]], with_prompt: bool,
                start: int) -> dict[str, Any] | None:
        """The completions route's log-probabilities (tokens, token_logprobs, top_logprobs,
        text_offset): the prompt's first when ``with_prompt``, then ``lps`` from offset ``start``."""
        if self.request.logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        pos = 0
        if with_prompt and self.prompt_logprobs is not None:
            for k, (t, lp) in enumerate(zip(self.request.prompts[c.prompt], self.prompt_logprobs[c.prompt])):
                text = self.texts(t)[0]
                out["tokens"].append(text)
                out["token_logprobs"].append(None if k == 0 else _finite(lp))
                out["top_logprobs"].append(None if k == 0 else {text: _finite(lp)})
                out["text_offset"].append(pos)
                pos += len(text)
        pos = start
        for t, lp, top in lps:
            text = self.texts(t)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(lp))
            alts: dict[str, float] = {}
            for a, b in top:
                alts.setdefault(self.texts(a)[0], _finite(b))
            out["top_logprobs"].append(alts)
            out["text_offset"].append(pos)
            pos += len(text)
        return out


def _finite(x: float) -> float:
    """JSON has no -inf: a token of probability 0 gets the most negative float32 instead."""
    return float(x) if math.isfinite(x) else -3.4028234663852886e38


def json_response(status: int, obj: Any, headers: list[tuple[str, str]]) -> Response:
    """A JSON :class:`Response`."""
    return Response(status, json.dumps(obj, separators=(",", ":"), allow_nan=False).encode(), "application/json", headers)
