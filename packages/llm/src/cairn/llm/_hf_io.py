"""``from_pretrained`` / ``save_pretrained``: Hugging Face checkpoints in and out, by the family tables.

Loading checks everything before reading a tensor: the config, every file's header, the
set of tensor names against the family table (missing and unexpected ones listed by
name) and every shape against the config (the tensor, both shapes and the config fields
named). Then each tensor is read alone, cast to the target dtype, transposed and reshaped
as the table says, and placed straight into its sharding. The model is built abstractly
and returned only when every tensor is in, so a failure leaves nothing half-loaded.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn import nn
from cairn.llm._config import LlmConfig
from cairn.llm._errors import CheckpointError
from cairn.llm._families import WeightRule, family_of
from cairn.llm._hf_config import config_from_hf, config_to_hf
from cairn.llm._hf_files import ShardedReader, write_shards
from cairn.llm._model import CausalLM
from cairn.llm._projection import float_value

__all__ = ["expected_tensors", "from_pretrained", "save_pretrained"]

# safetensors dtype codes of the weights this loader casts (integer tensors would be cast silently)
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# tensors some checkpoints carry that no model needs (buffers saved by old conversions)
IGNORED = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)


class _Tensor:
    """One expanded table row: HF name, model path, HF shape and the fields behind it;
    ``expert`` is the slice of the stacked model parameter a per-expert tensor fills."""

    def __init__(self, rule: WeightRule, cfg: LlmConfig, layer: int | None, expert: int | None = None) -> None:
        fmt = {"i": layer, "e": expert}
        self.name = rule.hf.format(**fmt)
        self.path = rule.path.format(**fmt)
        self.expert = expert
        self.transpose = rule.transpose
        self.fields = rule.hf_shape
        self.hf_shape = tuple(math.prod(int(getattr(cfg, f)) for f in expr.split("*")) for expr in rule.hf_shape)

    def explain(self, cfg: LlmConfig) -> str:
        parts = []
        for expr, n in zip(self.fields, self.hf_shape):
            vals = "*".join(str(getattr(cfg, f)) for f in expr.split("*"))
            parts.append(f"{expr}={vals}" if "*" not in expr else f"{expr}={vals}={n}")
        return ", ".join(parts)


def _applies(rule: WeightRule, cfg: LlmConfig) -> bool:
    if not rule.when:
        return True
    negate = rule.when.startswith("not ")
    value = bool(getattr(cfg, rule.when.removeprefix("not ")))
    return value != negate


def expected_tensors(cfg: LlmConfig) -> list[_Tensor]:
    """The tensors a checkpoint of ``cfg`` holds, in the family table's order, layers expanded."""
    out: list[_Tensor] = []
    for rule in family_of(cfg.model_type).weights:
        if not _applies(rule, cfg):
            continue
        layers: list[int | None] = [None]
        if "{i}" in rule.hf:
            moe = {"all": None, "moe": True, "dense": False}[rule.layers]
            layers = [i for i in range(cfg.num_hidden_layers) if moe is None or cfg.is_moe_layer(i) == moe]
        experts: list[int | None] = list(range(cfg.num_experts)) if "{e}" in rule.hf else [None]
        out.extend(_Tensor(rule, cfg, i, e) for i in layers for e in experts)
    return out


def _check_names_and_shapes(reader: ShardedReader, tensors: list[_Tensor], cfg: LlmConfig) -> None:
    present = set(reader.file_of)
    wanted = {t.name for t in tensors}
    missing = [t.name for t in tensors if t.name not in present]
    unexpected = sorted(n for n in present - wanted if not any(p.fullmatch(n) for p in IGNORED))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): " + ", ".join(missing))
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): " + ", ".join(unexpected))
    for t in tensors:
        if t.name in present and reader.dtype(t.name) not in FLOAT_DTYPES:
            problems.append(
                f"tensor {t.name} ({reader.file_of[t.name]}) has dtype {reader.dtype(t.name)}; expected a float "
                f"dtype ({', '.join(FLOAT_DTYPES)}): quantized checkpoints are not read by this loader"
            )
        if t.name in present and reader.shape(t.name) != t.hf_shape:
            problems.append(
                f"tensor {t.name} ({reader.file_of[t.name]}) has shape {reader.shape(t.name)} but the config "
                f"expects {t.hf_shape} from {t.explain(cfg)}"
            )
    if problems:
        raise CheckpointError(
            f"{reader.directory}: the checkpoint does not match its config.json (model_type "
            f"{cfg.model_type!r}):\n  " + "\n  ".join(problems)
        )


def _flat_state(model: CausalLM) -> dict[tuple, Any]:
    """``{path tuple: Variable}`` of every parameter of ``model``."""
    state = nn.state(model)
    assert isinstance(state, nn.State)  # one State: no filters given
    return state.flat_state()


def _read_config(path: pathlib.Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{file}: no config.json (a Hugging Face checkpoint directory has one)")
    try:
        return json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file}: not valid JSON: {e}") from e


def from_pretrained(path: str | os.PathLike, dtype: Any = None, mesh: Any = None, rules: Any = None) -> CausalLM:
    """A :class:`CausalLM` with the weights of a Hugging Face checkpoint directory.

    Args:
      path: a directory with ``config.json`` and ``model.safetensors`` or sharded
        ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``.
      dtype: parameter and computation dtype (default: the config's ``dtype`` /
        ``torch_dtype``, else float32). Tensors are cast one at a time.
      mesh: place each parameter in its ``NamedSharding`` on this mesh, through ``rules``.
        A stacked expert parameter is assembled on the host from its experts' tensors
        and then placed whole (not box by box).
      rules: the logical-axis rules (``cairn.core_array.LogicalAxisRules`` or pairs; axis
        names ``vocab``, ``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``expert``).

    Raises:
      UnsupportedModelError: the ``model_type`` (or its rope type) is not supported; the
        message lists the supported ones.
      CheckpointError: missing or unexpected tensors (listed), shape mismatches (tensor,
        both shapes, config fields), an unreadable shard (named).
      FileNotFoundError: no ``config.json``.

    Example: ``model = from_pretrained("Qwen2.5-0.5B"); logits = model(ids)`` gives
    ``[batch, length, vocab]`` float32 logits.
    """
    path = pathlib.Path(path)
    cfg = config_from_hf(_read_config(path))
    target = jnp.dtype(dtype if dtype is not None else cfg.dtype)
    tensors = expected_tensors(cfg)
    reader = ShardedReader(path)
    _check_names_and_shapes(reader, tensors, cfg)
    model = nn.abstract_model(lambda: CausalLM(cfg, dtype=target, rngs=nn.Rngs(0)), mesh=mesh, rules=rules)
    slots = {"/".join(map(str, p)): (p, v) for p, v in _flat_state(model).items()}
    uncovered = sorted(set(slots) - {t.path for t in tensors})
    if uncovered:  # a table that misses a parameter is a bug here, not in the checkpoint
        raise AssertionError(f"family table of {cfg.model_type!r} has no entry for {uncovered}")
    by_name = {t.name: t for t in tensors}
    values: dict[tuple, Any] = {}
    stacks = _ExpertStacks(tensors)
    for name, lazy in reader.read([t.name for t in tensors]):
        t = by_name[name]
        p, var = slots[t.path]
        if t.expert is None:
            values[p] = _place(t, lazy, var.raw_value, target)
        elif (full := stacks.add(t, lazy, var.raw_value, target)) is not None:
            values[p] = _put(full, var.raw_value)
    nn.update(model, nn.State.from_flat(values))
    return model


class _ExpertStacks:
    """Assembles stacked expert parameters ``[E, in, out]`` on the host from their
    per-expert tensors, which the shards may hold in any order; a stack is handed on (and
    its buffer dropped) as soon as its last expert is in, so the host holds at most the
    stacks whose experts are still being read."""

    def __init__(self, tensors: list[_Tensor]) -> None:
        self.todo: dict[str, int] = {}
        for t in tensors:
            if t.expert is not None:
                self.todo[t.path] = self.todo.get(t.path, 0) + 1
        self.buffers: dict[str, np.ndarray] = {}

    def add(self, t: _Tensor, lazy: Any, spec: Any, target: Any) -> np.ndarray | None:
        buf = self.buffers.get(t.path)
        if buf is None:
            buf = self.buffers[t.path] = np.empty(spec.shape, jnp.dtype(target))
        buf[t.expert] = _to_model(t, lazy[...], spec.shape[1:], target)
        self.todo[t.path] -= 1
        return self.buffers.pop(t.path) if self.todo[t.path] == 0 else None


def _put(host: np.ndarray, spec: Any) -> jax.Array:
    """A whole host array placed in the sharding of abstract value ``spec`` (if any)."""
    sharding = getattr(spec, "sharding", None)
    return jnp.asarray(host) if sharding is None else jax.device_put(host, sharding)


def _to_model(t: _Tensor, arr: np.ndarray, shape: tuple[int, ...], target: Any) -> np.ndarray:
    """A box of the Hugging Face tensor as the same box of the model's parameter."""
    host = arr.astype(target, copy=False)  # no copy when the file already holds ``target``
    return np.ascontiguousarray(host.T if t.transpose else host).reshape(shape)


def _groups(model_shape: tuple[int, ...], flat_shape: tuple[int, ...]) -> list[list[int]] | None:
    """For each dim of ``flat_shape``, the consecutive model dims it is the product of."""
    groups: list[list[int]] = []
    i = 0
    for n in flat_shape:
        group: list[int] = []
        size = 1
        while i < len(model_shape) and (not group or size < n):
            size *= model_shape[i]
            group.append(i)
            i += 1
        if size != n:
            return None
        groups.append(group)
    return groups if i == len(model_shape) else None


def _source_box(t: _Tensor, model_shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[slice, ...] | None:
    """The box of the Hugging Face tensor that holds ``model[index]``, or None when it is
    not one box (a split dim sliced other than along its first part)."""
    flat = t.hf_shape[::-1] if t.transpose else t.hf_shape
    groups = _groups(model_shape, flat)
    if groups is None:
        return None
    bounds = [s.indices(n)[:2] for s, n in zip(index, model_shape)]
    box = []
    for group in groups:
        if any(bounds[d] != (0, model_shape[d]) for d in group[1:]):
            return None
        inner = math.prod(model_shape[d] for d in group[1:])
        lo, hi = bounds[group[0]]
        box.append(slice(lo * inner, hi * inner))
    return tuple(box[::-1]) if t.transpose else tuple(box)


def _place(t: _Tensor, lazy: Any, spec: Any, target: Any) -> jax.Array:
    """The parameter of abstract value ``spec`` from the lazy Hugging Face tensor: whole
    when unsharded or replicated, else each device's box read on its own (the full tensor
    is read only where a box does not map onto one box of the file)."""
    sharding = getattr(spec, "sharding", None)
    if sharding is None:
        return jax.device_put(_to_model(t, lazy[...], spec.shape, target))  # one copy, no dispatch
    if sharding.is_fully_replicated:
        return jax.device_put(_to_model(t, lazy[...], spec.shape, target), sharding)

    def shard(index: tuple[slice, ...] | None) -> np.ndarray:
        if index is None:  # jax asks for the whole array this way
            index = tuple(slice(None) for _ in spec.shape)
        box = _source_box(t, spec.shape, index)
        if box is None:
            return _to_model(t, lazy[...], spec.shape, target)[index]
        shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, spec.shape))
        return _to_model(t, lazy[box], shape, target)

    return jax.make_array_from_callback(spec.shape, sharding, shard)


def save_pretrained(model: CausalLM, path: str | os.PathLike, max_shard_size: int | str = "5GB") -> list[str]:
    """Writes ``model`` as a Hugging Face checkpoint directory that transformers loads.

    ``config.json`` (the config the model was loaded with, every modelled key written from
    ``model.config``, ``dtype`` the model's) and the weights under Hugging Face names and
    ``[out, in]`` shapes, in the model's dtype (a quantized model's ``QArray`` weights as the
    floats its forward computes with, AWQ input scales divided out: the Hugging Face layout
    has no quantized form; ``export_for_serving`` keeps them quantized), in shards of at most ``max_shard_size``
    bytes (an int or ``"5GB"``-style; one ``model.safetensors`` when everything fits).

    Args:
      model: the :class:`CausalLM` to save.
      path: the directory to write (created if missing).
      max_shard_size: the most bytes per weight file: an int or ``"5GB"``-style text.

    Returns:
      The weight file names written.

    Raises:
      TypeError: ``model`` is not a :class:`CausalLM`.
    """
    cfg = model.config
    if not isinstance(cfg, LlmConfig):
        raise TypeError(f"save_pretrained expects a cairn.llm.CausalLM, got {type(model).__name__}")
    dtype_name = jnp.dtype(model.dtype).name
    hf = config_to_hf(cfg)
    hf["torch_dtype" if "torch_dtype" in hf else "dtype"] = dtype_name
    out = {}
    for t in expected_tensors(cfg):
        value = float_value(model, t.path)  # QArray weights dequantized, AWQ input scales divided out
        arr = np.asarray(jax.device_get(value if t.expert is None else value[t.expert]))
        if t.transpose:
            arr = arr.reshape(t.hf_shape[1], t.hf_shape[0]).T
        out[t.name] = np.ascontiguousarray(arr.reshape(t.hf_shape))
    return write_shards(path, out, max_shard_size, hf)
