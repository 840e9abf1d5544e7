"""Convolutions: ``Conv`` (1-3D and beyond) and ``ConvTranspose``, channels-last."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cairn.nn import _checks
from cairn.nn._linear import (
    DType,
    Initializer,
    check_axis,
    check_input,
    default_bias_init,
    default_kernel_init,
    dense_value,
    make_kernel_and_bias,
    promote_dtype,
    reshard_to,
    sharding_kw,
    store_layer_options,
)
from cairn.nn._module import Module
from cairn.nn._rngs import Rngs
from cairn.nn._variables import Param

__all__ = ["Conv", "ConvTranspose", "canonicalize_padding"]

PaddingLike = str | int | Sequence[int | tuple[int, int]]
_STR_PADS = ("SAME", "VALID", "CIRCULAR", "CAUSAL", "REFLECT")


def canonicalize_padding(
    padding: PaddingLike, rank: int, layer: str = "Conv"
) -> str | tuple[tuple[int, int], ...]:
    """Returns an upper-case padding mode or a tuple of ``rank`` ``(low, high)`` pairs.

    Accepts ``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, ``'CAUSAL'``, ``'REFLECT'``, an int
    (same pad both sides on every axis), a sequence of ints (per axis, both sides) or a
    sequence of pairs.
    """
    if isinstance(padding, str):
        p = padding.upper()
        if p not in _STR_PADS:
            raise ValueError(f"{layer}: padding must be one of {_STR_PADS} or ints, got {padding!r}")
        return p
    if isinstance(padding, bool) or not isinstance(padding, Sequence | int | np.integer):
        raise TypeError(f"{layer}: cannot interpret padding {padding!r}")
    if isinstance(padding, int | np.integer):
        return ((int(padding), int(padding)),) * rank
    try:
        items: list[Any] = list(padding)
    except TypeError as e:
        raise TypeError(f"{layer}: cannot interpret padding {padding!r}") from e
    if len(items) == 1 and rank > 1:
        items = items * rank
    if len(items) != rank:
        raise ValueError(
            f"{layer}: padding {padding!r} needs one entry per spatial dim ({rank})"
        )
    out = []
    for it in items:
        if isinstance(it, int | np.integer):
            out.append((int(it), int(it)))
        else:
            lo, hi = it
            out.append((int(lo), int(hi)))
    return tuple(out)


def _broadcast(value, rank: int, name: str, layer: str) -> tuple[int, ...]:
    """``None`` (all ones), an int or ``rank`` ints, each a positive int."""
    if value is None:
        return (1,) * rank
    return _checks.positive_ints(layer, name, value, rank)


def _features(layer: str, in_features, out_features, kernel_size) -> tuple:
    """Checked ``(in_features, out_features, kernel_size tuple)``."""
    return (
        _checks.positive_int(layer, "in_features", in_features),
        _checks.positive_int(layer, "out_features", out_features),
        _checks.positive_ints(layer, "kernel_size", kernel_size),
    )


def _dimension_numbers(ndim: int) -> lax.ConvDimensionNumbers:
    # channels-last: lhs (N, *spatial, C), rhs (*spatial, I, O), out (N, *spatial, C)
    sp = tuple(range(1, ndim - 1))
    lhs = (0, ndim - 1) + sp
    rhs = (ndim - 1, ndim - 2) + tuple(range(ndim - 2))
    return lax.ConvDimensionNumbers(lhs, rhs, lhs)


class _ConvBase(Module):
    _layer: str  # the name error messages use
    kernel_size: tuple[int, ...]
    # set by store_layer_options / make_kernel_and_bias
    kernel: Param
    bias: Param | None
    dtype: DType | None
    param_dtype: DType
    precision: Any
    promote_dtype: Callable[..., Any]
    conv_general_dilated: Callable[..., jax.Array]
    preferred_element_type: DType | None

    def _flatten_batch(self, x: jax.Array, rank: int):
        name = type(self).__name__
        if x.ndim < rank + 1:
            raise ValueError(
                f"{name} with kernel_size {self.kernel_size} expected an input with at least "
                f"{rank + 1} axes (*batch, *spatial[{rank}], features), got shape {tuple(x.shape)}"
            )
        batch = x.shape[: x.ndim - rank - 1]
        x = x.reshape((int(np.prod(batch)) if batch else 1,) + x.shape[x.ndim - rank - 1 :])
        return x, batch

    @staticmethod
    def _unflatten_batch(y: jax.Array, batch: tuple[int, ...]):
        return y.reshape(batch + y.shape[1:])

    def _store_mask(self, mask, kshape) -> None:
        """Keep ``mask`` (None or the kernel's exact shape) as a static constant."""
        if mask is not None and tuple(np.shape(mask)) != kshape:
            raise ValueError(
                f"{self._layer}: mask shape {np.shape(mask)} must equal kernel shape {kshape}"
            )
        self.mask = None if mask is None else _Frozen(np.asarray(mask))


class Conv(_ConvBase):
    """N-D convolution (cross-correlation) over channels-last inputs.

    Input ``(*batch, *spatial, in_features)``, kernel ``(*kernel_size, in_features //
    feature_group_count, out_features)``, output ``(*batch, *spatial_out, out_features)``:

    ``y[b, o, f] = bias[f] + sum_{k, c} xp[b, o * s + k * kd, g(f) * Cg + c] * kernel[k, c, f]``

    where ``xp`` is the padded (and, with ``input_dilation``, dilated) input and ``g(f)``
    the group of output feature ``f``. ``padding`` is ``'SAME'`` (output size ``ceil(n /
    s)``), ``'VALID'``, ``'CIRCULAR'`` (periodic wrap), ``'REFLECT'``, ``'CAUSAL'`` (1-D:
    left pad ``(k - 1) * kd``), an int, or per-axis ints/pairs.

    Args:
      in_features: the input's feature size.
      out_features: the output's feature size.
      kernel_size: the window size per spatial axis (an int for all).
      strides: the stride per spatial axis (an int for all).
      padding: ``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, ``'REFLECT'``, ``'CAUSAL'``, an int, or
        per-axis ints / ``(low, high)`` pairs.
      input_dilation: the input's dilation per spatial axis (``lhs_dilation``).
      kernel_dilation: the kernel's dilation per spatial axis (atrous convolution).
      feature_group_count: split the features into this many groups (``in_features`` for depthwise).
      use_bias: add a learned bias.
      mask: a 0/1 array of the kernel's shape multiplied into the kernel (e.g. for masked
        convolutions); None for none.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      precision: ``jax.lax.Precision`` of the matmul/convolution; None for the default.
      kernel_init: the kernel's initializer ``init(key, shape, dtype)``.
      bias_init: the bias's initializer.
      conv_general_dilated: the convolution, ``lax.conv_general_dilated``-compatible.
      promote_dtype: ``promote_dtype(arrays, dtype=...)``, how inputs and parameters are brought to
        one dtype.
      preferred_element_type: the accumulation dtype passed to ``lax.dot_general`` / the
        convolution; None for the default.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      kernel_metadata: metadata for the kernel :class:`Param` (``sharding_names``...).
      bias_metadata: metadata for the bias :class:`Param`.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> conv = nn.Conv(3, 8, kernel_size=(3, 3), rngs=nn.Rngs(0))
    >>> conv(jnp.ones((2, 16, 16, 3))).shape
    (2, 16, 16, 8)
    """

    _layer = "Conv"  # the name error messages use

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | Sequence[int],
        strides: int | Sequence[int] | None = 1,
        *,
        padding: PaddingLike = "SAME",
        input_dilation: int | Sequence[int] | None = 1,
        kernel_dilation: int | Sequence[int] | None = 1,
        feature_group_count: int = 1,
        use_bias: bool = True,
        mask: jax.Array | None = None,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        precision: Any = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        conv_general_dilated: Callable[..., jax.Array] = lax.conv_general_dilated,
        promote_dtype: Callable[..., Any] = promote_dtype,
        preferred_element_type: DType | None = None,
        rngs: Rngs,
        kernel_metadata: Mapping[str, Any] = {},
        bias_metadata: Mapping[str, Any] = {},
    ) -> None:
        in_features, out_features, ks = _features("Conv", in_features, out_features, kernel_size)
        rank = len(ks)
        feature_group_count = _checks.positive_int("Conv", "feature_group_count", feature_group_count)
        if in_features % feature_group_count or out_features % feature_group_count:
            raise ValueError(
                f"Conv: in_features ({in_features}) and out_features ({out_features}) must be "
                f"divisible by feature_group_count ({feature_group_count})"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.kernel_size = ks
        self.strides = _broadcast(strides, rank, "strides", "Conv")
        self.padding = canonicalize_padding(padding, rank, "Conv")
        if self.padding == "CAUSAL" and rank != 1:
            raise ValueError(f"Conv: 'CAUSAL' padding needs a 1-D kernel, got kernel_size {ks}")
        self.input_dilation = _broadcast(input_dilation, rank, "input_dilation", "Conv")
        self.kernel_dilation = _broadcast(kernel_dilation, rank, "kernel_dilation", "Conv")
        self.feature_group_count = int(feature_group_count)
        self.use_bias = bool(use_bias)
        kshape = ks + (in_features // feature_group_count, out_features)
        self._store_mask(mask, kshape)
        store_layer_options(
            self, dtype, param_dtype, precision,
            {"conv_general_dilated": conv_general_dilated, "promote_dtype": promote_dtype},
            preferred_element_type,
        )
        make_kernel_and_bias(
            self, rngs, kernel_init, kshape, bias_init, (out_features,) if use_bias else None,
            param_dtype, kernel_metadata, bias_metadata,
        )

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        """Convolve ``inputs`` with the kernel, add the bias.

        Args:
          inputs: ``(*batch, *spatial, in_features)``.
          out_sharding: the output's sharding (explicit mesh axes), passed to
            ``conv_general_dilated`` (with one batch axis) or applied to the result;
            None to let JAX infer it.
        """
        x = check_input(self, inputs, min_ndim=len(self.kernel_size) + 1)
        check_axis(self, x, -1, self.in_features, what="last axis (features)")
        rank = len(self.kernel_size)
        x, batch = self._flatten_batch(x, rank)
        # one batch axis: the conv itself places its output; otherwise the result is resharded
        direct = len(batch) == 1
        padding = self.padding
        if padding in ("CIRCULAR", "REFLECT"):
            kd = [(k - 1) * d + 1 for k, d in zip(self.kernel_size, self.kernel_dilation)]
            pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in kd] + [(0, 0)]
            x = jnp.pad(x, pads, mode="wrap" if padding == "CIRCULAR" else "reflect")
            padding = "VALID"
        elif padding == "CAUSAL":
            left = self.kernel_dilation[0] * (self.kernel_size[0] - 1)
            x = jnp.pad(x, [(0, 0), (left, 0), (0, 0)])
            padding = "VALID"
        if isinstance(padding, str) and any(d != 1 for d in self.input_dilation):
            # lax needs explicit pads with input dilation: resolve SAME/VALID on the
            # dilated input size
            kd = [(k - 1) * d + 1 for k, d in zip(self.kernel_size, self.kernel_dilation)]
            dil = [(n - 1) * d + 1 for n, d in zip(x.shape[1:-1], self.input_dilation)]
            padding = tuple(lax.padtype_to_pads(dil, kd, self.strides, padding))
        kernel = dense_value(self.kernel[...])
        if self.mask is not None:
            kernel = kernel * self.mask.array
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = self.promote_dtype((x, kernel, bias), dtype=self.dtype)
        y = self.conv_general_dilated(
            x,
            kernel,
            self.strides,
            padding,
            lhs_dilation=self.input_dilation,
            rhs_dilation=self.kernel_dilation,
            dimension_numbers=_dimension_numbers(x.ndim),
            feature_group_count=self.feature_group_count,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
            **sharding_kw(out_sharding if direct else None),
        )
        if bias is not None:
            y = y + bias.astype(y.dtype)
        y = self._unflatten_batch(y, batch)
        return y if direct else reshard_to(y, out_sharding)


class ConvTranspose(_ConvBase):
    """Transposed ("fractionally strided") convolution, ``lax.conv_transpose`` semantics.

    The input is dilated by ``strides`` (``s - 1`` zeros between elements), padded, and
    cross-correlated with the kernel ``(*kernel_size, in_features, out_features)`` (with
    ``transpose_kernel=True`` the kernel is ``(*kernel_size, out_features, in_features)``,
    flipped spatially and its feature axes swapped: the exact gradient of ``Conv``).
    ``'SAME'`` gives output size ``n * s``; ``'VALID'`` gives ``n * s + max(kd - s, 0)``;
    ``'CIRCULAR'`` computes ``'VALID'`` and wraps it periodically to ``n * s``.

    Args:
      in_features: the input's feature size.
      out_features: the output's feature size.
      kernel_size: the window size per spatial axis (an int for all).
      strides: the input dilation per spatial axis (the upsampling factor); None means 1.
      padding: ``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, or per-axis ``(low, high)`` pairs.
      kernel_dilation: the kernel's dilation per spatial axis; None means 1.
      use_bias: add a learned bias.
      mask: a 0/1 array of the kernel's shape multiplied into the kernel; None for none.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      precision: ``jax.lax.Precision`` of the matmul/convolution; None for the default.
      kernel_init: the kernel's initializer ``init(key, shape, dtype)``.
      bias_init: the bias's initializer.
      transpose_kernel: use the kernel ``(*kernel_size, out_features, in_features)`` flipped and
        transposed: the exact gradient of :class:`Conv`.
      promote_dtype: ``promote_dtype(arrays, dtype=...)``, how inputs and parameters are brought to
        one dtype.
      preferred_element_type: the accumulation dtype passed to ``lax.dot_general`` / the
        convolution; None for the default.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      kernel_metadata: metadata for the kernel :class:`Param` (``sharding_names``...).
      bias_metadata: metadata for the bias :class:`Param`.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> up = nn.ConvTranspose(4, 2, kernel_size=(3, 3), strides=(2, 2), rngs=nn.Rngs(0))
    >>> up(jnp.ones((1, 5, 5, 4))).shape
    (1, 10, 10, 2)
    """

    _layer = "ConvTranspose"  # the name error messages use

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | Sequence[int],
        strides: int | Sequence[int] | None = None,
        *,
        padding: PaddingLike = "SAME",
        kernel_dilation: int | Sequence[int] | None = None,
        use_bias: bool = True,
        mask: jax.Array | None = None,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        precision: Any = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        transpose_kernel: bool = False,
        promote_dtype: Callable[..., Any] = promote_dtype,
        preferred_element_type: DType | None = None,
        rngs: Rngs,
        kernel_metadata: Mapping[str, Any] = {},
        bias_metadata: Mapping[str, Any] = {},
    ) -> None:
        in_features, out_features, ks = _features(
            "ConvTranspose", in_features, out_features, kernel_size
        )
        rank = len(ks)
        self.in_features = in_features
        self.out_features = out_features
        self.kernel_size = ks
        self.strides = _broadcast(strides, rank, "strides", "ConvTranspose")
        self.padding = canonicalize_padding(padding, rank, "ConvTranspose")
        if self.padding in ("CAUSAL", "REFLECT"):
            raise ValueError(
                f"ConvTranspose: padding {self.padding!r} is not supported; use 'SAME', "
                "'VALID', 'CIRCULAR' or explicit pairs"
            )
        self.kernel_dilation = _broadcast(kernel_dilation, rank, "kernel_dilation", "ConvTranspose")
        self.use_bias = bool(use_bias)
        self.transpose_kernel = bool(transpose_kernel)
        kshape = ks + ((out_features, in_features) if transpose_kernel else (in_features, out_features))
        self._store_mask(mask, kshape)
        store_layer_options(
            self, dtype, param_dtype, precision,
            {"promote_dtype": promote_dtype}, preferred_element_type,
        )
        make_kernel_and_bias(
            self, rngs, kernel_init, kshape, bias_init, (out_features,) if use_bias else None,
            param_dtype, kernel_metadata, bias_metadata,
        )

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        """The transposed convolution of ``inputs``, plus the bias.

        Args:
          inputs: ``(*batch, *spatial, in_features)``.
          out_sharding: the output's sharding (explicit mesh axes), applied to the result;
            None to let JAX infer it.
        """
        x = check_input(self, inputs, min_ndim=len(self.kernel_size) + 1)
        check_axis(self, x, -1, self.in_features, what="last axis (features)")
        rank = len(self.kernel_size)
        x, batch = self._flatten_batch(x, rank)
        padding = "VALID" if self.padding == "CIRCULAR" else self.padding
        kernel = dense_value(self.kernel[...])
        if self.mask is not None:
            kernel = kernel * self.mask.array
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = self.promote_dtype((x, kernel, bias), dtype=self.dtype)
        y = lax.conv_transpose(
            x,
            kernel,
            self.strides,
            padding,
            rhs_dilation=self.kernel_dilation,
            dimension_numbers=_dimension_numbers(x.ndim),
            transpose_kernel=self.transpose_kernel,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
        )
        if self.padding == "CIRCULAR":
            # wrap the VALID result periodically onto the n * s grid; the shift puts the
            # first input element at an integer number of periods
            periods = [n * s for n, s in zip(x.shape[1:-1], self.strides)]
            for i, period in enumerate(periods, start=1):
                diff = -(y.shape[i] - period) % (2 * period)
                lo = diff // 2 if self.transpose_kernel else (diff + 1) // 2
                pad = [(0, 0)] * y.ndim
                pad[i] = (lo, diff - lo)
                y = jnp.pad(y, pad)
                y = y.reshape(y.shape[:i] + (-1, period) + y.shape[i + 1 :]).sum(axis=i)
        if bias is not None:
            y = y + bias.astype(y.dtype)
        return reshard_to(self._unflatten_batch(y, batch), out_sharding)


class _Frozen:
    """A constant NumPy array kept as static configuration (hashable by identity)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __repr__(self) -> str:
        return f"mask{self.array.shape}"
