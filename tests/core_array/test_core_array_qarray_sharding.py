"""QArray (dequantize vs a float64 reference, pytree, validation), sub-byte packing,
sharding rules and protocols."""

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
    ],
)
def test_qarray_shape_validation(layout, sshape, fragment):
    with pytest.raises(ValueError, match=fragment):
        QArray(np.zeros((6, 8), np.int8), np.ones(sshape, np.float32), layout=layout)


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
    optax = pytest.importorskip("optax")
    assert isinstance(optax.adam(1e-3), GradientTransformationLike)
