"""Where the autotune cache lives during tests, what a cached choice records, and how a
reader sees where each kernel choice came from."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import cairn.kernels as ck
from cairn.kernels import _cache

REPO = pathlib.Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "_kernels_home_probe.py"


def _q(t: int = 16) -> jax.Array:
    return jnp.ones((1, t, 1, 8), jnp.float32)


def _attention(q: jax.Array) -> jax.Array:
    return ck.dot_product_attention(q, q, q)


def _choice(q: jax.Array) -> ck.KernelCall:
    (call,) = ck.ops_in(_attention, q)  # traced afresh every time (no trace cache)
    return call


@pytest.mark.slow  # about 10-20 s: a pytest session with one xdist worker, and a subprocess
def test_a_test_session_never_writes_home(tmp_path):
    """A fresh pytest session (one xdist worker, as `nox -s tests` runs) with an empty $HOME:
    tests that autotune and save through the default location, in process and in a
    subprocess, leave $HOME empty."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("CAIRN_KERNELS_CACHE_DIR", "XDG_CACHE_HOME", "MPLCONFIGDIR", "HF_HOME")
           and not k.startswith("PYTEST_")}
    env["HOME"] = str(home)
    report = tmp_path / "saved.txt"
    env["CAIRN_PROBE_REPORT"] = str(report)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "1", str(PROBE)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 passed" in out.stdout
    saved = report.read_text().split()
    assert len(saved) == 2 and not any(s.startswith(str(home)) for s in saved), saved
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []


def test_a_saved_entry_records_machine_versions_and_load(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (7.25, 3.5, 1.0))
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    path = ck.autotune(_attention, _q(), iterations=1, mode="fwd_bwd").save()
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == 2
    (entry,) = doc["entries"]["dot_product_attention"].values()
    m = entry["measured"]
    assert m["loadavg"] == [7.25, 3.5, 1.0] and m["cpu_count"] == os.cpu_count()
    assert m["jax_version"] == jax.__version__
    import jaxlib

    assert m["jaxlib_version"] == jaxlib.__version__
    assert m["device_kind"] == jax.devices()[0].device_kind and m["platform"] == jax.devices()[0].platform
    assert m["mode"] == "fwd_bwd" and m["iterations"] == 1 and m["host"] and m["machine"]
    date = datetime.datetime.strptime(m["date"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    assert before <= date <= datetime.datetime.now(datetime.UTC)
    _cache.validate(doc)


@pytest.mark.cpu_dispatch
def test_each_choice_says_where_it_came_from(monkeypatch):
    q = _q(40)
    assert _choice(q).source == "default"
    assert "default heuristic" in _choice(q).describe_source()
    with ck.override("xla", op="dot_product_attention"):
        assert _choice(q).source == "override"
    with ck.recording() as calls:
        ck.dot_product_attention(q, q, q, config={"chunk_size": None})
    assert calls[0].source == "argument" and calls[0].measured == {}

    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 2.0, 1.0))
    entry = ck.autotune(_attention, q, iterations=1).entries[0]
    fresh = _choice(q)
    assert fresh.source == "autotune" and fresh.measured["loadavg"] == [3.5, 2.0, 1.0]
    assert fresh.measured["time_ms"] == entry.time_ms and "file" not in fresh.measured
    assert "autotuned in this process" in fresh.describe_source() and "load 3.5 on" in fresh.describe_source()

    path = _cache.save()
    _cache.clear()  # a new process: the choice is read back from the file
    cached = _choice(q)
    assert cached.source == "cache" and cached.measured["file"] == str(path)
    assert cached.measured["date"] == entry.measured["date"]
    text = cached.describe_source()
    assert str(path) in text and entry.measured["date"] in text and "load 3.5 on" in text


def _v1_file(directory: pathlib.Path, key: str) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (_cache.file_stem(_cache.device_kind()) + ".json")
    doc = {"schema_version": 1, "device_kind": _cache.device_kind(), "jax_version": "0.4.35",
           "entries": {"dot_product_attention": {key: {
               "implementation": "xla", "config": {"chunk_size": 8}, "time_ms": 0.5,
               "candidates": [{"implementation": "xla", "config": {"chunk_size": None}, "time_ms": 0.9}]}}}}
    path.write_text(json.dumps(doc))
    return path


def test_a_schema_1_entry_without_a_record_is_read_and_kept(isolated_kernel_cache):
    from cairn.kernels import _registry

    q = _q(40)
    (call,) = ck.ops_in(_attention, q)
    key = _registry.bucket_key(call.op, *call.args, **call.kwargs)
    path = _v1_file(isolated_kernel_cache, key)
    _cache.clear()  # a new process, finding the old file
    call = _choice(q)
    assert call.source == "cache" and dict(call.config) == {"chunk_size": 8}
    assert "no record of when or under what load" in call.describe_source()
    assert "tune --force" in call.describe_source()
    # tuning another bucket and saving keeps the old entry as it was, in a version-2 file
    ck.autotune(_attention, _q(200), iterations=1)
    _cache.save()
    doc = _cache.load_file(path)
    assert doc["schema_version"] == 2
    assert "measured" not in doc["entries"]["dot_product_attention"][key]
    assert len(doc["entries"]["dot_product_attention"]) == 2


def test_a_newer_schema_file_is_skipped_not_a_crash(isolated_kernel_cache, caplog):
    isolated_kernel_cache.mkdir()
    path = isolated_kernel_cache / (_cache.file_stem(_cache.device_kind()) + ".json")
    path.write_text(json.dumps({"schema_version": 99, "entries": {"x": "a future layout"}}))
    with caplog.at_level("WARNING", logger="cairn.kernels"):
        assert _choice(_q(40)).source == "default"
    assert any(str(path) in r.getMessage() and "newer" in r.getMessage() for r in caplog.records)
    ck.autotune(_attention, _q(40), iterations=1)
    with pytest.raises(_cache.CacheFileError, match="newer cairn-kernels .* not overwritten"):
        _cache.save()
    assert json.loads(path.read_text())["schema_version"] == 99

