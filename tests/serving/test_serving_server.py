"""The server end to end with tritonclient.http (unchanged) and a raw client: health,
metadata, JSON and binary tensors (FP16 and BF16 included), request ids, errors with
reasons (404, 405, 400, 401, 413, 500 for one request only, 503 when the queue is full),
metrics and structured access logs."""

import http.client
import json
import logging
import re
import socket
import threading

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as th
from serving_testlib import RawClient, affine_model, mlp_model, raw_exchange, status_of
from tritonclient.utils import InferenceServerException

from cairn.core_array import ArraySpec
from cairn.serving._batcher import BatchingConfig
from cairn.serving._http import HttpLimits
from cairn.serving._model import PythonModel


def _cast_model():
    """FP16 and BF16 in, both cast to float32 and summed out (row-wise)."""
    return PythonModel(
        lambda d: {"s": d["h"].astype(np.float32) + d["b"].astype(np.float32), "b2": d["b"]},
        {"h": ArraySpec(("b", 3), "float16"), "b": ArraySpec(("b", 3), "bfloat16")},
        {"s": ArraySpec(("b", 3), "float32"), "b2": ArraySpec(("b", 3), "bfloat16")},
        max_batch_size=4,
        name="cast",
    )


def _flaky_model():
    def fn(d):
        if np.any(d["x"] < 0):
            raise RuntimeError("negative inputs are not allowed")
        return {"y": d["x"] * 2}

    return PythonModel(fn, {"x": ArraySpec(("b", 4), "float32")}, {"y": ArraySpec(("b", 4), "float32")}, max_batch_size=8, name="flaky")


@pytest.fixture
def server(start_server):
    return start_server([affine_model(), mlp_model(), _cast_model(), _flaky_model()], batching=BatchingConfig(max_queue_delay=0.002))


@pytest.fixture
def client(server):
    c = th.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    c.close()


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "cairn-serving" and "binary_tensor_data" in meta["extensions"]
    assert client.is_model_ready("mlp") and client.is_model_ready("mlp", "1")
    assert not client.is_model_ready("mlp", "2") and not client.is_model_ready("nope")
    m = client.get_model_metadata("mlp")
    assert m["name"] == "mlp" and m["versions"] == ["1"]
    assert m["inputs"] == [{"name": "x", "datatype": "FP64", "shape": [-1, 8]}]
    assert {o["name"]: o["datatype"] for o in m["outputs"]} == {"y": "FP64", "z": "INT32"}
    cfg = client.get_model_config("mlp")
    assert cfg["max_batch_size"] == 16 and cfg["input"][0]["dims"] == [8]
    inp = th.InferInput("x", [2, 8], "FP64")
    inp.set_data_from_numpy(np.zeros((2, 8)))
    client.infer("mlp", [inp])
    (stats,) = client.get_inference_statistics("mlp")["model_stats"]
    assert stats["name"] == "mlp" and stats["inference_count"] == 2 and stats["execution_count"] == 1
    assert stats["inference_stats"]["success"]["count"] == 1 and stats["inference_stats"]["success"]["ns"] > 0
    assert {s["name"] for s in client.get_inference_statistics()["model_stats"]} == {"affine", "mlp", "cast", "flaky"}
    index = client.get_model_repository_index()
    assert {r["name"] for r in index} == {"affine", "mlp", "cast", "flaky"} and all(r["state"] == "READY" for r in index)


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False])
def test_infer_json_and_binary(client, binary_in, binary_out):
    x = np.random.default_rng(1).normal(size=(5, 8))
    inp = th.InferInput("x", list(x.shape), "FP64")
    inp.set_data_from_numpy(x, binary_data=binary_in)
    outs = [th.InferRequestedOutput("y", binary_data=binary_out), th.InferRequestedOutput("z", binary_data=binary_out)]
    result = client.infer("mlp", [inp], outputs=outs, request_id="req-7")
    ref = mlp_model().reference(x)
    np.testing.assert_allclose(result.as_numpy("y"), ref, rtol=1e-12)
    np.testing.assert_array_equal(result.as_numpy("z"), np.argmax(ref, axis=1))
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_name"] == "mlp" and response["model_version"] == "1"


def test_fp16_and_bf16_binary(client):
    h = np.array([[0.5, -1.25, 3.0]], np.float16)
    b = np.array([[1.0, 2.5, -0.0078125]], ml_dtypes.bfloat16)
    ih, ib = th.InferInput("h", [1, 3], "FP16"), th.InferInput("b", [1, 3], "BF16")
    ih.set_data_from_numpy(h)
    ib.set_data_from_numpy(b)
    result = client.infer("cast", [ih, ib])
    np.testing.assert_array_equal(result.as_numpy("s"), h.astype(np.float64) + b.astype(np.float64))
    np.testing.assert_array_equal(np.asarray(result.as_numpy("b2"), dtype=np.float32), b.astype(np.float32))


def test_versioned_route_unknown_model_and_version(client):
    x = np.ones((1, 4), np.float32)
    inp = th.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("affine", [inp], model_version="1").as_numpy("y"), x * 2 + 1)
    with pytest.raises(InferenceServerException, match="has no loaded version '3'"):
        client.infer("affine", [inp], model_version="3")
    with pytest.raises(InferenceServerException, match="model 'nope' is unknown"):
        client.infer("nope", [inp])


def test_validation_errors_name_the_input(server):
    c = RawClient(server)
    status, _, body = c.infer_json("affine", np.ones((1, 4)), datatype="FP64")
    assert status == 400 and "input 'x': dtype float64, expected float32" in json.loads(body)["error"]
    status, _, body = c.infer_json("affine", np.ones((1, 5), np.float32))
    assert status == 400 and "input 'x'" in json.loads(body)["error"]
    status, _, body = c.infer_json("affine", np.ones((9, 4), np.float32))
    assert status == 400 and "batch size 9 exceeds max_batch_size 8" in json.loads(body)["error"]
    status, _, body = c.infer_json("affine", np.ones((1, 4), np.float32), name="w")
    assert status == 400 and "missing ['x']; unknown ['w']" in json.loads(body)["error"]
    status, _, body = c.infer_json("affine", np.ones((1, 4), np.float32), outputs=[{"name": "q"}])
    assert status == 400 and "requested output 'q'" in json.loads(body)["error"]
    status, headers, body = c.request("GET", "/v2/models/affine/infer")
    assert status == 405 and headers["allow"] == "POST"
    status, _, body = c.request("GET", "/v2/nothing/here")
    assert status == 404 and "no route" in json.loads(body)["error"]
    status, _, body = c.request("POST", "/v2/models/affine/infer", b'{"inputs": [}')
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]
    c.close()


def test_request_ids(server):
    c = RawClient(server)
    _, headers, _ = c.request("GET", "/v2/health/live", headers={"X-Request-Id": "trace-42"})
    assert headers["x-request-id"] == "trace-42"
    _, h1, _ = c.request("GET", "/v2/health/live")
    _, h2, _ = c.request("GET", "/v2/health/live")
    assert h1["x-request-id"] != h2["x-request-id"]
    status, headers, body = c.infer_json("affine", np.ones((1, 4), np.float32), id="body-id")
    assert status == 200 and json.loads(body)["id"] == "body-id" and headers["x-request-id"]
    c.close()


def test_a_raising_model_fails_only_that_request(server, client):
    results = {}

    def send(i, v):
        c = RawClient(server)
        results[i] = c.infer_json("flaky", np.full((1, 4), v, np.float32))
        c.close()

    threads = [threading.Thread(target=send, args=(i, -1.0 if i == 3 else float(i))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (status, _, body) in results.items():
        if i == 3:
            assert status == 500 and "negative inputs are not allowed" in json.loads(body)["error"]
        else:
            assert status == 200 and json.loads(body)["outputs"][0]["data"] == [2.0 * i] * 4
    assert client.is_server_live()


def test_bearer_token(start_server):
    server = start_server(affine_model(), token="s3cret")
    c = RawClient(server)
    assert c.request("GET", "/v2/health/live")[0] == 200  # probes stay open
    status, headers, body = c.infer_json("affine", np.ones((1, 4), np.float32))
    assert status == 401 and headers["www-authenticate"] == "Bearer" and "bearer token" in json.loads(body)["error"]
    assert c.request("GET", "/metrics")[0] == 401
    assert c.request("GET", "/v2/models/affine", headers={"Authorization": "Bearer wrong"})[0] == 401
    client = th.InferenceServerClient(server.url.removeprefix("http://"))
    auth = {"Authorization": "Bearer s3cret"}
    inp = th.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(np.ones((1, 4), np.float32))
    np.testing.assert_array_equal(client.infer("affine", [inp], headers=auth).as_numpy("y"), np.full((1, 4), 3.0))
    with pytest.raises(InferenceServerException, match="bearer token"):
        client.infer("affine", [inp])
    client.close()
    c.close()


def test_body_limit_and_timeouts(start_server):
    server = start_server(affine_model(), limits=HttpLimits(max_body_bytes=1000, header_timeout=0.3, body_timeout=0.3))
    raw = raw_exchange(server, b"POST /v2/models/affine/infer HTTP/1.1\r\nContent-Length: 5000\r\n\r\n")
    assert status_of(raw) == 413 and b"exceeds the limit of 1000 bytes" in raw and b"Connection: close" in raw
    raw = raw_exchange(server, b"POST /v2/models/affine/infer HTTP/1.1\r\nContent-Le")  # never finishes its headers
    assert status_of(raw) == 408 and b"timed out reading the request headers" in raw
    raw = raw_exchange(server, b"POST /v2/models/affine/infer HTTP/1.1\r\nContent-Length: 10\r\n\r\n{}")
    assert status_of(raw) == 408 and b"request body" in raw
    raw = raw_exchange(server, b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert status_of(raw) == 411
    assert status_of(raw_exchange(server, b"garbage\r\n\r\n")) == 400
    assert status_of(raw_exchange(server, b"GET / HTTP/2.0\r\n\r\n")) == 505
    assert status_of(raw_exchange(server, b"GET /v2/health/live HTTP/1.1\r\nbad header\r\n\r\n")) == 400


def test_pipelined_requests_answer_in_order(server):
    one = b"GET /v2/health/live HTTP/1.1\r\nX-Request-Id: a\r\n\r\n"
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}).encode()
    two = b"POST /v2/models/affine/infer HTTP/1.1\r\nX-Request-Id: b\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    three = b"GET /v2/health/ready HTTP/1.1\r\nX-Request-Id: c\r\nConnection: close\r\n\r\n"
    import socket

    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(one + two + three)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK") == 3
    assert data.index(b"X-Request-Id: a") < data.index(b"X-Request-Id: b") < data.index(b"X-Request-Id: c")
    assert b'"data":[3.0,5.0,7.0,9.0]' in data


def test_queue_full_answers_503_with_retry_after(start_server):
    gate, running = threading.Event(), threading.Event()

    def slow(d):
        running.set()
        gate.wait(10)
        return {"y": d["x"]}

    model = PythonModel(slow, {"x": ArraySpec(("b", 4), "float32")}, {"y": ArraySpec(("b", 4), "float32")}, max_batch_size=1, name="slow")
    server = start_server(model, batching=BatchingConfig(max_queue_size=2), workers=2)
    results = []

    def send():
        c = RawClient(server)
        results.append(c.infer_json("slow", np.ones((1, 4), np.float32)))
        c.close()

    def queued() -> int:
        text = RawClient(server).request("GET", "/metrics")[2].decode()
        return int(float(text.split('cairn_inference_queue_size{model="slow",version="1"} ')[1].split()[0]))

    # one request running, then two queued (sent one after another: requests arriving in the
    # same loop iteration are all queued before the first is dispatched), then three refused
    threads = [threading.Thread(target=send) for _ in range(6)]
    threads[0].start()
    assert running.wait(10)
    for n, t in enumerate(threads[1:3], 1):
        t.start()
        while queued() < n:
            threading.Event().wait(0.01)
    for t in threads[3:]:
        t.start()
    while len(results) < 3:  # the other 3 are refused at once
        threading.Event().wait(0.01)
    gate.set()
    for t in threads:
        t.join()
    refused = [r for r in results if r[0] == 503]
    assert len(refused) == 3 and all(r[1]["retry-after"] == "1" and b"overloaded" in r[2] for r in refused)
    assert sum(r[0] == 200 for r in results) == 3


def test_metrics_and_access_log(server, client, caplog):
    inp = th.InferInput("x", [2, 4], "FP32")
    inp.set_data_from_numpy(np.ones((2, 4), np.float32))
    with caplog.at_level(logging.INFO, logger="cairn.serving.access"):
        for _ in range(3):
            client.infer("affine", [inp])
        RawClient(server).infer_json("affine", np.ones((1, 4)), datatype="FP64")
        c = RawClient(server)
        status, headers, body = c.request("GET", "/metrics")
        c.close()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    labels = '{model="affine",version="1"}'
    assert f"cairn_inference_request_success_total{labels} 3" in text
    assert 'cairn_inference_request_failure_total{model="affine",version="1",reason="bad_request"} 1' in text
    assert f"cairn_inference_count_total{labels} 6" in text
    for h in ("queue_duration_seconds", "compute_duration_seconds", "request_duration_seconds"):
        assert f"# TYPE cairn_inference_{h} histogram" in text
        assert f'cairn_inference_{h}_bucket{{model="affine",version="1",le="+Inf"}}' in text
    assert 'cairn_inference_batch_size_bucket{model="affine",version="1",le="2"}' in text
    assert 'cairn_http_requests_total{code="200"}' in text
    records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "cairn.serving.access"]
    infers = [r for r in records if r["path"] == "/v2/models/affine/infer"]
    assert len(infers) == 4 and [r["status"] for r in infers] == [200, 200, 200, 400]
    assert all(r["request_id"] and r["duration_ms"] >= 0 and r["method"] == "POST" for r in infers)
    parser = pytest.importorskip("prometheus_client.parser")  # the reference parser, when installed
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    assert families["cairn_inference_request_duration_seconds"].type == "histogram"
    assert families["cairn_inference_request_success"].type == "counter"


def test_server_stop_drains_and_refuses_new_connections(start_server):
    gate = threading.Event()

    def slow(d):
        gate.wait(10)
        return {"y": d["x"]}

    model = PythonModel(slow, {"x": ArraySpec(("b", 4), "float32")}, {"y": ArraySpec(("b", 4), "float32")}, max_batch_size=4, name="slow")
    server = start_server(model)
    results = []
    t = threading.Thread(target=lambda: results.append(RawClient(server).infer_json("slow", np.ones((1, 4), np.float32))))
    t.start()
    while server.app.http.in_flight == 0:
        threading.Event().wait(0.01)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    threading.Event().wait(0.2)
    gate.set()
    stopper.join(10)
    t.join(10)
    assert results[0][0] == 200 and results[0][1]["connection"] == "close"
    with pytest.raises(OSError):
        RawClient(server).request("GET", "/v2/health/live")


def test_concurrent_clients_on_two_models_get_their_own_rows(start_server):
    """Eight clients, two models (one on the shared pool, one inline), random batch sizes
    padded to buckets: every answer equals the model run alone on that request."""
    mlp, aff = mlp_model(max_batch_size=16), affine_model(max_batch_size=8)
    batching = {"mlp": BatchingConfig(max_queue_delay=0.002, run_inline=False), "affine": BatchingConfig(max_queue_delay=0.001)}
    server = start_server([mlp, aff], batching=batching, workers=2)
    failures = []

    def client(seed):
        rng = np.random.default_rng(seed)
        c = RawClient(server)
        for _ in range(25):
            n = int(rng.integers(1, 6))
            if rng.random() < 0.5:
                x = rng.normal(size=(n, 8))
                status, _, body = c.infer_json("mlp", x, datatype="FP64")
                want = mlp({"x": x})["y"]
            else:
                x = rng.normal(size=(n, 4)).astype(np.float32)
                status, _, body = c.infer_json("affine", x, outputs=[{"name": "y"}])
                want = aff({"x": x})["y"]
            got = np.array(json.loads(body)["outputs"][0]["data"]).reshape(want.shape) if status == 200 else None
            if got is None or not np.array_equal(got.astype(want.dtype), want):
                failures.append((seed, status, body[:200]))
        c.close()

    threads = [threading.Thread(target=client, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def _refuse_constant(token):
    raise ValueError(f"not JSON: {token}")


def test_nonfinite_outputs_are_strict_json_for_every_client(start_server):
    def fn(d):
        with np.errstate(divide="ignore", invalid="ignore"):
            return {"y": np.log(d["x"])}  # log(0) = -inf, log(-1) = nan, log(inf) = inf

    model = PythonModel(fn, {"x": ArraySpec(("b", 4), "float32")}, {"y": ArraySpec(("b", 4), "float32")}, max_batch_size=4, name="log")
    server = start_server(model)
    x = np.array([[0.0, -1.0, np.inf, 1.0]], np.float32)
    body = '{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, -1, "Infinity", 1]}]}'
    status, _, body = RawClient(server).request("POST", "/v2/models/log/infer", body)
    assert status == 200
    data = json.loads(body, parse_constant=_refuse_constant)["outputs"][0]["data"]
    assert data == ["-Infinity", "NaN", "Infinity", 0.0]
    client = th.InferenceServerClient(server.url.removeprefix("http://"))  # tritonclient reads the strings back
    inp = th.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(x)  # binary: tritonclient writes a JSON infinity as a bare token, refused (400)
    got = client.infer("log", [inp], outputs=[th.InferRequestedOutput("y", binary_data=False)]).as_numpy("y")
    client.close()
    with np.errstate(divide="ignore", invalid="ignore"):
        np.testing.assert_array_equal(got, np.log(x.astype(np.float64)).astype(np.float32))


@pytest.mark.parametrize(
    "data, match",
    [
        ("[1, 2, NaN, 4]", r"input 'x': data\[2\] is NaN, not a valid FP32 value"),
        ("[1, 2, 1e400, 4]", r"input 'x': data\[2\] is a number too large for any float"),
        ("[1, true, 3, 4]", r"input 'x': data\[1\] is true, not a valid FP32 value"),
    ],
)
def test_json_inputs_the_datatype_cannot_hold_answer_400(server, data, match):
    body = '{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": ' + data + "}]}"
    status, _, answer = RawClient(server).request("POST", "/v2/models/affine/infer", body)
    assert status == 400
    assert re.search(match, json.loads(answer)["error"])


def test_deeply_nested_json_answers_400_not_500(server):
    client = RawClient(server)
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"inputs": [], "parameters": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"):
        status, _, answer = client.request("POST", "/v2/models/affine/infer", body)
        assert status == 400 and "nested too deeply" in json.loads(answer)["error"]
    body = b"[" * 100_000 + b"]" * 100_000
    status, _, answer = client.request("POST", "/v2/repository/index", body)
    assert status == 400 and "nested too deeply" in json.loads(answer)["error"]
    status, _, answer = client.request("POST", "/v2/repository/index", b" " * (2 << 20) + b"{}")
    assert status == 400 and "repository index body of 2097154 bytes" in json.loads(answer)["error"]
    assert client.request("GET", "/v2/health/live")[0] == 200  # the connection lives on


def test_get_models_lists_the_repository(server, start_server):
    client = RawClient(server)
    status, _, body = client.request("GET", "/v2/models")
    assert status == 200
    listed = json.loads(body)
    assert listed == json.loads(client.request("POST", "/v2/repository/index", "{}")[2])
    assert {(r["name"], r.get("version"), r["state"]) for r in listed} == {
        ("affine", "1", "READY"), ("mlp", "1", "READY"), ("cast", "1", "READY"), ("flaky", "1", "READY")
    }
    assert json.loads(client.request("GET", "/v2/models/")[2]) == listed
    server.unload_model("mlp")
    everything = json.loads(client.request("GET", "/v2/models")[2])
    assert {"name": "mlp", "state": "UNAVAILABLE", "reason": "unloaded"} in everything
    ready = json.loads(client.request("GET", "/v2/models?ready=true")[2])
    assert ready == json.loads(client.request("POST", "/v2/repository/index", '{"ready": true}')[2])
    assert {r["name"] for r in ready} == {"affine", "cast", "flaky"}
    status, headers, _ = client.request("POST", "/v2/models")
    assert status == 405 and headers["allow"] == "GET"


@pytest.mark.slow
def test_a_big_json_body_is_parsed_while_health_checks_are_answered(start_server):
    """A ~60 MB JSON infer body is parsed off the event loop: while it is in flight (sent,
    not yet reached the model) health checks on another connection keep being answered."""
    events: list = []  # appended from three threads (list.append is atomic): their order is the evidence

    def total(d):
        events.append("model")
        return {"s": np.array([d["x"].astype(np.float64).sum()])}

    model = PythonModel(total, {"x": ArraySpec(("n",), "float32")}, {"s": ArraySpec((1,), "float64")}, max_batch_size=0, name="total")
    server = start_server(model)
    k = 4_200_000
    data = b"[" + b"0.25,1.5,-2.0," * (k - 1) + b"0.25,1.5,-2.0]"
    body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [%d], "data": %s}]}' % (3 * k, data)
    assert 55e6 < len(body) < HttpLimits().max_body_bytes
    sent = threading.Event()
    answer = []

    def big():
        with socket.create_connection((server.host, server.port), timeout=120) as s:
            s.sendall(b"POST /v2/models/total/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            sent.set()
            resp = http.client.HTTPResponse(s)
            resp.begin()
            answer.append((resp.status, resp.read()))
            events.append("infer")

    t = threading.Thread(target=big)
    t.start()
    assert sent.wait(120)
    health = RawClient(server)
    while t.is_alive():
        if health.request("GET", "/v2/health/live")[0] == 200:
            events.append("health")
    t.join()
    assert answer[0][0] == 200
    assert json.loads(answer[0][1])["outputs"][0]["data"] == [k * (0.25 + 1.5 - 2.0)]
    before_model = events[: events.index("model")].count("health")
    assert before_model >= 10, events[:40]  # answered while the body was being parsed
    assert events.index("model") < events.index("infer")


UNGUARDED = """
import http.client, json, sys
import numpy as np
from cairn.core_array import ArraySpec
from cairn.serving import PythonModel, serve

with open(sys.argv[1], "a") as f:  # a side effect of running this file: once, by its own process
    f.write("ran\\n")
m = PythonModel(lambda d: {"s": d["x"][:1]}, {"x": ArraySpec(("n",), "float32")}, {"s": ArraySpec((1,), "float32")},
                max_batch_size=0, name="first")
body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [400_000], "data": [1.5] * 400_000}]})
with serve(m) as server:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    conn.request("POST", "/v2/models/first/infer", body)
    resp = conn.getresponse()
    print(resp.status, json.loads(resp.read())["outputs"][0]["data"])
"""


def test_big_bodies_are_parsed_without_re_running_the_callers_script(tmp_path):
    # a script that calls serve() without an `if __name__ == "__main__":` guard: the worker
    # that parses a big body must not import it again (multiprocessing's spawn would)
    import subprocess
    import sys

    script, marker = tmp_path / "unguarded.py", tmp_path / "ran.txt"
    script.write_text(UNGUARDED)
    proc = subprocess.run([sys.executable, str(script), str(marker)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["200", "[1.5]"]
    assert marker.read_text() == "ran\n"


def test_a_big_json_answer_is_written_in_a_worker_and_stays_strict(start_server):
    n = 400_000  # 1.6 MB of float32: about 5 MB of JSON, written off the loop

    def ramp(d):
        y = np.arange(n, dtype=np.float32) * d["x"][0]
        y[1], y[2] = np.nan, -np.inf
        return {"y": y}

    model = PythonModel(ramp, {"x": ArraySpec((1,), "float32")}, {"y": ArraySpec((n,), "float32")}, max_batch_size=0, name="ramp")
    server = start_server(model)
    status, headers, body = RawClient(server).request(
        "POST", "/v2/models/ramp/infer", '{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [0.5]}]}'
    )
    assert status == 200 and headers["content-type"] == "application/json"
    data = json.loads(body, parse_constant=_refuse_constant)["outputs"][0]["data"]
    assert data[1:3] == ["NaN", "-Infinity"]
    assert server.app.offload._processes  # the answer went through a worker process
    want = np.arange(n, dtype=np.float64) * 0.5
    want[1], want[2] = np.nan, -np.inf
    np.testing.assert_array_equal(np.array(data, np.float64), want)
