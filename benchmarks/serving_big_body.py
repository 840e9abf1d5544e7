"""Health checks while one 64 MB JSON infer body is in flight (cairn.serving issue 25, item 11).

Serves one model (the float64 sum of a float32 vector) in this process, sends a ~64 MB
JSON ``/infer`` body from a thread over a raw socket, and, from the moment the body is
sent until its answer arrives, calls ``GET /v2/health/live`` on a second kept-alive
connection as fast as answers come. Reports the infer time and the health-check
latencies (median, 99th percentile and worst) seen meanwhile. The goal: every health
answer within 100 ms while the big body is parsed (bodies over 1 MiB are parsed in a
worker process; before, json.loads on the event loop held every connection for seconds).
The ``baseline`` row is the noise floor of the machine: the same health loop for 10 s on
the idle server while a separate process burns one core (as the parsing worker does).

    python benchmarks/serving_big_body.py [--mb 64] [--rounds 3]

Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cairn.core_array import ArraySpec
from cairn.serving import PythonModel, serve


def _body(mb: float) -> tuple[bytes, float]:
    """A JSON infer body of about ``mb`` megabytes and the float64 sum it asks for."""
    piece = b"0.25,1.5,-2.0,"
    k = int(mb * 1e6 * 0.98) // len(piece)
    data = b"[" + piece * (k - 1) + piece[:-1] + b"]"
    body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [%d], "data": %s}]}' % (3 * k, data)
    return body, k * (0.25 + 1.5 - 2.0)


def _health_until(server: Any, busy: Callable[[], bool]) -> list[float]:
    """Health-check latencies (s) on one kept-alive connection while ``busy()`` is true."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
    latencies = []
    while busy():
        t0 = time.perf_counter()
        conn.request("GET", "/v2/health/live")
        resp = conn.getresponse()
        resp.read()
        latencies.append(time.perf_counter() - t0)
        assert resp.status == 200
    conn.close()
    return latencies


def _summary(latencies: list[float]) -> dict:
    ms = sorted(x * 1e3 for x in latencies)
    return {
        "health_checks": len(ms),
        "health_p50_ms": round(ms[len(ms) // 2], 2),
        "health_p99_ms": round(ms[int(len(ms) * 0.99)], 2),
        "health_max_ms": round(ms[-1], 2),
    }


def baseline(server: Any, seconds: float = 10.0) -> dict:
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        end = time.perf_counter() + seconds
        return {"infer_s": 0.0, **_summary(_health_until(server, lambda: time.perf_counter() < end))}
    finally:
        burner.kill()
        burner.wait()


def one_round(server: Any, body: bytes, want: float) -> dict:
    sent, answer = threading.Event(), {}

    def big() -> None:
        with socket.create_connection((server.host, server.port), timeout=300) as s:
            start = time.perf_counter()
            s.sendall(b"POST /v2/models/total/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            sent.set()
            resp = http.client.HTTPResponse(s)
            resp.begin()
            answer.update(status=resp.status, body=resp.read(), seconds=time.perf_counter() - start)

    t = threading.Thread(target=big)
    t.start()
    sent.wait(300)
    latencies = _health_until(server, t.is_alive)
    t.join()
    assert answer["status"] == 200, answer
    assert json.loads(answer["body"])["outputs"][0]["data"] == [want]
    return {"infer_s": round(answer["seconds"], 3), **_summary(latencies)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=64.0, help="body size in MB (at most the 64 MiB body limit)")
    p.add_argument("--rounds", type=int, default=3, help="big requests, one after another")
    args = p.parse_args()
    model = PythonModel(
        lambda d: {"s": np.array([d["x"].astype(np.float64).sum()])},
        {"x": ArraySpec(("n",), "float32")},
        {"s": ArraySpec((1,), "float64")},
        max_batch_size=0,
        name="total",
    )
    body, want = _body(args.mb)
    rows = []
    with serve(model) as server:
        rows.append({"round": "baseline", "body_mb": 0, **baseline(server)})
        for i in range(args.rounds):
            rows.append({"round": i, "body_mb": round(len(body) / 1e6, 1), **one_round(server, body, want)})
    print(f"{'round':>8} {'body MB':>8} {'infer s':>8} {'checks':>7} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>8}")
    for r in rows:
        print(f"{r['round']:>8} {r['body_mb']:>8} {r['infer_s']:>8} {r['health_checks']:>7} {r['health_p50_ms']:>7} "
              f"{r['health_p99_ms']:>7} {r['health_max_ms']:>8}")
    print(json.dumps({"big_body": rows}))


if __name__ == "__main__":
    main()
