"""The OIP v2 tensor codec: JSON and Triton binary round trips for every datatype, and each
malformed request rejected with a 400 that names the input and what was expected."""

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.serving._protocol import (
    DATATYPES,
    ProtocolError,
    decode_request,
    encode_response,
    oip_datatype,
)


def _binary_body(arrays: dict, extra: dict | None = None):
    inputs, chunks = [], []
    for name, (dt, a) in arrays.items():
        raw = np.ascontiguousarray(a).tobytes()
        inputs.append({"name": name, "datatype": dt, "shape": list(a.shape), "parameters": {"binary_data_size": len(raw)}})
        chunks.append(raw)
    head = json.dumps({"inputs": inputs, **(extra or {})}).encode()
    return head + b"".join(chunks), len(head)


def _sample(dt: str, shape, rng) -> np.ndarray:
    dtype = DATATYPES[dt]
    if dt == "BOOL":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.normal(size=shape).astype(dtype)


shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(dt=st.sampled_from(sorted(DATATYPES)), shape=shapes, seed=st.integers(0, 2**16))
def test_binary_round_trip_is_bit_exact(dt, shape, seed):
    a = _sample(dt, shape, np.random.default_rng(seed))
    body, hl = _binary_body({"x": (dt, a)})
    req = decode_request(body, hl)
    got = req.inputs["x"]
    assert got.dtype == DATATYPES[dt] and got.shape == shape
    assert got.tobytes() == a.tobytes()
    req.binary_output = True
    out, out_hl = encode_response("m", "1", req, {"y": got})
    head = json.loads(out[:out_hl])
    meta = head["outputs"][0]
    assert meta["datatype"] == dt and meta["shape"] == list(shape)
    assert out[out_hl:] == a.tobytes() and meta["parameters"]["binary_data_size"] == a.nbytes


@settings(max_examples=60, deadline=None)
@given(dt=st.sampled_from(sorted(DATATYPES)), shape=shapes, seed=st.integers(0, 2**16), nested=st.booleans())
def test_json_round_trip(dt, shape, seed, nested):
    a = _sample(dt, shape, np.random.default_rng(seed))
    as_list = a.astype(np.float32) if a.dtype.itemsize == 2 and a.dtype.kind in "fV" else a
    data = as_list.tolist() if nested and shape else as_list.reshape(-1).tolist()
    body = json.dumps({"id": "r1", "inputs": [{"name": "x", "datatype": dt, "shape": list(shape), "data": data}]}).encode()
    req = decode_request(body, None)
    np.testing.assert_array_equal(req.inputs["x"], a)  # FP16/BF16 values survive float32 JSON exactly
    out, hl = encode_response("m", "3", req, {"y": req.inputs["x"]})
    assert hl is None
    head = json.loads(out)
    assert head["id"] == "r1" and head["model_version"] == "3"
    back = np.array(head["outputs"][0]["data"], dtype=np.float64 if dt != "BOOL" else bool)
    np.testing.assert_array_equal(back, a.reshape(-1).astype(back.dtype))


def test_bf16_and_fp16_datatype_names():
    assert oip_datatype(ml_dtypes.bfloat16) == "BF16" and oip_datatype(np.float16) == "FP16"
    with pytest.raises(ValueError, match="int4 has no Open Inference Protocol datatype"):
        oip_datatype("int4")


def test_several_binary_inputs_in_order_and_mixed_with_json():
    a, b = np.arange(6, dtype=np.int32).reshape(2, 3), np.ones((2,), np.float64)
    body, hl = _binary_body({"a": ("INT32", a), "b": ("FP64", b)})
    req = decode_request(body, hl)
    np.testing.assert_array_equal(req.inputs["a"], a)
    np.testing.assert_array_equal(req.inputs["b"], b)


def test_requested_outputs_pick_format_per_output():
    body = json.dumps(
        {
            "inputs": [],
            "parameters": {"binary_data_output": True},
            "outputs": [{"name": "y"}, {"name": "z", "parameters": {"binary_data": False}}],
        }
    ).encode()
    req = decode_request(body, None)
    assert req.outputs == {"y": True, "z": False}
    out, hl = encode_response("m", "1", req, {"y": np.array([1, 2], np.int8), "z": np.array([3.0]), "w": np.zeros(1)})
    head = json.loads(out[:hl])
    assert [o["name"] for o in head["outputs"]] == ["y", "z"]
    assert head["outputs"][1]["data"] == [3.0] and out[hl:] == b"\x01\x02"
    with pytest.raises(ProtocolError, match="requested output 'q'"):
        encode_response("m", "1", decode_request(b'{"inputs": [], "outputs": [{"name": "q"}]}', None), {"y": np.zeros(1)})


def _bin_head(size, shape=(2,), dt="FP32"):
    return json.dumps({"inputs": [{"name": "x", "datatype": dt, "shape": list(shape), "parameters": {"binary_data_size": size}}]}).encode()


@pytest.mark.parametrize(
    "body, header_length, match",
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "must be a JSON object"),
        (b'{"inputs": 3}', None, "'inputs' is missing or not a JSON array"),
        (b'{"inputs": [3]}', None, r"inputs\[0\] must be a JSON object"),
        (b'{"inputs": [{"name": "x", "datatype": "FP33", "shape": [1], "data": [1]}]}', None, "datatype 'FP33' is not supported"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": [1]}]}', None, "'shape' must be a list"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1]}]}', None, "'data' has 1 elements, shape \\[2\\] needs 2"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ["a"]}]}', None, "'data' is not a float32 array"),
        (b'{"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [300]}]}', None, "'data' is not a uint8 array"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [[1], [2, 3]]}]}', None, "not a float32 array"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}', None, "neither 'data' nor"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}, {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}', None, "given twice"),
        (b'{"id": 3, "inputs": []}', None, "'id' must be a string"),
        (b'{"inputs": [], "parameters": {"binary_data_output": 1}}', None, "binary_data_output must be a boolean"),
        (_bin_head(7) + b"\0" * 7, len(_bin_head(7)), "binary_data_size 7 does not match shape \\[2\\] of FP32 \\(8 bytes\\)"),
        (_bin_head(8) + b"\0" * 4, len(_bin_head(8)), "binary data ends after 4 of 8 bytes"),
        (_bin_head(8) + b"\0" * 9, len(_bin_head(8)), "1 bytes of binary data that no input claims"),
        (b'{"inputs": []}', 99, "outside the body"),
        (_bin_head(-1) + b"", len(_bin_head(-1)), "binary_data_size must be a non-negative integer"),
    ],
)
def test_malformed_requests_name_the_problem(body, header_length, match):
    with pytest.raises(ProtocolError, match=match) as e:
        decode_request(body, header_length)
    assert e.value.status == 400
