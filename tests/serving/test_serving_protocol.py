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
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ["a"]}]}', None, 'data\\[0\\] is "a", not a valid FP32 value'),
        (b'{"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [300]}]}', None, r"data\[0\] is 300, not a valid UINT8 value \(expected JSON integers in \[0, 255\]\)"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [[1], [2, 3]]}]}', None, "not a FP32 array"),
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


def _strict(text):
    """json.loads that refuses the bare NaN / Infinity tokens (as strict parsers do)."""

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("dt", ["FP16", "BF16", "FP32", "FP64"])
def test_nonfinite_outputs_are_strict_json_strings(dt):
    values = np.array([1.5, np.nan, np.inf, -np.inf, -0.0], np.float64)
    out, hl = encode_response("m", "1", decode_request(b'{"inputs": []}', None), {"y": values.astype(DATATYPES[dt])})
    assert hl is None
    data = _strict(out)["outputs"][0]["data"]
    assert data[1:4] == ["NaN", "Infinity", "-Infinity"] and data[0] == 1.5
    np.testing.assert_array_equal(np.array(data, np.float64), values)  # numpy reads the strings back


def test_nonfinite_strings_are_accepted_for_float_inputs():
    body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [["NaN", "Infinity"], ["-Infinity", 2.5]]}]}'
    got = decode_request(body, None).inputs["x"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.array([[np.nan, np.inf], [-np.inf, 2.5]], np.float32))


def _one_input(dt, data, shape=None):
    shape = [len(data)] if shape is None else shape
    return f'{{"inputs": [{{"name": "x", "datatype": "{dt}", "shape": {json.dumps(shape)}, "data": {data}}}]}}'.encode()


@pytest.mark.parametrize(
    "dt, data, match",
    [
        ("FP32", ["1", "2", "NaN"], r"data\[2\] is NaN, not a valid FP32 value .*a bare NaN/Infinity is not JSON"),
        ("FP32", ["Infinity"], r"data\[0\] is Infinity, not a valid FP32 value"),
        ("FP64", ["-Infinity"], r"data\[0\] is -Infinity, not a valid FP64 value"),
        ("FP32", ["1e400"], r"data\[0\] is a number too large for any float .*outside the range of FP32"),
        ("FP32", ["1", "1e39"], r"data\[1\] is 1e\+39, outside the range of FP32 \(largest finite magnitude 3.4028235e\+38"),
        ("FP16", ["70000"], r"data\[0\] is 70000, outside the range of FP16 \(largest finite magnitude 65504"),
        ("BF16", ["-1e39"], r"data\[0\] is -1e\+39, outside the range of BF16"),
        ("FP64", [str(10**400)], r"data\[0\] is 1000.*\.\.\., not a valid FP64 value"),
        ("FP32", ["true", "1"], r"data\[0\] is true, not a valid FP32 value \(expected JSON numbers"),
        ("FP32", ['"1.5"'], r'data\[0\] is "1.5", not a valid FP32 value'),
        ("INT8", ["1", "300"], r"data\[1\] is 300, not a valid INT8 value \(expected JSON integers in \[-128, 127\]\)"),
        ("UINT8", ["300"], r"data\[0\] is 300, not a valid UINT8 value \(expected JSON integers in \[0, 255\]\)"),
        ("UINT8", ["-1"], r"data\[0\] is -1, not a valid UINT8 value"),
        ("UINT64", [str(2**64)], r"data\[0\] is 18446744073709551616, not a valid UINT64 value"),
        ("INT32", ["2.5"], r"data\[0\] is 2.5, not a valid INT32 value \(expected JSON integers"),
        ("INT32", ["2.0"], r"data\[0\] is 2.0, not a valid INT32 value"),
        ("INT64", ["false"], r"data\[0\] is false, not a valid INT64 value"),
        ("BOOL", ["1", "0"], r"data\[0\] is 1, not a valid BOOL value \(expected JSON booleans \(true or false\)\)"),
        ("BOOL", ["true", "null"], r"data\[1\] is None, not a valid BOOL value"),
    ],
)
def test_json_inputs_must_hold_their_datatype(dt, data, match):
    with pytest.raises(ProtocolError, match=match) as e:
        decode_request(_one_input(dt, "[" + ", ".join(data) + "]"), None)
    assert e.value.status == 400 and e.value.message.startswith("input 'x': ")


def test_json_inputs_at_the_edges_of_their_range_are_accepted():
    cases = {
        "INT8": ([-128, 127], np.int8),
        "UINT8": ([0, 255], np.uint8),
        "UINT64": ([0, 2**64 - 1], np.uint64),
        "INT64": ([-(2**63), 2**63 - 1], np.int64),
        "FP16": ([65504.0, -65504.0], np.float16),
        "FP32": ([3.4028234663852886e38, 1e-45], np.float32),
        "BOOL": ([True, False], np.bool_),
    }
    for dt, (values, np_dtype) in cases.items():
        got = decode_request(_one_input(dt, json.dumps(values), [2]), None).inputs["x"]
        assert got.dtype == DATATYPES[dt]
        np.testing.assert_array_equal(got, np.array(values, dtype=np_dtype))


def test_bytes_inputs_are_refused_by_datatype():
    # no servable model takes strings: BYTES is refused up front, naming the datatype
    with pytest.raises(ProtocolError, match=r"input 'x': datatype 'BYTES' is not supported \(expected one of BOOL, "):
        decode_request(_one_input("BYTES", '["abc"]'), None)


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ' + b"[" * 50_000 + b"1" + b"]" * 50_000 + b"}]}",
        b'{"inputs": [], "parameters": {"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}",
    ],
)
def test_deeply_nested_json_is_a_400(body):
    with pytest.raises(ProtocolError, match="nested too deeply") as e:
        decode_request(body, None)
    assert e.value.status == 400


def test_data_nested_deeper_than_any_rank_is_a_400():
    body = _one_input("FP32", "[" * 40 + "1" + "]" * 40, [1])
    with pytest.raises(ProtocolError, match=r"input 'x': 'data' is nested deeper than 32 levels"):
        decode_request(body, None)


def test_protocol_errors_survive_pickling():
    # big bodies are decoded in a worker process: its ProtocolError must arrive intact
    import pickle

    e = pickle.loads(pickle.dumps(ProtocolError(400, "input 'x': bad")))
    assert (e.status, e.message, str(e)) == (400, "input 'x': bad", "input 'x': bad")
