"""ArraySpec symbolic dimensions: constraints, shape checks naming the failing axis, JSON
(old documents still load), and the JAX symbolic shapes they turn into."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.core_array import (
    ArraySpec,
    QArray,
    QuantLayout,
    shape_dtype_structs,
    specs_from_json,
    specs_to_json,
)


def test_symbolic_spec_basics():
    s = ArraySpec(("b", 512), "float32", constraints=("b <= 64",))
    assert s.shape == ("b", 512) and s.is_symbolic and s.symbols == ("b",)
    assert s.dim_bounds() == {"b": (1, 64)}
    assert not ArraySpec((2, 3), "float32").is_symbolic


@pytest.mark.parametrize(
    "text,stored",
    [("b <= 64", "b <= 64"), ("b<65", "b <= 64"), ("64 >= b", "64 >= b"), ("b > 1", "b >= 2"),
     ("2 < b", "3 <= b"), ("b == 8", "b == 8"), ("b >= c", "b >= c")],
)
def test_constraints_are_normalised(text, stored):
    s = ArraySpec(("b", "c"), "int8", constraints=(text,))
    assert s.constraints == (stored,)


@pytest.mark.parametrize(
    "shape,constraints,match",
    [
        (("b",), ("b <= x <= 3",), "must read"),
        (("b",), ("c <= 4",), "names dimension 'c'"),
        (("b",), ("4 <= 5",), "names no dimension"),
        (("b", "c"), ("b < c",), "strict comparison"),
        (("2b",), (), "must be a name"),
        ((-1,), (), "non-negative"),
        ((1.5,), (), "non-negative integers"),
        ((None,), (), "ints or dimension names"),
    ],
)
def test_bad_specs_raise_naming_what(shape, constraints, match):
    with pytest.raises(ValueError, match=match):
        ArraySpec(shape, "float32", constraints=constraints)


def test_check_shape_names_the_failing_axis():
    s = ArraySpec(("b", 512), "float32", constraints=("b <= 64",))
    assert s.check_shape((8, 512)) == {"b": 8}
    with pytest.raises(ValueError, match=r"input 'x': axis 1 has size 3, expected 512"):
        s.check_shape((8, 3), what="input 'x'")
    with pytest.raises(ValueError, match=r"b = 65.*'b <= 64'"):
        s.check_shape((65, 512))
    with pytest.raises(ValueError, match=r"3 dims\), expected"):
        s.check_shape((1, 2, 3))
    with pytest.raises(ValueError, match=r"axis 0 \(b\) has size 0"):
        s.check_shape((0, 512))
    with pytest.raises(ValueError, match=r"axis 0 \(b\) has size 4, but b = 8 elsewhere"):
        s.check_shape((4, 512), {"b": 8})
    assert s.matches((64, 512)) and not s.matches((65, 512)) and not s.matches((2,))


def test_shared_name_within_one_spec():
    s = ArraySpec(("n", "n"), "float32")
    assert s.matches((3, 3)) and not s.matches((3, 4))


def test_two_dim_constraint_and_bind():
    s = ArraySpec(("b", "t"), "int32", constraints=("t >= b", "b <= 4"))
    assert s.matches((2, 3)) and not s.matches((3, 2))
    bound = s.bind(b=2)
    assert bound.shape == (2, "t") and bound.constraints == ("t >= 2",)
    assert bound.matches((2, 2)) and not bound.matches((2, 1))
    assert s.bind({"b": 2, "t": 5}).shape == (2, 5) and s.bind({"b": 2, "t": 5}).constraints == ()
    with pytest.raises(ValueError, match="breaks the constraint 'b <= 4'"):
        s.bind(b=5)


def test_size_of_symbolic_spec_raises():
    s = ArraySpec(("b", 2), "float32")
    with pytest.raises(ValueError, match="symbolic dims"):
        _ = s.nbytes
    assert s.bind(b=3).nbytes == 24


def test_json_round_trip_and_format_versions():
    t = {"x": ArraySpec(("b", 3), "bfloat16", constraints=("b <= 8",)), "y": ArraySpec((2,), "int8")}
    text = specs_to_json(t)
    assert json.loads(text)["format"] == "cairn.specs/2"
    assert specs_from_json(text) == t
    concrete = {"y": ArraySpec((2,), "int8")}
    assert json.loads(specs_to_json(concrete))["format"] == "cairn.specs/1"
    # a document an older writer made (no constraints key anywhere) still loads
    old = '{"format":"cairn.specs/1","tree":{"t":"dict","v":{"w":{"t":"spec","v":{"shape":[2,3],"dtype":"float32","logical_axes":null,"sharding":null}}}}}'
    assert specs_from_json(old) == {"w": ArraySpec((2, 3), "float32")}
    # a concrete spec's JSON is unchanged (no "constraints" key), so old readers read it
    assert "constraints" not in ArraySpec((2,), "int8").to_json()
    bad = text.replace("cairn.specs/2", "cairn.specs/1")
    with pytest.raises(ValueError, match="cannot hold symbolic dims"):
        specs_from_json(bad)
    with pytest.raises(ValueError, match="format in"):
        specs_from_json(text.replace("cairn.specs/2", "cairn.specs/9"))


def test_json_keeps_qarray_of_symbolic_specs():
    q = QArray(ArraySpec(("n", 4), "int8"), ArraySpec((1, 4), "float32"), qtype="int8",
               layout=QuantLayout.per_channel(1))
    back = specs_from_json(specs_to_json({"w": q}))["w"]
    assert back.qvalue == ArraySpec(("n", 4), "int8") and back.layout == q.layout


def test_from_json_rejects_bad_constraints():
    with pytest.raises(ValueError, match="constraints"):
        ArraySpec.from_json({"shape": ["b"], "dtype": "int8", "constraints": "b <= 3"})
    with pytest.raises(ValueError, match="names dimension"):
        ArraySpec.from_json({"shape": [1], "dtype": "int8", "constraints": ["b <= 3"]})


def test_to_shape_dtype_struct_is_jax_symbolic():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax import export

    specs = {"x": ArraySpec(("b", 3), "float32", constraints=("b <= 8",)), "y": ArraySpec(("b",), "float32")}
    structs = shape_dtype_structs(specs)
    assert str(structs["x"].shape[0]) == "b" and structs["x"].shape[1] == 3

    def f(d):
        return d["x"].sum(axis=1) + d["y"]

    exp = export.export(jax.jit(f))(structs)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(exp.call({"x": x, "y": np.ones(2, np.float32)}), x.sum(1) + 1)
    # the constraint travels into the export: a batch of 9 is refused by JAX itself
    with pytest.raises(Exception, match="b <= 8|constraint"):
        exp.call({"x": jnp.zeros((9, 3)), "y": jnp.zeros(9)})
    assert ArraySpec.from_array(structs["x"]) == ArraySpec(("b", 3), "float32")  # back from JAX (names only)
    one = ArraySpec(("b", 3), "float32").to_shape_dtype_struct()
    assert str(one.shape[0]) == "b"
    assert ArraySpec((2, 3), "bfloat16").to_shape_dtype_struct().shape == (2, 3)


dims = st.one_of(st.integers(0, 5), st.sampled_from(["b", "t", "n"]))


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(dims, max_size=4), hi=st.integers(1, 9), dtype=st.sampled_from(["float32", "bfloat16", "int4", "bool"]))
def test_hypothesis_json_round_trip_and_matches(shape, hi, dtype):
    names = [d for d in shape if isinstance(d, str)]
    cons = tuple(f"{n} <= {hi}" for n in dict.fromkeys(names))
    s = ArraySpec(tuple(shape), dtype, constraints=cons)
    assert ArraySpec.from_json(json.loads(json.dumps(s.to_json()))) == s
    assert specs_from_json(specs_to_json([s])) == [s]
    # an independent check: bind every name to a size, compare with a direct evaluation
    sizes = {n: (i % (hi + 1)) + 1 for i, n in enumerate(dict.fromkeys(names))}
    concrete = tuple(sizes[d] if isinstance(d, str) else d for d in shape)
    expected = all(v <= hi for v in sizes.values())
    assert s.matches(concrete) == expected
