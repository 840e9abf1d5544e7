"""Named random-number streams.

Each stream holds a key (:class:`RngKey`) and a counter (:class:`RngCount`); calling the
stream returns ``fold_in(key, count)`` and increments the counter. Both are Variables,
so the counter is state: it advances inside ``nn.jit`` / ``nn.scan`` / ... and the new
value flows back to the caller's object, and the same program with the same seeds gives
the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.nn._filters import to_predicate
from cairn.nn._module import Module
from cairn.nn._variables import RngCount, RngKey


def _as_key(seed: Any):
    if isinstance(seed, RngStream):
        return seed()
    if isinstance(seed, int | np.integer):
        return jax.random.key(int(seed))
    arr = seed
    if hasattr(arr, "dtype") and jax.dtypes.issubdtype(arr.dtype, jax.dtypes.prng_key):
        return arr
    try:
        arr = jnp.asarray(arr)
    except TypeError:
        arr = None
    if arr is None:
        pass
    elif arr.dtype == jnp.uint32 and arr.shape[-1:] == (2,):
        return jax.random.wrap_key_data(arr)
    elif jnp.issubdtype(arr.dtype, jnp.integer) and arr.ndim == 0:
        return jax.random.key(arr)
    raise TypeError(
        f"an Rngs stream needs an int seed or a PRNG key, got {type(seed).__name__} "
        f"with shape {getattr(seed, 'shape', None)}"
    )


def _fold_in(key, count):
    if key.ndim == 0:
        return jax.random.fold_in(key, count)
    return jax.vmap(_fold_in)(key, count)


class RngStream(Module):
    """One named stream: ``stream()`` returns a fresh key and advances the counter.

    Args:
      key: an int seed or a ``jax.random`` key (typed or raw).
      tag: the stream's name, kept as the ``tag`` of its variables.
    """

    def __init__(self, key: Any, *, tag: str) -> None:
        key = _as_key(key)
        self.tag = tag
        self.key = RngKey(key, tag=tag)
        self.count = RngCount(jnp.zeros(key.shape, jnp.uint32), tag=tag)

    def __call__(self) -> jax.Array:
        key = self.key.raw_value
        count = self.count.raw_value
        self.count.raw_value = count + jnp.uint32(1)
        return _fold_in(key, count)

    def fork(self, *, split: int | tuple[int, ...] | None = None) -> RngStream:
        """An independent stream derived from this one (advances this one's counter).
        With ``split=n`` the new stream holds ``n`` keys (shape ``(n,)``), for use as a
        batched argument of ``nn.vmap`` / ``nn.scan``.

        Args:
          split: None for one key; an int or shape for that many keys.
        """
        key = self()
        if split is not None:
            if key.ndim != 0:
                raise ValueError(f"cannot split the already split stream {self.tag!r}")
            key = jax.random.split(key, split)
        return RngStream(key, tag=self.tag)


    def split(self, k: int | tuple[int, ...]) -> RngStream:
        """A new stream holding ``k`` keys split from this stream's next key.

        Args:
          k: the number (or shape) of keys.
        """
        return RngStream(jax.random.split(self(), k), tag=self.tag)

    def broadcast(self, k: int | tuple[int, ...]) -> RngStream:
        """A new stream holding this stream's next key repeated to shape ``k``.

        Args:
          k: the shape (or int) the key is repeated to.
        """
        key = self()
        shape = (k,) if isinstance(k, int) else tuple(k)
        return RngStream(jnp.broadcast_to(key, shape + key.shape), tag=self.tag)


class Rngs(Module):
    """A set of named random streams.

    ``Rngs(0)`` makes a ``default`` stream; ``Rngs(0, dropout=1)`` or
    ``Rngs(params=0, dropout=1)`` name them. ``rngs.params()`` / ``rngs["params"]()``
    draw a key from a stream; a stream that does not exist falls back to ``default``
    when there is one, and otherwise raises ``AttributeError`` naming the stream.

    Args:
      default: the seed (int) or key of the ``default`` stream; None for no default stream.
      streams: more streams, ``name=seed`` (or an :class:`RngStream`).

    >>> import jax
    >>> from cairn import nn
    >>> rngs = nn.Rngs(0, dropout=1)
    >>> k1, k2 = rngs.params(), rngs.params()   # 'params' falls back to 'default'
    >>> bool((jax.random.key_data(k1) != jax.random.key_data(k2)).any())
    True
    >>> int(rngs.default.count.value)
    2

    Raises:
      ValueError: a stream name that is not an identifier.
    """

    def __init__(self, default: Any = None, /, **streams: Any) -> None:
        if default is not None:
            streams = {"default": default, **streams}
        for name, seed in streams.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"Rngs stream names must be identifiers, got {name!r}")
            setattr(self, name, seed if isinstance(seed, RngStream) else RngStream(seed, tag=name))

    def streams(self) -> dict[str, RngStream]:
        return {k: v for k, v in self._graph_items() if isinstance(v, RngStream)}

    def __getattr__(self, name: str) -> RngStream:
        if name.startswith("_"):
            raise AttributeError(name)
        d = self.__dict__
        if "default" in d:
            return d["default"]
        names = [k for k, v in d.items() if isinstance(v, RngStream)]
        raise AttributeError(
            f"No RngStream named {name!r} and no 'default' stream in this Rngs (streams: {names}); "
            f"create it with nn.Rngs(..., {name}=seed)"
        )

    def __getitem__(self, name: str) -> RngStream:
        v = self.__dict__.get(name)
        if isinstance(v, RngStream):
            return v
        return getattr(self, name)

    def __contains__(self, name: str) -> bool:
        return isinstance(self.__dict__.get(name), RngStream)

    def __call__(self) -> jax.Array:
        return self.default()

    def fork(self, *, split: int | tuple[int, ...] | None = None) -> Rngs:
        """New independent Rngs with the same stream names (see :meth:`RngStream.fork`).

        Args:
          split: None for one key per stream; an int or shape for that many keys per stream.
        """
        out = Rngs()
        for name, stream in self.streams().items():
            setattr(out, name, stream.fork(split=split))
        return out

    def split(self, n: Any) -> Rngs:
        """New Rngs whose streams hold ``n`` keys each (an int or a shape), to pass as a
        batched (``in_axes=0``) argument of ``nn.vmap`` / ``nn.scan``. ``n`` may also be
        ``{filter: shape or None}`` (a stream name, ``...``, a Variable type...; first
        match wins): a stream it matches with None, or matches not at all, is forked
        with one key.

        Args:
          n: an int, a shape, or ``{filter: shape or None}``.
        """
        return self._per_stream(n, RngStream.split, "split")

    def broadcast(self, k: Any) -> Rngs:
        """New Rngs whose streams hold their next key repeated to shape ``k`` (an int, a
        shape, or ``{filter: shape or None}`` as in :meth:`split`; None, or a stream no
        filter matches: forked unbroadcast), see :meth:`RngStream.broadcast`.

        Args:
          k: an int, a shape, or ``{filter: shape or None}``.
        """
        return self._per_stream(k, RngStream.broadcast, "broadcast")

    def _per_stream(self, k: Any, op: Callable[[RngStream, Any], RngStream], fn: str) -> Rngs:
        if not isinstance(k, Mapping):
            k = {...: k}
        rules = [(to_predicate(f), shape) for f, shape in k.items()]
        out = Rngs()
        for name, stream in self.streams().items():
            # a stream is matched as its state is: by name (its path) or tag
            shape = next((sh for pred, sh in rules if pred((name,), stream)), None)  # type: ignore[arg-type]
            if shape is not None and not isinstance(shape, int | tuple):
                raise TypeError(
                    f"Rngs.{fn}: the shape for stream {name!r} must be an int, a tuple or "
                    f"None, got {type(shape).__name__}"
                )
            setattr(out, name, stream.fork() if shape is None else op(stream, shape))
        return out


# --- jax.random-style samplers: ``rngs.normal((2, 3))`` draws a key, then samples ---
_SAMPLERS = (
    "ball", "bernoulli", "beta", "binomial", "bits", "categorical", "cauchy", "chisquare",
    "choice", "dirichlet", "double_sided_maxwell", "exponential", "f", "gamma",
    "generalized_normal", "geometric", "gumbel", "laplace", "logistic", "loggamma",
    "lognormal", "maxwell", "multinomial", "multivariate_normal", "normal", "orthogonal",
    "pareto", "permutation", "poisson", "rademacher", "randint", "rayleigh", "t",
    "triangular", "truncated_normal", "uniform", "wald", "weibull_min",
)


def _sampler(name: str):
    fn = getattr(jax.random, name)

    def method(self, *args, stream: str | None = None, **kwargs):
        key = self() if stream is None else self[stream]()
        return fn(key, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = (
        f"``jax.random.{name}(key, *args, **kwargs)`` with a fresh key from this stream "
        f"(on :class:`Rngs`: the ``default`` stream, or ``stream=`` by name).\n\n"
        f"Args:\n"
        f"  args: ``jax.random.{name}``'s positional arguments after the key (shape, bounds...).\n"
        f"  stream: on :class:`Rngs`, the name of the stream that gives the key; None uses\n"
        f"    ``default``.\n"
        f"  kwargs: ``jax.random.{name}``'s keyword arguments (``shape``, ``dtype``...).\n"
    )
    return method


for _name in _SAMPLERS:
    if hasattr(jax.random, _name):
        setattr(Rngs, _name, _sampler(_name))
        setattr(RngStream, _name, _sampler(_name))


# --- initializers: ``rngs.lecun_normal()((2, 3))`` builds the initializer, then draws a key ---
# (not ``normal`` / ``uniform`` / ``orthogonal`` / ``truncated_normal``, which are the
# jax.random samplers above, nor the key-free ``zeros`` / ``ones`` / ``constant``)
_INITIALIZERS = (
    "delta_orthogonal", "glorot_normal", "glorot_uniform", "he_normal", "he_uniform",
    "kaiming_normal", "kaiming_uniform", "lecun_normal", "lecun_uniform", "variance_scaling",
    "xavier_normal", "xavier_uniform",
)


def _initializer(name: str):
    # jax.nn.initializers' own (Flax NNX binds these, so draws match Flax's bit for bit)
    make = getattr(jax.nn.initializers, name)

    def method(self, *args, **kwargs):
        init = make(*args, **kwargs)

        def keyless(*init_args, **init_kwargs):
            return init(self(), *init_args, **init_kwargs)

        keyless.__name__ = f"{name}_keyless"
        return keyless

    method.__name__ = method.__qualname__ = name
    method.__doc__ = (
        f"``jax.nn.initializers.{name}(*args, **kwargs)`` bound to this stream: the result takes\n"
        f"``(shape, dtype=...)`` and draws a fresh key each call (on :class:`Rngs`, from the\n"
        f"``default`` stream).\n\n"
        f"Args:\n"
        f"  args: ``initializers.{name}``'s positional arguments (scale, mode...).\n"
        f"  kwargs: ``initializers.{name}``'s keyword arguments.\n"
    )
    return method


for _name in _INITIALIZERS:
    setattr(Rngs, _name, _initializer(_name))
    setattr(RngStream, _name, _initializer(_name))
