"""Helpers for the serving tests (conftest.py puts this folder on sys.path): small models
and a raw keep-alive HTTP client (tritonclient covers the protocol; the raw client sends
what tritonclient never would)."""

from __future__ import annotations

import http.client
import json
import socket
import threading

import numpy as np

from cairn.core_array import ArraySpec
from cairn.serving._model import PythonModel
from cairn.serving._server import Server

F32 = "float32"


def affine_model(name: str = "affine", max_batch_size: int = 8, buckets=(1, 2, 4, 8), scale: float = 2.0, offset: float = 1.0, **kw):
    """y = x * scale + offset row by row (float32, x of shape (b, 4))."""

    def fn(d):
        with np.errstate(over="ignore"):  # fuzzed binary inputs hold huge floats
            return {"y": d["x"] * np.float32(scale) + np.float32(offset)}

    return PythonModel(
        fn,
        {"x": ArraySpec(("b", 4), F32)},
        {"y": ArraySpec(("b", 4), F32)},
        max_batch_size=max_batch_size,
        batch_buckets=buckets if max_batch_size else None,
        name=name,
        **kw,
    )


def mlp_model(name: str = "mlp", max_batch_size: int = 16, seed: int = 0):
    """A two-layer float64 MLP (x: (b, 8) float64 -> y: (b, 3), z: (b,) int32 argmax), computed
    row by row; ``model.reference(x)`` is the batched float64 formula."""
    rng = np.random.default_rng(seed)
    w1, w2 = rng.normal(size=(8, 16)), rng.normal(size=(16, 3))

    def reference(x):
        return np.tanh(x @ w1) @ w2

    def fn(d):  # row by row, so a row's result cannot depend on the batch it came in (BLAS may)
        y = np.stack([np.tanh(row @ w1) @ w2 for row in d["x"]]).reshape(len(d["x"]), 3)
        return {"y": y, "z": np.argmax(y, axis=1).astype(np.int32)}

    m = PythonModel(
        fn,
        {"x": ArraySpec(("b", 8), "float64")},
        {"y": ArraySpec(("b", 3), "float64"), "z": ArraySpec(("b",), "int32")},
        max_batch_size=max_batch_size,
        name=name,
    )
    m.reference = reference  # type: ignore[attr-defined]
    return m


class RawClient:
    """One keep-alive HTTP/1.1 connection (http.client); ``request`` returns (status, headers, body)."""

    def __init__(self, server: Server, timeout: float = 30.0):
        self.conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)

    def request(self, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
        if isinstance(body, str):
            body = body.encode()
        self.conn.request(method, path, body=body, headers=headers or {})
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.getheader("Connection", "").lower() == "close":
            self.conn.close()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data

    def infer_json(self, model: str, x: np.ndarray, datatype: str = "FP32", name: str = "x", **extra):
        body = {"inputs": [{"name": name, "shape": list(x.shape), "datatype": datatype, "data": x.reshape(-1).tolist()}], **extra}
        return self.request("POST", f"/v2/models/{model}/infer", json.dumps(body))

    def close(self) -> None:
        self.conn.close()


def raw_exchange(server: Server, payload: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes on a fresh socket, read until the server closes or answers one response."""
    with socket.create_connection((server.host, server.port), timeout=timeout) as s:
        s.sendall(payload)
        chunks = []
        try:
            while True:
                data = s.recv(65536)
                if not data:
                    break
                chunks.append(data)
                joined = b"".join(chunks)
                head, sep, rest = joined.partition(b"\r\n\r\n")
                if sep:
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
                    if len(rest) >= length:
                        break
        except TimeoutError:
            pass
        return b"".join(chunks)


def status_of(raw: bytes) -> int:
    """The status code of a raw HTTP response (0 when none came)."""
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.") else 0


def hammer(server: Server, model: str, stop: threading.Event, results: list, x: np.ndarray | None = None):
    """Send JSON infers on one keep-alive connection until ``stop``; append (status, body) to results."""
    client = RawClient(server)
    x = np.ones((1, 4), np.float32) if x is None else x
    try:
        while not stop.is_set():
            status, _, body = client.infer_json(model, x)
            results.append((status, body))
    finally:
        client.close()


def hermetic_prelude(blocked: tuple[str, ...]) -> str:
    """The first lines of a script run in a fresh process where importing any module named
    in (or under) ``blocked`` fails: a hermetic load must work without the model's code."""
    return (
        "import importlib.abc, json, sys\n"
        f"BLOCKED = {tuple(blocked)!r}\n"
        "\n"
        "class Blocker(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.startswith(BLOCKED):\n"
        "            raise ImportError(f'blocked in the hermetic test: {name}')\n"
        "        return None\n"
        "\n"
        "sys.meta_path.insert(0, Blocker())\n"
    )

