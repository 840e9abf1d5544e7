"""GPTQ (Frantar et al. 2023): weight-only quantization that corrects each row's rounding
error with the rows still to come, using the inputs' second moments.

For a weight ``W`` [K, N] (K: contracted inputs, N: outputs) fed inputs ``X`` [T, K],
``H = 2/T X^T X + damp I``. Rows are quantized in order; after row ``k`` the error
``e = (w_k - q_k) / U_kk`` is spread over the later rows as ``W[k+1:] -= U[k, k+1:]^T e``,
``U`` the upper Cholesky factor of ``H^-1``. Blocks of ``gptq_block_size`` rows apply the
update lazily (one matrix product per block). With a ``tile_size`` each tile of rows gets
its own scale, computed when the tile is reached, from the updated rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from cairn.core_array import QArray, QuantLayout
from cairn.quant._numerics import tile_length
from cairn.quant._providers import PtqProvider
from cairn.quant._qtypes import qtype_info, required
from cairn.quant._recording import InputRecorder, named_leaves, record_inputs
from cairn.quant._rules import QuantizationRule
from cairn.quant._weights import WeightFilter

__all__ = ["GptqRule", "gptq_quantize_params", "gptq_matrix"]


@dataclasses.dataclass(frozen=True)
class GptqRule(QuantizationRule):
    """A rule whose weights :func:`gptq_quantize_params` quantizes with GPTQ (weight-only).

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
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_qtype is None or qtype_info(self.weight_qtype).kind != "int":
            raise ValueError(f"{self._describe()}: GPTQ needs a signed integer weight_qtype, got {self.weight_qtype!r}")


def gptq_matrix(
    w: np.ndarray, hessian: np.ndarray, qtype: str, *, tile: int | None = None, block_size: int = 128, damping: float = 0.01
) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ of ``w`` [K, N] under ``hessian`` [K, K]: ``(q [K, N] ints, scale [K // tile or 1, N])``.

    Scales are symmetric, ``max|w| / (qmax + 0.5)`` over each tile of rows (or all rows),
    as :func:`~cairn.quant.quantize_array`; values use the type's whole range
    ``[-qmax - 1, qmax]``, because the error feedback can push a corrected row past the
    tile's absmax and the extra negative level then saves a clip (as Qwix's GPTQ does);
    values inside the symmetric grid stay in ``[-qmax, qmax]``.

    Args:
      w: the weight ``[K, N]`` (contracted over ``K``).
      hessian: ``[K, K]``, the layer's input Hessian (proportional to :math:`X^T X` over the
        calibration inputs).
      qtype: a signed integer qtype (``"int8"``, ``"int4"``...).
      tile: rows per scale (must divide ``K``); None for one scale per column.
      block_size: rows of ``w`` per lazy-update block (a speed knob; the result is the same).
      damping: added to the diagonal as ``damping * mean(diag(hessian))``.

    Raises:
      ValueError: shapes that do not match, or a tile that does not divide K.
    """
    w = np.array(w, np.float64)
    k, n = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"gptq: hessian of shape {hessian.shape} does not match a weight with {k} rows")
    qmax = qtype_info(qtype).qmax
    tile = k if tile is None else tile_length(tile, k, "gptq")
    h = np.array(hessian, np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[dead] = 0.0
    h += damping * np.mean(np.diag(h)) * np.eye(k)
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: H^-1 = U^T U
    q = np.zeros((k, n), np.int64)
    scales = np.zeros((k // tile, n))
    for start in range(0, k, block_size):
        stop = min(start + block_size, k)
        block = w[start:stop].copy()
        errors = np.zeros_like(block)
        for i in range(stop - start):
            row = start + i
            if row % tile == 0:
                rows = np.concatenate([block[i : i + tile], w[stop : row + tile]])[:tile]
                hi = np.max(np.abs(rows), axis=0)
                scales[row // tile] = np.where(hi > 0, hi / (qmax + 0.5), 1.0)
            s = scales[row // tile]
            v = block[i] / s
            # -qmax - 1 only for values past the symmetric grid's edge (so an identity
            # Hessian still gives round-to-nearest exactly, the absmax at -(qmax + 0.5) -> -qmax)
            q[row] = np.clip(np.round(v), np.where(v >= -(qmax + 0.5) * (1 + 1e-6), -qmax, -qmax - 1), qmax)
            errors[i] = (block[i] - q[row] * s) / u[row, row]
            block[i:] -= np.outer(u[row, row : stop], errors[i])
        w[stop:] -= u[start:stop, stop:].T @ errors
    return q, scales


class _HessianRecorder(InputRecorder):
    """Sums ``X^T X`` of each GPTQ weight's inputs."""

    rule_class = GptqRule

    def __init__(self, rules: Sequence[QuantizationRule], weight_filter: WeightFilter | None = None) -> None:
        super().__init__(rules, weight_filter)
        self.sums: dict[str, tuple[Any, int, tuple[int, ...]]] = {}

    def record(self, path: str, x2: Any, leaf_contract: tuple[int, ...]) -> None:
        xtx = x2.T @ x2
        prev = self.sums.get(path)
        total = xtx if prev is None else prev[0] + xtx
        count = x2.shape[0] + (0 if prev is None else prev[1])
        self.sums[path] = (total, count, leaf_contract)


def _to_matrix(w: np.ndarray, contract: list[int]) -> tuple[np.ndarray, list[int], list[int]]:
    """``w`` (leaf layout) as [K, N]: the contracted leaf axes first, then the rest."""
    free = [a for a in range(w.ndim) if a not in contract]
    k = int(np.prod([w.shape[a] for a in contract]))
    return np.transpose(w, contract + free).reshape(k, -1), contract, free


def _to_qarray(q: np.ndarray, scales: np.ndarray, leaf: Any, contract: list[int], free: list[int], tile: int | None, qtype: str) -> QArray:
    import jax.numpy as jnp

    shape = tuple(leaf.shape)
    order = contract + free
    inverse = np.argsort(order)
    qv = np.transpose(q.reshape([shape[a] for a in order]), inverse)
    if tile is None:
        scale = np.transpose(scales.reshape([1] * len(contract) + [shape[a] for a in free]), inverse)
        layout = QuantLayout.per_channel(*free) if free else QuantLayout.per_tensor()
    else:
        scale = np.transpose(scales.reshape([scales.shape[0]] + [shape[a] for a in free]), inverse)
        layout = QuantLayout.per_tile(contract[0], tile)
    info = qtype_info(qtype)
    return QArray(jnp.asarray(qv, info.storage), jnp.asarray(scale, jnp.float32), None, qtype=info.storage, layout=layout, dtype=jnp.dtype(leaf.dtype).name)


def gptq_quantize_params(
    params: Any,
    provider: PtqProvider,
    fn: Callable,
    batches: Iterable[Sequence[Any]],
    *,
    gptq_block_size: int = 128,
    gptq_damping_factor: float = 0.01,
) -> Any:
    """``params`` with every weight a :class:`GptqRule` selects quantized by GPTQ.

    Args:
      params: the float weights, ``fn``'s first argument.
      provider: a ``PtqProvider`` whose rules include ``GptqRule``\\ s (other rules' weights
        are left for ``quantize_params`` / on-the-fly quantization).
      fn: ``fn(params, *batch)``, traced to find each weight's inputs.
      batches: calibration inputs (tuples of ``fn``'s other arguments).
      gptq_block_size: rows per lazy update block.
      gptq_damping_factor: ``damp`` as a fraction of ``mean(diag(H))``.

    Returns:
      The tree with ``QArray`` leaves the provider's ``quantize(fn)`` consumes directly.

    Raises:
      ValueError: no batch, or no ``GptqRule`` selected a weight.
    """
    import jax

    recorder = record_inputs(_HessianRecorder(provider.rules, provider.weight_filter), fn, params, batches, "gptq_quantize_params")
    _, treedef = jax.tree_util.tree_flatten(params, is_leaf=lambda x: isinstance(x, QArray))
    out = []
    for name, leaf in named_leaves(params):  # the recorder keys weights by name (variable path)
        entry = recorder.sums.get(name)
        if entry is None:
            out.append(leaf)
            continue
        out.append(_gptq_leaf(recorder, name, leaf, entry, gptq_block_size, gptq_damping_factor))
    return jax.tree_util.tree_unflatten(treedef, out)


def _gptq_leaf(recorder: _HessianRecorder, path: str, leaf: Any, entry: tuple, block: int, damping: float) -> QArray:
    total, count, leaf_contract = entry
    rule = recorder.rule_of[path]
    qtype = required(rule.weight_qtype, f"{rule._describe()}.weight_qtype")
    w, contract, free = _to_matrix(np.asarray(leaf), list(leaf_contract))
    tile = None if rule.tile_size is None else tile_length(rule.tile_size, w.shape[0], f"{rule._describe()} on {path!r}")
    if tile is not None and len(contract) != 1:
        raise ValueError(f"{rule._describe()} on {path!r}: tiles need exactly one contracted axis, got {len(contract)}")
    hessian = 2.0 * np.asarray(total, np.float64) / max(count, 1)
    q, scales = gptq_matrix(w, hessian, qtype, tile=tile, block_size=block, damping=damping)
    return _to_qarray(q, scales, leaf, contract, free, tile, qtype)

