"""AWQ (Lin et al. 2024): activation-aware weight scaling before weight-only quantization.

Input channels that carry large activations matter most. For a weight ``W`` [K, N] and
its inputs ``X`` [T, K] (a weight of more axes, an einsum kernel such as ``[d, heads,
head_dim]``, is read as its contracted axes K against the rest N, in the leaf's order), with ``a = mean_t |X|`` per channel, AWQ tries
``s = a ** alpha`` (normalised to ``sqrt(max(s) min(s)) = 1``) for ``alpha`` on a grid in
``[0, 1)``, quantizes ``diag(s) W`` and keeps the ``alpha`` whose output
``(X / s) Q(diag(s) W)`` is closest to ``X W``. The stored weight is ``Q(diag(s) W)`` and
``s`` is kept beside it at ``<name>_awq_scale`` (``name``: the weight's variable path,
``a/kernel`` in cairn.nn and Flax NNX alike); the provider divides the activations by
it at the dot, so inference needs nothing but the two leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from cairn.core_array import QArray
from cairn.quant._numerics import quantize_array, tile_length
from cairn.quant._providers import PtqProvider
from cairn.quant._qtypes import qtype_info, required
from cairn.quant._recording import InputRecorder, record_inputs, recorded_leaves, with_input_scales
from cairn.quant._rules import QuantizationRule
from cairn.quant._weights import WeightFilter

__all__ = ["AwqRule", "awq_quantize_params"]

_SAMPLE_ROWS = 4096


@dataclasses.dataclass(frozen=True)
class AwqRule(QuantizationRule):
    """A rule whose weights :func:`awq_quantize_params` scales and quantizes (weight-only).

    Args:
      n_grid: number of ``alpha`` values tried in ``[0, 1)``.
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

    n_grid: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_qtype is None or qtype_info(self.weight_qtype).is_float:
            raise ValueError(f"{self._describe()}: AWQ needs an integer weight_qtype, got {self.weight_qtype!r}")
        if isinstance(self.n_grid, bool) or not isinstance(self.n_grid, int) or self.n_grid < 1:
            raise ValueError(f"{self._describe()}: n_grid must be a positive int, got {self.n_grid!r}")


class _ActivationRecorder(InputRecorder):
    """Mean ``|x|`` per input channel, and a sample of input rows for the search."""

    rule_class = AwqRule

    def __init__(self, rules: Sequence[QuantizationRule], weight_filter: WeightFilter | None = None) -> None:
        super().__init__(rules, weight_filter)
        self.stats: dict[str, tuple[Any, int, list[Any], tuple[int, ...]]] = {}

    def record(self, path: str, x2: Any, leaf_contract: tuple[int, ...]) -> None:
        import jax.numpy as jnp

        total, count, sample, _ = self.stats.get(path, (0.0, 0, [], leaf_contract))
        kept = sum(s.shape[0] for s in sample)
        if kept < _SAMPLE_ROWS:
            sample = [*sample, x2[: _SAMPLE_ROWS - kept]]
        self.stats[path] = (total + jnp.sum(jnp.abs(x2), axis=0), count + x2.shape[0], sample, leaf_contract)


def _as_matrix(w: np.ndarray, contract: list[int]) -> np.ndarray:
    """``w`` (leaf layout) as [K, N]: the contracted leaf axes first (K), then the rest."""
    free = [a for a in range(w.ndim) if a not in contract]
    return np.transpose(w, contract + free).reshape(int(np.prod([w.shape[a] for a in contract])), -1)


def _as_leaf(m: np.ndarray, shape: tuple[int, ...], contract: list[int]) -> np.ndarray:
    """The inverse of :func:`_as_matrix`: [K, N] back to the leaf's ``shape``."""
    order = contract + [a for a in range(len(shape)) if a not in contract]
    return np.transpose(m.reshape([shape[a] for a in order]), np.argsort(order))


def _search(w: np.ndarray, contract: list[int], x: np.ndarray, act: np.ndarray, rule: AwqRule,
            tile: tuple[int, int] | None) -> tuple[np.ndarray, QArray]:
    """The best per-input-channel scale ``s`` [K] and ``Q(diag(s) W)`` (in the leaf's layout)
    for a leaf ``w`` whose ``contract`` axes (K inputs, in leaf order) meet ``x`` [T, K]."""
    import jax.numpy as jnp

    mat = _as_matrix(w, contract)
    ref = x @ mat
    best: tuple[float, np.ndarray, QArray] | None = None
    for i in range(rule.n_grid):
        alpha = i / rule.n_grid
        s = np.maximum(act, 1e-8) ** alpha
        s = s / np.sqrt(s.max() * s.min())
        scaled = _as_leaf(mat * s[:, None], w.shape, contract)
        q = quantize_array(jnp.asarray(scaled, jnp.float32), required(rule.weight_qtype, "AwqRule.weight_qtype"),
                           reduce_axes=tuple(contract), tile=tile, method=rule.weight_calibration_method)
        out = (x / s[None, :]) @ _as_matrix(np.asarray(q.dequantize(), np.float64), contract)
        loss = float(np.mean((out - ref) ** 2))
        if best is None or loss < best[0]:
            best = (loss, s, q)
    assert best is not None
    return best[1], best[2]


def awq_quantize_params(params: Any, provider: PtqProvider, fn: Callable, batches: Iterable[Sequence[Any]]) -> Any:
    """``params`` with every weight an :class:`AwqRule` selects AWQ-quantized.

    Each selected weight (``[in, out]``, or an einsum kernel: its contracted axes are the
    inputs) becomes ``Q(diag(s) W)`` (a ``QArray``, per output
    channel or per tile as the rule says) and ``s`` is added at ``<name>_awq_scale``
    (``name``: the weight's variable path; in nested dicts a new key; in a cairn.nn or Flax
    NNX module an attribute of the weight's module, of the weight's variable type); ``quantize(fn, provider)`` on the result divides the
    weight's inputs by ``s``. The input tree is not changed.

    Args:
      params: the parameter tree (nested dicts or a module); not changed.
      provider: a :class:`PtqProvider` whose :class:`AwqRule` s select the weights.
      fn: ``fn(params, *batch)``, the model function, run in float to record activations.
      batches: calibration batches, each a sequence of ``fn``'s arguments after ``params``.

    Raises:
      ValueError: no batch, no ``AwqRule`` selected a weight, a selected weight with no
        output axis, or tiles asked of a weight contracted on more than one axis.
    """
    import jax.numpy as jnp

    recorder = record_inputs(_ActivationRecorder(provider.rules, provider.weight_filter), fn, params, batches, "awq_quantize_params")
    replaced: dict[str, Any] = {}
    scales: dict[str, Any] = {}
    for path, leaf, rule in recorded_leaves(params, recorder):
        if path not in recorder.stats:
            continue
        total, count, sample, contracted = recorder.stats[path]
        assert isinstance(rule, AwqRule)  # the recorder keeps AwqRule matches only
        contract = list(contracted)
        w = np.asarray(leaf, np.float64)
        if not contract or len(contract) == w.ndim:
            raise ValueError(f"{rule._describe()} on {path!r}: AWQ needs a weight with contracted (input) and "
                             f"output axes, got contracted axes {contract} of a {w.ndim}-d weight")
        tile = None
        if rule.tile_size is not None:
            if len(contract) != 1:
                raise ValueError(f"{rule._describe()} on {path!r}: tiles need exactly one contracted axis, "
                                 f"got {len(contract)} ({contract})")
            where = f"{rule._describe()} on {path!r}"
            tile = (contract[0], tile_length(rule.tile_size, w.shape[contract[0]], where))
        act = np.asarray(total, np.float64) / max(count, 1)
        s, replaced[path] = _search(w, contract, np.asarray(jnp.concatenate(sample), np.float64), act, rule, tile)
        scales[path] = jnp.asarray(s, jnp.float32)
    return with_input_scales(params, replaced, scales)
