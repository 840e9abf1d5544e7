"""Recurrent cells (``LSTMCell``, ``GRUCell``, ``SimpleCell``) and the ``RNN`` scan.

A cell maps ``(carry, x_t) -> (new_carry, y_t)`` for one time step, with ``x_t`` of
shape ``(*batch, in_features)``. ``RNN`` scans a cell over the time axis with
``jax.lax.scan`` (one compiled step, any sequence length).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp

from cairn.nn import _checks
from cairn.nn import initializers as _init
from cairn.nn._filters import All
from cairn.nn._linear import (
    DType,
    Initializer,
    Linear,
    check_axis,
    check_input,
    map_init_value,
    promote_dtype,
)
from cairn.nn._module import Module
from cairn.nn._rng_utils import split_rngs
from cairn.nn._rngs import Rngs, RngStream
from cairn.nn._variables import Param, RngState, VariableMetadata
from cairn.nn._vmap_scan import Carry, StateAxes, scan

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


class _NoDraw:
    """Stands in for ``rngs`` when a cell builds its ``Linear`` submodules from values it
    drew itself (the ``Linear`` draws no key then)."""

    def params(self) -> None:
        return None


_NO_DRAW: Any = _NoDraw()


def _given(value: Any) -> Initializer:
    """An initializer returning ``value`` (an array or a ``VariableMetadata`` box)."""
    return lambda key, shape, dtype: value


def _block(value: Any, k: int, size: int) -> Any:
    """Block ``k`` (of width ``size``) of the last axis of an initializer's result."""
    return map_init_value(value, lambda v: v[..., k * size:(k + 1) * size])


def _cat(arrays: list) -> jax.Array:
    return arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=-1)


def _bias(layer: Linear) -> Param:
    """The bias of a gate ``Linear`` made with one (``Linear.bias`` is typed optional)."""
    return cast(Param, layer.bias)


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

    def _linear(self, n_in, n_out, kernel, bias, kernel_metadata, bias_metadata) -> Linear:
        """A ``Linear`` holding the given ``kernel`` (and ``bias``; None: no bias)."""
        return Linear(
            n_in, n_out, use_bias=bias is not None, dtype=self.dtype,
            param_dtype=self.param_dtype, kernel_init=_given(kernel),
            bias_init=_given(bias), promote_dtype=self.promote_dtype, rngs=_NO_DRAW,
            kernel_metadata=kernel_metadata, bias_metadata=bias_metadata,
        )

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
    def _draw(
        self, in_features, hidden_features, n_gates, gate_fn, activation_fn, kernel_init,
        recurrent_kernel_init, bias_init, dtype, param_dtype, carry_init, promote_dtype_fn,
        rngs,
    ) -> tuple[Any, Any, Any]:
        """Store the options and draw the fused ``(in, n H)`` kernel, ``(H, n H)``
        recurrent kernel (each ``(., H)`` gate block initialized on its own) and ``(n H,)``
        bias, in that order; the cells keep them in Flax NNX's ``Linear`` submodules."""
        self._store_options(
            in_features, hidden_features, gate_fn, activation_fn, dtype, param_dtype,
            carry_init, promote_dtype_fn,
        )
        h = self.hidden_features
        kernel = _block_orthogonal(kernel_init, n_gates)(
            rngs.params(), (self.in_features, n_gates * h), param_dtype
        )
        recurrent = _block_orthogonal(recurrent_kernel_init, n_gates)(
            rngs.params(), (h, n_gates * h), param_dtype
        )
        bias = bias_init(rngs.params(), (n_gates * h,), param_dtype)
        return kernel, recurrent, bias


class LSTMCell(_GatedCell):
    r"""Long short-term memory cell (Hochreiter & Schmidhuber 1997).

    With ``z = x W + h U + b`` split into four ``hidden_features`` blocks ``(i, f, g, o)``:
    ``i, f, o = gate_fn(.)``, ``g = activation_fn(.)``, ``c' = f * c + i * g``,
    ``h' = o * activation_fn(c')``. The carry is ``(c, h)``, the output ``h'``.
    Parameters, as in Flax NNX: one ``Linear`` per gate for the input (``ii``, ``if_``,
    ``ig``, ``io``: ``(in, H)`` kernels, no bias) and for the hidden state (``hi``, ``hf``,
    ``hg``, ``ho``: ``(H, H)`` kernels and ``(H,)`` biases); the step runs them as one
    fused matmul each.

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

    # the gate layers, set by name in __init__
    ii: Linear
    if_: Linear
    ig: Linear
    io: Linear
    hi: Linear
    hf: Linear
    hg: Linear
    ho: Linear

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
        kernel, recurrent, bias = self._draw(
            in_features, hidden_features, 4, gate_fn, activation_fn, kernel_init,
            recurrent_kernel_init, bias_init, dtype, param_dtype, carry_init, promote_dtype,
            rngs,
        )
        n, h = self.in_features, self.hidden_features
        for k, name in enumerate(("ii", "if_", "ig", "io")):
            setattr(self, name, self._linear(n, h, _block(kernel, k, h), None, kernel_metadata, {}))
        for k, name in enumerate(("hi", "hf", "hg", "ho")):
            setattr(self, name, self._linear(
                h, h, _block(recurrent, k, h), _block(bias, k, h), recurrent_kernel_metadata,
                bias_metadata,
            ))

    def _fused(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The gates' ``(in, 4H)`` kernel, ``(H, 4H)`` recurrent kernel and ``(4H,)`` bias."""
        ins = (self.ii, self.if_, self.ig, self.io)
        hid = (self.hi, self.hf, self.hg, self.ho)
        return (
            _cat([m.kernel[...] for m in ins]),
            _cat([m.kernel[...] for m in hid]),
            _cat([_bias(m)[...] for m in hid]),
        )

    def __call__(
        self, carry: tuple[jax.Array, jax.Array], inputs: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        c, h = carry
        x = self._check_step(h, inputs)
        x, h, c, w, u, b = self.promote_dtype((x, h, c, *self._fused()), dtype=self.dtype)
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
    The carry and the output are ``h'``. Parameters, as in Flax NNX: ``dense_i`` (a
    ``Linear``: ``(in, 3H)`` kernel, ``(3H,)`` bias; gates ``r, z, n``) and ``dense_h``
    (``(H, 3H)`` kernel, no bias); and ``recurrent_bias (H)``, the candidate's recurrent
    bias ``b_hn`` (Flax's GRU has none; it starts at ``bias_init``, zeros by default).

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
        kernel, recurrent, bias = self._draw(
            in_features, hidden_features, 3, gate_fn, activation_fn, kernel_init,
            recurrent_kernel_init, bias_init, dtype, param_dtype, carry_init, promote_dtype,
            rngs,
        )
        h = self.hidden_features
        recurrent_bias = bias_init(rngs.params(), (h,), param_dtype)
        self.dense_i = self._linear(self.in_features, 3 * h, kernel, bias, kernel_metadata, bias_metadata)
        self.dense_h = self._linear(h, 3 * h, recurrent, None, recurrent_kernel_metadata, {})
        self.recurrent_bias = Param(recurrent_bias, **dict(bias_metadata))

    def __call__(self, carry: jax.Array, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = carry
        x = self._check_step(h, inputs)
        x, h, w, u, b, bh = self.promote_dtype(
            (x, h, self.dense_i.kernel[...], self.dense_h.kernel[...],
             _bias(self.dense_i)[...], self.recurrent_bias[...]),
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
      residual: add the carry to the pre-activation (``activation_fn(x W + h U + b + h)``).
      kernel_metadata: metadata for the input kernel :class:`Param` (``out_sharding``...).
      recurrent_kernel_metadata: metadata for the recurrent kernel :class:`Param`.
      bias_metadata: metadata for the bias :class:`Param`.

    Parameters, as in Flax NNX: ``dense_h`` (a ``Linear``: ``(H, H)`` kernel, no bias) and
    ``dense_i`` (``(in, H)`` kernel, ``(H,)`` bias).
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
        residual: bool = False,
        promote_dtype: Callable[..., Any] = promote_dtype,
        rngs: Rngs,
        kernel_metadata: Mapping[str, Any] = {},
        recurrent_kernel_metadata: Mapping[str, Any] = {},
        bias_metadata: Mapping[str, Any] = {},
    ) -> None:
        self._store_options(
            in_features, hidden_features, _NO_GATE, activation_fn, dtype, param_dtype,
            carry_init, promote_dtype,
        )
        self.residual = bool(residual)
        n, h = self.in_features, self.hidden_features
        kernel = kernel_init(rngs.params(), (n, h), param_dtype)
        recurrent = recurrent_kernel_init(rngs.params(), (h, h), param_dtype)
        bias = bias_init(rngs.params(), (h,), param_dtype)
        self.dense_h = self._linear(h, h, recurrent, None, recurrent_kernel_metadata, {})
        self.dense_i = self._linear(n, h, kernel, bias, kernel_metadata, bias_metadata)

    def __call__(self, carry: jax.Array, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = self._check_step(carry, inputs)
        x, h, w, u, b = self.promote_dtype(
            (x, carry, self.dense_i.kernel[...], self.dense_h.kernel[...], _bias(self.dense_i)[...]),
            dtype=self.dtype,
        )
        z = x @ w + h @ u + b
        if self.residual:
            z = z + h
        new_h = self.activation_fn(z)
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
      state_axes: ``{filter: axis}`` for the cell's variables in the scan (``nn.Carry``:
        threaded through the steps, None: the same for every step, changes dropped);
        None: ``{...: nn.Carry}`` (Flax NNX's default).
      broadcast_rngs: a filter of the cell's random streams to broadcast: every step
        draws the same numbers (a recurrent dropout mask shared over time), fresh for each
        call (the stream advances once per call).
      rngs: accepted for Flax NNX compatibility; unused.

    The cell is run with :func:`~cairn.nn.scan`, so state it changes in a step (a random
    stream's counter, a batch statistic) is threaded through the steps and written back.

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
        state_axes: Mapping[Any, Any] | None = None,
        broadcast_rngs: Any = None,
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
        # items, not a dict: a static attribute must be hashable
        self.state_axes = tuple((state_axes or {...: Carry}).items())
        self.broadcast_rngs = broadcast_rngs

    def _scan_fn(self, seq_lengths: jax.Array | None) -> Callable:
        """The per-step function over ``(cell, carry, (t, x_t))``, scanned by
        :func:`~cairn.nn.scan` with the cell's variables per ``state_axes``."""

        def step(cell, carry, inp):
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

        axes = dict(self.state_axes)
        if self.broadcast_rngs is not None:
            axes = {All(RngState, self.broadcast_rngs): None, **axes}
        return scan(step, in_axes=(StateAxes(axes), Carry, 0), out_axes=(Carry, 0),
                    unroll=self.unroll)

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
        run = self._scan_fn(seq_lengths)
        if self.broadcast_rngs is None:
            carry, ys = run(self.cell, initial_carry, (jnp.arange(t), xs))
        else:  # one fresh key per call for the broadcast streams
            with split_rngs(self.cell, splits=1, only=self.broadcast_rngs, squeeze=True,
                            graph=True, graph_updates=True):
                carry, ys = run(self.cell, initial_carry, (jnp.arange(t), xs))
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
    """The LSTM cell with its gates in two ``Linear`` submodules, as Flax NNX's
    ``OptimizedLSTMCell``: ``dense_i`` (``(in, 4H)`` kernel, no bias) and ``dense_h``
    (``(H, 4H)`` kernel, ``(4H,)`` bias), gates ``(i, f, g, o)`` along the last axis. Same
    arguments, equations and numbers as :class:`LSTMCell` (for the same seed the
    parameters hold the same values); only the parameter layout differs.

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
        kernel, recurrent, bias = self._draw(
            in_features, hidden_features, 4, gate_fn, activation_fn, kernel_init,
            recurrent_kernel_init, bias_init, dtype, param_dtype, carry_init, promote_dtype,
            rngs,
        )
        n, h = self.in_features, self.hidden_features
        self.dense_i = self._linear(n, 4 * h, kernel, None, kernel_metadata, {})
        self.dense_h = self._linear(h, 4 * h, recurrent, bias, recurrent_kernel_metadata, bias_metadata)

    def _fused(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.dense_i.kernel[...], self.dense_h.kernel[...], _bias(self.dense_h)[...]
