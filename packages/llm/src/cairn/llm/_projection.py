"""Projections that apply an AWQ input scale held beside their kernel (see ``_model``'s docstring)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from cairn import nn
from cairn.core_array import QArray

__all__ = ["AWQ_SCALE", "float_value", "project", "scaled_kernel", "with_params"]

AWQ_SCALE = "kernel_awq_scale"  # cairn.quant.input_scale_path("kernel")


def scaled_kernel(module: nn.Linear | nn.Einsum, contracted: int) -> jax.Array | None:
    """``module``'s float kernel with its AWQ input scale divided out of its first
    ``contracted`` (input) axes, or None when the module holds no scale."""
    held = getattr(module, AWQ_SCALE, None)
    if held is None:
        return None
    w = module.kernel[...]
    w = w.dequantize() if isinstance(w, QArray) else w
    s = held[...]
    inputs = w.shape[:contracted]
    if s.size != math.prod(inputs):
        raise ValueError(f"{type(module).__name__} {AWQ_SCALE}: a scale of {s.size} values (shape {tuple(s.shape)}) "
                         f"for a kernel of shape {tuple(w.shape)}, whose {math.prod(inputs)} input channels "
                         f"(axes {inputs}) it must scale")
    w32 = w.astype(jnp.float32) / s.astype(jnp.float32).reshape(*inputs, *(1,) * (w.ndim - contracted))
    return w32.astype(module.dtype or w.dtype)


def _contracted_axes(module: nn.Linear | nn.Einsum) -> int:
    """How many leading kernel axes a projection contracts with its input (1 for ``Linear``)."""
    if isinstance(module, nn.Linear):
        return 1
    inputs, out = module.einsum_str.replace(" ", "").split("->")
    kernel = inputs.split(",")[1]
    n = sum(1 for c in kernel if c not in out)
    assert all(c not in out for c in kernel[:n]), module.einsum_str  # the model's kernels: inputs first
    return n


def project(module: nn.Linear | nn.Einsum, x: jax.Array) -> jax.Array:
    """``module(x)``, applying the AWQ input scale the module holds (see the module docstring).

    Args:
      module: an ``nn.Linear`` or an ``nn.Einsum`` whose kernel's leading axes are its inputs.
      x: the input ``[..., inputs]``.
    """
    w = scaled_kernel(module, _contracted_axes(module))
    if w is None:
        return module(x)
    x = x.astype(w.dtype)
    y = x @ w if isinstance(module, nn.Linear) else jnp.einsum(module.einsum_str, x, w)
    if module.bias is None:
        return y
    bias = module.bias[...]
    return y + bias.astype(y.dtype)


def _dict_paths(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths of a nested dict's values (a ``QArray`` is one value), as tuples of str keys."""
    if isinstance(tree, dict):
        return [k for name, sub in tree.items() for k in _dict_paths(sub, (*prefix, str(name)))]
    return [prefix]


def _lookup(tree: Any, path: tuple[str, ...]) -> Any:
    """The value at ``path`` of a nested dict, or the submodule at ``path`` of a module."""
    for key in path:
        if isinstance(tree, dict):
            tree = tree[key] if key in tree else tree[int(key)]
        elif isinstance(tree, nn.List):
            tree = tree[int(key)]
        else:
            tree = getattr(tree, key, None)
    return tree


def with_params(model: Any, params: Any) -> Any:
    """A copy of ``model`` (a :class:`~cairn.llm.CausalLM`) holding ``params``; ``model`` is unchanged.

    ``params`` is a nested dict as ``serving_functions(model, ...).params`` gives it, or a
    part of one; its leaves may be ``QArray`` s (cairn.quant) and it may add a
    ``kernel_awq_scale`` beside any projection kernel (``attn/q``, ``k``, ``v``, ``o``,
    ``mlp/gate``, ``up``, ``down``, a MoE ``router``, ``lm_head``), as
    ``cairn.quant.awq_quantize_params`` does over such a dict: the copy holds it as an
    ``nn.Param`` and its forward divides it out (module docstring of ``cairn.llm._model``).

    Args:
      model: the model whose structure and remaining parameters the copy takes.
      params: nested dicts of arrays (string or int keys), the same paths as the model's state.

    Raises:
      ValueError: a path the model cannot hold (an unknown name, an input scale on the
        embedding or the MoE experts, whose products do not apply one), all such paths listed;
        or an input scale whose size is not the kernel's number of input channels.
    """
    graphdef, state = nn.split(model)
    copy = nn.merge(graphdef, state, copy=True)
    held = {tuple(map(str, p)) for p in nn.split(copy)[1].flat_state()}
    scales, bad = [], []
    for path in _dict_paths(params):
        if path in held:
            continue
        owner = _lookup(copy, path[:-1])
        if path[-1] == AWQ_SCALE and isinstance(owner, nn.Linear | nn.Einsum):
            scales.append((owner, path))
        else:
            bad.append("/".join(path))
    if bad:
        raise ValueError(f"parameters the model cannot hold: {bad[:5]}{' ...' if len(bad) > 5 else ''} ({len(bad)} in "
                         f"all); an input scale ({AWQ_SCALE}) is held only beside a projection kernel")
    for owner, path in scales:
        setattr(owner, AWQ_SCALE, nn.Param(jnp.asarray(_lookup(params, path), jnp.float32)))
    copy_state = nn.split(copy)[1]
    copy_state.replace_by_pure_dict(params)
    for owner, path in scales:
        try:
            scaled_kernel(owner, _contracted_axes(owner))
        except ValueError as e:
            raise ValueError(f"{'/'.join(path)}: {e}") from None
    return copy


def float_value(model: Any, path: str) -> jax.Array:
    """The float array the forward computes with for the parameter at ``path`` of ``model``:
    a ``QArray`` dequantized, a projection kernel's AWQ input scale divided out, in the
    model's dtype."""
    parts = tuple(path.split("/"))
    owner = _lookup(model, parts[:-1])
    if parts[-1] == "kernel" and isinstance(owner, nn.Linear | nn.Einsum):
        scaled = scaled_kernel(owner, _contracted_axes(owner))
        if scaled is not None:
            return scaled.astype(model.dtype)
    v = _lookup(model, parts)[...]
    return v.dequantize().astype(model.dtype) if isinstance(v, QArray) else v
