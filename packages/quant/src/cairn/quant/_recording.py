"""Recording the inputs of selected weights' dots, in float numerics (GPTQ, AWQ)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from cairn.quant._dots import bind_dequantized
from cairn.quant._providers import PtqProvider, _leaf_permutation
from cairn.quant._rewrite import DotSite, WeightRef, materialize
from cairn.quant._rules import QuantizationRule
from cairn.quant._weights import WeightFilter

__all__ = ["InputRecorder", "record_inputs", "recorded_leaves", "with_input_scales", "lookup_path"]


class InputRecorder(PtqProvider):
    """Runs a program in float and hands :meth:`record` each ``rule_class`` weight's inputs
    as a matrix [tokens, K] (K: the contracted inputs, in the weight's leaf axis order)."""

    rule_class: type | None = None
    _replay_arrays = None  # records Python state while rewriting: never a compiled replay

    def __init__(self, rules: Sequence[QuantizationRule], weight_filter: WeightFilter | None = None) -> None:
        super().__init__(rules, strict=False, weight_filter=weight_filter)
        self.rule_of: dict[str, QuantizationRule] = {}

    def _always_applies(self, rule: QuantizationRule) -> bool:
        return self.rule_class is not None and isinstance(rule, self.rule_class)

    def record(self, path: str, x2: Any, leaf_contract: tuple[int, ...]) -> None:
        raise NotImplementedError  # each recorder defines what it keeps

    def _handle(self, site: DotSite, invals: list) -> list | None:
        ops = invals[:2]
        refs = [isinstance(x, WeightRef) for x in ops]
        if site.eqn.primitive.name == "dot_general" and any(refs):
            rule = self._match(site, True)
            if rule is not None and self.rule_class is not None and isinstance(rule, self.rule_class):
                side = refs.index(True)
                self.rule_of.setdefault(ops[side].path, rule)
                self._matrix(site, side, ops)
        return bind_dequantized(site.eqn, [materialize(x) for x in ops], [materialize(r) for r in invals[2:]])

    def _matrix(self, site: DotSite, side: int, ops: list) -> None:
        import jax.numpy as jnp

        ref: WeightRef = ops[side]
        (lc, rc), (lb, rb) = site.eqn.params["dimension_numbers"]
        perm = _leaf_permutation(ref)
        if lb or rb or perm is None:  # batch dims, or more than transposes/casts: left to on-the-fly
            return
        w_contract, x_contract = (rc, lc) if side == 1 else (lc, rc)
        x = materialize(ops[1 - side])
        pairs = sorted(zip(w_contract, x_contract), key=lambda p: perm[p[0]])
        order = [a for a in range(x.ndim) if a not in x_contract] + [p[1] for p in pairs]
        k = int(np.prod([x.shape[p[1]] for p in pairs]))
        x2 = jnp.transpose(x, order).reshape(-1, k).astype(jnp.float32)
        self.record(ref.path, x2, tuple(perm[p[0]] for p in pairs))


R = TypeVar("R", bound="InputRecorder")


def record_inputs(recorder: R, fn: Callable, params: Any, batches: Iterable[Sequence[Any]], what: str) -> R:
    """Run ``fn(params, *batch)`` for every batch through ``recorder``.

    Raises:
      ValueError: no batch, or the recorder's rules selected no weight.
    """
    from cairn.quant._api import quantize

    run = quantize(fn, recorder)
    for batch in batches:
        run(params, *batch)
    if not recorder.rule_of:
        name = recorder.rule_class.__name__ if recorder.rule_class else "rule"
        raise ValueError(f"{what}: no batch was given, or no {name} selected a weight")
    return recorder


def recorded_leaves(params: Any, recorder: InputRecorder) -> Iterator[tuple[str, Any, QuantizationRule]]:
    """``(path, leaf, rule)`` for every leaf of ``params`` whose inputs ``recorder`` saw."""
    import jax

    from cairn.core_array import QArray, path_of

    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda v: isinstance(v, QArray))
    for kp, leaf in flat:
        path = path_of(kp)
        rule = recorder.rule_of.get(path)
        if rule is not None:
            yield path, leaf, rule


def lookup_path(root: Any, parts: Sequence[str]) -> Any:
    """The object at ``parts`` below ``root``: dict items by key, sequence items (lists,
    tuples, ``nn.List``) by index, anything else by attribute (a submodule or variable)."""
    node = root
    for part in parts:
        if isinstance(node, dict):
            node = node[part]
        elif part.isdigit() and hasattr(node, "__getitem__") and not hasattr(node, part):
            node = node[int(part)]  # a list, tuple, or a module library's list container
        else:
            node = getattr(node, part)
    return node


def _copy_containers(tree: Any) -> Any:
    """A copy of the dicts, lists and tuples of ``tree`` (the leaves are shared), so
    placing entries in the copy never reaches the caller's tree, however its dicts nest."""
    if isinstance(tree, dict):
        return {k: _copy_containers(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy_containers(v) for v in tree]
    if isinstance(tree, tuple):
        items = [_copy_containers(v) for v in tree]
        return type(tree)._make(items) if hasattr(tree, "_make") else type(tree)(items)
    return tree


def with_input_scales(params: Any, replaced: dict[str, Any], scales: dict[str, Any]) -> Any:
    """``params`` with the leaves at ``replaced``'s paths swapped and each weight's input
    scale added beside it at ``<path>_awq_scale``.

    Nested dicts, lists and tuples are copied (the input is never changed). Any other pytree (a cairn.nn or
    Flax NNX module) is rebuilt from its leaves and each scale is set as an attribute of
    the weight's owner, wrapped in the weight's own variable type.
    """
    import jax

    from cairn.core_array import QArray, path_of
    from cairn.quant._providers import input_scale_path

    if isinstance(params, dict):
        out = _copy_containers(params)
        for path, value in [*replaced.items(), *((input_scale_path(p), s) for p, s in scales.items())]:
            *parents, last = path.split("/")
            owner = lookup_path(out, parents)
            if not isinstance(owner, dict):
                raise ValueError(f"cannot place {path!r}: its parent is a {type(owner).__name__} inside the dicts")
            owner[last] = value
        return out
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda v: isinstance(v, QArray))
    new = jax.tree_util.tree_unflatten(treedef, [replaced.get(path_of(kp), leaf) for kp, leaf in flat])
    for path, s in scales.items():
        *parents, last = path.split("/")
        owner = lookup_path(new, parents)
        weight = lookup_path(owner, [last])
        wrapped = type(weight)(s) if hasattr(weight, "value") else s
        name = input_scale_path(last)
        if isinstance(owner, dict):
            owner[name] = wrapped
        else:
            setattr(owner, name, wrapped)
    return new
