"""Token embeddings: ``Embed`` with ``attend`` for a tied output projection."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.nn import _checks
from cairn.nn import initializers as _init
from cairn.nn._linear import (
    DType,
    Initializer,
    check_axis,
    check_input,
    make_param,
    promote_dtype,
    sharding_kw,
)
from cairn.nn._module import Module
from cairn.nn._rngs import Rngs

__all__ = ["Embed"]

default_embed_init = _init.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


class Embed(Module):
    """A lookup table ``embedding[num_embeddings, features]``.

    ``embed(ids)`` returns ``embedding[ids]`` with shape ``ids.shape + (features,)``;
    ``embed.attend(h)`` returns ``h @ embedding.T`` (logits over the vocabulary), which
    ties the input and output embeddings explicitly. Out-of-range ids raise an
    ``IndexError`` when the ids are concrete (eager call); under ``jit`` they yield NaN
    rows (``jnp.take(..., mode='fill')``).

    Args:
      num_embeddings: the number of rows (the vocabulary size).
      features: the width of each row.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      embedding_init: the table's initializer.
      promote_dtype: ``promote_dtype(arrays, dtype=...)``, how inputs and parameters are brought to
        one dtype.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      embedding_metadata: metadata for the table :class:`Param`.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> emb = nn.Embed(10, 4, rngs=nn.Rngs(0))
    >>> h = emb(jnp.array([[1, 2, 3]]))
    >>> h.shape, emb.attend(h).shape
    ((1, 3, 4), (1, 3, 10))
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        embedding_init: Initializer = default_embed_init,
        promote_dtype: Callable[..., Any] = promote_dtype,
        rngs: Rngs,
        embedding_metadata: Mapping[str, Any] = {},
    ) -> None:
        self.num_embeddings = _checks.positive_int("Embed", "num_embeddings", num_embeddings)
        self.features = _checks.positive_int("Embed", "features", features)
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.promote_dtype = promote_dtype
        self.embedding = make_param(
            embedding_init, rngs.params(), (self.num_embeddings, self.features), param_dtype,
            embedding_metadata,
        )

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        """The embedding rows of ``inputs``: shape ``inputs.shape + (features,)``.

        Args:
          inputs: integer ids in ``[0, num_embeddings)``.
          out_sharding: the output's sharding (explicit mesh axes): the lookup runs with
            the mesh axes automatic and its result is placed so; None to let JAX infer it
            (an ambiguous lookup then raises, as ``jnp.take`` does).
        """
        if not hasattr(inputs, "dtype"):
            inputs = jnp.asarray(inputs)
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise TypeError(
                f"Embed expected integer ids, got dtype {inputs.dtype} in input of shape "
                f"{tuple(inputs.shape)}"
            )
        if not isinstance(inputs, jax.core.Tracer) and inputs.size:
            arr = np.asarray(inputs)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.num_embeddings:
                raise IndexError(
                    f"Embed ids must be in [0, {self.num_embeddings}), got values in [{lo}, {hi}] "
                    f"in input of shape {tuple(inputs.shape)}"
                )
        (embedding,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)

        def take(table, ids):
            return jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)

        if out_sharding is not None:
            take = jax.sharding.auto_axes(take, out_sharding=out_sharding)
        return take(embedding, inputs)

    def attend(self, query: jax.Array, out_sharding: Any = None) -> jax.Array:
        """Logits ``query @ embedding.T`` of shape ``query.shape[:-1] + (num_embeddings,)``.

        Args:
          query: ``(..., features)`` hidden states.
          out_sharding: the logits' sharding (explicit mesh axes); None to let JAX infer it.
        """
        q = check_input(type(self).__name__ + ".attend", query)
        check_axis(type(self).__name__ + ".attend", q, -1, self.features)
        q, embedding = self.promote_dtype((q, self.embedding[...]), dtype=self.dtype)
        return jnp.einsum("...f,vf->...v", q, embedding, **sharding_kw(out_sharding))
