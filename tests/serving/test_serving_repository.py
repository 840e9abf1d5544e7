"""Model repositories: version policies, config.json, the repository endpoints through
tritonclient (index, load, unload), and hot reload of a new version under concurrent load
with no dropped or failed request."""

import json
import logging
import threading
import time

import numpy as np
import pytest
import tritonclient.http as th
from serving_testlib import RawClient, affine_model, hammer
from tritonclient.utils import InferenceServerException

from cairn.serving._batcher import BatchingConfig
from cairn.serving._repository import ModelRepository, VersionPolicy, parse_config


def _loader(path):
    """Test loader: a version directory holds scale.json; the model computes x*scale + version."""
    spec = json.loads((path / "scale.json").read_text())
    if spec.get("broken"):
        raise RuntimeError(f"cannot load {path.name}: broken on purpose")
    return affine_model(name=path.parent.name, scale=spec["scale"], offset=float(path.name))


def _write(repo, model, version, scale=2.0, **extra):
    d = repo / model / str(version)
    d.mkdir(parents=True, exist_ok=True)
    (d / "scale.json").write_text(json.dumps({"scale": scale, **extra}))


def _infer(client, model, x, version=""):
    inp = th.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp], model_version=version).as_numpy("y")


def test_version_policies():
    assert VersionPolicy().select([3, 1, 2]) == [3]
    assert VersionPolicy.latest(2).select([3, 1, 2]) == [2, 3]
    assert VersionPolicy.all().select([3, 1]) == [1, 3]
    assert VersionPolicy.specific(2, 9).select([1, 2, 3]) == [2]
    for p in (VersionPolicy.latest(3), VersionPolicy.all(), VersionPolicy.specific(1, 4)):
        assert VersionPolicy.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match="num_versions >= 1"):
        VersionPolicy.latest(0)
    with pytest.raises(ValueError, match="must be one of"):
        VersionPolicy.from_json({"latest": {}, "all": {}})
    with pytest.raises(ValueError, match="'latest', 'all' or 'specific', got 'newest'"):
        VersionPolicy.from_json({"newest": {}})


def test_config_parsing():
    cfg = parse_config(
        {
            "version_policy": {"specific": {"versions": [1, 3]}},
            "max_batch_size": 4,
            "dynamic_batching": {"max_queue_delay_microseconds": 2500, "max_queue_size": 7, "batch_buckets": [4, 1]},
        },
        "cfg",
        BatchingConfig(),
    )
    assert cfg.version_policy == VersionPolicy.specific(1, 3)
    assert cfg.batching == BatchingConfig(max_batch_size=4, max_queue_delay=0.0025, max_queue_size=7, batch_buckets=(1, 4))
    with pytest.raises(ValueError, match=r"cfg: unknown keys \['dynamic_batching.preferred', 'weird'\]"):
        parse_config({"weird": 1, "dynamic_batching": {"preferred": 1}}, "cfg", BatchingConfig())
    with pytest.raises(ValueError, match="cfg: BatchingConfig.max_queue_size"):
        parse_config({"dynamic_batching": {"max_queue_size": 0}}, "cfg", BatchingConfig())


def test_repository_scan_ignores_non_versions(tmp_path):
    for v in ("1", "2", "10"):
        _write(tmp_path, "m", v)
    (tmp_path / "m" / "01").mkdir()
    (tmp_path / "m" / "draft").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("x")
    repo = ModelRepository(tmp_path, loader=_loader)
    assert repo.names() == ["m"] and repo.versions("m") == [1, 2, 10]
    with pytest.raises(KeyError, match="model 'x' is not in the repository"):
        repo.versions("x")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        ModelRepository(tmp_path / "missing")
    (tmp_path / "m" / "config.json").write_text("{bad")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        repo.config("m")


def test_policies_through_the_server(tmp_path, start_server):
    for v in (1, 2, 3):
        _write(tmp_path, "latest", v)
        _write(tmp_path, "every", v)
        _write(tmp_path, "pick", v)
    (tmp_path / "every" / "config.json").write_text(json.dumps({"version_policy": {"all": {}}}))
    (tmp_path / "pick" / "config.json").write_text(json.dumps({"version_policy": {"specific": {"versions": [1, 3]}}}))
    server = start_server(ModelRepository(tmp_path, loader=_loader))
    client = th.InferenceServerClient(server.url.removeprefix("http://"))
    x = np.ones((1, 4), np.float32)
    np.testing.assert_array_equal(_infer(client, "latest", x), x * 2 + 3)  # default route: the newest
    assert not client.is_model_ready("latest", "2")
    assert [client.is_model_ready("every", v) for v in "123"] == [True, True, True]
    np.testing.assert_array_equal(_infer(client, "every", x, "2"), x * 2 + 2)
    assert [client.is_model_ready("pick", v) for v in "123"] == [True, False, True]
    assert client.get_model_metadata("every")["versions"] == ["1", "2", "3"]
    client.close()


def test_index_load_unload(tmp_path, start_server):
    _write(tmp_path, "a", 1)
    _write(tmp_path, "bad", 1, broken=True)
    server = start_server(ModelRepository(tmp_path, loader=_loader))
    client = th.InferenceServerClient(server.url.removeprefix("http://"))
    index = {r["name"]: r for r in client.get_model_repository_index()}
    assert index["a"]["state"] == "READY" and index["a"]["version"] == "1"
    assert index["bad"]["state"] == "UNAVAILABLE" and "broken on purpose" in index["bad"]["reason"]
    with pytest.raises(InferenceServerException, match="failed to load 'bad'.*broken on purpose"):
        client.load_model("bad")
    with pytest.raises(InferenceServerException, match="not in the repository"):
        client.load_model("ghost")
    client.unload_model("a")
    assert not client.is_model_ready("a")
    with pytest.raises(InferenceServerException, match="model 'a' is not loaded"):
        _infer(client, "a", np.ones((1, 4), np.float32))
    _write(tmp_path, "c", 5)  # a new model appears: explicit load picks it up
    client.load_model("c")
    client.load_model("a")
    x = np.ones((1, 4), np.float32)
    np.testing.assert_array_equal(_infer(client, "c", x), x * 2 + 5)
    np.testing.assert_array_equal(_infer(client, "a", x), x * 2 + 1)
    c = RawClient(server)
    status, _, body = c.request("POST", "/v2/repository/index", b'{"ready": true}')
    assert status == 200 and {r["name"] for r in json.loads(body)} == {"a", "c"}
    c.close()
    client.close()


@pytest.mark.parametrize("via", ["endpoint", "poll"])
def test_hot_reload_under_load_drops_nothing(tmp_path, start_server, via):
    _write(tmp_path, "m", 1)
    (tmp_path / "m" / "config.json").write_text(json.dumps({"dynamic_batching": {"max_queue_delay_microseconds": 500}}))
    kw = {"poll_interval": 0.05} if via == "poll" else {}
    server = start_server(ModelRepository(tmp_path, loader=_loader), **kw)
    stop, results = threading.Event(), [[] for _ in range(4)]
    threads = [threading.Thread(target=hammer, args=(server, "m", stop, results[i])) for i in range(4)]
    for t in threads:
        t.start()
    while min(len(r) for r in results) < 20:
        threading.Event().wait(0.01)
    _write(tmp_path, "m", 2)  # the new version appears while the clients hammer
    if via == "endpoint":
        c = RawClient(server)
        assert c.request("POST", "/v2/repository/models/m/load", b"{}")[0] == 200
        c.close()
    seen = lambda: {json.loads(b)["model_version"] for r in results for s, b in r[-5:] if s == 200}  # noqa: E731
    while "2" not in seen():
        threading.Event().wait(0.01)
    # every client, not just one, has been answered by version 2 (a starved client thread on
    # a loaded host may not have sent a request since the switch), then some more requests
    last = lambda r: r and r[-1][0] == 200 and json.loads(r[-1][1])["model_version"] == "2"  # noqa: E731
    deadline = time.monotonic() + 120
    while not all(last(r) for r in results) and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    n = sum(len(r) for r in results)
    while sum(len(r) for r in results) < n + 40:
        threading.Event().wait(0.01)
    stop.set()
    for t in threads:
        t.join()
    flat = [x for r in results for x in r]
    assert all(status == 200 for status, _ in flat), [b for s, b in flat if s != 200][:3]
    for r in results:  # each client saw version 1, then version 2, never back
        versions = [json.loads(b)["model_version"] for _, b in r]
        assert versions[0] == "1" and versions[-1] == "2"
        assert versions == sorted(versions)
        for _, b in r:
            out = json.loads(b)
            assert out["outputs"][0]["data"] == [2.0 + float(out["model_version"])] * 4
    assert server.app is not None and list(server.app.live["m"]) == [2]


def test_hot_reload_of_exported_versions_under_load(tmp_path, start_server):
    """Real export directories loaded with cairn.serving.load: version 2 (other weights) is
    exported while four clients hammer version 1, then loaded through tritonclient."""
    import jax.numpy as jnp

    from cairn.core_array import ArraySpec
    from cairn.serving import export

    def fn(p, inputs):
        return {"y": jnp.tanh(inputs["x"] @ p["w"])}

    spec = {"x": ArraySpec(("b", 4), "float32", constraints=("b <= 4",))}
    ws = {v: np.random.default_rng(v).normal(size=(4, 4)).astype(np.float32) for v in (1, 2)}
    export(fn, {"w": ws[1]}, spec, tmp_path / "m" / "1", batch_buckets=(4,))
    server = start_server(str(tmp_path), batching=BatchingConfig(max_queue_delay=0.0005))
    x = np.linspace(-1, 1, 4, dtype=np.float32).reshape(1, 4)
    stop, results = threading.Event(), [[] for _ in range(4)]
    threads = [threading.Thread(target=hammer, args=(server, "m", stop, results[i], x)) for i in range(4)]
    for t in threads:
        t.start()
    export(fn, {"w": ws[2]}, spec, tmp_path / "m" / "2", batch_buckets=(4,))
    client = th.InferenceServerClient(server.url.removeprefix("http://"))
    client.load_model("m")
    assert client.get_model_metadata("m")["versions"] == ["2"]
    # every client, not just one, has been answered by version 2 (a starved client thread on
    # a loaded host may not have sent a request since the switch), then some more requests
    last = lambda r: r and r[-1][0] == 200 and json.loads(r[-1][1])["model_version"] == "2"  # noqa: E731
    deadline = time.monotonic() + 120
    while not all(last(r) for r in results) and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    n = sum(len(r) for r in results)
    while sum(len(r) for r in results) < n + 40:
        threading.Event().wait(0.01)
    stop.set()
    for t in threads:
        t.join()
    client.close()
    for r in results:
        assert r and all(status == 200 for status, _ in r)
        versions = [json.loads(b)["model_version"] for _, b in r]
        assert versions == sorted(versions) and versions[-1] == "2"
        for _, b in r:
            out = json.loads(b)
            want = np.tanh(x.astype(np.float64) @ ws[int(out["model_version"])])
            np.testing.assert_allclose(np.array(out["outputs"][0]["data"]).reshape(1, 4), want, rtol=1e-5, atol=1e-6)


def test_polling_retries_a_failed_version_only_when_the_directory_changes(tmp_path, start_server, caplog):
    """A broken version is reported once (not once per poll) while the loaded one keeps
    serving; a change in the directory makes the next poll try again."""
    _write(tmp_path, "m", 1)
    server = start_server(ModelRepository(tmp_path, loader=_loader), poll_interval=0.02)
    _write(tmp_path, "m", 2, broken=True)
    with caplog.at_level(logging.ERROR, logger="cairn.serving"):
        threading.Event().wait(0.3)  # about fifteen polls
    errors = [r for r in caplog.records if "broken on purpose" in r.getMessage()]
    assert len(errors) == 1  # logged once, not once per poll
    c = RawClient(server)
    status, _, body = c.infer_json("m", np.ones((1, 4), np.float32))
    assert status == 200 and json.loads(body)["model_version"] == "1"  # version 1 kept serving
    _write(tmp_path, "m", 3)  # the directory changes: the next poll loads version 3
    while json.loads(c.infer_json("m", np.ones((1, 4), np.float32))[2])["model_version"] != "3":
        threading.Event().wait(0.02)
    c.close()
