"""``Dropout``: zero each element with probability ``rate``, scale the rest by 1/(1-rate)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from cairn.nn import _checks
from cairn.nn._module import Module
from cairn.nn._rngs import Rngs, RngStream

__all__ = ["Dropout"]


class Dropout(Module):
    """Inverted dropout (Srivastava et al. 2014).

    Training: ``y = x * m / (1 - rate)`` with ``m ~ Bernoulli(1 - rate)`` drawn from the
    ``rng_collection`` stream (``'dropout'``); ``broadcast_dims`` share one mask along those
    axes. ``deterministic=True`` (set by ``model.eval()``) returns ``x`` unchanged.
    The key comes from ``rngs`` passed to the call, else from the stream given to the
    constructor.

    Args:
      rate: the probability of dropping an element, in ``[0, 1]``.
      broadcast_dims: axes along which one mask is shared.
      deterministic: True returns the input unchanged; None must then be given at call time.
      rng_collection: the name of the stream the masks' keys come from.
      rngs: the :class:`Rngs` (or stream) the keys come from when the call gets none; None for none.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> drop = nn.Dropout(0.5, rngs=nn.Rngs(dropout=0))
    >>> y = drop(jnp.ones((1000,)))
    >>> sorted(set(y.tolist()))
    [0.0, 2.0]
    """

    def __init__(
        self,
        rate: float,
        *,
        broadcast_dims: Sequence[int] = (),
        deterministic: bool | None = False,
        rng_collection: str = "dropout",
        rngs: Rngs | RngStream | None = None,
    ) -> None:
        self.rate = _checks.rate("Dropout", "rate", rate)
        self.broadcast_dims = tuple(int(d) for d in broadcast_dims)
        self.deterministic = deterministic
        self.rng_collection = rng_collection
        self.rngs = _own_stream(rngs, rng_collection, "Dropout")

    def set_view(self, deterministic: bool | None = None) -> None:
        """The ``nn.view`` hook.

        Args:
          deterministic: if True, disables dropout masking.
        """
        if deterministic is not None:
            self.deterministic = deterministic

    def __call__(
        self,
        inputs: jax.Array,
        *,
        deterministic: bool | None = None,
        rngs: Rngs | RngStream | jax.Array | None = None,
    ) -> jax.Array:
        det = self.deterministic if deterministic is None else deterministic
        if det is None:
            raise ValueError(
                "Dropout: deterministic is None; pass it to __call__ or the constructor, or "
                "call model.train() / model.eval()"
            )
        if det or self.rate == 0.0:
            return inputs
        if self.rate == 1.0:
            return jnp.zeros_like(inputs)
        key = draw_key(rngs, self.rngs, self.rng_collection, "Dropout")
        keep = 1.0 - self.rate
        shape = list(inputs.shape)
        for d in self.broadcast_dims:
            if not -inputs.ndim <= d < inputs.ndim:
                raise ValueError(
                    f"Dropout broadcast_dims {self.broadcast_dims} out of range for input of shape "
                    f"{tuple(inputs.shape)}"
                )
            shape[d] = 1
        mask = jax.random.bernoulli(
            key, keep, tuple(shape), out_sharding=_mask_sharding(inputs, self.broadcast_dims)
        )
        mask = jnp.broadcast_to(mask, inputs.shape, out_sharding=jax.typeof(inputs).sharding)
        return lax.select(mask, inputs / jnp.asarray(keep, inputs.dtype), jnp.zeros_like(inputs))


def _mask_sharding(inputs: jax.Array, broadcast_dims: Sequence[int]):
    """The input's sharding with the broadcast axes (size 1 in the mask) unsharded, so the
    mask is laid out as the input (an explicit mesh refuses a select of mixed shardings)."""
    sharding = jax.typeof(inputs).sharding
    spec = tuple(sharding.spec) + (None,) * (inputs.ndim - len(sharding.spec))
    if not broadcast_dims or all(spec[d] is None for d in broadcast_dims):
        return sharding
    spec = tuple(None if i in {d % inputs.ndim for d in broadcast_dims} else a for i, a in enumerate(spec))
    return sharding.update(spec=jax.sharding.PartitionSpec(*spec))


def _own_stream(rngs, name: str, layer: str):
    """The stream a layer keeps: a fork of ``rngs[name]`` (or of a given stream)."""
    if rngs is None:
        return None
    if isinstance(rngs, Rngs):
        return rngs[name].fork()
    if isinstance(rngs, RngStream):
        return rngs.fork()
    raise TypeError(f"{layer}: rngs must be an Rngs, an RngStream or None, got {type(rngs).__name__}")


def draw_key(
    rngs: Rngs | RngStream | jax.Array | None, own: RngStream | None, name: str, layer: str
) -> jax.Array:
    """A fresh key from the call's ``rngs`` (Rngs, stream or key) or the layer's own stream."""
    if rngs is not None:
        if isinstance(rngs, Rngs):
            return rngs[name]()
        if isinstance(rngs, RngStream):
            return rngs()
        return rngs  # a raw key
    if own is None:
        raise ValueError(
            f"`deterministic` is False, but no `rngs` argument was provided to {layer}: it needs "
            f"a random key; pass rngs=nn.Rngs({name}=...) to the constructor or rngs=... to the call"
        )
    return own()
