"""Low-rank adaptation (Hu et al. 2021): ``LoRAParam``, ``LoRA`` and ``LoRALinear``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from cairn.nn import _checks
from cairn.nn import initializers as _init
from cairn.nn._linear import DType, Initializer, Linear, check_axis, check_input, promote_dtype
from cairn.nn._module import Module
from cairn.nn._rngs import Rngs
from cairn.nn._variables import Param

__all__ = ["LoRA", "LoRALinear", "LoRAParam"]

default_a_initializer = _init.he_uniform()


class LoRAParam(Param):
    """A LoRA adapter weight. A ``Param`` subclass, so plain ``Param`` filters include it
    and ``nn.Optimizer(model, tx, wrt=nn.LoRAParam)`` trains only the adapters."""

    __slots__ = ()


class LoRA(Module):
    """``y = (x @ A @ B) * scale (+ base_module(x))`` with ``A: (in, rank)``, ``B: (rank, out)``.

    ``B`` starts at zero, so a fresh adapter leaves ``base_module`` unchanged. ``scale`` is
    ``alpha / rank`` when ``alpha`` is given and 1 otherwise (Flax NNX has no alpha).

    Args:
      in_features: the input's feature size.
      lora_rank: the adapter's rank.
      out_features: the output's feature size.
      base_module: a module whose output is added (the adapted layer); None for the adapter alone.
      alpha: the output is scaled by ``alpha / lora_rank``; None scales by 1.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      a_initializer: the initializer of ``A`` ``(in, rank)``.
      b_initializer: the initializer of ``B`` ``(rank, out)`` (zeros).
      lora_param_type: the variable type of ``A`` and ``B`` (:class:`LoRAParam`).
      promote_dtype: ``promote_dtype(arrays, dtype=...)``, how inputs and parameters are brought to
        one dtype.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      a_metadata: metadata for ``A``.
      b_metadata: metadata for ``B``.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> lora = nn.LoRA(3, 2, 4, rngs=nn.Rngs(0))
    >>> lora(jnp.ones((5, 3))).shape
    (5, 4)
    """

    def __init__(
        self,
        in_features: int,
        lora_rank: int,
        out_features: int,
        *,
        base_module: Module | None = None,
        alpha: float | None = None,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        a_initializer: Initializer = default_a_initializer,
        b_initializer: Initializer = _init.zeros,
        lora_param_type: type[Param] = LoRAParam,
        promote_dtype: Callable[..., Any] = promote_dtype,
        rngs: Rngs,
        a_metadata: Mapping[str, Any] = {},
        b_metadata: Mapping[str, Any] = {},
    ) -> None:
        self.in_features = _checks.positive_int("LoRA", "in_features", in_features)
        self.out_features = _checks.positive_int("LoRA", "out_features", out_features)
        self.lora_rank = _checks.positive_int("LoRA", "lora_rank", lora_rank)
        self.alpha = None if alpha is None else _checks.finite_float("LoRA", "alpha", alpha)
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.promote_dtype = promote_dtype
        self.base_module = base_module
        self.lora_a = lora_param_type(
            a_initializer(rngs.params(), (self.in_features, self.lora_rank), param_dtype),
            **dict(a_metadata),
        )
        self.lora_b = lora_param_type(
            b_initializer(rngs.params(), (self.lora_rank, self.out_features), param_dtype),
            **dict(b_metadata),
        )

    @property
    def scale(self) -> float:
        return 1.0 if self.alpha is None else self.alpha / self.lora_rank

    def __call__(self, x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        """``x A B`` (scaled), plus ``base_module(x, *args, **kwargs)`` when there is one.

        Args:
          x: the input, ``in_features`` last.
          args: more positional arguments for ``base_module``.
          kwargs: more keyword arguments for ``base_module``.

        Raises:
          TypeError: extra arguments that are not None with no ``base_module`` to take them.
        """
        if self.base_module is None and any(a is not None for a in (*args, *kwargs.values())):
            raise TypeError(
                "LoRA: extra call arguments are passed to base_module, but this LoRA has none"
            )
        x = check_input(self, x)
        check_axis(self, x, -1, self.in_features)
        xp, a, b = self.promote_dtype((x, self.lora_a[...], self.lora_b[...]), dtype=self.dtype)
        out = (xp @ a) @ b
        if self.alpha is not None:
            out = out * jnp.asarray(self.scale, out.dtype)
        if self.base_module is not None:
            if not callable(self.base_module):
                raise TypeError("LoRA: base_module must be callable")
            out = self.base_module(x, *args, **kwargs) + out
        return out


class LoRALinear(Linear):
    """A ``Linear`` layer with a LoRA adapter: ``y = x W + b + (x A B) * scale``.

    Takes every ``Linear`` argument plus ``lora_rank`` (and optional ``alpha``); the
    adapter is the submodule ``lora`` (paths ``lora/lora_a``, ``lora/lora_b``).

    Args:
      in_features: the input's feature size.
      out_features: the output's feature size.
      lora_rank: the adapter's rank.
      alpha: the adapter's output is scaled by ``alpha / lora_rank``; None scales by 1.
      lora_dtype: the adapter's computation dtype; None promotes.
      lora_param_dtype: the dtype ``A`` and ``B`` are stored in.
      a_initializer: the initializer of ``A``.
      b_initializer: the initializer of ``B`` (zeros).
      lora_param_type: the variable type of ``A`` and ``B``.
      lora_promote_dtype: the adapter's ``promote_dtype``.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      a_metadata: metadata for ``A``.
      b_metadata: metadata for ``B``.
      kwargs: every other :class:`Linear` argument (``use_bias``, ``kernel_init``...).

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> layer = nn.LoRALinear(3, 4, lora_rank=2, rngs=nn.Rngs(0))
    >>> layer(jnp.ones((5, 3))).shape
    (5, 4)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        lora_rank: int,
        alpha: float | None = None,
        lora_dtype: DType | None = None,
        lora_param_dtype: DType = jnp.float32,
        a_initializer: Initializer = default_a_initializer,
        b_initializer: Initializer = _init.zeros,
        lora_param_type: type[Param] = LoRAParam,
        lora_promote_dtype: Callable[..., Any] = promote_dtype,
        rngs: Rngs,
        a_metadata: Mapping[str, Any] = {},
        b_metadata: Mapping[str, Any] = {},
        **kwargs: Any,
    ) -> None:
        super().__init__(in_features, out_features, rngs=rngs, **kwargs)
        self.lora = LoRA(
            in_features, lora_rank, out_features, alpha=alpha, dtype=lora_dtype,
            param_dtype=lora_param_dtype, a_initializer=a_initializer,
            b_initializer=b_initializer, lora_param_type=lora_param_type,
            promote_dtype=lora_promote_dtype, rngs=rngs, a_metadata=a_metadata,
            b_metadata=b_metadata,
        )

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        y = super().__call__(inputs, out_sharding=out_sharding)
        return y + self.lora(inputs).astype(y.dtype)
