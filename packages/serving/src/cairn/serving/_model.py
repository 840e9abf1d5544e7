"""The model protocol the server runs (``ServableModel``) and an adapter for Python callables.

A servable model takes a mapping of input names to NumPy arrays batched along axis 0 and
returns a dict of output names to NumPy arrays with the same batch. Exported models
(:func:`cairn.serving.load`) and plain callables (:class:`PythonModel`) both satisfy it,
so the server never knows which one it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from cairn.core_array import ArraySpec, canonical_dtype

__all__ = ["ServableModel", "PythonModel", "validate_inputs", "batch_dim", "normalize_buckets"]


@runtime_checkable
class ServableModel(Protocol):
    """What the server needs from a model.

    Attributes:
      name: the model name (the directory name by default).
      inputs: per-request specs by input name; axis 0 is symbolic (``"b"``) when the model
        is batchable.
      outputs: output specs by name, batch axis symbolic like the inputs'.
      max_batch_size: the largest batch one call takes; 0 when the model is not batchable.
      batch_buckets: sorted batch sizes the batcher pads up to (precompiled); ``()`` when
        not batchable.

    Calling the model with ``{name: array}`` (batched along axis 0) returns
    ``{name: array}``; it validates names, dtypes and shapes, raising ``ValueError`` that
    names the input and what was expected.
    """

    name: str
    inputs: Mapping[str, ArraySpec]
    outputs: Mapping[str, ArraySpec]
    max_batch_size: int
    batch_buckets: tuple[int, ...]

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


def batch_dim(specs: Mapping[str, ArraySpec]) -> str | None:
    """The symbolic name shared by axis 0 of every spec, or ``None`` when the specs are not
    batchable (some spec has a concrete or no axis 0, or they disagree).

    >>> batch_dim({"x": ArraySpec(("b", 3), "float32"), "y": ArraySpec(("b",), "int32")})
    'b'
    >>> batch_dim({"x": ArraySpec((2, 3), "float32")}) is None
    True
    """
    names = {s.shape[0] if s.ndim and isinstance(s.shape[0], str) else None for s in specs.values()}
    if len(names) != 1:
        return None
    (name,) = names
    return name


def normalize_buckets(buckets: Sequence[int] | None, max_batch_size: int) -> tuple[int, ...]:
    """Sorted, unique bucket sizes within ``1..max_batch_size``; the largest bucket is
    ``max_batch_size`` (added when missing) so every admissible batch has a bucket.
    ``None`` gives the powers of two up to ``max_batch_size``.

    Raises:
      ValueError: a bucket below 1 or above ``max_batch_size``.

    >>> normalize_buckets(None, 12), normalize_buckets([4, 1, 4], 8)
    ((1, 2, 4, 8, 12), (1, 4, 8))
    """
    if max_batch_size <= 0:
        if buckets:
            raise ValueError(f"batch_buckets {tuple(buckets)} given for a model that is not batchable")
        return ()
    if buckets is None:
        out = {1 << k for k in range(max_batch_size.bit_length()) if 1 << k <= max_batch_size}
    else:
        out = {int(b) for b in buckets}
        bad = [b for b in out if not 1 <= b <= max_batch_size]
        if bad:
            raise ValueError(f"batch_buckets {sorted(bad)} out of range: each must be in 1..{max_batch_size}")
    return tuple(sorted(out | {max_batch_size}))


def _as_array(name: str, value: Any, spec: ArraySpec) -> np.ndarray:
    arr = np.asarray(value)
    want = spec.numpy_dtype
    if arr.dtype != want:
        try:
            got = canonical_dtype(arr.dtype)
        except ValueError:
            got = str(arr.dtype)
        raise ValueError(f"input {name!r}: dtype {got}, expected {spec.dtype}")
    return arr


def validate_inputs(
    specs: Mapping[str, ArraySpec], inputs: Mapping[str, Any], max_batch_size: int = 0
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Check a request's arrays against the specs.

    Args:
      specs: input specs by name.
      inputs: arrays by name (NumPy or array-likes of exactly the spec's dtype).
      max_batch_size: when > 0, axis 0 may not exceed it.

    Returns:
      ``(arrays, bindings)``: the inputs as NumPy arrays and the sizes bound to the
      symbolic dims (``{"b": 8}``).

    Raises:
      ValueError: a missing or unknown input, a wrong dtype, rank or size, a symbolic dim
        whose size disagrees between inputs, a broken constraint, or a batch above
        ``max_batch_size``; the message names the input and what was expected.
    """
    if not isinstance(inputs, Mapping):
        raise ValueError(f"inputs must be a mapping of name to array, got {type(inputs).__name__}")
    missing = [n for n in specs if n not in inputs]
    unknown = [n for n in inputs if n not in specs]
    if missing or unknown:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
        raise ValueError(f"inputs: {'; '.join(parts)}; expected exactly {sorted(specs)}")
    arrays: dict[str, np.ndarray] = {}
    env: dict[str, int] = {}
    for name, spec in specs.items():
        arr = _as_array(name, inputs[name], spec)
        env = spec.check_shape(arr.shape, env, what=f"input {name!r}")
        arrays[name] = arr
    if max_batch_size > 0:
        b = batch_dim(specs)
        if b is not None and env.get(b, 0) > max_batch_size:
            raise ValueError(f"inputs: batch size {env[b]} exceeds max_batch_size {max_batch_size}")
    return arrays, env


class PythonModel:
    """A :class:`ServableModel` around a Python callable (serving without export).

    Args:
      fn: ``fn({name: array}) -> {name: array}`` (a single array or a tuple is named
        ``output_0``, ``output_1``, ...); called with NumPy arrays, its results are
        converted with ``np.asarray``.
      inputs: input specs by name; axis 0 symbolic when batchable.
      outputs: output specs by name.
      max_batch_size: the largest batch (0: not batchable). When the input specs have a
        symbolic axis 0 with an upper bound and this is ``None``, the bound is used
        (else 0 for unbatchable specs, 64 otherwise).
      batch_buckets: sizes the batcher pads up to (default: powers of two and the max).
      name: the model name.

    Raises:
      ValueError: ``max_batch_size > 0`` while the input specs share no symbolic axis 0.

    >>> m = PythonModel(lambda x: {"y": x["x"] * 2}, {"x": ArraySpec(("b", 2), "float32")},
    ...                 {"y": ArraySpec(("b", 2), "float32")}, max_batch_size=4, name="double")
    >>> m.batch_buckets, m({"x": np.ones((3, 2), np.float32)})["y"].tolist()
    ((1, 2, 4), [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]])
    """

    def __init__(
        self,
        fn: Callable[[dict[str, np.ndarray]], Any],
        inputs: Mapping[str, ArraySpec],
        outputs: Mapping[str, ArraySpec],
        max_batch_size: int | None = None,
        batch_buckets: Sequence[int] | None = None,
        name: str = "model",
    ) -> None:
        self.fn = fn
        self.name = name
        self.inputs = dict(inputs)
        self.outputs = dict(outputs)
        b = batch_dim(self.inputs)
        if max_batch_size is None:
            hi = None if b is None else next(iter(self.inputs.values())).dim_bounds()[b][1]
            max_batch_size = 0 if b is None else (hi if hi is not None else 64)
        if max_batch_size > 0 and b is None:
            raise ValueError(
                f"model {name!r}: max_batch_size {max_batch_size} needs every input's axis 0 to be the same "
                f"symbolic dim, got shapes {[s.shape for s in self.inputs.values()]}"
            )
        self.max_batch_size = int(max_batch_size)
        self.batch_buckets = normalize_buckets(batch_buckets, self.max_batch_size)

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays, _ = validate_inputs(self.inputs, inputs, self.max_batch_size)
        return name_outputs(self.fn(arrays), self.outputs)

    def __repr__(self) -> str:
        return f"PythonModel(name={self.name!r}, inputs={list(self.inputs)}, outputs={list(self.outputs)})"


def name_outputs(out: Any, expected: Mapping[str, ArraySpec] | None = None) -> dict[str, np.ndarray]:
    """A function's result as ``{name: np.ndarray}`` (dict keys kept; a single array is
    ``output_0``; a tuple or list ``output_i``).

    Raises:
      ValueError: ``expected`` is given and the names differ.
    """
    if isinstance(out, Mapping):
        named = {str(k): np.asarray(v) for k, v in out.items()}
    elif isinstance(out, tuple | list):
        named = {f"output_{i}": np.asarray(v) for i, v in enumerate(out)}
    else:
        named = {"output_0": np.asarray(out)}
    if expected is not None and set(named) != set(expected):
        raise ValueError(f"model returned outputs {sorted(named)}, expected {sorted(expected)}")
    return named
