"""QArray (dequantize vs a float64 reference, pytree, validation), sub-byte packing,
sharding rules and protocols."""

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.core_array import (
    Checkpointable,
    GradientTransformationLike,
    LogicalAxisRules,
    QArray,
    QuantLayout,
    as_numpy_dtype,
    dtype_info,
    flatten_with_paths,
    logical_to_partition_spec,
    named_sharding,
    pack_bits,
    unpack_bits,
)


def _reference_dequant(q, scale, zp, layout):
    """Independent float64 reference: loop over every element and find its scale."""
    q = np.asarray(q, np.float64)
    out = np.empty_like(q)
    scale = np.asarray(scale, np.float64)
    zp = None if zp is None else np.asarray(zp, np.float64)
    for idx in np.ndindex(q.shape):
        if layout.kind == "per_tensor":
            sidx = (0,) * scale.ndim
        elif layout.kind == "per_channel":
            sidx = tuple(i if scale.shape[d] != 1 else 0 for d, i in enumerate(idx))
        else:
            ax = layout.axes[0] % q.ndim
            sidx = tuple(
                (i // layout.tile_size if d == ax else (i if scale.shape[d] != 1 else 0)) for d, i in enumerate(idx)
            )
        s = scale[sidx] if scale.ndim else scale
        z = 0.0 if zp is None else (zp[sidx] if zp.ndim else zp)
        out[idx] = (q[idx] - z) * s
    return out


@pytest.mark.parametrize(
    "layout, sshape",
    [
        (QuantLayout.per_tensor(), ()),
        (QuantLayout.per_channel(1), (1, 8)),
        (QuantLayout.per_channel(0), (6, 1)),
        (QuantLayout.per_tile(1, 4), (6, 2)),
        (QuantLayout.per_tile(0, 3), (2, 8)),
        (QuantLayout.per_tile(0, 2), (3, 1)),
    ],
)
@pytest.mark.parametrize("with_zp", [False, True])
def test_dequantize_matches_reference(layout, sshape, with_zp):
    rng = np.random.default_rng(0)
    q = rng.integers(-128, 128, (6, 8)).astype(np.int8)
    scale = rng.uniform(0.01, 1, sshape).astype(np.float32)
    zp = rng.integers(-5, 5, sshape).astype(np.int8) if with_zp else None
    qa = QArray(q, scale, zp, qtype="int8", layout=layout, dtype="float32")
    np.testing.assert_allclose(qa.dequantize(), _reference_dequant(q, scale, zp, layout), rtol=1e-6)
    qb = QArray(q, scale, zp, qtype="int8", layout=layout, dtype="bfloat16")
    assert qb.dequantize().dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(qb.dequantize().astype(np.float64), _reference_dequant(q, scale, zp, layout), rtol=1e-2)


def test_qarray_is_a_pytree_and_jits():
    jax = pytest.importorskip("jax")
    q = QArray(np.ones((4, 8), np.int8), np.full((4, 2), 0.5, np.float32), qtype="int8", layout=QuantLayout.per_tile(1, 4))
    assert [p for p in flatten_with_paths({"w": q})] == ["w/qvalue", "w/scale"]
    out = jax.jit(lambda t: t.dequantize())(q)
    np.testing.assert_allclose(np.asarray(out), 0.5)
    doubled = jax.tree_util.tree_map(lambda x: x * 2, q)
    assert isinstance(doubled, QArray) and doubled.layout == q.layout and doubled.qtype == "int8"


@pytest.mark.parametrize(
    "layout, sshape, fragment",
    [
        (QuantLayout.per_channel(1), (6, 1), "does not fit"),
        (QuantLayout.per_tile(1, 3), (6, 2), "not a multiple of tile_size"),
        (QuantLayout.per_tile(1, 4), (6, 8), "does not fit"),
        (QuantLayout.per_channel(2), (1, 8), r"axis 2 is out of range for values of shape \(6, 8\)"),
        (QuantLayout.per_channel(-3), (6, 1), "axis -3 is out of range"),
        (QuantLayout.per_tile(5, 2), (3, 8), "per_tile axis 5 is out of range"),
        (QuantLayout.per_channel(0, -2), (6, 1), "name the same axis twice"),
    ],
)
def test_qarray_shape_validation(layout, sshape, fragment):
    with pytest.raises(ValueError, match=fragment):
        QArray(np.zeros((6, 8), np.int8), np.ones(sshape, np.float32), layout=layout)
    if "range" in fragment:  # a Python scalar scale does not skip the layout check
        with pytest.raises(ValueError, match="out of range"):
            QArray(np.zeros((6, 8), np.int8), 0.5, layout=layout)


@pytest.mark.parametrize(
    "qvalue, qtype, fragment",
    [
        (np.zeros(4, np.float32), "int4", "qvalue has dtype float32 but qtype is 'int4'"),
        (np.zeros(4, np.int8), "int4", "qvalue has dtype int8 but qtype is 'int4'"),
        (np.zeros(2, np.uint8), "uint4", "unpack_bits on packed storage"),
        (np.zeros(4, "U1"), "int8", "qvalue has dtype <U1"),
    ],
)
def test_qvalue_dtype_must_be_the_qtype(qvalue, qtype, fragment):
    with pytest.raises(ValueError, match=fragment):
        QArray(qvalue, np.ones((), np.float32), qtype=qtype)
    ok = QArray(qvalue.astype(as_numpy_dtype(qtype)) if qvalue.dtype.kind != "U" else np.zeros(4, np.int8),
                np.ones((), np.float32), qtype=qtype)
    assert ok.qtype == qtype


def test_layout_validation():
    with pytest.raises(ValueError, match="unknown"):
        QuantLayout("blocked")
    with pytest.raises(ValueError, match="needs axes"):
        QuantLayout("per_channel")
    with pytest.raises(ValueError, match="positive tile_size"):
        QuantLayout("per_tile", (0,), 0)
    with pytest.raises(ValueError, match="no axes"):
        QuantLayout("per_tensor", (1,))
    assert QuantLayout.from_json(QuantLayout.per_tile(1, 32).to_json()) == QuantLayout.per_tile(1, 32)
    with pytest.raises(TypeError, match="QuantLayout"):
        QArray(np.zeros(2, np.int8), np.ones(()), layout="per_tensor")
    with pytest.raises(ValueError, match="zero_point shape"):
        QArray(np.zeros((2, 2), np.int8), np.ones((1, 2)), np.zeros((2, 2)), layout=QuantLayout.per_channel(1))


SUB_BYTE = ["int4", "uint4", "int2", "uint2", "float4_e2m1fn"]


def _reference_pack(values_bits, bits):
    """Bit-by-bit reference: element k of each byte's group lands at bit offset k*bits."""
    per = 8 // bits
    n = values_bits.shape[-1]
    nbytes = -(-n // per)
    out = np.zeros(values_bits.shape[:-1] + (nbytes,), np.uint8)
    for idx in np.ndindex(values_bits.shape):
        j = idx[-1]
        out[idx[:-1] + (j // per,)] |= np.uint8(int(values_bits[idx]) << ((j % per) * bits))
    return out


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(SUB_BYTE), st.lists(st.integers(0, 6), min_size=1, max_size=3), st.integers(0, 2**31))
def test_pack_unpack_round_trip(name, shape, seed):
    dt = np.dtype(getattr(ml_dtypes, name))
    info_bits = {"int4": 4, "uint4": 4, "int2": 2, "uint2": 2, "float4_e2m1fn": 4}[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 1 << info_bits, shape).astype(np.uint8)
    if name == "int4":
        vals = np.where(raw >= 8, raw.astype(np.int16) - 16, raw).astype(dt)
    elif name == "int2":
        vals = np.where(raw >= 2, raw.astype(np.int16) - 4, raw).astype(dt)
    else:
        vals = raw.view(dt) if name == "float4_e2m1fn" else raw.astype(dt)
    packed = pack_bits(vals)
    np.testing.assert_array_equal(packed, _reference_pack(raw, info_bits))
    back = unpack_bits(packed, name, shape[-1])
    assert back.dtype == dt
    np.testing.assert_array_equal(back.view(np.uint8) & ((1 << info_bits) - 1), raw)
    if name != "float4_e2m1fn":
        np.testing.assert_array_equal(back.astype(np.int16), vals.astype(np.int16))


def test_pack_errors():
    with pytest.raises(ValueError, match="1-, 2- or 4-bit"):
        pack_bits(np.zeros(3, np.int8))
    with pytest.raises(ValueError, match="at least one axis"):
        pack_bits(np.zeros((), ml_dtypes.int4))
    with pytest.raises(ValueError, match="uint8"):
        unpack_bits(np.zeros(2, np.int8), "int4", 3)
    with pytest.raises(ValueError, match="do not fit"):
        unpack_bits(np.zeros(2, np.uint8), "int4", 5)
    with pytest.raises(ValueError, match="not a 1-, 2- or 4-bit"):
        unpack_bits(np.zeros(2, np.uint8), "int8", 2)


def test_logical_axis_rules():
    rules = LogicalAxisRules([("batch", "data"), ("embed", "model"), ("mlp", "model"), ("heads", ("model", "data"))])
    assert rules.mesh_axes(("batch", "embed", "mlp")) == ("data", "model", None)  # a mesh axis is used once
    assert rules.mesh_axes(("heads", None)) == (("model", "data"), None)
    assert rules.mesh_axes(("batch", "heads")) == ("data", None)
    assert rules.mesh_axes(("batch", "embed"), mesh_axis_names=("data",)) == ("data", None)
    fallback = LogicalAxisRules([("embed", "fsdp"), ("embed", "model")])
    assert fallback.mesh_axes(("embed",), mesh_axis_names=("model",)) == ("model",)
    assert LogicalAxisRules({"vocab": None}).mesh_axes(("vocab", "unknown")) == (None, None)
    assert LogicalAxisRules.from_json(rules.to_json()) == rules
    with pytest.raises(ValueError, match="rule 0"):
        LogicalAxisRules([("batch",)])
    with pytest.raises(ValueError, match="target 3"):
        LogicalAxisRules([("batch", 3)])
    with pytest.raises(ValueError, match="logical axis 5"):
        rules.mesh_axes((5,))


def test_partition_spec_and_named_sharding():
    jax = pytest.importorskip("jax")
    P = jax.sharding.PartitionSpec
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    rules = [("batch", "data"), ("embed", "model")]
    assert logical_to_partition_spec(("batch", None, "embed"), rules) == P("data", None, "model")
    ns = named_sharding(mesh, ("batch", "embed"), rules)
    assert ns.spec == P("data", "model") and ns.mesh == mesh
    small = jax.make_mesh((1,), ("data",))
    assert logical_to_partition_spec(("batch", "embed"), rules, small) == P("data", None)


def test_protocols_are_duck_typed():
    class It:
        def get_state(self):
            return {"i": 1}

        def set_state(self, s):
            pass

    class Tx:
        def init(self, params):
            return ()

        def update(self, updates, state, params=None, **extra):
            return updates, state

    assert isinstance(It(), Checkpointable) and not isinstance(object(), Checkpointable)
    assert isinstance(Tx(), GradientTransformationLike)

    class OnlyInit:
        def init(self, params):
            return ()

    assert not isinstance(OnlyInit(), GradientTransformationLike) and not isinstance(Tx(), Checkpointable)
    import typing

    for proto in (Checkpointable, GradientTransformationLike):
        assert typing.Protocol in proto.__mro__ and getattr(proto, "_is_runtime_protocol", False)
    optax = pytest.importorskip("optax")
    assert isinstance(optax.adam(1e-3), GradientTransformationLike)


# --- hypothesis: QArray ---


@st.composite
def qarrays(draw):
    """Random QArrays: any layout kind, 1-3 dims, integer and float quantized types,
    float32 / bfloat16 / float16 scales, with or without a zero point."""
    ndim = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["per_tensor", "per_channel", "per_tile"]))
    tile = draw(st.integers(1, 3))
    axis = draw(st.integers(-ndim, ndim - 1))
    shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
    if kind == "per_tile":
        shape[axis % ndim] *= tile
        layout = QuantLayout.per_tile(axis, tile)
    elif kind == "per_channel":
        layout = QuantLayout.per_channel(axis)
    else:
        layout = QuantLayout.per_tensor()
    shape = tuple(shape)
    full = layout.expected_scale_shape(shape)
    # broadcast (size 1) allowed on axes that are not the quantized one
    sshape = () if kind == "per_tensor" and draw(st.booleans()) else tuple(
        d if (i == axis % ndim or draw(st.booleans())) else 1 for i, d in enumerate(full)
    )
    if kind == "per_tensor":
        sshape = sshape if sshape == () else (1,) * ndim
    qtype = draw(st.sampled_from(["int8", "int4", "uint4", "int2", "float8_e4m3fn", "float4_e2m1fn"]))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    info = dtype_info(qtype)
    if info.kind == "float":
        q = rng.uniform(-4, 4, shape).astype(as_numpy_dtype(qtype))
    else:
        lo, hi = (0, 2**info.bits) if info.kind == "uint" else (-(2 ** (info.bits - 1)), 2 ** (info.bits - 1))
        q = rng.integers(lo, hi, shape).astype(as_numpy_dtype(qtype))
    sdtype = draw(st.sampled_from([np.float32, ml_dtypes.bfloat16, np.float16]))
    scale = rng.uniform(0.01, 2, sshape).astype(sdtype)
    zp = rng.integers(-3, 4, sshape).astype(np.int8) if draw(st.booleans()) else None
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    return QArray(q, scale, zp, qtype=qtype, layout=layout, dtype=dtype)


def _bits(a):
    a = np.asarray(a)
    return a.dtype, a.shape, a.view(np.uint8 if a.dtype.itemsize == 1 else f"u{a.dtype.itemsize}").tobytes()


@settings(max_examples=60, deadline=None)
@given(qarrays())
def test_qarray_json_round_trip_is_exact(q):
    r = QArray.from_json(json.loads(json.dumps(q.to_json())))
    assert (r.qtype, r.dtype, r.layout) == (q.qtype, q.dtype, q.layout)
    for name in ("qvalue", "scale", "zero_point"):
        a, b = getattr(q, name), getattr(r, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert _bits(a) == _bits(b), name
    np.testing.assert_array_equal(np.asarray(r.dequantize(), np.float64), np.asarray(q.dequantize(), np.float64))


@settings(max_examples=60, deadline=None)
@given(qarrays())
def test_qarray_dequantize_matches_float64_reference(q):
    ref = _reference_dequant(q.qvalue, q.scale, q.zero_point, q.layout)
    got = np.asarray(q.dequantize(), np.float64)
    # float32 math then a cast to `dtype`: float32 keeps ~1e-6, bfloat16 8 bits of mantissa
    rtol = 1e-6 if q.dtype == "float32" else 8e-3
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=1e-30)


@settings(max_examples=30, deadline=None)
@given(qarrays())
def test_qarray_pytree_round_trip(q):
    jax = pytest.importorskip("jax")
    leaves, treedef = jax.tree_util.tree_flatten(q)
    r = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(r, QArray) and (r.qtype, r.dtype, r.layout) == (q.qtype, q.dtype, q.layout)
    assert len(leaves) == (3 if q.zero_point is not None else 2)
    paths = sorted(flatten_with_paths({"w": q}))
    assert paths == sorted(["w/qvalue", "w/scale"] + (["w/zero_point"] if q.zero_point is not None else []))


def test_qarray_json_errors():
    q = QArray(np.zeros((2, 2), np.int8), np.ones((1, 2), np.float32), layout=QuantLayout.per_channel(1))
    d = q.to_json()
    with pytest.raises(ValueError, match=r"missing keys \['scale'\]"):
        QArray.from_json({k: v for k, v in d.items() if k != "scale"})
    bad = json.loads(json.dumps(d))
    bad["qvalue"]["data"] = bad["qvalue"]["data"][:-1]
    with pytest.raises(ValueError, match="'qvalue' has shape \\[2, 2\\] but 3 values"):
        QArray.from_json(bad)
    bad = json.loads(json.dumps(d))
    bad["qvalue"]["data"][0] = 300
    with pytest.raises(ValueError, match="'qvalue' holds values outside int8"):
        QArray.from_json(bad)
    bad = json.loads(json.dumps(d))
    bad["layout"] = {"axes": [1]}
    with pytest.raises(ValueError, match="QuantLayout.from_json expects a dict with 'kind'"):
        QArray.from_json(bad)
    with pytest.raises(ValueError, match="expects a dict"):
        QArray.from_json([1])
