"""Open Inference Protocol v2 (KServe v2) tensors: JSON and Triton's binary extension.

A request body is a JSON header, optionally followed by raw little-endian tensors when
the ``Inference-Header-Content-Length`` HTTP header gives the JSON's length; an input
that arrives in binary carries ``parameters.binary_data_size``. Outputs go back in
binary when the request asks for it (``parameters.binary_data_output`` on the request,
or ``parameters.binary_data`` on a requested output), which is what ``tritonclient.http``
asks for by default.

JSON stays strict both ways. A JSON output holding NaN or an infinity carries it as the
string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (numbers elsewhere; ``np.array(data,
dtype)`` reads both back), never as the bare tokens Python's ``json`` would write, which
strict parsers refuse. A JSON input must hold what its datatype says: booleans for BOOL,
integers within the type's range for the INT and UINT types, numbers within range (or
those three strings) for the FP types; anything else (``true`` for FP32, ``1e400``, 300
for UINT8, 2.5 for INT32, a bare ``NaN``) is a 400 naming the input, the element and what
was expected.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from cairn.core_array import canonical_dtype

# --- datatypes ---

#: OIP datatype name -> NumPy dtype (BF16 through ml_dtypes).
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_BY_CANONICAL = {canonical_dtype(dt): name for name, dt in DATATYPES.items()}
_MAX_RANK = 32
#: how a JSON tensor writes the non-finite floats (strict JSON has no NaN or Infinity).
NONFINITE_STRINGS = ("NaN", "Infinity", "-Infinity")
_F64_MAX = float(np.finfo(np.float64).max)
_NOT_JSON = "a bare NaN/Infinity is not JSON; send the strings \"NaN\", \"Infinity\", \"-Infinity\" (or binary data)"


class ProtocolError(Exception):
    """A request the server refuses: ``status`` is the HTTP status, the message the reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a parsing process, re-raised here
        return ProtocolError, (self.status, self.message)


class _BareConstant:
    """What a bare ``NaN``/``Infinity``/``-Infinity`` token parses to: kept (not a float) so
    the input holding it is refused by name."""

    __slots__ = ("token",)

    def __init__(self, token: str) -> None:
        self.token = token

    def __repr__(self) -> str:
        return self.token


def loads_json(body: bytes | memoryview, what: str = "request body") -> Any:
    """Parse untrusted JSON: a bare ``NaN``/``Infinity`` becomes a marker that no datatype
    accepts, and nesting deeper than Python can follow is a 400, not a RecursionError.

    Raises:
      ProtocolError: (400) not JSON, not UTF-8, or nested too deeply.

    >>> loads_json(b'{"a": [1, 2.5, "NaN"]}')
    {'a': [1, 2.5, 'NaN']}
    """
    try:
        return json.loads(bytes(body), parse_constant=_BareConstant)
    except RecursionError:
        raise ProtocolError(400, f"{what} is JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(400, f"{what} is not valid JSON: {e}") from None


def oip_datatype(dtype: Any) -> str:
    """The OIP datatype name of a dtype: ``oip_datatype('bfloat16') == 'BF16'``.

    Args:
      dtype: anything ``cairn.core_array.canonical_dtype`` accepts.

    Raises:
      ValueError: the dtype has no OIP name (int4, float8 ...).

    >>> oip_datatype("float32"), oip_datatype("bfloat16"), oip_datatype(bool)
    ('FP32', 'BF16', 'BOOL')
    """
    name = canonical_dtype(dtype)
    try:
        return _BY_CANONICAL[name]
    except KeyError:
        raise ValueError(f"dtype {name} has no Open Inference Protocol datatype") from None


# --- requests ---


@dataclasses.dataclass
class InferRequest:
    """A decoded inference request.

    Attributes:
      id: the request's ``id`` (echoed back) or None.
      inputs: input name -> array, shaped as the request said.
      outputs: requested output names -> whether each goes back in binary; None = all.
      binary_output: the default for outputs not named (``binary_data_output``).
      parameters: the request's ``parameters`` object.
    """

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: dict[str, bool] | None
    binary_output: bool
    parameters: dict[str, Any]


def _field(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(400, f"{where}: '{key}' is missing or not a {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {dict: "JSON object", list: "JSON array", str: "string", int: "integer", bool: "boolean"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _parameters(obj: Mapping[str, Any], where: str) -> dict[str, Any]:
    params = obj.get("parameters", {})
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ProtocolError(400, f"{where}: 'parameters' must be a JSON object")
    return params


def _shape(obj: Mapping[str, Any], where: str) -> tuple[int, ...]:
    shape = _field(obj, "shape", list, where)
    if len(shape) > _MAX_RANK or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(400, f"{where}: 'shape' must be a list of at most {_MAX_RANK} non-negative integers, got {shape!r}")
    return tuple(shape)


def _decode_input(obj: Any, index: int, binary: memoryview, offset: int) -> tuple[str, np.ndarray, int]:
    if not isinstance(obj, dict):
        raise ProtocolError(400, f"inputs[{index}] must be a JSON object")
    name = _field(obj, "name", str, f"inputs[{index}]")
    where = f"input '{name}'"
    datatype = _field(obj, "datatype", str, where)
    dtype = DATATYPES.get(datatype)
    if dtype is None:
        raise ProtocolError(400, f"{where}: datatype {datatype!r} is not supported (expected one of {', '.join(DATATYPES)})")
    shape = _shape(obj, where)
    count = math.prod(shape)
    size = _parameters(obj, where).get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ProtocolError(400, f"{where}: binary_data_size must be a non-negative integer, got {size!r}")
        if size != count * dtype.itemsize:
            raise ProtocolError(
                400, f"{where}: binary_data_size {size} does not match shape {list(shape)} of {datatype} ({count * dtype.itemsize} bytes)"
            )
        if offset + size > len(binary):
            raise ProtocolError(400, f"{where}: binary data ends after {len(binary) - offset} of {size} bytes")
        array = np.frombuffer(binary[offset : offset + size], dtype=dtype.newbyteorder("<")).reshape(shape)
        return name, array, offset + size
    if "data" not in obj:
        raise ProtocolError(400, f"{where}: has neither 'data' nor parameters.binary_data_size")
    return name, _json_tensor(obj["data"], dtype, shape, where), offset


def _json_tensor(data: Any, dtype: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    if not isinstance(data, list):
        raise ProtocolError(400, f"{where}: 'data' must be a JSON array")
    datatype = _BY_CANONICAL[canonical_dtype(dtype)]
    allowed: set[type]
    if dtype.kind == "b":
        allowed, expected = {bool}, "JSON booleans (true or false)"
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        allowed, expected = {int}, f"JSON integers in [{info.min}, {info.max}]"
    else:
        allowed, expected = {int, float, str}, f"JSON numbers within the range of {datatype} (or the strings {', '.join(NONFINITE_STRINGS)})"
    types = _leaf_types(data, where)
    bad = types - allowed
    if bad or str in types:
        _refuse_leaves(data, lambda v: type(v) in bad or (type(v) is str and v not in NONFINITE_STRINGS), where, datatype, expected)
    try:
        if dtype.kind == "f" or dtype == DATATYPES["BF16"]:
            array = _float_tensor(data, dtype, str in types, where, datatype, expected)
        else:
            array = np.array(data, dtype=dtype)  # exact ints only: one out of range raises OverflowError
    except OverflowError:  # an int out of the INT type's range, or too large for any float
        lo, hi = (np.iinfo(dtype).min, np.iinfo(dtype).max) if dtype.kind in "iu" else (-_F64_MAX, _F64_MAX)
        _refuse_leaves(data, lambda v: type(v) is int and not lo <= v <= hi, where, datatype, expected)
        raise ProtocolError(400, f"{where}: 'data' holds a value outside the range of {datatype} (expected {expected})") from None
    except (ValueError, TypeError) as e:
        raise ProtocolError(400, f"{where}: 'data' is not a {datatype} array ({e})") from None
    if array.size != math.prod(shape):
        raise ProtocolError(400, f"{where}: 'data' has {array.size} elements, shape {list(shape)} needs {math.prod(shape)}")
    return array.reshape(shape)


def _leaf_types(data: list, where: str) -> set[type]:
    """The Python types of a JSON array's leaves (at C speed: one ``map(type)`` per list)."""
    types: set[type] = set()
    level = [data]
    for _ in range(_MAX_RANK):
        inner: list[list] = []
        for items in level:
            found = set(map(type, items))
            if list in found:
                inner.extend(v for v in items if type(v) is list)
                found.discard(list)
            types |= found
        if not inner:
            return types
        level = inner
    raise ProtocolError(400, f"{where}: 'data' is nested deeper than {_MAX_RANK} levels (the largest rank)")


def _flat_leaves(data: list) -> Any:
    for v in data:
        if type(v) is list:
            yield from _flat_leaves(v)
        else:
            yield v


def _refuse_leaves(data: list, wrong: Any, where: str, datatype: str, expected: str) -> None:
    """Raise a 400 naming the first leaf ``wrong`` accepts (its flat index and value)."""
    for i, v in enumerate(_flat_leaves(data)):
        if wrong(v):
            shown = json.dumps(v) if isinstance(v, bool | str) else repr(v)
            shown = shown if len(shown) <= 40 else f"{shown[:37]}..."
            hint = f"; {_NOT_JSON}" if isinstance(v, _BareConstant) else ""
            raise ProtocolError(400, f"{where}: data[{i}] is {shown}, not a valid {datatype} value (expected {expected}){hint}")


def _float_tensor(data: list, dtype: np.dtype, strings: bool, where: str, datatype: str, expected: str) -> np.ndarray:
    """A float tensor: numbers, plus the non-finite strings; a finite number that the
    datatype cannot hold (or that JSON parsed to an infinity, ``1e400``) is refused."""
    wide = np.array(data, dtype=np.float64)  # numpy reads "NaN", "Infinity", "-Infinity" itself
    if dtype == DATATYPES["BF16"]:
        with np.errstate(over="ignore"):
            array = wide.astype(np.float32).astype(dtype)
    else:
        with np.errstate(over="ignore"):
            array = wide.astype(dtype)
    overflow = ~np.isfinite(array.astype(np.float64))
    if strings and overflow.any():  # the strings say "non-finite" on purpose; numbers never do
        marked = np.array([isinstance(v, str) for v in _flat_leaves(data)], bool).reshape(overflow.shape)
        overflow &= ~marked
    if overflow.any():
        i = int(np.flatnonzero(overflow.reshape(-1))[0])
        value = next(v for k, v in enumerate(_flat_leaves(data)) if k == i)
        value = "a number too large for any float (JSON parsed it to infinity)" if value in (math.inf, -math.inf) else repr(value)
        biggest = float(np.finfo(np.float32 if dtype == DATATYPES["BF16"] else dtype).max)
        raise ProtocolError(
            400, f"{where}: data[{i}] is {value}, outside the range of {datatype} (largest finite magnitude {biggest:.8g}; expected {expected})"
        )
    return array


def _requested_outputs(request: Mapping[str, Any], default_binary: bool) -> dict[str, bool] | None:
    outputs = request.get("outputs")
    if outputs is None:
        return None
    if not isinstance(outputs, list):
        raise ProtocolError(400, "'outputs' must be a JSON array")
    wanted: dict[str, bool] = {}
    for i, out in enumerate(outputs):
        if not isinstance(out, dict):
            raise ProtocolError(400, f"outputs[{i}] must be a JSON object")
        name = _field(out, "name", str, f"outputs[{i}]")
        binary = _parameters(out, f"output '{name}'").get("binary_data", default_binary)
        if not isinstance(binary, bool):
            raise ProtocolError(400, f"output '{name}': binary_data must be a boolean")
        wanted[name] = binary
    return wanted


def decode_request(body: bytes | memoryview, header_length: int | None) -> InferRequest:
    """Decode an inference request body.

    Args:
      body: the HTTP body: JSON, or JSON followed by binary tensors.
      header_length: the ``Inference-Header-Content-Length`` value, or None for all-JSON.

    Raises:
      ProtocolError: (400) malformed JSON, a missing field, an unknown datatype, data
        that does not fill its shape, or binary sizes that disagree with the body.

    >>> r = decode_request(b'{"id": "7", "inputs": [{"name": "x", "shape": [1, 2], '
    ...                    b'"datatype": "INT32", "data": [3, 4]}]}', None)
    >>> r.id, r.inputs["x"].tolist(), r.outputs
    ('7', [[3, 4]], None)
    """
    if header_length is None:
        header_length = len(body)
    elif not 0 <= header_length <= len(body):
        raise ProtocolError(400, f"Inference-Header-Content-Length {header_length} is outside the body of {len(body)} bytes")
    request = loads_json(memoryview(body)[:header_length])
    try:
        return _decode_parsed(request, memoryview(body)[header_length:])
    except RecursionError:  # a deep value (under json's limit) reached a repr or a walk
        raise ProtocolError(400, "request body is JSON nested too deeply") from None


def _decode_parsed(request: Any, binary: memoryview) -> InferRequest:
    if not isinstance(request, dict):
        raise ProtocolError(400, "request body must be a JSON object")
    rid = request.get("id")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError(400, "'id' must be a string")
    params = _parameters(request, "request")
    binary_output = params.get("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise ProtocolError(400, "parameters.binary_data_output must be a boolean")
    raw = _field(request, "inputs", list, "request")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for i, obj in enumerate(raw):
        name, array, offset = _decode_input(obj, i, binary, offset)
        if name in inputs:
            raise ProtocolError(400, f"input '{name}' is given twice")
        inputs[name] = array
    if offset != len(binary):
        raise ProtocolError(400, f"the body has {len(binary) - offset} bytes of binary data that no input claims")
    return InferRequest(rid, inputs, _requested_outputs(request, binary_output), binary_output, params)


# --- responses ---


def encode_response(
    model_name: str,
    model_version: str,
    request: InferRequest,
    outputs: Mapping[str, np.ndarray],
) -> tuple[bytes, int | None]:
    """Encode an inference response.

    Args:
      model_name, model_version: echoed in the response.
      request: the decoded request (its id, requested outputs and binary flags).
      outputs: output name -> array.

    Returns:
      ``(body, header_length)``: header_length is the JSON's length when binary tensors
      follow (send it as ``Inference-Header-Content-Length``), else None.

    Raises:
      ProtocolError: (400) a requested output the model does not have.

    >>> req = decode_request(b'{"inputs": []}', None)
    >>> encode_response("m", "1", req, {"y": np.array([1.5], np.float32)})[0]
    b'{"model_name":"m","model_version":"1","outputs":[{"name":"y","datatype":"FP32","shape":[1],"data":[1.5]}]}'
    """
    if request.outputs is None:
        wanted = {name: request.binary_output for name in outputs}
    else:
        wanted = request.outputs
        for name in wanted:
            if name not in outputs:
                raise ProtocolError(400, f"requested output '{name}' is not an output of model '{model_name}' (it has {sorted(outputs)})")
    entries = []
    chunks: list[bytes] = []
    for name, binary in wanted.items():
        array = np.asarray(outputs[name])
        entry: dict[str, Any] = {"name": name, "datatype": oip_datatype(array.dtype), "shape": list(array.shape)}
        if binary:
            raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = _json_data(array.reshape(-1))
        entries.append(entry)
    head: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request.id is not None:
        head["id"] = request.id
    head["outputs"] = entries
    header = json.dumps(head, separators=(",", ":"), allow_nan=False).encode()
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def _json_data(flat: np.ndarray) -> list[Any]:
    """A flat array as JSON values: NaN and the infinities as their strings (module docstring)."""
    if flat.dtype.kind not in "biu" and flat.dtype not in (np.float32, np.float64):
        flat = flat.astype(np.float32)  # FP16 and BF16 travel as JSON numbers
    if flat.dtype.kind != "f" or np.isfinite(flat).all():
        return flat.tolist()
    out = flat.astype(object)
    out[np.isnan(flat)] = NONFINITE_STRINGS[0]
    out[flat == np.inf] = NONFINITE_STRINGS[1]
    out[flat == -np.inf] = NONFINITE_STRINGS[2]
    return out.tolist()
