"""Streamed HTTP responses in cairn.serving._http: chunked bodies flushed piece by piece,
HTTP/1.0 clients, keep-alive and pipelining after a stream, no timeout while streaming,
and the disconnect hook (what cancels a generation when its client goes away)."""

import asyncio
import socket
import threading
import time

import pytest

from cairn.serving._http import HttpLimits, HttpServer, Request, Response, Stream, StreamResponse


class _Harness:
    """An HttpServer on its own loop thread; ``/stream?n=N&dt=S`` streams N pieces S seconds
    apart (``&hold=1``: the pieces after the first wait for ``release``)."""

    def __init__(self, limits: HttpLimits) -> None:
        self.loop = asyncio.new_event_loop()
        self.disconnects: list[str] = []
        self.release = threading.Event()  # ``hold=1``: pieces after the first wait for it
        self.finished: list[tuple[str, int, int]] = []
        self.server = HttpServer(self.handle, lambda req, resp, n: self.finished.append((req.path, resp.status, n)), limits)
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.port = self.loop.run_until_complete(self.server.start("127.0.0.1", 0))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(10)

    def handle(self, req: Request) -> Response | StreamResponse:
        if req.path == "/plain":
            return Response(200, b'{"ok":true}')
        params = dict(p.split("=") for p in req.query.split("&") if p)
        n, dt, hold = int(params.get("n", "3")), float(params.get("dt", "0")), params.get("hold") == "1"
        req.on_disconnect = lambda: self.disconnects.append(req.path)

        def start(stream: Stream) -> None:
            def piece(i: int) -> None:
                if stream.closed:
                    return
                if hold and i > 0 and not self.release.is_set():
                    self.loop.call_later(0.01, piece, i)
                    return
                if i == n:
                    stream.end()
                    return
                stream.write(f"data: {i}\n\n".encode())
                self.loop.call_later(dt, piece, i + 1)

            if n == 0:
                stream.end()  # ended inside start()
            else:
                piece(0)

        return StreamResponse(start, headers=[("X-Test", "1")])

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def harness():
    h = _Harness(HttpLimits(header_timeout=0.3, body_timeout=0.3, keep_alive_timeout=0.3))
    yield h
    h.close()


def _read_until(sock: socket.socket, marker: bytes, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def _dechunk(body: bytes) -> tuple[bytes, bytes]:
    """Decode a chunked body; returns (payload, what follows the terminating chunk)."""
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body.startswith(b"\r\n")
            return out, body[2:]
        out += body[:size]
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]


def test_chunked_stream_then_keep_alive_and_pipelining(harness):
    with socket.create_connection(("127.0.0.1", harness.port)) as s:
        # a stream, then a plain request pipelined behind it on the same connection
        s.sendall(b"GET /stream?n=4&dt=0.01 HTTP/1.1\r\nHost: x\r\n\r\nGET /plain HTTP/1.1\r\nHost: x\r\n\r\n")
        data = _read_until(s, b'{"ok":true}')
        head, _, rest = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head and b"X-Test: 1" in head
        assert b"Content-Type: text/event-stream" in head and b"Connection: keep-alive" in head
        payload, after = _dechunk(rest)
        assert payload == b"".join(f"data: {i}\n\n".encode() for i in range(4))
        assert after.startswith(b"HTTP/1.1 200") and after.endswith(b'{"ok":true}')
        # and the connection is still usable, including a stream ended inside start()
        s.sendall(b"GET /stream?n=0 HTTP/1.1\r\nHost: x\r\n\r\n")
        data = _read_until(s, b"0\r\n\r\n")
        assert _dechunk(data.partition(b"\r\n\r\n")[2]) == (b"", b"")
    _wait(lambda: len(harness.finished) == 3)
    assert [f[:2] for f in harness.finished] == [("/stream", 200), ("/plain", 200), ("/stream", 200)]
    assert harness.finished[0][2] == len(payload)


def test_pieces_are_flushed_as_produced(harness):
    with socket.create_connection(("127.0.0.1", harness.port)) as s:
        s.sendall(b"GET /stream?n=3&hold=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        data = _read_until(s, b"data: 0")  # arrives while the producer still holds the rest back
        assert b"data: 0" in data and b"data: 1" not in data
        harness.release.set()
        data += _read_until(s, b"0\r\n\r\n")
        assert b"data: 2" in data


def test_streaming_connection_is_not_timed_out(harness):
    # every timeout is 0.3 s; the stream lasts ~1.2 s and must arrive whole
    with socket.create_connection(("127.0.0.1", harness.port)) as s:
        s.sendall(b"GET /stream?n=6&dt=0.2 HTTP/1.1\r\nHost: x\r\n\r\n")
        data = _read_until(s, b"0\r\n\r\n")
        payload, _ = _dechunk(data.partition(b"\r\n\r\n")[2])
        assert payload.count(b"data: ") == 6
        assert not harness.disconnects
        # and the idle connection is closed by the keep-alive timeout afterwards
        s.settimeout(5)
        assert s.recv(100) == b""


def test_http10_stream_is_raw_and_closes(harness):
    with socket.create_connection(("127.0.0.1", harness.port)) as s:
        s.sendall(b"GET /stream?n=2 HTTP/1.0\r\n\r\n")
        data = _read_until(s, b"\x00never")  # read to EOF
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head and b"Connection: close" in head
    assert body == b"data: 0\n\ndata: 1\n\n"


def test_disconnect_mid_stream_calls_the_hook(harness):
    with socket.create_connection(("127.0.0.1", harness.port)) as s:
        s.sendall(b"GET /stream?n=100&dt=0.05 HTTP/1.1\r\nHost: x\r\n\r\n")
        _read_until(s, b"data: 1")
    _wait(lambda: harness.disconnects)
    assert harness.disconnects == ["/stream"]
    _wait(lambda: not harness.server.in_flight)
    assert harness.server.in_flight == 0 and not harness.server.connections
    # a plain request is unaffected afterwards
    with socket.create_connection(("127.0.0.1", harness.port)) as s:
        s.sendall(b"GET /plain HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _read_until(s, b'{"ok":true}').endswith(b'{"ok":true}')
