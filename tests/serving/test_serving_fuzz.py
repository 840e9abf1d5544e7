"""Fuzzing the endpoints with a seeded mutation loop: malformed JSON, wrong shapes and
dtypes, binary sizes that disagree with the header, unknown models and versions, oversize
bodies, garbage request heads, slow clients. Every request gets an answer (a 4xx with a
reason, or 200 when the mutation happened to stay valid), the server stays up and still
answers correctly, and slow clients hold only their own connections."""

import json
import random
import socket
import threading
import time

import numpy as np
import pytest
from serving_testlib import RawClient, affine_model, raw_exchange, status_of

from cairn.core_array import ArraySpec
from cairn.serving._batcher import BatchingConfig
from cairn.serving._http import HttpLimits
from cairn.serving._model import PythonModel

MAX_BODY = 4096
DATATYPES = ["FP32", "FP64", "FP16", "BF16", "INT32", "INT8", "UINT8", "BOOL", "INT64", "BYTES", "fp32", "", "FP128"]


def _int_model():
    return PythonModel(
        lambda d: {"s": d["a"].astype(np.int64).sum(axis=1, keepdims=True) + d["b"]},
        {"a": ArraySpec(("b", 3), "int32"), "b": ArraySpec(("b", 1), "int64")},
        {"s": ArraySpec(("b", 1), "int64")},
        max_batch_size=4,
        name="ints",
    )


@pytest.fixture
def server(start_server):
    limits = HttpLimits(max_body_bytes=MAX_BODY, header_timeout=0.5, body_timeout=0.5)
    return start_server([affine_model(), _int_model()], limits=limits, batching=BatchingConfig(max_queue_delay=0.001))


def _valid(rng: random.Random):
    """A valid request: (path, json header dict, binary chunks)."""
    if rng.random() < 0.5:
        n = rng.randint(1, 4)
        x = np.asarray([[rng.uniform(-5, 5) for _ in range(4)] for _ in range(n)], np.float32)
        inputs = [("x", "FP32", x)]
        path = "/v2/models/affine/infer"
    else:
        n = rng.randint(1, 4)
        a = np.asarray([[rng.randint(-100, 100) for _ in range(3)] for _ in range(n)], np.int32)
        inputs = [("a", "INT32", a), ("b", "INT64", np.arange(n, dtype=np.int64).reshape(n, 1))]
        path = "/v2/models/ints/infer" if rng.random() < 0.8 else "/v2/models/ints/versions/1/infer"
    head = {"id": str(rng.randint(0, 10**6)), "inputs": []}
    chunks = []
    for name, dt, arr in inputs:
        entry = {"name": name, "shape": list(arr.shape), "datatype": dt}
        if rng.random() < 0.5:
            raw = arr.tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = arr.reshape(-1).tolist()
        head["inputs"].append(entry)
    if rng.random() < 0.3:
        head["parameters"] = {"binary_data_output": rng.random() < 0.5}
    return path, head, chunks


def _mutate_json(rng: random.Random, path: str, head: dict, chunks: list):
    choice = rng.randrange(14)
    dicts = [i for i in head["inputs"] if isinstance(i, dict)] if isinstance(head.get("inputs"), list) else []
    if not dicts:  # an earlier mutation broke 'inputs' itself
        return path, head, chunks
    inp = rng.choice(dicts)
    if choice == 0:
        inp["datatype"] = rng.choice(DATATYPES)
    elif choice == 1:
        inp["shape"] = [rng.choice([-1, 0, 1, 2, 3, 4, 5, 9, 10**12, "2", None]) for _ in range(rng.randint(0, 4))]
    elif choice == 2:
        inp["data"] = rng.choice([[], [1], ["a"], [[1, 2], [3]], {"x": 1}, None, [1e309], [True] * 7, [[[1]]] * 5])
    elif choice == 3:
        inp.pop(rng.choice(["name", "shape", "datatype", "data", "parameters"]), None)
    elif choice == 4:
        inp.setdefault("parameters", {})["binary_data_size"] = rng.choice([-1, 0, 1, 7, 17, 10**9, "8", None, 2.5])
    elif choice == 5:
        inp["name"] = rng.choice(["", "y", "x ", "a", "b", 7, None])
    elif choice == 6:
        path = rng.choice(["/v2/models/nope/infer", "/v2/models/affine/versions/2/infer", "/v2/models/affine/versions/x/infer",
                           "/v2/models//infer", "/v2/models/affine/infer/more", "/v2/models/%00/infer"])
    elif choice == 7:
        head["outputs"] = rng.choice([[{"name": "nope"}], [{"name": "y", "parameters": {"binary_data": "yes"}}], {}, [7], [{"name": "s"}]])
    elif choice == 8:
        head["id"] = rng.choice([1, None, [], "ok"])
    elif choice == 9:
        head["inputs"].append(dict(inp))
    elif choice == 10:
        head["inputs"] = rng.choice([None, {}, "x", [None]])
    elif choice == 11:
        head["parameters"] = rng.choice([None, [], {"binary_data_output": "x"}, "p"])
    elif choice == 12 and chunks:
        i = rng.randrange(len(chunks))
        chunks[i] = chunks[i][: rng.randrange(len(chunks[i]) + 1)] if rng.random() < 0.5 else chunks[i] + b"\0" * rng.randint(1, 9)
    else:
        inp["shape"] = [d + rng.choice([-1, 1]) if isinstance(d, int) else d for d in inp.get("shape", [])]
    return path, head, chunks


def _encode(rng: random.Random, path: str, head: dict, chunks: list):
    header = json.dumps(head).encode()
    body = header + b"".join(chunks)
    headers = {}
    if chunks or rng.random() < 0.1:
        headers["Inference-Header-Content-Length"] = str(len(header))
    roll = rng.random()
    if roll < 0.05:  # byte-level damage
        b = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
        body = bytes(b)
    elif roll < 0.08:
        body = body[: rng.randrange(len(body) + 1)]
    elif roll < 0.10:
        headers["Inference-Header-Content-Length"] = rng.choice(["-1", "x", str(len(body) + 5), "99999999999999999999"])
    elif roll < 0.12:
        body = body + b"\0" * (MAX_BODY + 1 - len(body))  # over the limit: 413
    elif roll < 0.13:
        headers["Content-Encoding"] = "gzip"
    return path, body, headers


def _check(status: int, headers: dict, body: bytes, path: str, sent: bytes):
    assert status in (200, 400, 404, 405, 413), (status, body[:300], path, sent[:300])
    if status == 200:
        hl = headers.get("inference-header-content-length")
        out = json.loads(body[: int(hl)] if hl else body)
        assert out["outputs"] and out["model_name"] in ("affine", "ints")
    else:
        reason = json.loads(body)["error"]
        assert isinstance(reason, str) and len(reason) > 5


def _fuzz(server, seed: int, n: int):
    rng = random.Random(seed)
    client = RawClient(server)
    counts = {}
    for _ in range(n):
        path, head, chunks = _valid(rng)
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            path, head, chunks = _mutate_json(rng, path, head, chunks)
        path, body, headers = _encode(rng, path, head, chunks)
        status, rheaders, rbody = client.request("POST", path, body, headers)
        _check(status, rheaders, rbody, path, body)
        counts[status] = counts.get(status, 0) + 1
    client.close()
    return counts


def _still_serving(server):
    c = RawClient(server)
    status, _, body = c.infer_json("affine", np.ones((2, 4), np.float32))
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [3.0] * 8
    c.close()


def test_fuzz_endpoints(server):
    counts = _fuzz(server, seed=1, n=1500)
    assert counts.get(200, 0) > 100 and counts.get(400, 0) > 300 and counts.get(404, 0) > 10 and counts.get(413, 0) > 5
    _still_serving(server)


@pytest.mark.slow
def test_fuzz_endpoints_long(server):
    threads, errors = [], []

    def run(seed):
        try:
            _fuzz(server, seed=seed, n=5000)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    for seed in range(4):  # four clients at once, 20k requests in all
        threads.append(threading.Thread(target=run, args=(100 + seed,)))
        threads[-1].start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    _still_serving(server)


def _mutate_head(rng: random.Random) -> bytes:
    lines = [b"POST /v2/models/affine/infer HTTP/1.1", b"Host: x", b"Content-Length: 2"]
    ops = rng.randrange(6)
    if ops == 0:
        lines[0] = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
    elif ops == 1:
        lines[0] = rng.choice([b"POST  /v2 HTTP/1.1", b"POST /v2 HTTP/9.9", b"POST /v2", b"", b"\x00 / HTTP/1.1"])
    elif ops == 2:
        lines[2] = rng.choice([b"Content-Length: -5", b"Content-Length: x", b"Content-Length: 1e3", b"Content-Length: 99999999999999999999"])
    elif ops == 3:
        lines.append(rng.choice([b"no colon here", b": empty", b" Leading: space"]))
    elif ops == 4:
        lines.append(b"X-Big: " + b"a" * 70000)
    else:
        lines.append(b"Transfer-Encoding: chunked")
    return b"\r\n".join(lines) + b"\r\n\r\n{}"


def test_fuzz_request_heads(server):
    rng = random.Random(7)
    for _ in range(150):
        raw = raw_exchange(server, _mutate_head(rng))
        status = status_of(raw)
        assert 400 <= status < 500 or status == 505, raw[:200]
        assert b'"error"' in raw
    _still_serving(server)


def test_slow_clients_do_not_block_others(server):
    """Twenty clients dribble a byte every 50 ms; a normal client meanwhile gets 100 answers;
    the slow ones are cut off with 408 once the 0.5 s header timeout passes."""
    request = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200 + b"\r\n\r\n"
    outcomes = []

    def dribble():
        with socket.create_connection((server.host, server.port), timeout=5) as s:
            try:
                for byte in request:
                    s.sendall(bytes([byte]))
                    time.sleep(0.05)
            except OSError:  # the server closed on us after its 408
                pass
            data = b""
            try:
                while chunk := s.recv(4096):
                    data += chunk
            except OSError:
                pass
            outcomes.append(status_of(data))

    slow = [threading.Thread(target=dribble) for _ in range(20)]
    for t in slow:
        t.start()
    c = RawClient(server)
    for _ in range(100):
        status, _, _ = c.infer_json("affine", np.ones((1, 4), np.float32))
        assert status == 200
    assert all(t.is_alive() for t in slow[:1]) or outcomes  # the fast client finished alongside them
    c.close()
    for t in slow:
        t.join(10)
    assert outcomes == [408] * 20
