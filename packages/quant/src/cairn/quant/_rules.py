"""Quantization rules: which operations are quantized, and how (Qwix's field names).

A rule applies to a dot (``dot_general``, ``conv_general_dilated``, ``ragged_dot``) when
``module_path``, a regular expression, matches the *whole* module path of the op (as in
Qwix, the path of the module the op runs in: for an operand that flows from a weight, the
module holding the weight, e.g. ``layers/0/mlp`` for the cairn.nn leaf
``layers/0/mlp/kernel`` and for the Flax NNX leaf ``layers/0/mlp/kernel/value``, and for
a plain pytree leaf its path minus its last component; for a dot between two
activations, the ``jax.named_scope`` path the op was traced under) and, when ``op_names`` is not empty,
one of its entries names the op kind (``"dot_general"``, ``"einsum"``,
``"conv_general_dilated"``, ``"ragged_dot"``) or the kind and its index within the
module in program order (``"dot_general1"``). The first rule that applies wins.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import cast

from cairn.core_array import PathError, compile_pattern
from cairn.quant._calibration import parse_method
from cairn.quant._qtypes import qtype_info

__all__ = ["QuantizationRule", "QtRule"]

_OP_KINDS = ("dot_general", "einsum", "conv_general_dilated", "ragged_dot")


@dataclasses.dataclass(frozen=True)
class QuantizationRule:
    """How to quantize the ops a rule selects (PTQ; base of :class:`QtRule` and :class:`LoraRule`).

    Args:
      module_path: regular expression matched in full against the op's module path (the
        module holding the weight: ``"layers/0/mlp"``, not ``"layers/0/mlp/kernel"``).
      op_names: op kinds or per-module op names (``"dot_general0"``); empty means all.
      weight_qtype: qtype of the weight operand (``"int8"``, ``"int4"``, ``"nf4"``, ...)
        or ``None`` to leave weights in float.
      act_qtype: qtype of the activation operand(s), or ``None`` (weight-only).
      tile_size: tile length along the weight's last contracting axis (an ``int``), or
        a ``float`` ``1/tile_count``; ``None`` for per-channel scales. A pair
        ``(contracting, output)`` tiles the weight's last output axis too, so each 2-d
        block (e.g. ``(128, 128)``, as in block-scaled fp8 training) gets one scale.
      weight_calibration_method: ``"absmax"``, ``"absmax,s"``, ``"minmax[,s]"``,
        ``"rms,k"``, ``"percentile,p"`` or ``"fixed,min,max"``.
      act_calibration_method: the same grammar for activations (``None``: ``"absmax"``).
      act_static_scale: use a calibrated static activation scale (see ``calibrate``)
        instead of computing it from every batch.
      act_batch_axes: activation axes averaged over when calibrating a static scale.

    Raises:
      ValueError: an unknown qtype or calibration method, a pattern that does not
        compile, an unknown op name, or a tile size that is not positive.
    """

    module_path: str = ".*"
    op_names: Sequence[str] = ()
    weight_qtype: str | None = None
    act_qtype: str | None = None
    tile_size: int | float | tuple[int | float, int | float] | None = None
    weight_calibration_method: str = "absmax"
    act_calibration_method: str | None = None
    act_static_scale: bool = False
    act_batch_axes: Sequence[int] = (0,)

    def __post_init__(self) -> None:
        try:
            compile_pattern(self.module_path)
        except PathError as e:
            raise ValueError(f"{type(self).__name__}(module_path={self.module_path!r}): {e}") from None
        names = (self.op_names,) if isinstance(self.op_names, str) else tuple(self.op_names)
        object.__setattr__(self, "op_names", names)
        object.__setattr__(self, "act_batch_axes", tuple(int(a) for a in self.act_batch_axes))
        for name in names:
            if not any(name == k or (name.startswith(k) and name[len(k):].isdigit()) for k in _OP_KINDS):
                raise ValueError(
                    f"{self._describe()}: op name {name!r} is none of {_OP_KINDS} "
                    "(optionally followed by the op's index in its module, e.g. 'dot_general1')"
                )
        for field in ("weight_qtype", "act_qtype"):
            value = getattr(self, field)
            if value is not None:
                try:
                    qtype_info(value)
                except ValueError as e:
                    raise ValueError(f"{self._describe()}: {field}: {e}") from None
        for field in ("weight_calibration_method", "act_calibration_method"):
            value = getattr(self, field)
            if value is not None:
                try:
                    parse_method(value)
                except ValueError as e:
                    raise ValueError(f"{self._describe()}: {field}: {e}") from None
        tile = self.tile_size
        if isinstance(tile, list):
            tile = tuple(tile)
            object.__setattr__(self, "tile_size", tile)
        pair = isinstance(tile, tuple)
        for field in ("weight_qtype", "act_qtype"):
            block = qtype_info(getattr(self, field)).block if getattr(self, field) else None
            if block is not None and tile is not None and tile != block:
                raise ValueError(f"{self._describe()}: {getattr(self, field)} uses blocks of {block}; tile_size must be None or {block}")
        sizes = cast(tuple, tile) if pair else (tile,)
        if tile is not None and (
            (pair and len(sizes) != 2)
            or any(isinstance(t, bool) or not isinstance(t, int | float) or not t > 0 or (isinstance(t, float) and t > 1) for t in sizes)
        ):
            raise ValueError(
                f"{self._describe()}: tile_size must be a positive int or a float in (0, 1] "
                f"(1/tile_count), or a pair of them (contracting axis, output axis), got {tile!r}"
            )

    def _describe(self) -> str:
        return f"{type(self).__name__}(module_path={self.module_path!r})"

    def applies_to(self, module_path: str, op_kind: str, op_index: int) -> bool:
        """Whether this rule selects op number ``op_index`` of kind ``op_kind`` under ``module_path``.

        Args:
          module_path: the module path of the op (``"layers/0/mlp"``).
          op_kind: the op's kind (``"dot_general"``, ``"einsum"``, ``"conv_general_dilated"``...).
          op_index: the op's number among the ops of that kind in the module (0, 1...).
        """
        if compile_pattern(self.module_path).fullmatch(module_path) is None:
            return False
        if not self.op_names:
            return True
        kinds = {op_kind, "dot_general"} if op_kind == "einsum" else {op_kind}
        return any(n in kinds or n in {f"{k}{op_index}" for k in kinds} for n in self.op_names)


@dataclasses.dataclass(frozen=True)
class QtRule(QuantizationRule):
    """A :class:`QuantizationRule` for quantized training (``QtProvider``).

    With ``bwd_qtype=None`` the forward pass is quantized and gradients pass straight
    through (QAT); with ``bwd_qtype`` set, the backward dots are quantized as well.

    Args:
      bwd_qtype: qtype of the backward pass's dot operands, or ``None``.
      bwd_calibration_method: calibration of the backward operands.
      bwd_weight_grad_tile_size: the weight gradient's cotangent is quantized per output
        channel in tiles of this many tokens (an ``int``, or a float ``1/tile_count``)
        instead of per tensor.
      bwd_stochastic_rounding: ``None`` (round to nearest), ``"uniform"`` (uniform noise in
        ``[-0.5, 0.5)`` before rounding) or ``"low_bit_uniform"`` (the same noise from 8
        random bits); needs ``QtProvider(..., bwd_rng=key)``.
      disable_channelwise_axes: use one scale for the whole tensor instead of one per
        channel (per-tensor scales).
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
    """

    bwd_qtype: str | None = None
    bwd_calibration_method: str = "absmax"
    bwd_weight_grad_tile_size: int | float | None = None
    bwd_stochastic_rounding: str | None = None
    disable_channelwise_axes: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bwd_qtype is not None:
            try:
                qtype_info(self.bwd_qtype)
            except ValueError as e:
                raise ValueError(f"{self._describe()}: bwd_qtype: {e}") from None
        parse_method(self.bwd_calibration_method)
        tile = self.bwd_weight_grad_tile_size
        if tile is not None and (isinstance(tile, bool) or not tile > 0 or (isinstance(tile, float) and tile > 1)):
            raise ValueError(f"{self._describe()}: bwd_weight_grad_tile_size must be a positive int or a float in (0, 1], got {tile!r}")
        if self.bwd_stochastic_rounding not in (None, "uniform", "low_bit_uniform"):
            raise ValueError(
                f"{self._describe()}: bwd_stochastic_rounding must be None, 'uniform' or "
                f"'low_bit_uniform', got {self.bwd_stochastic_rounding!r}"
            )
