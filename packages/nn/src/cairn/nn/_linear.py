"""Dense layers: ``Linear``, ``LinearGeneral``, ``Einsum``; dtype helpers shared by layers."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import lax

from cairn.core_array import QArray
from cairn.nn import _checks
from cairn.nn import initializers as _init
from cairn.nn._module import Module
from cairn.nn._rngs import Rngs
from cairn.nn._variables import Param, VariableMetadata

__all__ = ["Einsum", "Linear", "LinearGeneral", "canonicalize_dtype", "dense_value", "promote_dtype"]

DType = Any
Initializer = Callable[..., jax.Array]

default_kernel_init = _init.lecun_normal()
default_bias_init = _init.zeros


# --- helpers ---


def canonicalize_dtype(*args: Any, dtype: DType | None = None, inexact: bool = True) -> DType:
    """The dtype computations run in: ``dtype`` if given, else the promotion of ``args``.

    ``None`` arguments are ignored. With ``inexact=True`` an integer result is promoted to
    float32 (so integer inputs to a float layer compute in float).
    """
    if dtype is None:
        arrays = [a for a in args if a is not None]
        dtype = jnp.result_type(*arrays) if arrays else jnp.float32
        if inexact and not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    if inexact and not jnp.issubdtype(dtype, jnp.inexact):
        raise ValueError(f"computation dtype must be floating or complex, got {jnp.dtype(dtype)}")
    return dtype


def dense_value(x: Any) -> Any:
    """``x``, or a ``QArray``'s dequantized values (so layers run on quantized weights, e.g.
    after ``nn.update(model, quant.quantize_params(...))``, in float numerics)."""
    return x.dequantize() if isinstance(x, QArray) else x


def promote_dtype(
    args: Sequence[Any], /, *, dtype: DType | None = None, inexact: bool = True
) -> Any:
    """Casts every non-``None`` array of ``args`` to one common dtype (see above); a
    ``QArray`` argument is dequantized first."""
    args = type(args)(dense_value(a) for a in args)  # type: ignore[call-arg]
    dt = canonicalize_dtype(*args, dtype=dtype, inexact=inexact)
    container: Callable[..., Any] = type(args)
    return container(None if a is None else jnp.asarray(a, dt) for a in args)


def sharding_kw(out_sharding: Any) -> dict[str, Any]:
    """``{"out_sharding": out_sharding}`` for an op that takes it, or ``{}`` when it is None
    (so a user's own ``dot_general`` / ``einsum_op`` without the keyword keeps working)."""
    return {} if out_sharding is None else {"out_sharding": out_sharding}


def reshard_to(y: jax.Array, out_sharding: Any) -> jax.Array:
    """``y`` resharded to ``out_sharding`` (a ``PartitionSpec`` under ``jax.set_mesh``, or a
    ``NamedSharding``); ``y`` itself when it is None."""
    return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)


def promote_for_dot(layer: Any, x: Any, kernel: Any, bias: Any) -> tuple[Any, Any, Any]:
    """``layer.promote_dtype`` on ``(x, kernel, bias)``, except that a ``QArray`` kernel
    stays quantized when the layer's ``dot_general`` is not ``lax.dot_general`` (a kernel
    library's quantized dot, e.g. ``cairn.kernels.quantized_dot_general``, takes it as is);
    ``x`` and ``bias`` are then cast to the dtype the dequantized kernel would promote to."""
    if isinstance(kernel, QArray) and layer.dot_general is not lax.dot_general:
        dt = canonicalize_dtype(x, jnp.zeros((), kernel.dtype), bias, dtype=layer.dtype)
        x, bias = layer.promote_dtype((x, bias), dtype=dt)
        return x, kernel, bias
    return layer.promote_dtype((x, kernel, bias), dtype=layer.dtype)


def check_input(layer: Module | str, x: Any, *, min_ndim: int = 1) -> jax.Array:
    """Validates a layer input: an array of a numeric dtype with at least ``min_ndim`` axes."""
    name = layer if isinstance(layer, str) else type(layer).__name__
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    dt = jnp.dtype(x.dtype)
    if not (jnp.issubdtype(dt, jnp.number)):
        raise TypeError(
            f"{name} expected a numeric (float or int) input, got dtype {dt} in input of shape "
            f"{tuple(x.shape)}"
        )
    if x.ndim < min_ndim:
        raise ValueError(
            f"{name} expected an input with at least {min_ndim} axes, got shape {tuple(x.shape)}"
        )
    return x


def check_axis(
    layer: Module | str, x: jax.Array, axis: int, expected: int, what: str = "last axis"
) -> None:
    name = layer if isinstance(layer, str) else type(layer).__name__
    if x.shape[axis] != expected:
        raise ValueError(
            f"{name} expected {what} {expected}, got {x.shape[axis]} in input of shape "
            f"{tuple(x.shape)}"
        )


def to_tuple(x: int | Sequence[int], name: str = "value") -> tuple[int, ...]:
    if isinstance(x, int):
        return (x,)
    try:
        return tuple(int(v) for v in x)
    except TypeError as e:
        raise TypeError(f"{name} must be an int or a sequence of ints, got {x!r}") from e


def map_init_value(out: Any, fn: Callable[[Any], Any]) -> Any:
    """Applies ``fn`` to an initializer's result, keeping any metadata box around it
    (initializers wrapped by ``nn.with_partitioning`` return ``VariableMetadata``)."""
    if isinstance(out, VariableMetadata):
        return VariableMetadata(fn(out.value), out.metadata)
    return fn(out)


def make_param(
    init: Initializer, key: jax.Array, shape: Sequence[int], dtype: DType,
    metadata: Mapping[str, Any],
) -> Param:
    return Param(init(key, shape, dtype), **dict(metadata))


def store_layer_options(
    module: Module, dtype: DType | None, param_dtype: DType, precision: Any,
    ops: Mapping[str, Any], preferred_element_type: DType | None,
) -> None:
    """Store the options the kernel layers share, in the attribute order they all use;
    ``ops`` are the layer's own callables (its contraction op and ``promote_dtype``, in
    the layer's order), stored between ``precision`` and ``preferred_element_type``.
    The initializers are not kept: they only build the parameters, and two layers
    that differ only in them have the same structure (GraphDef), as in Flax NNX."""
    module.dtype = dtype
    module.param_dtype = param_dtype
    module.precision = precision
    for name, op in ops.items():
        setattr(module, name, op)
    module.preferred_element_type = preferred_element_type


def make_kernel_and_bias(
    module: Module, rngs: Rngs, kernel_init: Initializer, kernel_shape: Sequence[int],
    bias_init: Initializer, bias_shape: Sequence[int] | None, param_dtype: DType,
    kernel_metadata: Mapping[str, Any], bias_metadata: Mapping[str, Any],
) -> None:
    """``module.kernel``, then ``module.bias`` (None when ``bias_shape`` is None; no
    ``params`` key is drawn for it then)."""
    module.kernel = make_param(kernel_init, rngs.params(), kernel_shape, param_dtype, kernel_metadata)
    module.bias = (
        None if bias_shape is None
        else make_param(bias_init, rngs.params(), bias_shape, param_dtype, bias_metadata)
    )


# --- Linear ---


class Linear(Module):
    """``y = x @ kernel + bias`` over the last axis.

    Args:
      in_features: size of the input's last axis.
      out_features: size of the output's last axis.
      use_bias: add a learned bias (zeros by default).
      dtype: computation dtype (default: promotion of input and parameters).
      param_dtype: dtype the parameters are stored in (float32).
      precision: ``jax.lax.Precision`` for the matmul.
      kernel_init: the kernel's initializer; the kernel has shape ``(in, out)``.
      bias_init: the bias's initializer.
      preferred_element_type: accumulation dtype passed to ``lax.dot_general``.
      rngs: ``Rngs`` with a ``params`` stream.
      dot_general: the contraction, ``lax.dot_general``-compatible (e.g. a quantized one).
      promote_dtype: ``promote_dtype(arrays, dtype=...)``, how inputs and parameters are brought to
        one dtype.
      kernel_metadata: metadata for the kernel :class:`Param` (``sharding_names``...).
      bias_metadata: metadata for the bias :class:`Param`.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> layer = nn.Linear(3, 4, rngs=nn.Rngs(0))
    >>> layer(jnp.ones((2, 3))).shape
    (2, 4)
    """

    # set by store_layer_options / make_kernel_and_bias
    kernel: Param
    bias: Param | None
    dtype: DType | None
    param_dtype: DType
    precision: Any
    promote_dtype: Callable[..., Any]
    preferred_element_type: DType | None
    dot_general: Callable[..., jax.Array]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        precision: Any = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        dot_general: Callable[..., jax.Array] = lax.dot_general,
        promote_dtype: Callable[..., Any] = promote_dtype,
        preferred_element_type: DType | None = None,
        rngs: Rngs,
        kernel_metadata: Mapping[str, Any] = {},
        bias_metadata: Mapping[str, Any] = {},
    ) -> None:
        self.in_features = _checks.positive_int("Linear", "in_features", in_features)
        self.out_features = _checks.positive_int("Linear", "out_features", out_features)
        self.use_bias = bool(use_bias)
        store_layer_options(
            self, dtype, param_dtype, precision,
            {"dot_general": dot_general, "promote_dtype": promote_dtype}, preferred_element_type,
        )
        make_kernel_and_bias(
            self, rngs, kernel_init, (self.in_features, self.out_features), bias_init,
            (self.out_features,) if use_bias else None, param_dtype, kernel_metadata,
            bias_metadata,
        )

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        """``inputs @ kernel + bias``.

        Args:
          inputs: ``(..., in_features)``.
          out_sharding: the output's sharding (a ``PartitionSpec`` or ``NamedSharding``,
            for a mesh with explicit axes), passed to ``dot_general``; None to let JAX infer it.
        """
        x = check_input(self, inputs)
        kernel = self.kernel[...]
        # the kernel's own input size: in_features, or a shard of it inside shard_map
        check_axis(self, x, -1, kernel.shape[0])
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = promote_for_dot(self, x, kernel, bias)
        y = self.dot_general(
            x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=self.precision,
            preferred_element_type=self.preferred_element_type, **sharding_kw(out_sharding),
        )
        if bias is not None:
            y = y + bias.astype(y.dtype)
        return y


# --- LinearGeneral ---


class LinearGeneral(Module):
    """A dense layer contracting any set of input axes against a multi-axis kernel.

    The kernel has shape ``(*batch_sizes, *in_features, *out_features)``. Input axes
    ``axis`` (whose sizes must equal ``in_features``) are contracted, the leading
    ``batch_axis`` axes are batch dims shared with the kernel, and the output is
    ``(*batch, *free input axes, *out_features)``.

    Args:
      in_features: the sizes of the contracted input axes (an int for one).
      out_features: the output's trailing shape (an int for one axis).
      axis: the input axes contracted (an int for one).
      batch_axis: ``{input axis: size}`` of the leading axes shared with the kernel (batch dims).
      use_bias: add a learned bias.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      kernel_init: the kernel's initializer ``init(key, shape, dtype)``.
      bias_init: the bias's initializer.
      precision: ``jax.lax.Precision`` of the matmul/convolution; None for the default.
      promote_dtype: ``promote_dtype(arrays, dtype=...)``, how inputs and parameters are brought to
        one dtype.
      dot_general: the contraction, ``lax.dot_general``-compatible; None for ``lax.dot_general``.
      preferred_element_type: the accumulation dtype passed to ``lax.dot_general`` / the
        convolution; None for the default.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      kernel_metadata: metadata for the kernel :class:`Param` (``sharding_names``...).
      bias_metadata: metadata for the bias :class:`Param`.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> qkv = nn.LinearGeneral(8, (2, 4), rngs=nn.Rngs(0))  # 8 -> 2 heads x 4
    >>> qkv(jnp.ones((3, 5, 8))).shape
    (3, 5, 2, 4)
    """

    # set by store_layer_options / make_kernel_and_bias
    kernel: Param
    bias: Param | None
    dtype: DType | None
    param_dtype: DType
    precision: Any
    promote_dtype: Callable[..., Any]
    preferred_element_type: DType | None
    dot_general: Callable[..., jax.Array]

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        axis: int | Sequence[int] = -1,
        batch_axis: Mapping[int, int] = {},
        use_bias: bool = True,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        precision: Any = None,
        promote_dtype: Callable[..., Any] = promote_dtype,
        dot_general: Callable[..., jax.Array] | None = None,
        preferred_element_type: DType | None = None,
        rngs: Rngs,
        kernel_metadata: Mapping[str, Any] = {},
        bias_metadata: Mapping[str, Any] = {},
    ) -> None:
        self.in_features = _checks.positive_ints("LinearGeneral", "in_features", in_features)
        self.out_features = _checks.positive_ints("LinearGeneral", "out_features", out_features)
        self.axis = to_tuple(axis, "axis")
        if len(self.axis) != len(self.in_features):
            raise ValueError(
                f"LinearGeneral: axis {self.axis} and in_features {self.in_features} must have "
                "the same length"
            )
        batch_axis = dict(batch_axis)
        self.batch_axis = tuple(sorted(
            (int(k), _checks.positive_int("LinearGeneral", f"batch_axis[{k}]", v))
            for k, v in batch_axis.items()
        ))
        bdims = tuple(k for k, _ in self.batch_axis)
        if bdims != tuple(range(len(bdims))):
            raise ValueError(
                f"LinearGeneral: batch_axis dims {bdims} must be the leading dims 0..n-1"
            )
        self.use_bias = bool(use_bias)
        store_layer_options(
            self, dtype, param_dtype, precision,
            {
                "promote_dtype": promote_dtype,
                "dot_general": dot_general if dot_general is not None else lax.dot_general,
            },
            preferred_element_type,
        )
        batch_shape = tuple(v for _, v in self.batch_axis)
        n_in, n_b = len(self.in_features), len(batch_shape)
        kshape = batch_shape + self.in_features + self.out_features
        # fans: treat the in dims as fan_in and the out dims as fan_out
        flat = (math.prod(batch_shape), math.prod(self.in_features), math.prod(self.out_features))

        def kinit(key, shape, dtype):
            w = kernel_init(key, flat if n_b else flat[1:], dtype)
            return map_init_value(w, lambda v: jnp.reshape(v, shape))

        def binit(key, shape, dtype):
            b = bias_init(key, (flat[0], flat[2]) if n_b else (flat[2],), dtype)
            return map_init_value(b, lambda v: jnp.reshape(v, shape))

        del n_in
        make_kernel_and_bias(
            self, rngs, kinit, kshape, binit,
            batch_shape + self.out_features if use_bias else None, param_dtype,
            kernel_metadata, bias_metadata,
        )

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        """Contract ``inputs``' ``axis`` against the kernel, add the bias.

        Args:
          inputs: an array whose ``axis`` sizes are ``in_features``.
          out_sharding: the output's sharding (explicit mesh axes), passed to
            ``dot_general``; None to let JAX infer it.
        """
        x = check_input(self, inputs)
        nd = x.ndim
        axes = tuple(a % nd if -nd <= a < nd else None for a in self.axis)
        if None in axes:
            raise ValueError(
                f"LinearGeneral axis {self.axis} out of range for input of shape {tuple(x.shape)}"
            )
        for a, f in zip(cast(tuple[int, ...], axes), self.in_features):
            check_axis(self, x, a, f, what=f"axis {a} of size")
        nb = len(self.batch_axis)
        for b, size in self.batch_axis:
            check_axis(self, x, b, size, what=f"batch axis {b} of size")
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = promote_for_dot(self, x, kernel, bias)
        k_in = tuple(range(nb, nb + len(axes)))
        k_b = tuple(range(nb))
        y = self.dot_general(
            x, kernel, ((axes, k_in), (tuple(range(nb)), k_b)), precision=self.precision,
            preferred_element_type=self.preferred_element_type, **sharding_kw(out_sharding),
        )
        if bias is not None:
            # bias (*batch, *out) broadcasts over the free input axes in the middle
            n_free = y.ndim - nb - len(self.out_features)
            bshape = bias.shape[:nb] + (1,) * n_free + bias.shape[nb:]
            y = y + jnp.reshape(bias, bshape).astype(y.dtype)
        return y


# --- Einsum ---

_EINSUM_RE = re.compile(r"^\s*([a-zA-Z.]*)\s*,\s*([a-zA-Z.]*)\s*->\s*([a-zA-Z.]*)\s*$")


class Einsum(Module):
    """``y = einsum(einsum_str, x, kernel) + bias`` with a learned kernel.

    ``einsum_str`` names the input first and the kernel second, e.g. ``'btd,dnh->btnh'``.
    ``bias_shape`` (optional) must broadcast against the trailing output axes.

    Args:
      einsum_str: the equation, input first and kernel second (``'btd,dnh->btnh'``).
      kernel_shape: the kernel's shape.
      bias_shape: the bias's shape (broadcast against the output's trailing axes); None for no bias.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      precision: ``jax.lax.Precision`` of the matmul/convolution; None for the default.
      kernel_init: the kernel's initializer ``init(key, shape, dtype)``.
      bias_init: the bias's initializer.
      promote_dtype: ``promote_dtype(arrays, dtype=...)``, how inputs and parameters are brought to
        one dtype.
      einsum_op: the einsum, ``jnp.einsum``-compatible.
      preferred_element_type: the accumulation dtype passed to ``lax.dot_general`` / the
        convolution; None for the default.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      kernel_metadata: metadata for the kernel :class:`Param` (``sharding_names``...).
      bias_metadata: metadata for the bias :class:`Param`.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> layer = nn.Einsum('btd,dnh->btnh', (8, 2, 4), (2, 4), rngs=nn.Rngs(0))
    >>> layer(jnp.ones((3, 5, 8))).shape
    (3, 5, 2, 4)
    """

    # set by store_layer_options / make_kernel_and_bias
    kernel: Param
    bias: Param | None
    dtype: DType | None
    param_dtype: DType
    precision: Any
    promote_dtype: Callable[..., Any]
    preferred_element_type: DType | None
    einsum_op: Callable[..., jax.Array]

    def __init__(
        self,
        einsum_str: str,
        kernel_shape: Sequence[int],
        bias_shape: Sequence[int] | None = None,
        *,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        precision: Any = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        promote_dtype: Callable[..., Any] = promote_dtype,
        einsum_op: Callable[..., jax.Array] = jnp.einsum,
        preferred_element_type: DType | None = None,
        rngs: Rngs,
        kernel_metadata: Mapping[str, Any] = {},
        bias_metadata: Mapping[str, Any] = {},
    ) -> None:
        m = _EINSUM_RE.match(einsum_str.replace(" ", ""))
        if m is None:
            raise ValueError(
                f"Einsum: einsum_str must look like 'inputs,kernel->output' with two operands, "
                f"got {einsum_str!r}"
            )
        self.kernel_shape = _checks.positive_ints("Einsum", "kernel_shape", kernel_shape)
        ksub = m.group(2)
        named = len(ksub.replace("...", ""))
        ellipsis = "..." in ksub
        if ksub.count(".") not in (0, 3) or (
            named > len(self.kernel_shape) if ellipsis else named != len(self.kernel_shape)
        ):
            raise ValueError(
                f"Einsum: kernel subscripts {ksub!r} name {named} axes"
                f"{' plus ...' if ellipsis else ''} but kernel_shape is {self.kernel_shape}"
            )
        self.einsum_str = einsum_str.replace(" ", "")
        self._in_spec = m.group(1)
        self.bias_shape = (
            None if bias_shape is None else _checks.positive_ints(
                "Einsum", "bias_shape", bias_shape, allow_empty=True
            )
        )
        store_layer_options(
            self, dtype, param_dtype, precision,
            {"promote_dtype": promote_dtype, "einsum_op": einsum_op}, preferred_element_type,
        )
        make_kernel_and_bias(
            self, rngs, kernel_init, self.kernel_shape, bias_init, self.bias_shape, param_dtype,
            kernel_metadata, bias_metadata,
        )

    def __call__(
        self, inputs: jax.Array, einsum_str: str | None = None, out_sharding: Any = None
    ) -> jax.Array:
        """``einsum(einsum_str, inputs, kernel) + bias``.

        Args:
          inputs: the input, with the axes the equation's first operand names.
          einsum_str: an equation for this call instead of the layer's.
          out_sharding: the output's sharding (explicit mesh axes), passed to the
            ``einsum_op``; None to let JAX infer it.
        """
        x = check_input(self, inputs)
        spec = self._in_spec if einsum_str is None else einsum_str.split(",")[0].strip()
        if "..." not in spec and x.ndim != len(spec):
            raise ValueError(
                f"Einsum expected an input with {len(spec)} axes for subscripts {spec!r}, got "
                f"shape {tuple(x.shape)}"
            )
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = self.promote_dtype((x, kernel, bias), dtype=self.dtype)
        kw = sharding_kw(out_sharding)
        if self.preferred_element_type is not None:
            kw["preferred_element_type"] = self.preferred_element_type
        y = self.einsum_op(
            einsum_str or self.einsum_str, x, kernel, precision=self.precision, **kw
        )
        if bias is not None:
            y = y + bias.astype(y.dtype)
        return y
