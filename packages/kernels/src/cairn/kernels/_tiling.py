"""Helpers every Pallas implementation shares: padding to a block, config checks, the Mosaic
GPU interpreter's parameters. Nothing here imports a GPU backend (``import cairn.kernels``
on a CPU stays free of Triton and Mosaic code)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp


def round_up(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return -(-n // m) * m


def pad_axis(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    """``x`` padded with ``value`` at the end of ``axis`` to ``size``."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def pad_to_multiple(x: jax.Array, axis: int, block: int) -> jax.Array:
    """``x`` padded with zeros at the end of ``axis`` to a multiple of ``block``."""
    return pad_axis(x, axis, round_up(x.shape[axis], block))


def checked_config(config: Mapping[str, Any], defaults: Mapping[str, Any], *, blocks: Iterable[str] = (),
                   lo: int = 16, hi: int | None = None, counts: Iterable[str] = (),
                   strict: bool = False) -> dict[str, Any]:
    """``config`` with ``defaults`` filled in, checked; raises ``ValueError`` naming a bad key.

    Args:
      config: the caller's (or the autotuner's) settings.
      defaults: every key's default.
      blocks: keys that must be powers of two in ``[lo, hi]`` (``hi=None``: no upper bound).
      lo, hi: the block bounds (Triton blocks are >= 16; wgmma tiles 32..256).
      counts: keys that must be positive ints.
      strict: refuse keys that ``defaults`` does not have.
    """
    cfg = {**defaults, **dict(config)}
    span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    for key in blocks:
        v = cfg[key]
        if not isinstance(v, int) or v < lo or (hi is not None and v > hi) or v & (v - 1):
            raise ValueError(f"config {key}={v!r} does not fit: a power of two {span}")
    for key in counts:
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"config {key}={cfg[key]!r} must be a positive int")
    unknown = set(cfg) - set(defaults)
    if strict and unknown:
        raise ValueError(f"config keys {sorted(unknown)} unknown; expected {sorted(defaults)}")
    return cfg


def mosaic_interpret_params(interpret: bool, *, poison: bool = True) -> Any:
    """``plgpu.kernel``'s ``interpret`` argument: Mosaic GPU's interpret mode on the CPU
    (``InterpretGPUParams``, only under ``jax._src`` in jax 0.10; no public alias yet).

    Args:
      interpret: run on the CPU interpreter (else ``None``: compile for the GPU).
      poison: fill uninitialised memory (outputs included) with NaN, so a test sees any
        element a kernel never writes (else zeros).
    """
    if not interpret:
        return None
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:  # pragma: no cover - a JAX without the GPU interpreter
        raise NotImplementedError(
            "this JAX has no Mosaic GPU interpret mode (InterpretGPUParams); run the pallas_mosaic_gpu "
            "implementation on a GPU or pick another implementation"
        ) from e
    return InterpretGPUParams(uninitialized_memory="nan" if poison else "zero")
