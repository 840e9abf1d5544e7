"""Providers: what happens at each dot a rule selects (Qwix's ``PtqProvider``, ``QtProvider``).

A provider holds an ordered list of rules; at each dot the first rule that applies
decides the qtypes and calibration. ``PtqProvider`` runs inference numerics (integer
dots where both operands are quantized per channel); ``QtProvider`` runs the same
forward pass with straight-through gradients (QAT), and with ``bwd_qtype`` set also
quantizes the cotangent of the backward dots.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from cairn.core_array import QArray, QuantLayout, compile_pattern
from cairn.quant._calibration import bounds, parse_method
from cairn.quant._dots import bind_dequantized, operand_axes, quantized_dot
from cairn.quant._numerics import fake_quant, quantize_array, quantize_with_bounds, tile_length
from cairn.quant._qtypes import qtype_info, required
from cairn.quant._rewrite import DotSite, WeightRef, materialize
from cairn.quant._rules import QtRule, QuantizationRule
from cairn.quant._weights import WeightFilter, check_weight_filter

__all__ = ["QuantizationProvider", "PtqProvider", "QtProvider"]

SiteKey = tuple[str, str, int, int]


class QuantizationProvider:
    """An ordered list of rules, the first applying one wins (base of the providers).

    Args:
      rules: the rules, tried in order.
      strict: raise when a trace leaves a rule unused (a rule that matches nothing is
        almost always a typo in ``module_path``); ``False`` allows it, and
        :meth:`get_unused_rules` still reports it.
      weight_filter: which leaves of the weight arguments are weights. ``None`` (the
        default, Qwix's meaning): parameters (leaves held by a variable whose class is
        named ``Param`` or derives from one: ``nn.Param``, ``nnx.Param``, their
        ``LoRAParam``) and plain pytree leaves; a KV cache, BatchNorm statistics or any
        other variable is left as the program uses it. A variable class or tuple of
        classes (``nn.Cache``): the leaves such variables hold. A callable ``(path,
        variable) -> bool`` (``variable``: the variable holding the leaf, ``None`` for a
        plain pytree leaf): ``lambda path, variable: True`` makes every array leaf a weight.

    Raises:
      TypeError: an entry of ``rules`` is not a :class:`QuantizationRule`, or
        ``weight_filter`` is neither ``None`` nor callable.
    """

    rule_type: type = QuantizationRule

    def __init__(self, rules: Sequence[QuantizationRule], *, strict: bool = True, weight_filter: WeightFilter | None = None) -> None:
        rules = tuple(rules)
        for i, r in enumerate(rules):
            if not isinstance(r, self.rule_type):
                raise TypeError(
                    f"{type(self).__name__} rule {i} is a {type(r).__name__}; expected a {self.rule_type.__name__}"
                )
        self.rules = rules
        self.strict = strict
        self.weight_filter = check_weight_filter(weight_filter, type(self).__name__)
        self._used: set[int] = set()
        self._trace_used: set[int] = set()
        self._seen: list[str] = []
        self._plan: dict[str, tuple[QuantizationRule, tuple[int, ...], tuple[tuple[int, int], ...] | None]] = {}
        self._static: dict[SiteKey, tuple[Any, Any]] = {}
        self._recording: dict[SiteKey, list[tuple[Any, Any]]] | None = None
        self._weights: dict[str, Any] = {}

    # Attributes holding arrays the handler reads: a compiled eager replay (_replay.py) takes
    # them as arguments, so a new value is never stale. None: calls are never compiled.
    _replay_arrays: tuple[str, ...] | None = ("_static",)

    def _replay_key(self) -> tuple | None:
        """What a compiled replay depends on besides its arguments (``None``: run op by op,
        as while recording calibration statistics)."""
        if self._recording is not None:
            return None
        return (type(self), repr(self.rules), self.strict)

    def get_unused_rules(self) -> list[QuantizationRule]:
        """The rules that have not selected any op in any trace so far."""
        return [r for i, r in enumerate(self.rules) if i not in self._used]

    # --- tracing bookkeeping (called by quantize) ---

    def _begin_trace(self, weights: dict[str, Any]) -> None:
        self._trace_used = set()
        self._seen = []
        self._weights = weights

    def _end_trace(self, what: str) -> None:
        unused = [(i, r) for i, r in enumerate(self.rules) if i not in self._trace_used]
        if self.strict and unused:
            seen = sorted(set(self._seen))
            lines = "; ".join(f"rule {i}: {r}" for i, r in unused)
            raise ValueError(
                f"{type(self).__name__}: {len(unused)} rule(s) matched no op while tracing {what}: {lines}. "
                f"Module paths of the dots seen: {seen[:30]}{' ...' if len(seen) > 30 else ''}. "
                "Fix module_path / op_names, or pass strict=False"
            )

    def _not_entered(self, eqn: Any, refs: list[WeightRef]) -> None:
        """Weights flow into a construct the rewrite does not enter, so its dots stay float:
        an error (strict) or a warning, when a rule's ``module_path`` selects one of them."""
        paths = sorted({r.path for r in refs if any(
            rule.weight_qtype and compile_pattern(rule.module_path).fullmatch(r.module_path) for rule in self.rules
        )})
        if not paths:
            return
        msg = (
            f"{type(self).__name__}: weight(s) {paths} flow into {eqn.primitive.name!r}, which quantize does not "
            "enter: the dots inside run in float, unquantized (docs/quant.md lists the constructs not entered)"
        )
        if self.strict:
            raise ValueError(msg + "; pass strict=False to run them in float with a warning")
        warnings.warn(msg, stacklevel=2)

    def _match(self, site: DotSite, has_weight: bool) -> QuantizationRule | None:
        self._seen.append(site.module_path)
        for i, rule in enumerate(self.rules):
            if not (rule.act_qtype or (has_weight and rule.weight_qtype) or self._always_applies(rule)):
                continue
            if rule.applies_to(site.module_path, site.kind, site.index):
                self._used.add(i)
                self._trace_used.add(i)
                return rule
        return None

    def _always_applies(self, rule: QuantizationRule) -> bool:
        return False

    # --- the handler the interpreter calls ---

    def _handle(self, site: DotSite, invals: list) -> list | None:
        ops = invals[:2]
        refs = [isinstance(x, WeightRef) for x in ops]
        rule = self._match(site, any(refs))
        scaled = _divide_by_input_scale(site, ops, self._weights)
        if rule is None:
            if scaled is ops:
                return None
            return bind_dequantized(site.eqn, [materialize(x) for x in scaled], [materialize(r) for r in invals[2:]])
        ops = scaled
        quantized = [self._operand(site, rule, x, side) for side, x in enumerate(ops)]
        return self._compute(site, rule, quantized, invals[2:])

    def _operand(self, site: DotSite, rule: QuantizationRule, x: Any, side: int) -> Any:
        ndim = len(site.eqn.invars[side].aval.shape)
        reduce_axes, tile_axis = operand_axes(site.eqn, side, ndim)
        key = (site.module_path, site.kind, site.index, side)
        if isinstance(x, WeightRef):
            if not rule.weight_qtype:
                return x.materialize()
            if isinstance(rule, QtRule) and rule.disable_channelwise_axes:
                reduce_axes = tuple(range(ndim))
            tile = self._tile(rule, site, side, tile_axis, x.path)
            self._record_plan(x, rule, reduce_axes, tile)
            return self._weight(x, rule, reduce_axes, tile)
        if self._recording is not None:
            self._recording.setdefault(key, []).append(self._act_bounds(rule, x))
        if not rule.act_qtype:
            return x
        if isinstance(rule, QtRule) and rule.disable_channelwise_axes:
            reduce_axes = tuple(range(ndim))
        return self._activation(rule, x, reduce_axes, key, tile_axis)

    def _tile(self, rule: QuantizationRule, site: DotSite, side: int, axis: int | None, where: str) -> tuple[tuple[int, int], ...] | None:
        """The weight's tiles as ``((axis, size), ...)``: along its last contracting axis,
        and with a pair ``tile_size`` along its last output axis too."""
        block = qtype_info(rule.weight_qtype).block if rule.weight_qtype else None
        if block is not None and axis is not None:
            return ((axis, block),)
        if rule.tile_size is None or axis is None:
            return None
        shape = site.eqn.invars[side].aval.shape
        what = f"{rule._describe()} on {where!r}"
        if not isinstance(rule.tile_size, tuple):
            return ((axis, tile_length(rule.tile_size, shape[axis], what)),)
        if site.eqn.primitive.name != "dot_general":
            raise ValueError(f"{what}: a two-axis tile_size {rule.tile_size} applies to dot_general weights, not {site.eqn.primitive.name}")
        (contracting, batch) = (d[side] for d in site.eqn.params["dimension_numbers"])
        free = [a for a in range(len(shape)) if a not in contracting and a not in batch]
        if not free:
            raise ValueError(f"{what}: a two-axis tile_size needs an output axis on the weight; it has shape {tuple(shape)}")
        first, second = rule.tile_size
        return ((axis, tile_length(first, shape[axis], what)), (free[-1], tile_length(second, shape[free[-1]], what)))

    def _act_bounds(self, rule: QuantizationRule, x: Any) -> tuple[Any, Any]:
        method = parse_method(rule.act_calibration_method or "absmax")
        lo, hi = bounds(x, method, tuple(range(len(x.shape))))
        return lo.reshape(()), hi.reshape(())

    def _activation(self, rule: QuantizationRule, x: Any, reduce_axes: tuple[int, ...], key: SiteKey, tile_axis: int | None) -> Any:
        import jax.numpy as jnp

        method = rule.act_calibration_method or "absmax"
        act_qtype = required(rule.act_qtype, f"{rule._describe()}.act_qtype")
        block = qtype_info(act_qtype).block
        tile = None if block is None or tile_axis is None else (tile_axis, block)
        if not rule.act_static_scale or block is not None:
            q = quantize_array(x, act_qtype, reduce_axes=reduce_axes, tile=tile, method=method, where="activation")
            return self._wrap(q, x)
        if key not in self._static:
            raise ValueError(
                f"{rule._describe()} asks for a static activation scale (act_static_scale=True) but op "
                f"{key[1]}{key[2]} of module {key[0]!r} (operand {key[3]}) has none: run "
                "calibrate(fn, provider, batches) first"
            )
        lo, hi = self._static[key]
        symmetric = parse_method(method).symmetric
        ones = (1,) * len(x.shape)
        q = quantize_with_bounds(x, act_qtype, jnp.reshape(lo, ones), jnp.reshape(hi, ones), QuantLayout.per_tensor(), symmetric=symmetric)
        return self._wrap(q, x)

    def _weight(self, ref: WeightRef, rule: QuantizationRule, reduce_axes: tuple[int, ...], tile: tuple[tuple[int, int], ...] | None) -> Any:
        q = _prequantized_view(ref, reduce_axes, tile) if isinstance(ref.value, QArray) else None
        if q is None:
            q = quantize_array(
                ref.materialize(), required(rule.weight_qtype, f"{rule._describe()}.weight_qtype"), reduce_axes=reduce_axes, tile=tile,
                method=rule.weight_calibration_method, where=ref.path,
            )
        return self._wrap(q, None if isinstance(ref.value, QArray) else ref)

    def _wrap(self, q: QArray, original: Any) -> Any:
        """What a quantized operand becomes (PTQ: the QArray itself)."""
        return q

    def _compute(self, site: DotSite, rule: QuantizationRule, ops: list, rest: list) -> list:
        if site.eqn.primitive.name == "dot_general":
            return quantized_dot(site.eqn, *ops)
        return bind_dequantized(site.eqn, ops, [materialize(r) for r in rest])

    def _record_plan(self, ref: WeightRef, rule: QuantizationRule, reduce_axes: tuple[int, ...], tile: tuple[tuple[int, int], ...] | None) -> None:
        if ref.name in self._plan:
            return
        perm = _leaf_permutation(ref)
        if perm is None:
            return
        leaf_axes = tuple(sorted(perm[a] for a in reduce_axes))
        leaf_tile = None if tile is None else tuple((perm[a], t) for a, t in tile)
        self._plan[ref.name] = (rule, leaf_axes, leaf_tile)


class PtqProvider(QuantizationProvider):
    """Post-training quantization: inference numerics (see the module docstring)."""


class QtProvider(QuantizationProvider):
    """Quantized training: the PTQ forward pass with straight-through gradients.

    Each quantized operand is ``x + stop_gradient(dequantize(quantize(x)) - x)``, so
    gradients flow to the float weights as if quantization were the identity. With
    ``bwd_qtype`` set in a :class:`QtRule`, the cotangent entering the backward dots is
    quantized per tensor to that qtype (with ``bwd_calibration_method``); with
    ``bwd_weight_grad_tile_size`` the weight gradient's cotangent is quantized per output
    channel in tiles of tokens instead; ``bwd_stochastic_rounding`` rounds with noise drawn
    from ``bwd_rng``.

    Args:
      rules: the ``QtRule`` rules, tried in order.
      strict: raise when a trace leaves a rule unused.
      bwd_rng: a PRNG key, needed by rules with ``bwd_stochastic_rounding``.
      weight_filter: which leaves are weights, as for every provider.
    """

    rule_type = QtRule
    _replay_arrays = ("_static", "bwd_rng")

    def _wrap(self, q: QArray, original: Any) -> Any:
        import jax

        x = original.materialize() if isinstance(original, WeightRef) else original
        dq = q.dequantize()
        if x is None:
            return dq
        return x + jax.lax.stop_gradient(dq.astype(x.dtype) - x)

    def __init__(
        self, rules: Sequence[QuantizationRule], *, strict: bool = True, bwd_rng: Any = None, weight_filter: WeightFilter | None = None
    ) -> None:
        super().__init__(rules, strict=strict, weight_filter=weight_filter)
        self.bwd_rng = bwd_rng

    def _compute(self, site: DotSite, rule: QuantizationRule, ops: list, rest: list) -> list:
        rest = [materialize(r) for r in rest]
        if not isinstance(rule, QtRule) or rule.bwd_qtype is None:
            return bind_dequantized(site.eqn, ops, rest)
        key = None
        if rule.bwd_stochastic_rounding is not None:
            if self.bwd_rng is None:
                raise ValueError(
                    f"{rule._describe()}: bwd_stochastic_rounding={rule.bwd_stochastic_rounding!r} needs random "
                    "bits: pass QtProvider(rules, bwd_rng=jax.random.key(...))"
                )
            import zlib

            import jax

            key = jax.random.fold_in(self.bwd_rng, zlib.crc32(f"{site.module_path}/{site.kind}{site.index}".encode()) & 0x7FFFFFFF)
        side = site.weight_sides[0] if len(site.weight_sides) == 1 else None
        return _quantized_backward(site, rule, ops, rest, side, key)


def _noise(key: Any, shape: tuple[int, ...], mode: str | None) -> Any:
    """Uniform noise in [-0.5, 0.5) for stochastic rounding (8 random bits for ``low_bit_uniform``)."""
    if key is None or mode is None:
        return None
    import jax

    if mode == "low_bit_uniform":
        return (jax.random.randint(key, shape, 0, 256).astype("float32") + 0.5) / 256 - 0.5
    return jax.random.uniform(key, shape, minval=-0.5, maxval=0.5)


def _token_axes(site: DotSite, weight_side: int) -> list[int]:
    """Axes of the dot's output that index the activation's free axes (tokens)."""
    (lc, rc), (lb, _) = site.eqn.params["dimension_numbers"]
    nl = len(site.eqn.invars[0].aval.shape) - len(lc) - len(lb)
    nr = len(site.eqn.invars[1].aval.shape) - len(rc) - len(lb)
    nb = len(lb)
    return list(range(nb, nb + nl)) if weight_side == 1 else list(range(nb + nl, nb + nl + nr))


def _quantized_backward(site: DotSite, rule: QtRule, ops: list, rest: list, weight_side: int | None, key: Any) -> list:
    import jax

    def run(*operands: Any) -> list:
        return bind_dequantized(site.eqn, operands, rest)

    @jax.custom_vjp
    def dot(*operands: Any) -> list:
        return run(*operands)

    def fwd(*operands: Any) -> tuple[list, tuple]:
        return run(*operands), operands

    bwd_qtype = required(rule.bwd_qtype, f"{rule._describe()}.bwd_qtype")

    def bwd(saved: tuple, ct: list) -> tuple:
        mode = rule.bwd_stochastic_rounding
        ct_x = [fake_quant(c, bwd_qtype, method=rule.bwd_calibration_method, where="cotangent", noise=_noise(key, c.shape, mode)) for c in ct]
        _, vjp = jax.vjp(run, *saved)
        grads = list(vjp(ct_x))
        tile = rule.bwd_weight_grad_tile_size
        if tile is not None and weight_side is not None and site.eqn.primitive.name == "dot_general":
            tokens = _token_axes(site, weight_side)
            where = f"{rule._describe()}: weight-gradient cotangent of {site.kind}{site.index} in {site.module_path!r}"
            ct_w = [
                fake_quant(c, bwd_qtype, reduce_axes=tokens, tile=(tokens[-1], tile_length(tile, c.shape[tokens[-1]], where)),
                           method=rule.bwd_calibration_method, where=where,
                           noise=_noise(None if key is None else jax.random.fold_in(key, 1), c.shape, mode))
                for c in ct
            ]
            grads[weight_side] = vjp(ct_w)[weight_side]
        return tuple(grads)

    dot.defvjp(fwd, bwd)
    return dot(*ops)


def input_scale_path(weight_path: str) -> str:
    """Where a weight's per-input-channel scale (AWQ, SmoothQuant) is kept: ``<name>_awq_scale``
    (``name``: the weight's variable path, :attr:`WeightRef.name`).

    Args:
      weight_path: the weight's variable path (``"layers/0/mlp/kernel"``).
    """
    return f"{weight_path}_awq_scale"


def _divide_by_input_scale(site: DotSite, ops: list, weights: dict[str, Any]) -> list:
    """When the weight operand has an input scale ``s`` [K], the other operand is divided by
    it along the axes it contracts with the weight (the weight was stored times ``s``)."""
    refs = [isinstance(x, WeightRef) for x in ops]
    if site.eqn.primitive.name != "dot_general" or refs.count(True) != 1:
        return ops
    side = refs.index(True)
    ref: WeightRef = ops[side]
    scale = weights.get(input_scale_path(ref.name))
    perm = _leaf_permutation(ref)
    if scale is None or perm is None:
        return ops
    import jax.numpy as jnp

    (lc, rc), _ = site.eqn.params["dimension_numbers"]
    w_contract, x_contract = (rc, lc) if side == 1 else (lc, rc)
    pairs = sorted(zip(w_contract, x_contract), key=lambda p: perm[p[0]])
    x = materialize(ops[1 - side])
    s = jnp.reshape(materialize(scale), [x.shape[xa] for _, xa in pairs])
    order = sorted(range(len(pairs)), key=lambda i: pairs[i][1])
    s = jnp.transpose(s, order)
    shape = [x.shape[a] if a in x_contract else 1 for a in range(x.ndim)]
    out = list(ops)
    out[1 - side] = (x / jnp.reshape(s, shape)).astype(x.dtype)
    return out


def _leaf_permutation(ref: WeightRef) -> list[int] | None:
    """``perm[view_axis] = leaf_axis`` when the views only transpose / convert / copy the leaf."""
    ndim = len(ref.value.shape)
    perm = list(range(ndim))
    for prim, params, _ in ref.views:
        if prim.name == "transpose":
            perm = [perm[a] for a in params["permutation"]]
        elif prim.name not in ("convert_element_type", "copy", "copy_p", "pvary"):
            return None
    return perm


def _prequantized_view(ref: WeightRef, reduce_axes: tuple[int, ...], tile: tuple[tuple[int, int], ...] | None) -> QArray | None:
    """``ref``'s QArray in the dot's layout, when the views allow and its scales fit the dot."""
    import jax.numpy as jnp

    perm = _leaf_permutation(ref)
    if perm is None:
        return None
    q: QArray = ref.value.unpack()
    dtype = q.dtype
    for prim, params, _ in ref.views:
        if prim.name == "convert_element_type":
            dtype = jnp.dtype(params["new_dtype"]).name
    inverse = {leaf: view for view, leaf in enumerate(perm)}
    layout = q.layout
    if layout.kind == "per_channel":
        layout = QuantLayout.per_channel(*sorted(inverse[a % q.ndim] for a in layout.axes))
    elif layout.kind == "per_tile":
        layout = QuantLayout.per_tile(tuple(inverse[a % q.ndim] for a in layout.axes), layout.tile_sizes)
        if tile is None or sorted(zip(layout.axes, layout.tile_sizes)) != sorted(tile):
            return None
    elif tile is not None:
        return None

    def t(a: Any) -> Any:
        return a if a is None or getattr(a, "ndim", 0) == 0 else jnp.transpose(a, perm)

    out = QArray(t(q.qvalue), t(q.scale), t(q.zero_point), qtype=q.qtype, layout=layout, dtype=dtype)
    if layout.kind == "per_channel" and any(a in reduce_axes for a in layout.axes):
        return None
    return out
