"""The parameter initializers of the model's layers, one function object per setting.

The layers keep their initializers as static attributes, which are part of the model's
pytree structure. Returning the same function object for the same (kind, logical names,
stddev) makes two models of one config equal in structure, so they share compiled
programs (``generate``, ``nn.jit``) instead of compiling again for every new model object
(a loaded checkpoint, ``CausalLM.astype``, a merged LoRA model).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from cairn import nn

__all__ = ["normal", "zeros"]


@functools.cache
def normal(names: tuple[str | None, ...], stddev: float = 0.02) -> Callable[..., Any]:
    """``normal(stddev)`` with logical axis ``names`` (cached: one object per argument)."""
    return nn.with_partitioning(nn.initializers.normal(stddev), names)


@functools.cache
def zeros(names: tuple[str | None, ...]) -> Callable[..., Any]:
    """Zeros with logical axis ``names`` (cached: one object per argument)."""
    return nn.with_partitioning(nn.initializers.zeros, names)
