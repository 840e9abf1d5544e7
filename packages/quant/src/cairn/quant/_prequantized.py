"""``process_prequantized_params``: load weights quantized elsewhere into the program's layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cairn.core_array import QArray, flatten_with_paths, path_of
from cairn.quant._weights import leaf_names

__all__ = ["process_prequantized_params"]

_PARTS = ("qvalue", "scale", "zero_point")


def _check(path: str, part: str, got: Any, want: Any) -> None:
    if want is None:
        if got is not None:
            raise ValueError(f"process_prequantized_params: {path!r} has a {part} but the template has none")
        return
    if got is None:
        raise ValueError(f"process_prequantized_params: {path!r} lacks its {part}")
    if tuple(got.shape) != tuple(want.shape) or str(got.dtype) != str(want.dtype):
        raise ValueError(
            f"process_prequantized_params: {path}/{part} is {got.dtype}{list(got.shape)}, "
            f"the template expects {want.dtype}{list(want.shape)}"
        )


def _leaf(path: str, given: Any, template: Any) -> Any:
    import jax.numpy as jnp

    if not isinstance(template, QArray):
        if isinstance(given, Mapping):
            raise ValueError(f"process_prequantized_params: {path!r} is quantized in the checkpoint but float in the template")
        _check(path, "value", given, template)
        return jnp.asarray(given)
    if isinstance(given, QArray):
        given = {p: getattr(given, p) for p in _PARTS}
    if not isinstance(given, Mapping) or "qvalue" not in given or "scale" not in given:
        raise ValueError(
            f"process_prequantized_params: {path!r} must be a dict with 'qvalue' and 'scale' (and an optional "
            f"'zero_point'), as the template quantizes it to {template.qtype}"
        )
    parts = {p: given.get(p) for p in _PARTS}
    for p in _PARTS:
        _check(path, p, parts[p], getattr(template, p))
    arrays = {p: None if v is None else jnp.asarray(v) for p, v in parts.items()}
    return QArray(arrays["qvalue"], arrays["scale"], arrays["zero_point"], qtype=template.qtype, layout=template.layout, dtype=template.dtype)


def process_prequantized_params(checkpoint_params: Mapping[str, Any], template_params: Any, *, allow_extra_params: bool = False) -> Any:
    """Weights quantized elsewhere, in the structure and layouts of ``template_params``.

    Args:
      checkpoint_params: nested dicts keyed like the template's weight names (variable
        paths: ``a/kernel`` for cairn.nn, Flax NNX and plain trees alike) or leaf paths
        (``a/kernel/value`` in a Flax NNX state); each leaf an array,
        a ``QArray``, or a dict with ``qvalue``, ``scale`` and an optional ``zero_point``.
      template_params: what :func:`quantize_params` returns for these weights (concrete, or
        abstract through ``jax.eval_shape``); its ``QArray`` leaves give qtype and layout.
      allow_extra_params: ignore checkpoint entries the template lacks.

    Returns:
      A tree of the template's structure with ``QArray`` leaves where it has them.

    Raises:
      ValueError: a missing or extra entry, or a part whose shape or dtype differs, each
        naming its path.
    """
    import jax

    flat = flatten_with_paths(checkpoint_params, is_leaf=lambda x: isinstance(x, Mapping) and "qvalue" in x or isinstance(x, QArray))
    used: set[str] = set()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template_params, is_leaf=lambda x: isinstance(x, QArray))
    out = []
    for (kp, template), name in zip(leaves, leaf_names(template_params, [kp for kp, _ in leaves])):
        # a weight's entry is at its name (its variable's path: ``a/kernel`` for a Flax NNX
        # template, as nnx.to_pure_dict writes it) or at its leaf path (``a/kernel/value``)
        path = path_of(kp)
        key = name if name in flat or path not in flat else path
        if key not in flat:
            also = "" if name == path else f" (nor for its leaf path {path!r})"
            raise ValueError(f"process_prequantized_params: the checkpoint has no entry for {name!r}{also}")
        used.add(key)
        out.append(_leaf(key, flat[key], template))
    extra = sorted(set(flat) - used)
    if extra and not allow_extra_params:
        raise ValueError(f"process_prequantized_params: checkpoint entries not in the template: {extra[:20]} (allow_extra_params=True ignores them)")
    return jax.tree_util.tree_unflatten(treedef, out)
