"""A small, fast HTTP/1.1 server on asyncio protocols (keep-alive, TCP_NODELAY, limits).

Each connection is an ``asyncio.Protocol`` that parses requests itself (no per-request
task or thread): the handler returns a :class:`Response` at once, or an
``asyncio.Future`` resolving to one, and the connection writes it with a single
``transport.write`` (headers and body together, Nagle off). Requests on one connection
are answered in order. Limits: header size (431), body size (413, announced by
Content-Length before any body is read), header and body read timeouts (408, so a
client sending a byte a second holds only its own connection), an idle keep-alive
timeout, and ``Transfer-Encoding`` is refused (411: send Content-Length).

Draining (SIGTERM) stops accepting connections and answers what is in flight. A kept-alive
connection stays open for ``drain_grace`` seconds meanwhile, and a request that arrives
on it (the client may have sent it before it could know) is answered 503 with
``Connection: close`` instead of meeting a reset; then idle connections close.

A handler may instead answer a :class:`StreamResponse`: the head goes out at once with
``Transfer-Encoding: chunked`` (HTTP/1.1; an HTTP/1.0 client gets the raw body and a
close) and the producer writes the body piece by piece through a :class:`Stream`, each
piece flushed as one chunk; the connection stays busy (no timeout, later pipelined
requests wait) until :meth:`Stream.end`. A handler that sets ``request.on_disconnect``
learns when the client goes away before its answer is complete (to cancel the work).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


@dataclasses.dataclass
class Request:
    """One parsed HTTP request (header names lower-cased)."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes | memoryview  # a read-only memoryview when larger than 1 MiB (received in place)
    peer: str
    keep_alive: bool
    started: float
    version: str = "HTTP/1.1"
    on_disconnect: Callable[[], None] | None = None  # set by a handler; called (loop thread) if the client leaves first


@dataclasses.dataclass
class Response:
    """What a handler answers: status, body, content type and extra headers."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = dataclasses.field(default_factory=list)


class Stream:
    """The writing end of a :class:`StreamResponse` (event-loop thread only).

    ``write`` sends one piece of the body at once (one chunk); ``end`` finishes the
    response. Both do nothing once the client is gone (``closed``).
    """

    def __init__(self, conn: HttpConnection, request: Request, response: StreamResponse, chunked: bool, keep: bool) -> None:
        self._conn, self._request, self._response, self._chunked = conn, request, response, chunked
        self.keep = keep  # keep the connection open after the body
        self.nbytes = 0
        self.ended = False

    @property
    def closed(self) -> bool:
        """True once the response ended or the client disconnected (also when the socket
        already failed but ``connection_lost`` has not run yet: writing then only logs)."""
        transport = self._conn.transport
        return self.ended or self._conn._closing or transport is None or transport.is_closing()

    def write(self, data: bytes) -> None:
        """Send ``data`` now as one chunk (empty data is skipped: it would end the body)."""
        if self.closed or not data:
            return
        self.nbytes += len(data)
        transport = self._conn.transport
        assert transport is not None
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)

    def end(self) -> None:
        """Finish the response; the connection goes on with the next request (or closes)."""
        if self.ended:
            return
        self.ended = True
        if not self._conn._closing and self._chunked:
            self._conn.transport.write(b"0\r\n\r\n")  # type: ignore[union-attr]
        self._conn._stream_ended(self)


@dataclasses.dataclass
class StreamResponse:
    """A response whose body is produced over time.

    Attributes:
      start: called on the event loop right after the head is written, with the
        :class:`Stream` to write the body to; the producer must call ``stream.end()``.
      status, content_type, headers: as for :class:`Response`.
    """

    start: Callable[[Stream], None]
    status: int = 200
    content_type: str = "text/event-stream"
    headers: list[tuple[str, str]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """Connection limits.

    Args:
      max_body_bytes: larger Content-Length answers 413 before the body is read.
      max_header_bytes: a request head (line + headers) larger than this answers 431.
      header_timeout: seconds from a request's first byte to the end of its headers (408).
      body_timeout: seconds from the end of the headers to the end of the body (408).
      keep_alive_timeout: an idle connection is closed after this many seconds.
      drain_grace: while draining, kept-alive connections stay open this many seconds
        (or until their clients close them) and answer new requests 503 + ``Connection: close``.
    """

    max_body_bytes: int = 64 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 75.0
    drain_grace: float = 1.0


Handler = Callable[[Request], "Response | StreamResponse | asyncio.Future[Response | StreamResponse]"]
Finisher = Callable[[Request, "Response | StreamResponse", int], None]

_IDLE, _HEAD, _BODY, _BUSY = range(4)
_BIG_BODY = 1 << 20  # larger bodies are received into one buffer allocated up front


class HttpConnection(asyncio.Protocol):
    """One client connection; see the module docstring."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._buf = bytearray()
        self._state = _IDLE
        self._deadline = 0.0
        self._head: tuple[str, str, str, dict[str, str], bool, float, str] | None = None
        self._length = 0
        self._body: np.ndarray | None = None  # a big body, filled in place as it arrives
        self._filled = 0
        self._closing = False
        self.transport: asyncio.Transport | None = None
        self._peer = ""
        self._pending: Request | None = None  # the request being answered (for on_disconnect)
        self._stream: Stream | None = None
        self._starting = False

    # --- asyncio callbacks ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._deadline = time.monotonic() + self._server.limits.keep_alive_timeout
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._server.connections.discard(self)
        pending, self._pending = self._pending, None
        if pending is not None and pending.on_disconnect is not None:
            try:
                pending.on_disconnect()
            except Exception:  # noqa: BLE001 - a handler's hook must not break the loop
                pass
        if self._stream is not None:
            self._stream.end()  # the producer's later writes are no-ops

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        if self._state == _IDLE:
            self._state = _HEAD
            self._deadline = time.monotonic() + self._server.limits.header_timeout
        self._buf += data
        if self._state != _BUSY:
            self._advance()
        elif len(self._buf) > self._server.limits.max_header_bytes + self._length:
            self.transport.pause_reading()  # type: ignore[union-attr]  # a pipelining client waits for us

    # --- parsing ---

    def _advance(self) -> None:
        """Parse and dispatch as many complete requests as the buffer holds."""
        limits = self._server.limits
        while not self._closing:
            if self._state in (_IDLE, _HEAD):
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buf) > limits.max_header_bytes:
                        self._fail(431, "request head is larger than the limit")
                    elif not self._buf:
                        self._state = _IDLE
                    return
                if end > limits.max_header_bytes:
                    self._fail(431, "request head is larger than the limit")
                    return
                if not self._parse_head(bytes(self._buf[:end])):
                    return
                del self._buf[: end + 4]
                self._state = _BODY
                self._deadline = time.monotonic() + limits.body_timeout
            if self._state == _BODY:
                body = self._take_body()
                if body is None:
                    return
                self._dispatch(body)
                if self._state == _BUSY:
                    return

    def _take_body(self) -> bytes | memoryview | None:
        """The body once complete (None before). A big one is copied piece by piece, as it
        arrives, into a buffer allocated once and never zero-filled: copying 64 MB at the
        end, or growing the receive buffer to it, stalled the loop ~100 ms on a busy host."""
        if self._length <= _BIG_BODY:
            if len(self._buf) < self._length:
                return None
            body = bytes(self._buf[: self._length])
            del self._buf[: self._length]
            return body
        if self._body is None:
            self._body, self._filled = np.empty(self._length, np.uint8), 0
        take = min(len(self._buf), self._length - self._filled)
        self._body[self._filled : self._filled + take] = memoryview(self._buf)[:take]
        del self._buf[:take]
        self._filled += take
        if self._filled < self._length:
            return None
        done, self._body = self._body, None
        return done.data.toreadonly()

    def _parse_head(self, head: bytes) -> bool:
        try:
            text = head.decode("latin-1")
            line, *lines = text.split("\r\n")
            method, target, version = line.split(" ")
        except ValueError:
            self._fail(400, "malformed request line")
            return False
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            self._fail(505 if version.startswith("HTTP/") else 400, f"unsupported protocol version {version[:20]!r}")
            return False
        headers: dict[str, str] = {}
        for h in lines:
            name, sep, value = h.partition(":")
            if not sep or not name or name != name.strip():
                self._fail(400, "malformed header line")
                return False
            headers[name.lower()] = value.strip()
        if "transfer-encoding" in headers:
            self._fail(411, "Transfer-Encoding is not supported: send Content-Length")
            return False
        length = headers.get("content-length", "0")
        if not length.isdigit() or len(length) > 18:
            self._fail(400, f"invalid Content-Length {length[:30]!r}")
            return False
        self._length = int(length)
        if self._length > self._server.limits.max_body_bytes:
            self._fail(413, f"request body of {self._length} bytes exceeds the limit of {self._server.limits.max_body_bytes} bytes")
            return False
        if headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits a second for this
        conn = headers.get("connection", "").lower()
        keep = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
        path, _, query = target.partition("?")
        self._head = (method, path, query, headers, keep, time.perf_counter(), version)
        return True

    def _dispatch(self, body: bytes | memoryview) -> None:
        assert self._head is not None
        method, path, query, headers, keep, started, version = self._head
        request = Request(method, path, query, headers, body, self._peer, keep and not self._server.draining, started, version)
        self._state = _BUSY
        self._server.in_flight += 1
        self._pending = request
        result: Response | StreamResponse | asyncio.Future[Response | StreamResponse]
        try:
            if self._server.draining:  # a request on a kept-alive connection after SIGTERM
                result = _error(503, "the server is shutting down; send the request again (to another instance)")
            else:
                result = self._server.handler(request)
        except Exception as e:  # a handler bug is this request's 500, never the connection's crash
            result = _error(500, f"internal error: {type(e).__name__}: {e}")
        if isinstance(result, Response):
            self._respond(request, result, resume=False)  # _advance's loop goes on with the buffer
        elif isinstance(result, StreamResponse):
            self._start_stream(request, result)
        else:
            result.add_done_callback(lambda fut: self._settle(request, _result(fut)))

    # --- writing ---

    def _settle(self, request: Request, response: Response | StreamResponse) -> None:
        """A handler's future resolved: write its response, or start its stream."""
        if isinstance(response, StreamResponse):
            self._start_stream(request, response, inline=False)
        else:
            self._respond(request, response)

    def _respond(self, request: Request, response: Response, resume: bool = True) -> None:
        self._server.in_flight -= 1
        self._pending = None
        keep = request.keep_alive and not self._server.draining and not self._closing
        self._write(response, keep)
        self._server.finished(request, response, len(response.body))
        self._next(keep, resume)

    def _start_stream(self, request: Request, response: StreamResponse, inline: bool = True) -> None:
        """Write a streamed response's head and hand the body to its producer (``inline``:
        called from :meth:`_advance`, whose loop goes on if the stream ends at once)."""
        chunked = request.version == "HTTP/1.1"
        keep = chunked and request.keep_alive and not self._server.draining and not self._closing
        stream = self._stream = Stream(self, request, response, chunked, keep)
        if self.transport is not None and not self._closing:
            status = response.status
            parts = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\nContent-Type: {response.content_type}\r\n"]
            parts.append("Transfer-Encoding: chunked\r\n" if chunked else "")
            parts.extend(f"{k}: {v}\r\n" for k, v in response.headers)
            parts.append("Cache-Control: no-cache\r\nConnection: keep-alive\r\n\r\n" if keep else "Cache-Control: no-cache\r\nConnection: close\r\n\r\n")
            self.transport.write("".join(parts).encode("latin-1"))
        self._starting = inline
        try:
            response.start(stream)
        except Exception:  # noqa: BLE001 - a producer bug ends this response, never the connection loop
            stream.keep = False
            stream.end()
        finally:
            self._starting = False

    def _stream_ended(self, stream: Stream) -> None:
        """Called by :meth:`Stream.end`: account the response, go on with the connection."""
        if self._stream is not stream:
            return
        self._stream = None
        self._pending = None
        self._server.in_flight -= 1
        self._server.finished(stream._request, stream._response, stream.nbytes)
        keep = stream.keep and not self._server.draining and not self._closing
        self._next(keep, resume=not self._starting)  # ended inside start(): _advance's loop goes on

    def _next(self, keep: bool, resume: bool) -> None:
        """After a response: close, or wait for (or parse) the next request."""
        if not keep:
            self._close()
            return
        self._state = _HEAD if self._buf else _IDLE
        limits = self._server.limits
        self._deadline = time.monotonic() + (limits.header_timeout if self._buf else limits.keep_alive_timeout)
        if resume:
            self.transport.resume_reading()  # type: ignore[union-attr]
            if self._buf:
                self._advance()

    def _write(self, response: Response, keep: bool) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        status = response.status
        parts = [
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
            f"Content-Type: {response.content_type}\r\nContent-Length: {len(response.body)}\r\n"
        ]
        parts.extend(f"{k}: {v}\r\n" for k, v in response.headers)
        parts.append("Connection: keep-alive\r\n\r\n" if keep else "Connection: close\r\n\r\n")
        head = "".join(parts).encode("latin-1")
        if len(response.body) > 1 << 16:  # a big body is not copied behind its head (writelines joins on 3.11)
            self.transport.write(head)
            self.transport.write(response.body)
        else:
            self.transport.write(head + response.body)

    def _fail(self, status: int, reason: str) -> None:
        """Answer a request that could not be parsed, then close the connection."""
        response = _error(status, reason)
        self._write(response, keep=False)
        started = self._head[5] if self._head else time.perf_counter()
        request = Request("-", "-", "", {}, b"", self._peer, False, started)
        self._server.finished(request, response, len(response.body))
        self._close()

    def _close(self) -> None:
        self._closing = True
        if self.transport is not None:
            self.transport.close()

    def expire(self, now: float) -> None:
        """Called by the server's sweeper: enforce this connection's current deadline."""
        if self._closing or self._state == _BUSY or now < self._deadline:
            return
        if self._state == _IDLE:
            self._close()
        else:
            phase = "headers" if self._state == _HEAD else "body"
            self._fail(408, f"timed out reading the request {phase}")

    def close_if_idle(self) -> None:
        if self._state == _IDLE:
            self._close()


def json_response(status: int, obj: Any, headers: list[tuple[str, str]]) -> Response:
    """A compact JSON body answered with ``status`` and ``headers``."""
    return Response(status, json.dumps(obj, separators=(",", ":"), allow_nan=False).encode(), headers=headers)


def _error(status: int, reason: str) -> Response:
    return Response(status, json.dumps({"error": reason}).encode())


def _result(fut: asyncio.Future[Response | StreamResponse]) -> Response | StreamResponse:
    if fut.cancelled():
        return _error(503, "the request was cancelled (server shutting down)")
    exc = fut.exception()
    if exc is not None:
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")
    return fut.result()


class HttpServer:
    """The listening socket, its connections and the timeout sweeper (loop thread only).

    Args:
      handler: request -> Response or Future[Response].
      finished: called after each response is written (metrics, access log).
      limits: :class:`HttpLimits`.
    """

    def __init__(self, handler: Handler, finished: Finisher, limits: HttpLimits) -> None:
        self.handler = handler
        self.finished = finished
        self.limits = limits
        self.connections: set[HttpConnection] = set()
        self.in_flight = 0
        self.draining = False
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[Any] | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 = an ephemeral port) and return the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: HttpConnection(self), host, port, reuse_address=True, backlog=1024)
        self._sweeper = loop.create_task(self._sweep())
        return int(self._server.sockets[0].getsockname()[1])

    async def _sweep(self) -> None:
        lim = self.limits
        period = max(0.02, min(0.5, lim.header_timeout / 4, lim.body_timeout / 4, lim.keep_alive_timeout / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self.connections):
                conn.expire(now)

    async def drain(self, timeout: float) -> bool:
        """Stop accepting, wait for in-flight requests, close idle connections after the
        grace (module docstring); True if every in-flight request finished."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        now = time.monotonic()
        deadline, grace = now + timeout, now + min(self.limits.drain_grace, timeout)
        while True:
            now = time.monotonic()
            if now >= grace:
                for conn in list(self.connections):
                    conn.close_if_idle()
            if (self.in_flight == 0 and (now >= grace or not self.connections)) or now > deadline:
                return self.in_flight == 0
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        """Close every connection and the sweeper."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn._close()
        if self._sweeper is not None:
            self._sweeper.cancel()
