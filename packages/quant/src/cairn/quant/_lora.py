"""LoRA and QLoRA by rules: ``LoraRule``, ``LoraProvider``, ``apply_lora_to_model``.

Each dot a :class:`LoraRule` selects gains a low-rank term: ``y = x W + (x A) B * alpha /
rank``, with ``A`` [in, rank] and ``B`` [rank, out] (``in``: the weight's contracted
axes, ``out``: its other axes, each flattened in the weight's axis order). With
``weight_qtype`` set the base product ``x W`` is quantized as by ``PtqProvider`` (QLoRA).

The adapters live next to the weight, under the ``LoRALinear`` names of cairn.nn and
Flax NNX: for a weight ``<module>/kernel`` at ``<module>/lora/lora_a`` and
``<module>/lora/lora_b``; for any other weight ``<name>`` at ``<name>_lora/lora_a`` and
``..._lora/lora_b``. ``<name>`` is the weight's variable path (``a/kernel`` for Flax NNX's
leaf ``a/kernel/value``), so the names, the initial values and the dropout masks are the
same for a Flax NNX model, the equivalent cairn.nn model and a plain tree; an adapter
tree made here loads into ``nn.LoRALinear`` / ``nnx.LoRALinear`` and back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from cairn.quant._dots import bind_dequantized
from cairn.quant._providers import PtqProvider
from cairn.quant._recording import lookup_path
from cairn.quant._rewrite import DotSite, WeightRef, materialize
from cairn.quant._rules import QuantizationRule
from cairn.quant._weights import WeightFilter

__all__ = ["LoraRule", "LoraProvider", "apply_lora_to_model", "apply_lora_to_params", "lora_paths"]


def _he_uniform(key: Any, shape: Sequence[int], dtype: Any) -> Any:
    """He-uniform init of ``A``: uniform in ``[-l, l]`` with ``l = sqrt(6 / shape[0])``.

    Args:
      key: a ``jax.random`` key.
      shape: ``(in_features, rank)``.
      dtype: the adapter's dtype.
    """
    import jax

    limit = (6.0 / max(shape[0], 1)) ** 0.5
    return jax.random.uniform(key, tuple(shape), dtype, -limit, limit)


def _zeros(key: Any, shape: Sequence[int], dtype: Any) -> Any:
    """Zeros init of ``B`` (a fresh adapter adds nothing).

    Args:
      key: a ``jax.random`` key (unused).
      shape: ``(rank, out_features)``.
      dtype: the adapter's dtype.
    """
    import jax.numpy as jnp

    del key
    return jnp.zeros(tuple(shape), dtype)


@dataclasses.dataclass(frozen=True)
class LoraRule(QuantizationRule):
    """A rule that adds a rank-``rank`` adapter to each dot it selects (QLoRA with ``weight_qtype``).

    Args:
      rank: the adapters' rank ``r``.
      alpha: the adapter output is scaled by ``alpha / rank``.
      dropout: dropout rate on the adapter's input, applied only when the provider is
        given a ``dropout_rng`` (training).
      lora_a_initializer: ``init(key, shape, dtype)`` of ``A`` (He uniform, as cairn.nn).
      lora_b_initializer: ``init(key, shape, dtype)`` of ``B`` (zeros: a fresh adapter
        leaves the model's output unchanged).
      module_path: regular expression matched in full against the op's module path (the module
        holding the weight: ``"layers/0/mlp"``, not ``"layers/0/mlp/kernel"``).
      op_names: op kinds or per-module op names (``"dot_general0"``); empty means all.
      weight_qtype: qtype of the weight operand (``"int8"``, ``"int4"``, ``"nf4"``, ...) or ``None``
        to leave weights in float.
      act_qtype: qtype of the activation operand(s), or ``None`` (weight-only).
      tile_size: tile length along the weight's last contracting axis (an ``int``), or a ``float``
        ``1/tile_count``; ``None`` for per-channel scales; a pair ``(contracting, output)`` tiles
        the last output axis too.
      weight_calibration_method: ``"absmax"``, ``"absmax,s"``, ``"minmax[,s]"``, ``"rms,k"``,
        ``"percentile,p"`` or ``"fixed,min,max"``.
      act_calibration_method: the same grammar for activations (``None``: ``"absmax"``).
      act_static_scale: use a calibrated static activation scale (see :func:`calibrate`) instead of
        computing it from every batch.
      act_batch_axes: activation axes averaged over when calibrating a static scale.

    Raises:
      ValueError: a rank that is not a positive int, or a dropout outside ``[0, 1)``.
    """

    rank: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    lora_a_initializer: Callable[..., Any] = _he_uniform
    lora_b_initializer: Callable[..., Any] = _zeros

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"{self._describe()}: rank must be a positive int, got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{self._describe()}: dropout must be in [0, 1), got {self.dropout!r}")


def lora_paths(weight_path: str) -> tuple[str, str]:
    """The paths of ``A`` and ``B`` for the weight at ``weight_path``.

    Args:
      weight_path: the weight's variable path.

    >>> lora_paths("layers/0/mlp/kernel")
    ('layers/0/mlp/lora/lora_a', 'layers/0/mlp/lora/lora_b')
    >>> lora_paths("blocks/1/w_out")
    ('blocks/1/w_out_lora/lora_a', 'blocks/1/w_out_lora/lora_b')
    """
    module, _, name = weight_path.rpartition("/")
    prefix = (f"{module}/lora" if module else "lora") if name == "kernel" else f"{weight_path}_lora"
    return f"{prefix}/lora_a", f"{prefix}/lora_b"


@dataclasses.dataclass(frozen=True)
class _AdapterSpec:
    rule: LoraRule
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    dtype: Any

    @property
    def shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        n_in = int(_prod(self.in_shape))
        n_out = int(_prod(self.out_shape))
        return (n_in, self.rule.rank), (self.rule.rank, n_out)


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


class LoraProvider(PtqProvider):
    """``PtqProvider`` plus low-rank adapters on the dots its :class:`LoraRule`\\ s select.

    Args:
      rules: ``LoraRule``\\ s (and plain ``QuantizationRule``\\ s for ops without adapters).
      strict: as for every provider.
      dropout_rng: a PRNG key; when given, adapter dropout (``LoraRule.dropout``) is applied.
      weight_filter: which leaves are weights, as for every provider.
    """

    def __init__(
        self, rules: Sequence[QuantizationRule], *, strict: bool = True, dropout_rng: Any = None, weight_filter: WeightFilter | None = None
    ) -> None:
        super().__init__(rules, strict=strict, weight_filter=weight_filter)
        self.dropout_rng = dropout_rng
        self._adapters: dict[str, _AdapterSpec] = {}
        self._collecting = False

    _replay_arrays = ("_static", "dropout_rng")

    def _replay_key(self) -> tuple | None:
        key = super()._replay_key()
        return None if key is None else (*key, self._collecting)

    def _always_applies(self, rule: QuantizationRule) -> bool:
        return isinstance(rule, LoraRule)

    def _handle(self, site: DotSite, invals: list) -> list | None:
        ops = invals[:2]
        refs = [isinstance(x, WeightRef) for x in ops]
        if not any(refs):
            return super()._handle(site, invals)
        rule = self._match(site, True)
        if rule is None:
            return None
        if rule.weight_qtype or rule.act_qtype:
            base = self._compute(site, rule, [self._operand(site, rule, x, s) for s, x in enumerate(ops)], invals[2:])
        else:
            base = bind_dequantized(site.eqn, [materialize(x) for x in ops], [materialize(r) for r in invals[2:]])
        if not isinstance(rule, LoraRule):
            return base
        if site.eqn.primitive.name != "dot_general":
            raise NotImplementedError(
                f"{rule._describe()} selects a {site.kind} on {ops[refs.index(True)].path!r}: LoRA adapters "
                "are supported on dot_general (matmul, einsum, dense layers) only"
            )
        side = refs.index(True)
        ref: WeightRef = ops[side]
        spec = self._spec(site, side, rule)
        self._adapters.setdefault(ref.name, spec)  # by the weight's variable path, not its leaf path
        if self._collecting:
            return base
        a, b = self._find(ref.name, spec)
        term = _lora_term(site.eqn, materialize(ops[1 - side]), side, a, b, spec, self._dropout_key(ref.name))
        return [base[0] + term.astype(base[0].dtype)]

    def _spec(self, site: DotSite, side: int, rule: LoraRule) -> _AdapterSpec:
        (lc, rc), (lb, rb) = site.eqn.params["dimension_numbers"]
        w_contract, w_batch = (rc, rb) if side == 1 else (lc, lb)
        aval = site.eqn.invars[side].aval
        if w_batch:
            raise NotImplementedError(f"{rule._describe()}: LoRA on a dot with batch dimensions on the weight is not supported")
        contract = sorted(w_contract)
        free = [a for a in range(len(aval.shape)) if a not in w_contract]
        return _AdapterSpec(rule, tuple(aval.shape[a] for a in contract), tuple(aval.shape[a] for a in free), aval.dtype)

    def _find(self, path: str, spec: _AdapterSpec) -> tuple[Any, Any]:
        pa, pb = lora_paths(path)  # self._weights is keyed by weight names (variable paths)
        missing = [p for p in (pa, pb) if p not in self._weights]
        if missing:
            raise ValueError(
                f"{spec.rule._describe()} selects {path!r} but its adapter {missing[0]!r} is not among the "
                "weights; create the adapters with apply_lora_to_model / apply_lora_to_params"
            )
        a, b = materialize(self._weights[pa]), materialize(self._weights[pb])
        (sa, sb) = spec.shapes
        if tuple(a.shape) != sa or tuple(b.shape) != sb:
            raise ValueError(f"LoRA adapters of {path!r} have shapes {tuple(a.shape)}, {tuple(b.shape)}; expected {sa}, {sb}")
        return a, b

    def _dropout_key(self, path: str) -> Any:
        if self.dropout_rng is None:
            return None
        import zlib

        import jax

        return jax.random.fold_in(self.dropout_rng, zlib.crc32(path.encode()) & 0x7FFFFFFF)


def _lora_term(eqn: Any, x: Any, side: int, a: Any, b: Any, spec: _AdapterSpec, key: Any) -> Any:
    """``(x A) B * alpha / rank`` laid out like the dot's output."""
    import jax
    import jax.numpy as jnp

    (lc, rc), _ = eqn.params["dimension_numbers"]
    w_contract, x_contract = (rc, lc) if side == 1 else (lc, rc)
    pairs = sorted(zip(w_contract, x_contract))
    rule = spec.rule
    if key is not None and rule.dropout > 0:
        keep = jax.random.bernoulli(key, 1.0 - rule.dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - rule.dropout), 0).astype(x.dtype)
    a_r = a.reshape((*spec.in_shape, rule.rank)).astype(x.dtype)
    xa = jax.lax.dot_general(x, a_r, ((tuple(p[1] for p in pairs), tuple(range(len(pairs)))), ((), ())))
    b_r = b.reshape((rule.rank, *spec.out_shape)).astype(x.dtype)
    y = jax.lax.dot_general(xa, b_r, (((xa.ndim - 1,), (0,)), ((), ())))
    if side == 0:  # the weight is the left operand: its free axes come first in the output
        nx = y.ndim - len(spec.out_shape)
        y = jnp.transpose(y, (*range(nx, y.ndim), *range(nx)))
    return y * (rule.alpha / rule.rank)


def _new_adapters(provider: LoraProvider, rng: Any) -> dict[str, tuple[Any, Any]]:
    import jax

    out = {}
    for i, (path, spec) in enumerate(sorted(provider._adapters.items())):
        ka, kb = jax.random.split(jax.random.fold_in(rng, i))
        (sa, sb) = spec.shapes
        out[path] = (spec.rule.lora_a_initializer(ka, sa, spec.dtype), spec.rule.lora_b_initializer(kb, sb, spec.dtype))
    return out


def _collect(provider: LoraProvider, fn: Callable, *args: Any) -> None:
    import jax

    from cairn.quant._api import quantize

    provider._collecting = True
    try:
        jax.eval_shape(quantize(fn, provider), *args)
    finally:
        provider._collecting = False
    if not provider._adapters:
        raise ValueError("no LoraRule selected a dot: nothing to add adapters to")


def apply_lora_to_params(params: Any, provider: LoraProvider, fn: Callable, *args: Any, rng: Any) -> Any:
    """``params`` (nested dicts) with fresh adapters next to every weight a ``LoraRule`` selects.

    ``fn(params, *args)`` is traced (shapes only) to find the weights; each adapter pair
    goes under :func:`lora_paths` of its weight, so the result is what a ``nn.LoRALinear``
    would hold. Adapters already present are kept.

    Args:
      params: the parameter tree (nested dicts); not changed.
      provider: the :class:`LoraProvider` whose :class:`LoraRule` s select the weights.
      fn: ``fn(params, *args)``, the function that uses the weights.
      args: example arguments of ``fn`` after ``params`` (only shapes are traced).
      rng: a ``jax.random`` key; adapter ``i`` (in sorted path order) uses ``fold_in(rng, i)``.

    Returns:
      a copy of ``params`` with the adapters added.
    """
    _collect(provider, fn, params, *args)
    import copy

    out = copy.copy(params)
    for path, (a, b) in _new_adapters(provider, rng).items():
        for p, value in zip(lora_paths(path), (a, b)):
            _insert(out, p.split("/"), value)
    return out


def _insert(tree: Any, parts: list[str], value: Any) -> None:
    node = tree
    for part in parts[:-1]:
        if not isinstance(node, dict):
            raise TypeError(f"apply_lora_to_params: cannot add {'/'.join(parts)!r}: {part!r} is under a {type(node).__name__}, not a dict")
        node[part] = dict(node.get(part, {}))
        node = node[part]
    node.setdefault(parts[-1], value)


def _library_type(variable: Any, name: str) -> type | None:
    """The class ``name`` of the module library that ``variable``'s class comes from (found
    in the packages above that class's module, among modules already imported)."""
    import sys

    module = type(variable).__module__
    while module:
        lib = sys.modules.get(module)
        found = getattr(lib, name, None) if lib is not None else None
        if isinstance(found, type):
            return found
        module = module.rpartition(".")[0]
    return None


def apply_lora_to_model(model: Any, provider: LoraProvider, *model_inputs: Any, rng: Any, method: str = "__call__") -> Any:
    """Add fresh adapters to ``model`` in place, next to every weight a ``LoraRule`` selects.

    The model is traced on ``model_inputs`` (shapes only). Each adapter pair becomes an
    attribute ``lora`` (for a weight named ``kernel``) or ``<name>_lora`` of the module
    holding the weight's variable: the library's ``Dict`` (``nn.Dict``, ``nnx.Dict``) of
    ``{"lora_a": ..., "lora_b": ...}`` as the library's ``LoRAParam`` variables (cairn.nn
    and Flax NNX both have them), so ``nn.Optimizer(model, tx, wrt=nn.LoRAParam)`` or
    ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` trains only the adapters, at the paths
    of the library's ``LoRALinear``. Returns ``model``; call it through
    ``quantize_model(model, provider)``.

    Args:
      model: the module to add adapters to (changed in place).
      provider: the :class:`LoraProvider` whose :class:`LoraRule` s select the weights.
      model_inputs: example inputs of ``model.<method>`` (only shapes are traced).
      rng: a ``jax.random`` key; adapter ``i`` (in sorted path order) uses ``fold_in(rng, i)``.
      method: the name of the model's method to trace.

    Raises:
      TypeError: a selected weight that no module holds by attribute (a plain array in a
        list or dict of the model), where no adapter can be added.
    """
    _collect(provider, lambda m, *a: getattr(m, method)(*a), model, *model_inputs)
    for name, (a, b) in _new_adapters(provider, rng).items():
        parts = name.split("/")  # the weight's variable path: module path, then the variable's attribute
        variable = lookup_path(model, parts)
        owner = lookup_path(model, parts[:-1]) if len(parts) > 1 else model
        if isinstance(owner, dict | list | tuple):
            raise TypeError(f"apply_lora_to_model: the weight {name!r} is held by a {type(owner).__name__}, not a module; cannot add adapters there")
        param = _library_type(variable, "LoRAParam") or (type(variable) if hasattr(variable, "value") else None)
        make = param if param is not None else (lambda v: v)
        container = _library_type(variable, "Dict") or dict
        attr = lora_paths(name)[0].split("/")[-2]
        if getattr(owner, attr, None) is None:
            setattr(owner, attr, container({"lora_a": make(a), "lora_b": make(b)}))
    return model
