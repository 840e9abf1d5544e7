"""load: integrity (every file hashed before parsing: flipped bytes, truncation, missing
files, bad manifests), version and platform checks, the hermetic subprocess load (model
code, cairn.nn and cairn.quant unimportable), and the persistent compilation cache."""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from serving_testlib import hermetic_prelude

from cairn.core_array import (
    ArraySpec,
    QArray,
    QuantLayout,
    dumps_checksummed_json,
    read_checksummed_json,
)
from cairn.serving import ModelFormatError, ModelIntegrityError, export, load
from cairn.serving._hashing import MANIFEST

RNG = np.random.default_rng(1)

MODEL_CODE = '''
import jax.numpy as jnp

def forward(params, inputs):
    h = jnp.maximum(inputs["x"] @ params["l1"]["w"] + params["l1"]["b"], 0.0)
    return {"logits": h @ params["l2"].dequantize(), "norm": jnp.sqrt((h * h).sum(axis=1))}
'''


def _params():
    q = RNG.integers(-127, 128, size=(16, 3)).astype(np.int8)
    return {
        "l1": {"w": RNG.normal(size=(6, 16)).astype(np.float32), "b": RNG.normal(size=16).astype(np.float32)},
        "l2": QArray(q, (RNG.random((1, 3)) / 50).astype(np.float32), qtype="int8", layout=QuantLayout.per_channel(1)),
    }


def _reference(params, x):
    h = np.maximum(x.astype(np.float64) @ params["l1"]["w"] + params["l1"]["b"], 0.0)
    w2 = params["l2"].qvalue.astype(np.float64) * params["l2"].scale
    return {"logits": h @ w2, "norm": np.sqrt((h * h).sum(1))}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A model exported from code in its own module (so a subprocess can be denied it)."""
    root = tmp_path_factory.mktemp("hermetic")
    code_dir = root / "code"
    code_dir.mkdir()
    (code_dir / "s1_model_code.py").write_text(MODEL_CODE)
    sys.path.insert(0, str(code_dir))
    try:
        import s1_model_code
    finally:
        sys.path.remove(str(code_dir))
        sys.modules.pop("s1_model_code", None)
    params = _params()
    path = export(s1_model_code.forward, params, {"x": ArraySpec(("b", 6), "float32", constraints=("b <= 8",))},
                  root / "repo" / "clf" / "1", batch_buckets=(2, 8))
    return path, params


def _files(path):
    return sorted(os.path.relpath(os.path.join(d, f), path).replace(os.sep, "/")
                  for d, _, fs in os.walk(path) for f in fs)


def _copy(src, tmp_path, name="m"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return str(dst)


def _rewrite_manifest(path, edit):
    doc = read_checksummed_json(os.path.join(path, MANIFEST))
    edit(doc)
    with open(os.path.join(path, MANIFEST), "wb") as f:
        f.write(dumps_checksummed_json(doc))


def test_flipped_bytes_in_every_file_are_caught_and_named(model, tmp_path):
    """Hundreds of random byte changes, each in a random file at a random offset: every one
    raises ModelIntegrityError naming that file, before anything is deserialised."""
    path = _copy(model[0], tmp_path)
    files = _files(path)
    assert {MANIFEST, "signatures/serving_default.jax_exported"} <= set(files)
    rnd = random.Random(17)
    hit = set()
    for rep in range(400):
        rel = files[rep % len(files)] if rep < len(files) else rnd.choice(files)
        full = os.path.join(path, rel)
        data = bytearray(open(full, "rb").read())
        off = rnd.randrange(len(data))
        old = data[off]
        data[off] = rnd.choice([b for b in range(256) if b != old])
        open(full, "wb").write(data)
        try:
            with pytest.raises(ModelIntegrityError) as err:
                load(path, precompile=False)
            assert err.value.file == rel, (rel, str(err.value))
            assert rel in str(err.value)
            hit.add(rel)
        finally:
            data[off] = old
            open(full, "wb").write(data)
    assert hit == set(files)
    m = load(path)  # restored: loads and runs
    assert m({"x": np.zeros((1, 6), np.float32)})["logits"].shape == (1, 3)


def test_truncated_and_missing_files_are_named(model, tmp_path):
    path = _copy(model[0], tmp_path)
    for rel in _files(path):
        full = os.path.join(path, rel)
        data = open(full, "rb").read()
        open(full, "wb").write(data[: len(data) // 2])
        with pytest.raises(ModelIntegrityError, match=rel.replace(".", r"\.")):
            load(path, precompile=False)
        os.remove(full)
        with pytest.raises(ModelIntegrityError, match="missing") as err:
            load(path, precompile=False)
        assert err.value.file == rel
        open(full, "wb").write(data)
    load(path, precompile=False)


def _seal_raw(body: bytes) -> bytes:
    """Bytes with a correct checksum around ``body``: the test of what comes after the check."""
    return b'{"checksum": "sha256:' + hashlib.sha256(body).hexdigest().encode() + b'", "body": ' + body + b"}\n"


def test_bad_manifests(model, tmp_path):
    path = _copy(model[0], tmp_path)
    raw = open(os.path.join(path, MANIFEST), "rb").read()

    def write(body):
        with open(os.path.join(path, MANIFEST), "wb") as f:
            f.write(body)

    write(_seal_raw(b"{not json"))
    with pytest.raises(ModelFormatError, match="manifest.json: not valid JSON"):
        load(path)
    write(b"[1, 2]")
    with pytest.raises(ModelIntegrityError, match="manifest.json: it lacks the sha256 checksum"):
        load(path)
    write(raw[:-40] + bytes([raw[-40] ^ 1]) + raw[-39:])
    with pytest.raises(ModelIntegrityError, match="manifest.json: checksum mismatch"):
        load(path)
    doc = json.loads(raw)["body"]
    legacy = {**doc, "format": "cairn.serving.model/1", "manifest_sha256": "0" * 64}
    write(json.dumps(legacy, indent=1, sort_keys=True).encode())
    with pytest.raises(ModelFormatError, match="'cairn.serving.model/1'.*export the model again"):
        load(path)
    write(dumps_checksummed_json({**doc, "format": "cairn.serving.model/7"}))
    with pytest.raises(ModelFormatError, match="format 'cairn.serving.model/7' is not supported"):
        load(path)
    write(dumps_checksummed_json({k: v for k, v in doc.items() if k != "files"}))
    with pytest.raises(ModelFormatError, match=r"missing fields \['files'\]"):
        load(path)
    write(dumps_checksummed_json({**doc, "files": {**doc["files"], "../../etc/passwd": {"sha256": "0", "size": 1}}}))
    with pytest.raises(ModelFormatError, match="unsafe file path"):
        load(path)
    write(raw)
    load(path, precompile=False)
    with pytest.raises(ModelFormatError, match="not a model directory"):
        load(tmp_path / "nope")


def test_version_and_platform_checks(model, tmp_path):
    import jax

    path = _copy(model[0], tmp_path)
    _rewrite_manifest(path, lambda d: d["signatures"]["serving_default"].update(calling_convention_version=99))
    with pytest.raises(ModelFormatError, match=r"calling convention version 99, but jax .* runs versions .*upgrade jax"):
        load(path)
    path = _copy(model[0], tmp_path, "m2")
    _rewrite_manifest(path, lambda d: d.update(platforms=["tpu"]))
    with pytest.raises(ModelFormatError, match=f"exported for platforms \\['tpu'\\], but this process runs on '{jax.default_backend()}'"):
        load(path)
    with pytest.raises(ModelFormatError, match=r"signatures \['nope'\] not in"):
        load(model[0], signatures=["nope"])


def test_artifact_from_a_newer_jax_says_upgrade(model, tmp_path):
    """A blob this jax cannot deserialize (consistent hashes, so not corruption), written
    by a newer jax: the error names the file and says to upgrade."""
    from cairn.serving._hashing import sha256_file

    path = _copy(model[0], tmp_path)
    rel = "signatures/serving_default.jax_exported"
    full = os.path.join(path, rel)
    open(full, "wb").write(b"\x00" * 64)

    def edit(d):
        d["created_by"]["jax"] = "99.0.0"
        d["files"][rel] = {"sha256": sha256_file(full), "size": 64}

    _rewrite_manifest(path, edit)
    with pytest.raises(ModelFormatError, match=r"signatures/serving_default.jax_exported: jax.export cannot deserialize .* jax 99.0.0, newer than this one: upgrade jax") as err:
        load(path)
    assert err.value.file == rel


def test_crc32c_catches_a_chunk_changed_behind_the_manifest(model, tmp_path):
    """Second line of defence: a chunk altered and re-hashed in the manifest (so the SHA-256
    check passes) still fails TensorStore's crc32c, named by its weight key."""
    from cairn.serving._hashing import sha256_file

    path = _copy(model[0], tmp_path)
    doc = read_checksummed_json(os.path.join(path, MANIFEST))
    key = next(e["key"] for e in doc["weights"]["arrays"] if e["path"] == "l1/w")
    chunk = f"{key}/c/0/0"
    data = bytearray(open(os.path.join(path, chunk), "rb").read())
    data[10] ^= 0x40
    open(os.path.join(path, chunk), "wb").write(data)
    _rewrite_manifest(path, lambda d: d["files"][chunk].update(sha256=sha256_file(os.path.join(path, chunk))))
    with pytest.raises(ModelIntegrityError, match=f"{key}: cannot read the weight array 'l1/w'") as err:
        load(path)
    assert err.value.file == key


HERMETIC = hermetic_prelude(("cairn.nn", "cairn.quant", "cairn.kernels", "cairn.optim", "cairn.data",
                             "cairn.checkpoint", "flax", "s1_model_code")) + textwrap.dedent('''
    for name in BLOCKED:
        sys.modules[name] = None
    import jax
    import numpy as np
    from cairn.serving import load

    events = []
    jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))

    path, cache, x = sys.argv[1], sys.argv[2], np.array(json.loads(sys.argv[3]), np.float32)
    m = load(path, compilation_cache_dir=cache)
    out = m({"x": x})
    try:
        import s1_model_code  # noqa: F401
        reachable = True
    except ImportError:
        reachable = False
    mods = sorted(k for k in sys.modules if k.startswith(("cairn", "flax")) and sys.modules[k] is not None)
    print(json.dumps({"name": m.name, "buckets": list(m.batch_buckets), "reachable": reachable, "modules": mods,
                      "cache_hits": events.count("/jax/compilation_cache/cache_hits"),
                      "out": {k: v.tolist() for k, v in out.items()}}))
''')


def _run_hermetic(path, cache, x, tmp_path):
    script = tmp_path / "hermetic.py"
    script.write_text(HERMETIC)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, str(script), str(path), str(cache), json.dumps(x.tolist())],
                          capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cache_entries(cache):
    return sorted(f for _, _, fs in os.walk(cache) for f in fs)


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.xdist_group("serving_subprocess")
def test_hermetic_subprocess_load_and_compilation_cache(model, tmp_path):
    """A fresh process where the model's code, cairn.nn and cairn.quant cannot be imported
    loads and runs the model; a second cold start finds every bucket in the cache."""
    path, params = model
    cache = tmp_path / "jax_cache"
    x = RNG.normal(size=(3, 6)).astype(np.float32)
    first = _run_hermetic(path, cache, x, tmp_path)
    assert first["name"] == "clf" and first["buckets"] == [2, 8] and not first["reachable"]
    # of the cairn packages only core_array and serving itself were imported
    assert {m.split(".")[1] for m in first["modules"] if m.startswith("cairn.")} <= {"core_array", "serving"}
    assert not any(m.startswith("flax") for m in first["modules"])
    ref = _reference(params, x)
    for k in ref:
        np.testing.assert_allclose(np.array(first["out"][k]), ref[k], rtol=1e-4, atol=1e-4)
    assert _cache_entries(cache), "the persistent compilation cache stayed empty"
    assert first["cache_hits"] == 0
    second = _run_hermetic(path, cache, x, tmp_path)
    assert second["out"] == first["out"]
    assert second["cache_hits"] >= 2  # both buckets came from the cache, not XLA
