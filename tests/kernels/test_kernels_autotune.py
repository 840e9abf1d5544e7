"""Autotuning by measurement, the schema-validated cache, and the cairn-autotune CLI."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cairn.kernels as ck
from cairn.kernels import _cache, _cli, _registry
from cairn.kernels._registry import Implementation

ALL = frozenset({"cpu", "gpu", "tpu"})


def _slow(x, config, interpret):
    y = x
    for _ in range(config["rounds"]):
        y = jnp.tanh(y @ jnp.eye(x.shape[-1]) + 0.1)
    return y


def two_speed_op():
    """``xla`` is a cheap copy; ``pallas_triton`` (made to run on the CPU here) does 40 matmuls."""
    op = f"speed_{uuid.uuid4().hex[:8]}"
    ck.register_op(op, bucket=lambda x: (1 << (x.shape[0] - 1).bit_length(), x.shape[1]))
    ck.register(Implementation(op, "pallas_triton", _slow, ALL, configs=lambda x: ({"rounds": 40}, {"rounds": 20}),
                               default_config=lambda x: {"rounds": 40}))
    ck.register(Implementation(op, "xla", lambda x, config, interpret: x + 0.0, ALL))
    return op


def test_measures_across_implementations_and_buckets_hit():
    op = two_speed_op()
    x = jnp.ones((100, 64))
    assert _registry.resolve(op, x)[0].name == "pallas_triton"  # the preference order
    entry = ck.autotune_op(op, x, iterations=2)
    assert entry.implementation == "xla"
    assert {(m.implementation, m.config.get("rounds")) for m in entry.candidates} == {
        ("pallas_triton", 40), ("pallas_triton", 20), ("xla", None)}
    assert all(m.time_ms is not None and m.time_ms >= 0 for m in entry.candidates)
    assert _registry.resolve(op, jnp.ones((120, 64)))[0].name == "xla"  # 120 is in the bucket of 100
    assert _registry.resolve(op, jnp.ones((300, 64)))[0].name == "pallas_triton"  # another bucket


@pytest.mark.cpu_dispatch
def test_save_load_round_trip_atomic_and_valid(isolated_kernel_cache):
    op = two_speed_op()
    ck.autotune_op(op, jax.ShapeDtypeStruct((8, 16), jnp.float32), iterations=1)
    path = _cache.save()
    assert path.parent == isolated_kernel_cache
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    doc = _cache.load_file(path)
    assert op in doc["entries"] and doc["device_kind"] == _cache.device_kind()
    _cache.clear()
    assert _registry.resolve(op, jnp.ones((8, 16)))[0].name == "xla"  # read back from the file
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(path.read_text()), _cache.schema())  # the shipped schema is real JSON Schema


def test_package_directory_is_never_written(isolated_kernel_cache):
    before = sorted(p.name for p in _cache.SCHEMA_PATH.parent.iterdir())
    op = two_speed_op()
    ck.autotune_op(op, jnp.ones((4, 4)), iterations=1)
    _cache.save()
    assert sorted(p.name for p in _cache.SCHEMA_PATH.parent.iterdir()) == before


@pytest.mark.parametrize(
    "doc, field",
    [
        ({"device_kind": "cpu", "entries": {}}, "missing required key 'schema_version'"),
        ({"schema_version": 0, "device_kind": "cpu", "entries": {}}, r"\$.schema_version: expected one of \[1, 2\]"),
        ({"schema_version": 1, "device_kind": "cpu", "entries": {"op": {"b": {"implementation": "cudnn",
          "config": {}, "time_ms": 1}}}}, r"\$.entries\['op'\]\['b'\].implementation"),
        ({"schema_version": 1, "device_kind": "cpu", "entries": {"op": {"b": {"implementation": "xla",
          "config": [], "time_ms": 1}}}}, r"config: expected object"),
        ({"schema_version": 1, "device_kind": "cpu", "entries": {"op": {"b": {"implementation": "xla",
          "config": {}, "time_ms": -1}}}}, r"time_ms: expected >= 0"),
        ({"schema_version": 1, "device_kind": "cpu", "entries": {}, "extra": 1}, "unexpected key 'extra'"),
    ],
)
def test_bad_cache_files_raise_naming_file_and_field(tmp_path, doc, field):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(_cache.CacheFileError, match=f"{path}: field .*{field}" if field.startswith("missing")
                       else field) as info:
        _cache.load_file(path)
    assert str(path) in str(info.value)


def test_malformed_json_names_the_file(tmp_path, isolated_kernel_cache):
    isolated_kernel_cache.mkdir()
    bad = isolated_kernel_cache / (_cache.file_stem(_cache.device_kind()) + ".json")
    bad.write_text('{"schema_version": 1,')
    with pytest.raises(_cache.CacheFileError, match=f"{bad}: not valid JSON"):
        ck.dot_product_attention(jnp.ones((1, 4, 1, 8)), jnp.ones((1, 4, 1, 8)), jnp.ones((1, 4, 1, 8)))


def test_one_log_line_per_op_on_misses(caplog):
    op = two_speed_op()
    with caplog.at_level(logging.INFO, logger="cairn.kernels"):
        for n in (3, 5, 9, 17):
            ck.call(op, jnp.ones((n, 2)))
    misses = [r for r in caplog.records if "no autotuned entry" in r.getMessage()]
    assert len(misses) == 1 and all(r.levelno < logging.WARNING for r in caplog.records)


def test_device_kind_file_stem():
    assert _cache.file_stem("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"


@pytest.mark.cpu_dispatch
def test_autotune_a_function_with_attention():
    def model(q):
        return ck.dot_product_attention(q, q, q, is_causal=True)

    q = jax.ShapeDtypeStruct((1, 40, 2, 16), jnp.float32)
    result = ck.autotune(model, q, iterations=1, mode="fwd_bwd")
    (entry,) = result.entries
    assert entry.op == "dot_product_attention" and entry.implementation == "xla"
    assert {m.config["chunk_size"] for m in entry.candidates} == {None}  # no chunk below 40 keys
    assert "dot_product_attention" in result.table()
    with ck.recording() as calls:
        model(jnp.ones((1, 33, 2, 16)))  # same bucket (64 keys)
    assert calls[0].config == dict(entry.config)


def _cli_module(tmp_path, monkeypatch):
    mod = f"cli_model_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent("""
        import cairn.kernels as ck

        def step(q, k, v):
            return ck.dot_product_attention(q, k, v, is_causal=True).sum()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return mod


SPECS = ["f32[1,32,4,16]", "f32[1,32,2,16]", "f32[1,32,2,16]"]


@pytest.mark.cpu_dispatch
@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_cli_lists_and_writes(tmp_path, monkeypatch, capsys):
    mod = _cli_module(tmp_path, monkeypatch)
    assert _cli.main(["tune", f"{mod}:step", "--list", "--args-spec", *SPECS]) == 0
    out = capsys.readouterr().out
    assert "dot_product_attention[xla]" in out and "chosen by the untuned default heuristic" in out
    out_file = tmp_path / "tuned.json"
    assert _cli.main(["tune", f"{mod}:step", "--iterations", "1", "--output", str(out_file), "--args-spec", *SPECS]) == 0
    doc = _cache.load_file(out_file)
    assert list(doc["entries"]) == ["dot_product_attention"]
    # cairn-autotune, 0.1's command, still works (it always measures)
    legacy = tmp_path / "legacy.json"
    assert _cli.autotune_main([f"{mod}:step", "--iterations", "1", "--output", str(legacy), "--args-spec", *SPECS]) == 0
    assert list(_cache.load_file(legacy)["entries"]) == ["dot_product_attention"]
    assert _cli.main(["tune", "no_colon", "--list"]) == 2
    assert _cli.main(["tune", f"{mod}:missing", "--list"]) == 2
    assert "has no attribute" in capsys.readouterr().err
    sys.modules.pop(mod, None)


def test_cli_tune_reuses_the_cache_unless_forced_and_show_prints_records(tmp_path, monkeypatch, capsys):
    mod = _cli_module(tmp_path, monkeypatch)
    monkeypatch.setattr("os.getloadavg", lambda: (0.25, 0.5, 0.5))
    assert _cli.main(["tune", f"{mod}:step", "--iterations", "1", "--args-spec", *SPECS]) == 0
    path = _cache.cache_dir() / (_cache.file_stem(_cache.device_kind()) + ".json")
    first = json.loads(path.read_text())["entries"]["dot_product_attention"]
    assert [e["measured"]["loadavg"] for e in first.values()] == [[0.25, 0.5, 0.5]]
    capsys.readouterr()

    _cache.clear()  # a later process
    monkeypatch.setattr("os.getloadavg", lambda: (9.0, 9.0, 9.0))
    assert _cli.main(["tune", f"{mod}:step", "--iterations", "1", "--args-spec", *SPECS]) == 0
    out = capsys.readouterr().out
    assert "chosen by the autotune cache" in out and "load 0.25 on" in out  # listed, then reused
    assert "load average 9 on" in out  # the busy machine is named
    assert json.loads(path.read_text())["entries"]["dot_product_attention"] == first  # not re-measured

    _cache.clear()
    assert _cli.main(["tune", f"{mod}:step", "--force", "--iterations", "1", "--args-spec", *SPECS]) == 0
    again = json.loads(path.read_text())["entries"]["dot_product_attention"]
    assert list(again) == list(first)
    assert [e["measured"]["loadavg"] for e in again.values()] == [[9.0, 9.0, 9.0]]  # re-measured now

    assert _cli.main(["show"]) == 0
    shown = capsys.readouterr().out
    assert str(path) in shown and "schema 2" in shown and "under load 9 on" in shown
    assert _cli.main(["show", "--file", str(tmp_path / "none.json")]) == 0
    assert "untuned default heuristic" in capsys.readouterr().out
    sys.modules.pop(mod, None)


def test_parse_spec():
    assert _cli.parse_spec("bf16[2,3]") == jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)
    assert _cli.parse_spec("int32[]") == jax.ShapeDtypeStruct((), np.int32)
    with pytest.raises(ValueError, match="dtype\\[d0,d1"):
        _cli.parse_spec("f32(2,3)")
    with pytest.raises(ValueError, match="unknown dtype"):
        _cli.parse_spec("floaty[2]")


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_fwd_bwd_autotuning_differentiates_only_float_arguments():
    # ragged_dot's group sizes are int32: the backward timing must not differentiate them
    lhs = jnp.ones((16, 8), jnp.float32)
    rhs = jnp.ones((2, 8, 4), jnp.float32)
    sizes = jnp.array([10, 6], jnp.int32)
    entry = ck.autotune_op("ragged_dot", lhs, rhs, sizes, iterations=1, mode="fwd_bwd", store=False)
    assert entry.implementation == "xla"  # the only one that runs compiled on the CPU
