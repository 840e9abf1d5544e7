"""export -> load round trips: dtypes, symbolic batch and bucket padding, QArray weights,
output naming, signatures, atomic writes, and the artifact-size promise (weights are
arguments, never constants). References are float64 NumPy."""

import os
import tempfile

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cairn.core_array import ArraySpec, QArray, QuantLayout, read_checksummed_json
from cairn.serving import (
    LoadedModel,
    PythonModel,
    ServableModel,
    Signature,
    export,
    load,
)

RNG = np.random.default_rng(0)
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}


def _mlp(params, inputs):
    import jax.numpy as jnp

    x = inputs["x"].astype(jnp.float32)
    h = jnp.tanh(x @ params["dense"]["w"] + params["dense"]["b"])
    return {"y": (h @ params["out"]).astype(inputs["x"].dtype)}


def _mlp_ref(params, x):
    x = np.asarray(x, np.float64)
    h = np.tanh(x @ params["dense"]["w"].astype(np.float64) + params["dense"]["b"].astype(np.float64))
    return h @ params["out"].astype(np.float64)


def _mlp_params(d=8, h=16, o=4):
    return {"dense": {"w": RNG.normal(size=(d, h)).astype(np.float32) / 3, "b": RNG.normal(size=h).astype(np.float32)},
            "out": RNG.normal(size=(h, o)).astype(np.float32)}


@pytest.fixture(scope="module")
def mlp_dir(tmp_path_factory):
    params = _mlp_params()
    path = export(_mlp, params, {"x": ArraySpec(("b", 8), "float32", constraints=("b <= 8",))},
                  tmp_path_factory.mktemp("exp") / "mlp" / "1", batch_buckets=(1, 4))
    return path, params


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_float_round_trip(tmp_path, dtype):
    params = _mlp_params()
    path = export(_mlp, params, {"x": ArraySpec(("b", 8), dtype)}, tmp_path / "m", max_batch_size=4)
    m = load(path)
    x = RNG.normal(size=(3, 8)).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    out = m({"x": x})["y"]
    assert out.dtype == x.dtype and out.shape == (3, 4)
    ref = _mlp_ref(params, x)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10)


def test_int_and_bool_inputs(tmp_path):
    table = RNG.normal(size=(10, 3)).astype(np.float32)

    def fn(p, inp):
        import jax.numpy as jnp

        rows = p["table"][inp["ids"]]
        return {"emb": jnp.where(inp["mask"][:, :, None], rows, 0.0), "count": inp["mask"].sum(axis=1)}

    specs = {"ids": ArraySpec(("b", 5), "int32"), "mask": ArraySpec(("b", 5), "bool")}
    m = load(export(fn, {"table": table}, specs, tmp_path / "m", max_batch_size=8))
    ids = RNG.integers(0, 10, size=(6, 5)).astype(np.int32)
    mask = RNG.random((6, 5)) > 0.5
    out = m({"ids": ids, "mask": mask})
    np.testing.assert_array_equal(out["emb"], np.where(mask[:, :, None], table[ids], 0.0))
    np.testing.assert_array_equal(out["count"], mask.sum(1))
    assert out["count"].dtype == np.int32


def test_symbolic_batch_every_size_and_bucket_padding(mlp_dir):
    path, params = mlp_dir
    m = load(path)
    assert isinstance(m, ServableModel) and isinstance(m, LoadedModel)
    assert m.name == "mlp" and m.max_batch_size == 8 and m.batch_buckets == (1, 4, 8)
    assert m.inputs["x"].shape == ("b", 8) and m.outputs["y"].shape == ("b", 4)
    assert sorted(m.default_signature._compiled) == [1, 4, 8]  # precompiled at load
    x = RNG.normal(size=(8, 8)).astype(np.float32)
    ref = _mlp_ref(params, x)
    for n in range(1, 9):  # 2, 3 pad to 4; 5..7 pad to 8
        out = m({"x": x[:n]})["y"]
        assert out.shape == (n, 4)
        np.testing.assert_allclose(out, ref[:n], rtol=1e-5, atol=1e-5)
    # padding rows never leak: each row equals the row run alone
    alone = np.concatenate([m({"x": x[i : i + 1]})["y"] for i in range(3)])
    np.testing.assert_allclose(m({"x": x[:3]})["y"], alone, rtol=1e-6, atol=1e-6)


def test_call_validation_names_the_input(mlp_dir):
    m = load(mlp_dir[0])
    good = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match=r"input 'x': dtype float64, expected float32"):
        m({"x": good.astype(np.float64)})
    with pytest.raises(ValueError, match=r"input 'x': axis 1 has size 7, expected 8"):
        m({"x": np.zeros((2, 7), np.float32)})
    with pytest.raises(ValueError, match=r"missing \['x'\]; unknown \['z'\]"):
        m({"z": good})
    with pytest.raises(ValueError, match=r"b = 9.*b <= 8"):
        m({"x": np.zeros((9, 8), np.float32)})


def test_weights_are_arguments_not_constants(tmp_path):
    """A 1 MiB weight leaves the StableHLO a few KB; closed over, it would be in it."""
    import jax
    from jax import export as jexport

    w = RNG.normal(size=(512, 512)).astype(np.float32)
    spec = {"x": ArraySpec(("b", 512), "float32")}
    path = export(lambda p, i: i["x"] @ p["w"], {"w": w}, spec, tmp_path / "m")
    size = os.path.getsize(os.path.join(path, "signatures", "serving_default.jax_exported"))
    assert size < 16 * 1024, size
    from cairn.core_array import shape_dtype_structs

    closed = jexport.export(jax.jit(lambda i: i["x"] @ w))(shape_dtype_structs(spec)).serialize()
    assert len(closed) > w.nbytes  # what we avoid
    out = load(path)({"x": np.eye(512, dtype=np.float32)[:2]})["output_0"]
    np.testing.assert_allclose(out, w[:2], rtol=1e-6)


def _qarray_int8(rows, cols, zero=False):
    q = RNG.integers(-127, 128, size=(rows, cols)).astype(np.int8)
    scale = (RNG.random((1, cols)) + 0.5).astype(np.float32) / 100
    zp = RNG.integers(-3, 4, size=(1, cols)).astype(np.int8) if zero else None
    return QArray(q, scale, zp, qtype="int8", layout=QuantLayout.per_channel(1))


def _qarray_int4(rows, cols, packed):
    q = RNG.integers(-8, 8, size=(rows, cols)).astype(ml_dtypes.int4)
    scale = (RNG.random((rows // 4, cols)) + 0.5).astype(np.float32)
    qa = QArray(q, scale, qtype="int4", layout=QuantLayout.per_tile(0, 4))
    return qa.pack() if packed else qa


def _deq_ref(q: QArray) -> np.ndarray:
    """Independent float64 dequantisation (unpacks with ml_dtypes, tiles by repeat)."""
    q = q.unpack()
    v = np.asarray(q.qvalue).astype(np.float64)
    s = np.asarray(q.scale, np.float64)
    if q.layout.kind == "per_tile":
        s = np.repeat(s, q.layout.tile_size, axis=q.layout.axes[0])
    zp = 0.0 if q.zero_point is None else np.asarray(q.zero_point, np.float64)
    return (v - zp) * s


@pytest.mark.parametrize("kind", ["int8", "int8_zero_point", "int4_unpacked", "int4_packed"])
def test_qarray_leaves(tmp_path, kind):
    rows, cols = 64, 32
    if kind.startswith("int8"):
        w = _qarray_int8(rows, cols, zero=kind.endswith("zero_point"))
    else:
        w = _qarray_int4(rows, cols, packed=kind == "int4_packed")
    seen = {}

    def fn(p, inp):
        seen["packed"] = p["layer"]["w"].packed_length is not None
        return inp["x"] @ p["layer"]["w"].dequantize()

    path = export(fn, {"layer": {"w": w}}, {"x": ArraySpec(("b", rows), "float32")}, tmp_path / "m")
    assert seen["packed"] == (kind == "int4_packed")  # the model sees the QArray as it was given
    man = read_checksummed_json(os.path.join(path, "manifest.json"))
    meta = man["weights"]["qarrays"]["layer/w"]
    assert meta["qtype"] == w.qtype and meta["layout"] == w.layout.to_json()
    arrays = {e["path"]: e for e in man["weights"]["arrays"]}
    assert set(arrays) >= {"layer/w/qvalue", "layer/w/scale"}
    m = load(path)
    x = RNG.normal(size=(3, rows)).astype(np.float32)
    np.testing.assert_allclose(m({"x": x})["output_0"], x.astype(np.float64) @ _deq_ref(w), rtol=1e-4, atol=1e-4)
    qbytes = m.weights["layer/w/qvalue"].nbytes
    if kind.startswith("int4"):
        # packed two to a byte on disk and on the device
        assert arrays["layer/w/qvalue"]["dtype"] == "uint8" and qbytes == rows * cols // 2
        assert m.weights_nbytes == qbytes + w.scale.nbytes
        chunk = os.path.join(path, arrays["layer/w/qvalue"]["key"], "c", "0", "0")
        assert os.path.getsize(chunk) <= rows * cols // 2 + 4
    else:
        assert qbytes == rows * cols


def test_output_naming(tmp_path):
    spec = {"x": ArraySpec(("b", 2), "float32")}
    single = load(export(lambda p, i: i["x"] * p["k"], {"k": np.float32(2)}, spec, tmp_path / "a"))
    assert list(single.outputs) == ["output_0"]
    pair = load(export(lambda p, i: (i["x"], i["x"] + p["k"]), {"k": np.float32(1)}, spec, tmp_path / "b"))
    assert sorted(pair.outputs) == ["output_0", "output_1"]
    nested = load(export(lambda p, i: {"a": {"b": i["x"]}, "c": i["x"]}, {}, spec, tmp_path / "c"))
    assert sorted(nested.outputs) == ["a/b", "c"]
    x = np.ones((2, 2), np.float32)
    np.testing.assert_array_equal(pair({"x": x})["output_1"], x + 1)


def test_unbatchable_and_concrete_models(tmp_path):
    concrete = load(export(lambda p, i: i["x"].sum(), {}, {"x": ArraySpec((3, 2), "float32")}, tmp_path / "a"))
    assert concrete.max_batch_size == 0 and concrete.batch_buckets == ()
    assert float(concrete({"x": np.ones((3, 2), np.float32)})["output_0"]) == 6.0
    # symbolic axis 0 whose outputs are not batched: refused unless max_batch_size=0
    with pytest.raises(ValueError, match="not batched along axis 0"):
        export(lambda p, i: i["x"].sum(), {}, {"x": ArraySpec(("n", 2), "float32")}, tmp_path / "b")
    m = load(export(lambda p, i: i["x"].sum(), {}, {"x": ArraySpec(("n", 2), "float32")}, tmp_path / "b",
                    max_batch_size=0))
    assert m.max_batch_size == 0 and float(m({"x": np.ones((5, 2), np.float32)})["output_0"]) == 10.0
    with pytest.raises(ValueError, match="batch_buckets"):
        export(lambda p, i: i["x"], {}, {"x": ArraySpec((3,), "float32")}, tmp_path / "c", batch_buckets=(1, 2))


def test_batch_options_are_checked(tmp_path):
    spec = {"x": ArraySpec(("b", 2), "float32", constraints=("b <= 4",))}
    with pytest.raises(ValueError, match="exceeds the constraint b <= 4"):
        export(lambda p, i: i["x"], {}, spec, tmp_path / "a", max_batch_size=8)
    with pytest.raises(ValueError, match=r"out of range: each must be in 1..4"):
        export(lambda p, i: i["x"], {}, spec, tmp_path / "a", batch_buckets=(0, 2))
    m = load(export(lambda p, i: i["x"], {}, {"x": ArraySpec(("b", 2), "float32")}, tmp_path / "d"))
    assert m.max_batch_size == 64 and m.batch_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert m.inputs["x"].constraints == ("b <= 64",)


def test_bad_export_arguments(tmp_path):
    with pytest.raises(ValueError, match="must be an ArraySpec"):
        export(lambda p, i: i["x"], {}, {"x": (2, 3)}, tmp_path / "a")
    with pytest.raises(ValueError, match="non-empty dict"):
        export(lambda p, i: i, {}, {}, tmp_path / "a")
    with pytest.raises(ValueError, match="params leaf 'name'.*not numeric"):
        export(lambda p, i: i["x"], {"name": "abc"}, {"x": ArraySpec((2,), "float32")}, tmp_path / "a")
    with pytest.raises(ValueError, match=r"signature 'serving_default': exporting fn .* failed"):
        export(lambda p, i: i["x"].reshape(3, -1), {}, {"x": ArraySpec(("b", 2), "float32")}, tmp_path / "a")
    with pytest.raises(ValueError, match="needs jax_enable_x64"):
        export(lambda p, i: i["x"], {}, {"x": ArraySpec((2,), "float64")}, tmp_path / "a")
    with pytest.raises(ValueError, match="signature name"):
        export(lambda p, i: i["x"], {}, {"x": ArraySpec((2,), "float32")}, tmp_path / "a",
               signatures={"../evil": Signature(lambda p, i: i["x"], {"x": ArraySpec((2,), "float32")})})
    assert not os.path.exists(tmp_path / "a") and os.listdir(tmp_path) == []


def test_multiple_signatures_share_weights(tmp_path):
    params = {"w": RNG.normal(size=(4, 4)).astype(np.float32)}
    path = export(
        lambda p, i: i["x"] @ p["w"], params, {"x": ArraySpec(("b", 4), "float32")}, tmp_path / "m",
        max_batch_size=4,
        signatures={"transpose": Signature(lambda p, i: {"t": i["v"] @ p["w"].T}, {"v": ArraySpec((4,), "float32")})},
    )
    m = load(path)
    assert sorted(m.signatures) == ["serving_default", "transpose"]
    t = m.signatures["transpose"]
    assert isinstance(t, ServableModel) and t.max_batch_size == 0
    v = np.arange(4, dtype=np.float32)
    np.testing.assert_allclose(t({"v": v})["t"], params["w"].astype(np.float64) @ v, rtol=1e-5)
    only = load(path, signatures=["transpose"], precompile=False)
    assert list(only.signatures) == ["transpose"] and only.inputs == t.inputs


def test_atomic_write_and_overwrite(tmp_path):
    spec = {"x": ArraySpec((2,), "float32")}
    p = export(lambda p, i: i["x"] + p["k"], {"k": np.float32(1)}, spec, tmp_path / "m")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export(lambda p, i: i["x"], {}, spec, tmp_path / "m")
    export(lambda p, i: i["x"] + p["k"], {"k": np.float32(5)}, spec, tmp_path / "m", overwrite=True)
    assert float(load(p)({"x": np.zeros(2, np.float32)})["output_0"][0]) == 5.0
    assert sorted(os.listdir(tmp_path)) == ["m"]  # no temporary or old copy left behind

    def boom(p, i):
        raise RuntimeError("model bug")

    with pytest.raises(ValueError, match="model bug"):
        export(boom, {}, spec, tmp_path / "n")
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_manifest_contents(mlp_dir):
    import jax

    man = read_checksummed_json(os.path.join(mlp_dir[0], "manifest.json"))
    assert man["format"] == "cairn.serving.model/2"
    assert man["created_by"]["jax"] == jax.__version__ and "jaxlib" in man["created_by"]
    sig = man["signatures"]["serving_default"]
    assert sig["inputs"]["x"] == {"shape": ["b", 8], "dtype": "float32", "logical_axes": None, "sharding": None,
                                  "constraints": ["b <= 8"]}
    assert sig["batch_buckets"] == [1, 4, 8] and isinstance(sig["calling_convention_version"], int)
    assert man["platforms"] == [jax.default_backend()]
    files = set(man["files"])
    on_disk = {os.path.relpath(os.path.join(d, f), mlp_dir[0]) for d, _, fs in os.walk(mlp_dir[0]) for f in fs}
    assert files == on_disk - {"manifest.json", "manifest.json.sha256"}


def test_python_model_adapter():
    m = PythonModel(lambda i: (i["x"] * 2,), {"x": ArraySpec(("b", 2), "float32", constraints=("b <= 4",))},
                    {"output_0": ArraySpec(("b", 2), "float32")}, name="dbl")
    assert isinstance(m, ServableModel) and m.max_batch_size == 4 and m.batch_buckets == (1, 2, 4)
    np.testing.assert_array_equal(m({"x": np.ones((3, 2), np.float32)})["output_0"], 2 * np.ones((3, 2)))
    with pytest.raises(ValueError, match="exceeds max_batch_size 4"):
        PythonModel(lambda i: i, {"x": ArraySpec(("b",), "int8")}, {}, max_batch_size=4)({"x": np.zeros(5, np.int8)})
    with pytest.raises(ValueError, match="same symbolic dim"):
        PythonModel(lambda i: i, {"x": ArraySpec((2,), "int8")}, {}, max_batch_size=4)
    with pytest.raises(ValueError, match=r"model returned outputs \['output_0'\], expected \['y'\]"):
        PythonModel(lambda i: i["x"], {"x": ArraySpec((2,), "int8")}, {"y": ArraySpec((2,), "int8")})(
            {"x": np.zeros(2, np.int8)})


DTYPES = ["float32", "float16", "bfloat16", "int8", "int32", "uint8", "bool"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(DTYPES), tail=st.lists(st.integers(1, 3), max_size=2), n=st.integers(1, 5),
       batched=st.booleans())
@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_hypothesis_round_trip_identity_plus_weight(tmp_path, dtype, tail, n, batched):
    """fn(p, x) = x + w (or x ^ w for bool) for any shape/dtype: the round trip is exact."""
    import jax.numpy as jnp

    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    w = (np.arange(int(np.prod(tail)), dtype=np.float32).reshape(tail) % 3).astype(npdt)
    spec = ArraySpec((("b",) if batched else (n,)) + tuple(tail), dtype)

    def fn(p, i):
        return jnp.logical_xor(i["x"], p["w"]) if dtype == "bool" else i["x"] + p["w"]

    path = os.path.join(tempfile.mkdtemp(dir=tmp_path), "m")
    m = load(export(fn, {"w": w}, {"x": spec}, path, max_batch_size=4 if batched else None))
    rows = min(n, 4) if batched else n
    x = (RNG.integers(0, 4, size=(rows, *tail))).astype(npdt)
    ref = np.logical_xor(x, w) if dtype == "bool" else (x.astype(np.float64) + w.astype(np.float64)).astype(npdt)
    out = m({"x": x})["output_0"]
    assert out.dtype == npdt and out.shape == x.shape
    np.testing.assert_array_equal(out, ref)


def test_big_weights_are_chunked_by_rows(tmp_path, monkeypatch):
    import cairn.serving._weights as weights_mod

    monkeypatch.setattr(weights_mod, "_CHUNK_BYTES", 1024)  # 4 rows of 64 float32 a chunk
    w = RNG.normal(size=(64, 64)).astype(np.float32)
    path = export(lambda p, i: i["x"] @ p["w"], {"w": w}, {"x": ArraySpec(("b", 64), "float32")}, tmp_path / "m")
    man = read_checksummed_json(os.path.join(path, "manifest.json"))
    chunks = [f for f in man["files"] if f.startswith("weights/0/c/")]
    assert len(chunks) == 16
    np.testing.assert_array_equal(load(path).weights["w"], w)


def test_output_dim_expressions_get_names(tmp_path):
    import jax.numpy as jnp

    m = load(export(lambda p, i: jnp.concatenate([i["x"], i["x"]]), {}, {"x": ArraySpec(("n", 2), "float32")},
                    tmp_path / "m", max_batch_size=0))
    assert m.outputs["output_0"].shape == ("d0", 2)
    man = read_checksummed_json(os.path.join(m.path, "manifest.json"))
    assert man["signatures"]["serving_default"]["output_shape_exprs"]["output_0"][0].replace(" ", "") == "2*n"
    assert m({"x": np.ones((3, 2), np.float32)})["output_0"].shape == (6, 2)


def test_every_weight_dtype_round_trips_bit_for_bit(tmp_path):
    """Weights of every low-precision dtype, including those zarr3 cannot name (uint4,
    uint2: stored as their bytes), come back bit for bit and reach the function intact."""
    import jax.numpy as jnp

    names = ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "bfloat16", "float16", "int4", "uint4", "int2",
             "uint2", "uint8", "bool", "int32"]
    names = [n for n in names if hasattr(ml_dtypes, n) or hasattr(np, n)]
    params = {}
    for n in names:
        dt = np.dtype(getattr(ml_dtypes, n, None) or n)
        params[n] = (np.arange(12).reshape(3, 4) % 3).astype(dt)
    path = export(lambda p, i: {k: v.astype(jnp.float32) + i["x"] for k, v in p.items()}, params,
                  {"x": ArraySpec((), "float32")}, tmp_path / "m")
    man = read_checksummed_json(os.path.join(path, "manifest.json"))
    stored = {e["path"]: e["stored_dtype"] for e in man["weights"]["arrays"]}
    assert stored["uint4"] == "uint8" and stored["int4"] == "int4"  # zarr3 has no uint4
    casts = man["weights"]["casts"]  # jax.export has no int2, uint2: they cross as int8, uint8
    assert {n for n in ("int2", "uint2") if n in names} <= set(casts)
    m = load(path)
    out = m({"x": np.float32(0.5)})
    for n in names:
        held = np.asarray(m.weights[n])
        if n in casts:
            np.testing.assert_array_equal(held, params[n].astype(held.dtype))
        else:
            assert held.dtype == params[n].dtype
            np.testing.assert_array_equal(held.view(np.uint8), params[n].view(np.uint8))
        np.testing.assert_array_equal(out[n], params[n].astype(np.float32) + 0.5)
    with pytest.raises(ValueError, match="input 'x' is int2, which jax.export cannot serialize"):
        export(lambda p, i: i["x"], {}, {"x": ArraySpec((2,), "int2")}, tmp_path / "n")
    with pytest.raises(ValueError, match="jax.export cannot serialize it"):
        export(lambda p, i: p["int2"], {"int2": params["int2"]}, {"x": ArraySpec((2,), "int8")}, tmp_path / "n")


def test_multi_platform_export_loads_here(tmp_path):
    import jax

    m = load(export(lambda p, i: i["x"] * 2, {}, {"x": ArraySpec(("b", 2), "float32")}, tmp_path / "m",
                    platforms=("cpu", "cuda"), max_batch_size=2))
    assert m.manifest["platforms"] == ["cpu", "cuda"] and jax.default_backend() in ("cpu", "gpu")
    np.testing.assert_array_equal(m({"x": np.ones((2, 2), np.float32)})["output_0"], 2 * np.ones((2, 2)))
