"""Recording the inputs of selected weights' dots, in float numerics (GPTQ, AWQ)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from cairn.quant._dots import bind_dequantized
from cairn.quant._providers import PtqProvider, _leaf_permutation
from cairn.quant._rewrite import DotSite, WeightRef, materialize
from cairn.quant._rules import QuantizationRule
from cairn.quant._weights import WeightFilter, is_variable, leaf_names

__all__ = ["InputRecorder", "record_inputs", "recorded_leaves", "named_leaves", "with_input_scales", "lookup_path"]


class InputRecorder(PtqProvider):
    """Runs a program in float and hands :meth:`record` each ``rule_class`` weight's inputs
    as a matrix [tokens, K] (K: the contracted inputs, in the weight's leaf axis order),
    under the weight's name (its variable path, :attr:`WeightRef.name`)."""

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
                self.rule_of.setdefault(ops[side].name, rule)
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
        self.record(ref.name, x2, tuple(perm[p[0]] for p in pairs))


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
    """``(name, leaf, rule)`` for every leaf of ``params`` whose inputs ``recorder`` saw
    (``name``: the weight's variable path, as the recorder keys it)."""
    for name, leaf in named_leaves(params):
        rule = recorder.rule_of.get(name)
        if rule is not None:
            yield name, leaf, rule


def named_leaves(params: Any) -> list[tuple[str, Any]]:
    """``(name, leaf)`` for every leaf of ``params`` (a ``QArray`` is one leaf)."""
    import jax

    from cairn.core_array import QArray

    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda v: isinstance(v, QArray))
    return list(zip(leaf_names(params, [kp for kp, _ in flat]), [leaf for _, leaf in flat]))


def lookup_path(root: Any, parts: Sequence[str]) -> Any:
    """The object at ``parts`` below ``root``: dict items by key (a decimal part also finds
    an int key), sequence items (lists, tuples, ``nn.List``) by index, anything else by
    attribute (a submodule or variable)."""
    node = root
    for part in parts:
        if isinstance(node, dict):
            # a pure dict of a module tree keys list items by int (``layers: {0: ...}``),
            # while the path spells them as decimals (``layers/0``)
            node = node[int(part)] if part not in node and part.isdigit() and int(part) in node else node[part]
        elif part.isdigit() and hasattr(node, "__getitem__") and not hasattr(node, part):
            node = node[int(part)]  # a list, tuple, or a module library's list container
        else:
            node = getattr(node, part)
    return node


def with_input_scales(params: Any, replaced: dict[str, Any], scales: dict[str, Any]) -> Any:
    """``params`` with the weights named in ``replaced`` swapped and each weight's input
    scale added beside it at ``<name>_awq_scale`` (``name``: the weight's variable path).

    The tree is rebuilt from its leaves (the input is never changed). Each scale goes into
    the container holding the weight's variable: a new key of a dict, else an attribute of
    the module, wrapped in the weight's own variable type (``nn.Param``, ``nnx.Param``).

    Raises:
      ValueError: the weight's container is a list or tuple, where nothing can be added by name.
    """
    import jax

    from cairn.core_array import QArray
    from cairn.quant._providers import input_scale_path

    named = named_leaves(params)
    _, treedef = jax.tree_util.tree_flatten(params, is_leaf=lambda v: isinstance(v, QArray))
    new = jax.tree_util.tree_unflatten(treedef, [replaced.get(name, leaf) for name, leaf in named])
    for name, s in scales.items():
        *parents, last = name.split("/")
        owner = lookup_path(new, parents)
        if isinstance(owner, list | tuple):
            raise ValueError(f"cannot place {input_scale_path(name)!r}: the weight {name!r} is held by a {type(owner).__name__}")
        weight = lookup_path(owner, [last])
        wrapped = type(weight)(s) if is_variable(weight) else s
        if isinstance(owner, dict):
            owner[input_scale_path(last)] = wrapped
        else:
            setattr(owner, input_scale_path(last), wrapped)
    return new
