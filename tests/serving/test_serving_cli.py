"""cairn-serve in a subprocess over a repository of real exported models: tritonclient
answers match NumPy, the token is enforced, logs are JSON lines, and SIGTERM answers the
requests in flight before the process exits 0."""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tritonclient.http as th

from cairn.core_array import ArraySpec


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    import jax
    import jax.numpy as jnp

    from cairn.serving import export

    root = tmp_path_factory.mktemp("repo")
    w = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)

    def mlp(p, x):
        return {"y": jnp.tanh(x["x"] @ p["w"])}

    def slow(p, x):  # ~90 GFLOP (about a second here) whatever the batch: in flight at SIGTERM
        body = lambda i, m: jnp.tanh(m @ p["m"]) * 0.5  # noqa: E731
        m = jax.lax.fori_loop(0, 800, body, p["m"])
        return {"y": x["x"] + m[0, 0] * 0}

    spec = {"x": ArraySpec(("b", 8), "float32", constraints=("b <= 4",))}
    export(mlp, {"w": w}, spec, root / "mlp" / "1", batch_buckets=(4,))
    export(slow, {"m": np.eye(384, dtype=np.float32)}, spec, root / "slow" / "1", batch_buckets=(4,))
    return root, w


def _start(root, *extra, env=None):
    proc = subprocess.Popen(
        [sys.executable, "-m", "cairn.serving._cli", "--model-repository", str(root), "--port", "0", *extra],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
    )
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"serving on http://([\d.]+:\d+)", line)
        if m:
            threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
            return proc, m.group(1), lines
    proc.kill()
    raise AssertionError("cairn-serve did not start:\n" + "".join(lines))


def test_cli_serves_exported_models_with_a_token(repo):
    root, w = repo
    proc, addr, lines = _start(root, "--max-queue-delay-us", "500", env={"CAIRN_SERVE_TOKEN": "tok"})
    try:
        assert addr.startswith("127.0.0.1:")  # loopback unless told otherwise
        client = th.InferenceServerClient(addr)
        auth = {"Authorization": "Bearer tok"}
        x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
        inp = th.InferInput("x", [3, 8], "FP32")
        inp.set_data_from_numpy(x)
        y = client.infer("mlp", [inp], headers=auth).as_numpy("y")
        np.testing.assert_allclose(y, np.tanh(x.astype(np.float64) @ w), rtol=1e-5, atol=1e-6)
        with pytest.raises(Exception, match="bearer token"):
            client.infer("mlp", [inp])
        assert client.get_model_metadata("mlp", headers=auth)["inputs"][0]["shape"] == [-1, 8]
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert any(r.get("path") == "/v2/models/mlp/infer" and r.get("status") == 401 for r in records)
    assert any(r.get("status") == 200 and r.get("request_id") for r in records)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_sigterm_drains_in_flight_requests(repo):
    root, _ = repo
    proc, addr, _ = _start(root, "--workers", "1")
    results = []

    def send():
        client = th.InferenceServerClient(addr, network_timeout=60)
        inp = th.InferInput("x", [1, 8], "FP32")
        inp.set_data_from_numpy(np.ones((1, 8), np.float32))
        try:
            results.append(client.infer("slow", [inp]).as_numpy("y"))
        except Exception as e:  # noqa: BLE001 - recorded and asserted on
            results.append(e)

    threads = [threading.Thread(target=send) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # all six are queued or running (one slow batch takes longer than this)
    assert results == []  # none answered yet: the drain below is what answers them
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert proc.wait(60) == 0
    assert len(results) == 6 and all(isinstance(r, np.ndarray) for r in results), results
    for r in results:
        np.testing.assert_array_equal(r, np.ones((1, 8), np.float32))


def test_a_request_on_a_kept_alive_connection_after_sigterm_gets_503_and_close(repo):
    root, _ = repo
    proc, addr, _ = _start(root, "--drain-grace", "60")  # a long grace: the test waits for nothing
    host, port = addr.split(":")
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/v2/health/live")
        first = conn.getresponse()
        first.read()
        assert first.status == 200 and first.getheader("Connection") == "keep-alive"
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the drain has begun once the listening socket is gone
            try:
                socket.create_connection((host, int(port)), timeout=5).close()
            except ConnectionRefusedError:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the server kept listening after SIGTERM")
        conn.request("GET", "/v2/models/mlp")  # on the connection kept alive from before
        late = conn.getresponse()
        body = late.read()
        assert late.status == 503 and late.getheader("Connection") == "close"
        assert "shutting down" in json.loads(body)["error"]
        conn.close()
        assert proc.wait(60) == 0  # its only connection closed: the drain ends before the grace
    finally:
        proc.kill()


def test_main_in_process_leaves_no_log_handler_behind(tmp_path, capsys):
    # a notebook or test calling main() must not keep a handler on its (later closed) stderr:
    # later access-log lines would then fail with "I/O operation on closed file"
    import logging

    from cairn.serving._cli import main

    log = logging.getLogger("cairn.serving")
    before, level = list(log.handlers), log.level
    assert main(["--model-repository", str(tmp_path / "missing")]) == 2
    assert log.handlers == before and log.level == level
    assert "missing" in capsys.readouterr().err
