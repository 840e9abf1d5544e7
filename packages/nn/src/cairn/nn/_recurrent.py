"""Recurrent cells (``LSTMCell``, ``GRUCell``, ``SimpleCell``) and the ``RNN`` scan.

A cell maps ``(carry, x_t) -> (new_carry, y_t)`` for one time step, with ``x_t`` of
shape ``(*batch, in_features)``. ``RNN`` scans a cell over the time axis with
``jax.lax.scan`` (one compiled step, any sequence length).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from cairn.nn import _checks
from cairn.nn import initializers as _init
from cairn.nn._linear import (
    DType,
    Initializer,
    check_axis,
    check_input,
    map_init_value,
    promote_dtype,
)
from cairn.nn._module import Module
from cairn.nn._rngs import Rngs, RngStream
from cairn.nn._variables import Param, VariableMetadata

__all__ = ["GRUCell", "LSTMCell", "RNN", "RNNCellBase", "SimpleCell"]

_default_kernel_init = _init.lecun_normal()
_NO_GATE = object()  # SimpleCell has no gate_fn
_default_recurrent_init = _init.orthogonal()


def _block_orthogonal(init: Initializer, n_blocks: int) -> Initializer:
    """Applies ``init`` to each ``(H, H)`` gate block of an ``(H, n * H)`` kernel."""

    def f(key, shape, dtype):
        h = shape[0]
        keys = jax.random.split(key, n_blocks)
        blocks = [init(k, (h, shape[1] // n_blocks), dtype) for k in keys]
        values = [b.value if isinstance(b, VariableMetadata) else b for b in blocks]
        return map_init_value(blocks[0], lambda _: jnp.concatenate(values, axis=1))

    return f


class RNNCellBase(Module):
    """Base class: subclasses define ``__call__(carry, x)``, ``initialize_carry`` and
    ``num_feature_axes``."""

    in_features: int
    hidden_features: int

    if TYPE_CHECKING:  # what every cell defines (declared for the type checker only)

        def __call__(self, carry: Any, inputs: jax.Array) -> tuple[Any, jax.Array]: ...

        def initialize_carry(
            self,
            input_shape: Sequence[int],
            rngs: Rngs | RngStream | None = None,
            carry_init: Initializer | None = None,
        ) -> Any: ...

    @property
    def num_feature_axes(self) -> int:
        return 1

    def _zero_carry(self, input_shape, n: int, rngs, carry_init):
        batch = tuple(input_shape[:-1])
        init = carry_init if carry_init is not None else self.carry_init
        key = None
        if rngs is not None:
            key = rngs.carry() if isinstance(rngs, Rngs) else rngs()
        keys: list[Any] = [None] * n if key is None else list(jax.random.split(key, n))
        return tuple(
            init(k, batch + (self.hidden_features,), self.param_dtype) for k in keys
        )

    def _store_options(
        self, in_features, hidden_features, gate_fn, activation_fn, dtype, param_dtype,
        carry_init, promote_dtype_fn,
    ) -> None:
        """Store the options the cells share, in the order they all use (``gate_fn``
        only for gated cells: ``_NO_GATE`` leaves it out)."""
        name = type(self).__name__
        self.in_features = _checks.positive_int(name, "in_features", in_features)
        self.hidden_features = _checks.positive_int(name, "hidden_features", hidden_features)
        if gate_fn is not _NO_GATE:
            self.gate_fn = gate_fn
        self.activation_fn = activation_fn
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.carry_init = carry_init if carry_init is not None else _init.zeros
        self.promote_dtype = promote_dtype_fn

    def _check_step(self, carry_h: jax.Array, x: jax.Array):
        x = check_input(self, x)
        check_axis(self, x, -1, self.in_features)
        if carry_h.shape[-1] != self.hidden_features:
            raise ValueError(
                f"{type(self).__name__} expected carry last axis {self.hidden_features}, got "
                f"carry of shape {tuple(carry_h.shape)}"
            )
        return x


class _GatedCell(RNNCellBase):
    def _setup(
        self, in_features, hidden_features, n_gates, gate_fn, activation_fn, kernel_init,
        recurrent_kernel_init, bias_init, dtype, param_dtype, carry_init, promote_dtype_fn,
        rngs, kernel_metadata, recurrent_kernel_metadata, bias_metadata,
    ):
        self._store_options(
            in_features, hidden_features, gate_fn, activation_fn, dtype, param_dtype,
            carry_init, promote_dtype_fn,
        )
        h = self.hidden_features
        kinit = _block_orthogonal(kernel_init, n_gates)
        self.kernel = Param(
            kinit(rngs.params(), (self.in_features, n_gates * h), param_dtype),
            **dict(kernel_metadata),
        )
        self.recurrent_kernel = Param(
            _block_orthogonal(recurrent_kernel_init, n_gates)(
                rngs.params(), (h, n_gates * h), param_dtype
            ),
            **dict(recurrent_kernel_metadata),
        )
        self.bias = Param(bias_init(rngs.params(), (n_gates * h,), param_dtype), **dict(bias_metadata))


class LSTMCell(_GatedCell):
    r"""Long short-term memory cell (Hochreiter & Schmidhuber 1997).

    With ``z = x W + h U + b`` split into four ``hidden_features`` blocks ``(i, f, g, o)``:
    ``i, f, o = gate_fn(.)``, ``g = activation_fn(.)``, ``c' = f * c + i * g``,
    ``h' = o * activation_fn(c')``. The carry is ``(c, h)``, the output ``h'``.
    Parameters are fused: ``kernel (in, 4H)``, ``recurrent_kernel (H, 4H)``, ``bias (4H)``.

    Args:
      in_features: the input's feature size.
      hidden_features: the size of the hidden state.
      gate_fn: the gates' activation.
      activation_fn: the candidate/output activation.
      kernel_init: the kernel's initializer ``init(key, shape, dtype)``.
      recurrent_kernel_init: the recurrent kernel's initializer.
      bias_init: the bias's initializer.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      carry_init: the initial carry's initializer (None: zeros).
      promote_dtype: ``promote_dtype(arrays, dtype=...)``, how inputs and parameters are brought to
        one dtype.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      kernel_metadata: metadata for the kernel :class:`Param` (``sharding_names``...).
      recurrent_kernel_metadata: metadata for the recurrent kernel :class:`Param`.
      bias_metadata: metadata for the bias :class:`Param`.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> cell = nn.LSTMCell(3, 5, rngs=nn.Rngs(0))
    >>> carry = cell.initialize_carry((2, 3))
    >>> (c, h), y = cell(carry, jnp.ones((2, 3)))
    >>> y.shape
    (2, 5)
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        gate_fn: Callable[..., Any] = jax.nn.sigmoid,
        activation_fn: Callable[..., Any] = jnp.tanh,
        kernel_init: Initializer = _default_kernel_init,
        recurrent_kernel_init: Initializer = _default_recurrent_init,
        bias_init: Initializer = _init.zeros,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        carry_init: Initializer | None = None,
        promote_dtype: Callable[..., Any] = promote_dtype,
        rngs: Rngs,
        kernel_metadata: Mapping[str, Any] = {},
        recurrent_kernel_metadata: Mapping[str, Any] = {},
        bias_metadata: Mapping[str, Any] = {},
    ) -> None:
        self._setup(
            in_features, hidden_features, 4, gate_fn, activation_fn, kernel_init,
            recurrent_kernel_init, bias_init, dtype, param_dtype, carry_init, promote_dtype,
            rngs, kernel_metadata, recurrent_kernel_metadata, bias_metadata,
        )

    def __call__(
        self, carry: tuple[jax.Array, jax.Array], inputs: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        c, h = carry
        x = self._check_step(h, inputs)
        x, h, c, w, u, b = self.promote_dtype(
            (x, h, c, self.kernel[...], self.recurrent_kernel[...], self.bias[...]),
            dtype=self.dtype,
        )
        z = x @ w + h @ u + b
        i, f, g, o = jnp.split(z, 4, axis=-1)
        i, f, o = self.gate_fn(i), self.gate_fn(f), self.gate_fn(o)
        g = self.activation_fn(g)
        new_c = f * c + i * g
        new_h = o * self.activation_fn(new_c)
        return (new_c, new_h), new_h

    def initialize_carry(
        self,
        input_shape: Sequence[int],
        rngs: Rngs | RngStream | None = None,
        carry_init: Initializer | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Zeros (or ``carry_init``) ``(c, h)``, each ``(*batch, hidden_features)``.

        Args:
          input_shape: the input's shape ``(*batch, in_features)``.
          rngs: random streams for a random ``carry_init``; None for none.
          carry_init: the carry's initializer; None gives zeros.
        """
        return self._zero_carry(input_shape, 2, rngs, carry_init)


class GRUCell(_GatedCell):
    r"""Gated recurrent unit (Cho et al. 2014).

    ``r = gate_fn(x W_r + b_r + h U_r)``, ``z = gate_fn(x W_z + b_z + h U_z)``,
    ``n = activation_fn(x W_n + b_n + r * (h U_n + b_hn))``, ``h' = (1 - z) * n + z * h``.
    The carry and the output are ``h'``. Fused parameters: ``kernel (in, 3H)``,
    ``recurrent_kernel (H, 3H)``, ``bias (3H)`` for the input side, ``recurrent_bias (H)``
    for the candidate's recurrent term.

    Args:
      in_features: the input's feature size.
      hidden_features: the size of the hidden state.
      gate_fn: the gates' activation.
      activation_fn: the candidate/output activation.
      kernel_init: the kernel's initializer ``init(key, shape, dtype)``.
      recurrent_kernel_init: the recurrent kernel's initializer.
      bias_init: the bias's initializer.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      carry_init: the initial carry's initializer (None: zeros).
      promote_dtype: ``promote_dtype(arrays, dtype=...)``, how inputs and parameters are brought to
        one dtype.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      kernel_metadata: metadata for the kernel :class:`Param` (``sharding_names``...).
      recurrent_kernel_metadata: metadata for the recurrent kernel :class:`Param`.
      bias_metadata: metadata for the bias :class:`Param`.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> cell = nn.GRUCell(3, 5, rngs=nn.Rngs(0))
    >>> h, y = cell(cell.initialize_carry((2, 3)), jnp.ones((2, 3)))
    >>> y.shape
    (2, 5)
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        gate_fn: Callable[..., Any] = jax.nn.sigmoid,
        activation_fn: Callable[..., Any] = jnp.tanh,
        kernel_init: Initializer = _default_kernel_init,
        recurrent_kernel_init: Initializer = _default_recurrent_init,
        bias_init: Initializer = _init.zeros,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        carry_init: Initializer | None = None,
        promote_dtype: Callable[..., Any] = promote_dtype,
        rngs: Rngs,
        kernel_metadata: Mapping[str, Any] = {},
        recurrent_kernel_metadata: Mapping[str, Any] = {},
        bias_metadata: Mapping[str, Any] = {},
    ) -> None:
        self._setup(
            in_features, hidden_features, 3, gate_fn, activation_fn, kernel_init,
            recurrent_kernel_init, bias_init, dtype, param_dtype, carry_init, promote_dtype,
            rngs, kernel_metadata, recurrent_kernel_metadata, bias_metadata,
        )
        self.recurrent_bias = Param(
            bias_init(rngs.params(), (self.hidden_features,), param_dtype), **dict(bias_metadata)
        )

    def __call__(self, carry: jax.Array, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = carry
        x = self._check_step(h, inputs)
        x, h, w, u, b, bh = self.promote_dtype(
            (x, h, self.kernel[...], self.recurrent_kernel[...], self.bias[...],
             self.recurrent_bias[...]),
            dtype=self.dtype,
        )
        xi = x @ w + b
        hu = h @ u
        xr, xz, xn = jnp.split(xi, 3, axis=-1)
        hr, hz, hn = jnp.split(hu, 3, axis=-1)
        r = self.gate_fn(xr + hr)
        z = self.gate_fn(xz + hz)
        n = self.activation_fn(xn + r * (hn + bh))
        new_h = (1.0 - z) * n + z * h
        return new_h, new_h

    def initialize_carry(
        self,
        input_shape: Sequence[int],
        rngs: Rngs | RngStream | None = None,
        carry_init: Initializer | None = None,
    ) -> jax.Array:
        """Zeros (or ``carry_init``) ``h`` of shape ``(*batch, hidden_features)``.

        Args:
          input_shape: the input's shape ``(*batch, in_features)``.
          rngs: random streams for a random ``carry_init``; None for none.
          carry_init: the carry's initializer; None gives zeros.
        """
        return self._zero_carry(input_shape, 1, rngs, carry_init)[0]


class SimpleCell(RNNCellBase):
    """Elman cell: ``h' = activation_fn(x W + h U + b)``; carry and output are ``h'``.

    Args:
      in_features: the input's feature size.
      hidden_features: the size of the hidden state.
      activation_fn: the candidate/output activation.
      kernel_init: the kernel's initializer ``init(key, shape, dtype)``.
      recurrent_kernel_init: the recurrent kernel's initializer.
      bias_init: the bias's initializer.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      carry_init: the initial carry's initializer (None: zeros).
      promote_dtype: ``promote_dtype(arrays, dtype=...)``, how inputs and parameters are brought to
        one dtype.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        activation_fn: Callable[..., Any] = jnp.tanh,
        kernel_init: Initializer = _default_kernel_init,
        recurrent_kernel_init: Initializer = _default_recurrent_init,
        bias_init: Initializer = _init.zeros,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        carry_init: Initializer | None = None,
        promote_dtype: Callable[..., Any] = promote_dtype,
        rngs: Rngs,
    ) -> None:
        self._store_options(
            in_features, hidden_features, _NO_GATE, activation_fn, dtype, param_dtype,
            carry_init, promote_dtype,
        )
        h = self.hidden_features
        self.kernel = Param(kernel_init(rngs.params(), (self.in_features, h), param_dtype))
        self.recurrent_kernel = Param(recurrent_kernel_init(rngs.params(), (h, h), param_dtype))
        self.bias = Param(bias_init(rngs.params(), (h,), param_dtype))

    def __call__(self, carry: jax.Array, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = self._check_step(carry, inputs)
        x, h, w, u, b = self.promote_dtype(
            (x, carry, self.kernel[...], self.recurrent_kernel[...], self.bias[...]),
            dtype=self.dtype,
        )
        new_h = self.activation_fn(x @ w + h @ u + b)
        return new_h, new_h

    def initialize_carry(
        self,
        input_shape: Sequence[int],
        rngs: Rngs | RngStream | None = None,
        carry_init: Initializer | None = None,
    ) -> jax.Array:
        """The initial carry for inputs of ``input_shape``.

        Args:
          input_shape: the input's shape ``(*batch, in_features)``.
          rngs: random streams for a random ``carry_init``; None for none.
          carry_init: the carry's initializer; None gives zeros.
        """
        return self._zero_carry(input_shape, 1, rngs, carry_init)[0]


def _reverse_within_lengths(x: jax.Array, lengths: jax.Array, time_axis: int) -> jax.Array:
    """Reverses each example's first ``lengths[b]`` steps; padding stays at the end.

    ``x`` is batch-major ``(*batch, T, ...)`` with ``time_axis = len(batch)``.
    """
    t = x.shape[time_axis]
    steps = jnp.arange(t)
    lengths = lengths[..., None]  # (*batch, 1)
    idx = jnp.where(steps < lengths, lengths - 1 - steps, steps)  # (*batch, T)
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - time_axis - 1))
    return jnp.take_along_axis(x, idx, axis=time_axis)


class RNN(Module):
    """Runs ``cell`` over the time axis with ``jax.lax.scan``.

    Input ``(*batch, time, features)`` (or ``(time, *batch, features)`` with
    ``time_major=True``); returns the outputs ``(*batch, time, out)``, or ``(carry,
    outputs)`` with ``return_carry=True``. ``seq_lengths`` (``(*batch,)`` ints) stops each
    example after its length: the carry is frozen and later outputs are zero.
    ``reverse=True`` processes each sequence backwards (within its length); outputs come
    back in processing order unless ``keep_order=True``.

    Args:
      cell: the recurrent cell (``LSTMCell``, ``GRUCell``...).
      time_major: the input is ``(time, *batch, features)``.
      return_carry: return ``(carry, outputs)`` instead of the outputs.
      reverse: process each sequence backwards (within its length).
      keep_order: with ``reverse``, return the outputs in input order.
      unroll: ``jax.lax.scan``'s unroll.
      rngs: accepted for Flax NNX compatibility; unused.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> rnn = nn.RNN(nn.GRUCell(3, 4, rngs=nn.Rngs(0)))
    >>> rnn(jnp.ones((2, 7, 3))).shape
    (2, 7, 4)
    """

    def __init__(
        self,
        cell: RNNCellBase,
        *,
        time_major: bool = False,
        return_carry: bool = False,
        reverse: bool = False,
        keep_order: bool = False,
        unroll: int = 1,
        rngs: Rngs | None = None,
    ) -> None:
        del rngs
        if not isinstance(cell, Module):
            raise TypeError(f"RNN: cell must be an RNN cell module, got {type(cell).__name__}")
        self.cell = cell
        self.time_major = bool(time_major)
        self.return_carry = bool(return_carry)
        self.reverse = bool(reverse)
        self.keep_order = bool(keep_order)
        self.unroll = _checks.positive_int("RNN", "unroll", unroll)

    def __call__(
        self,
        inputs: jax.Array,
        *,
        initial_carry: Any = None,
        seq_lengths: jax.Array | None = None,
        return_carry: bool | None = None,
        time_major: bool | None = None,
        reverse: bool | None = None,
        keep_order: bool | None = None,
        rngs: Rngs | None = None,
    ) -> Any:
        return_carry = self.return_carry if return_carry is None else return_carry
        time_major = self.time_major if time_major is None else time_major
        reverse = self.reverse if reverse is None else reverse
        keep_order = self.keep_order if keep_order is None else keep_order
        x = check_input(self, inputs, min_ndim=2)
        time_axis = 0 if time_major else x.ndim - 2
        if time_major:
            x = jnp.moveaxis(x, 0, -2)  # batch-major from here on
        batch = x.shape[:-2]
        t = x.shape[-2]
        if initial_carry is None:
            initial_carry = self.cell.initialize_carry(batch + (x.shape[-1],), rngs=rngs)
        if seq_lengths is not None:
            seq_lengths = jnp.asarray(seq_lengths)
            if tuple(seq_lengths.shape) != tuple(batch):
                raise ValueError(
                    f"RNN: seq_lengths of shape {tuple(seq_lengths.shape)} must have the batch "
                    f"shape {tuple(batch)} of inputs {tuple(inputs.shape)} (time axis {time_axis})"
                )
        nb = len(batch)
        if reverse:
            if seq_lengths is None:
                x = jnp.flip(x, axis=nb)
            else:
                x = _reverse_within_lengths(x, seq_lengths, nb)
        xs = jnp.moveaxis(x, nb, 0)  # (T, *batch, F)
        cell = self.cell

        def step(carry, inp):
            tt, xt = inp
            new_carry, y = cell(carry, xt)
            new_carry = jax.tree.map(lambda n, o: n.astype(o.dtype), new_carry, carry)
            if seq_lengths is not None:
                live = tt < seq_lengths  # (*batch,)

                def keep(new, old):
                    m = live.reshape(live.shape + (1,) * (new.ndim - live.ndim))
                    return jnp.where(m, new, old.astype(new.dtype))

                new_carry = jax.tree.map(keep, new_carry, carry)
                y = jnp.where(live.reshape(live.shape + (1,) * (y.ndim - live.ndim)), y, 0)
            return new_carry, y

        carry, ys = lax.scan(step, initial_carry, (jnp.arange(t), xs), unroll=self.unroll)
        ys = jnp.moveaxis(ys, 0, nb)  # (*batch, T, out)
        if reverse and keep_order:
            if seq_lengths is None:
                ys = jnp.flip(ys, axis=nb)
            else:
                ys = _reverse_within_lengths(ys, seq_lengths, nb)
        if time_major:
            ys = jnp.moveaxis(ys, -2, 0)
        return (carry, ys) if return_carry else ys


class OptimizedLSTMCell(LSTMCell):
    """Flax NNX's name for the LSTM cell whose four gates are computed with fused
    matmuls. :class:`LSTMCell` here already is that cell (its parameters are the fused
    ``kernel (in, 4H)``, ``recurrent_kernel (H, 4H)``, ``bias (4H)``), so this is the
    same cell under Flax's second name; same arguments, same numbers.

    Args:
      in_features: the input's feature size.
      hidden_features: the size of the hidden state.
      gate_fn: the gates' activation.
      activation_fn: the candidate/output activation.
      kernel_init: the kernel's initializer ``init(key, shape, dtype)``.
      recurrent_kernel_init: the recurrent kernel's initializer.
      bias_init: the bias's initializer.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      carry_init: the initial carry's initializer (None: zeros).
      promote_dtype: ``promote_dtype(arrays, dtype=...)``, how inputs and parameters are brought to
        one dtype.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      kernel_metadata: metadata for the kernel :class:`Param` (``sharding_names``...).
      recurrent_kernel_metadata: metadata for the recurrent kernel :class:`Param`.
      bias_metadata: metadata for the bias :class:`Param`.
    """
