"""SmoothQuant (Xiao et al. 2023): move activation outliers into the weights before w8a8.

For a weight ``W`` [K, N] and its inputs ``X``, per input channel
``s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)``; ``X / s`` has tamer outliers and
``diag(s) W`` absorbs them, so ``(X / s)(diag(s) W) = X W`` exactly in float and both
quantize better. The weight is stored as ``diag(s) W`` (quantized by the rule) and ``s``
at ``<name>_awq_scale`` (``name``: the weight's variable path, as for AWQ), which every provider divides out of the inputs at the dot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from cairn.quant._numerics import quantize_array, tile_length
from cairn.quant._providers import PtqProvider
from cairn.quant._recording import InputRecorder, record_inputs, recorded_leaves, with_input_scales
from cairn.quant._rules import QuantizationRule
from cairn.quant._weights import WeightFilter

__all__ = ["SmoothQuantRule", "smooth_quant_params"]


@dataclasses.dataclass(frozen=True)
class SmoothQuantRule(QuantizationRule):
    """A rule whose weights :func:`smooth_quant_params` smooths (``alpha``: migration strength).

    Args:
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
      alpha: the migration strength in ``[0, 1]``: the smoothing scale is ``max|X_j|^alpha /
        max|W_j|^(1 - alpha)`` per input channel ``j``.
    """

    alpha: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"{self._describe()}: alpha must be in [0, 1], got {self.alpha!r}")


class _MaxRecorder(InputRecorder):
    rule_class = SmoothQuantRule

    def __init__(self, rules: Sequence[QuantizationRule], weight_filter: WeightFilter | None = None) -> None:
        super().__init__(rules, weight_filter)
        self.absmax: dict[str, tuple[Any, tuple[int, ...]]] = {}

    def record(self, path: str, x2: Any, leaf_contract: tuple[int, ...]) -> None:
        import jax.numpy as jnp

        m = jnp.max(jnp.abs(x2), axis=0)
        prev = self.absmax.get(path)
        self.absmax[path] = (m if prev is None else jnp.maximum(prev[0], m), leaf_contract)


def smooth_quant_params(params: Any, provider: PtqProvider, fn: Callable, batches: Iterable[Sequence[Any]]) -> Any:
    """``params`` with every weight a :class:`SmoothQuantRule` selects smoothed and quantized,
    and its smoothing scale stored beside it (as AWQ stores its scale: a dict key, or an
    attribute of the weight's owner in a module). The input tree is not changed.

    Args:
      params: the parameter tree (nested dicts or a module); not changed.
      provider: a :class:`PtqProvider` whose :class:`SmoothQuantRule` s select the weights.
      fn: ``fn(params, *batch)``, the model function, run in float to record activation maxima.
      batches: calibration batches, each a sequence of ``fn``'s arguments after ``params``.

    Raises:
      ValueError: no batch, no rule selected a weight, or a weight that is not [in, out]
        contracted on axis 0.
    """
    import jax.numpy as jnp

    recorder = record_inputs(_MaxRecorder(provider.rules, provider.weight_filter), fn, params, batches, "smooth_quant_params")
    replaced: dict[str, Any] = {}
    scales: dict[str, Any] = {}
    for path, leaf, rule in recorded_leaves(params, recorder):
        if path not in recorder.absmax:
            continue
        act_max, contract = recorder.absmax[path]
        assert isinstance(rule, SmoothQuantRule)  # the recorder keeps SmoothQuantRule matches only
        if list(contract) != [0] or np.ndim(leaf) != 2:
            raise ValueError(f"{rule._describe()} on {path!r}: SmoothQuant handles [in, out] weights contracted on axis 0")
        w = np.asarray(leaf, np.float64)
        a = np.maximum(np.asarray(act_max, np.float64), 1e-5)
        wmax = np.maximum(np.abs(w).max(axis=1), 1e-5)
        s = a**rule.alpha / wmax ** (1.0 - rule.alpha)
        smoothed = jnp.asarray(w * s[:, None], jnp.float32)
        tile = None if rule.tile_size is None else (0, tile_length(rule.tile_size, w.shape[0], f"{rule._describe()} on {path!r}"))
        value = smoothed if rule.weight_qtype is None else quantize_array(
            smoothed, rule.weight_qtype, reduce_axes=(0,), tile=tile, method=rule.weight_calibration_method, where=path
        )
        replaced[path] = value
        scales[path] = jnp.asarray(s, jnp.float32)
    return with_input_scales(params, replaced, scales)
