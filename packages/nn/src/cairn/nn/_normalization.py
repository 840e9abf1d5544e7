"""Normalization layers: LayerNorm, RMSNorm, GroupNorm, BatchNorm, InstanceNorm.

Statistics are computed in at least float32 whatever the input dtype (a bfloat16 input
does not lose its mean to rounding); the result is cast to ``dtype`` (default: the
promotion of input and parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from cairn.nn import _checks
from cairn.nn import initializers as _init
from cairn.nn._linear import DType, Initializer, canonicalize_dtype, check_input, make_param
from cairn.nn._module import Module
from cairn.nn._rngs import Rngs
from cairn.nn._variables import BatchStat, Param

__all__ = ["BatchNorm", "GroupNorm", "InstanceNorm", "LayerNorm", "RMSNorm"]


def _axes(axes: int | Sequence[int], ndim: int, name: str, shape) -> tuple[int, ...]:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"{name}: axis {a} out of range for input of shape {tuple(shape)}")
        out.append(a % ndim)
    return tuple(sorted(set(out)))


def _stats(
    x: jax.Array,
    axes: tuple[int, ...],
    *,
    use_mean: bool = True,
    use_fast_variance: bool = True,
    mask: jax.Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
):
    """Mean and (biased) variance of ``x`` over ``axes`` in >= float32.

    With ``use_mean=False`` returns ``(0, mean(x**2))`` (RMSNorm). ``mask`` (broadcastable
    to ``x``, True = counted) weights the statistics; ``axis_name`` averages them across
    devices with ``lax.pmean``.
    """
    dt = jnp.promote_types(jnp.float32, x.dtype)
    x = x.astype(dt)

    def mean(v):
        if mask is None:
            m = v.mean(axes, keepdims=True)
        else:
            w = jnp.broadcast_to(mask, v.shape).astype(dt)
            m = (v * w).sum(axes, keepdims=True) / jnp.maximum(w.sum(axes, keepdims=True), 1.0)
        if axis_name is not None:
            m = lax.pmean(m, axis_name, axis_index_groups=axis_index_groups)
        return m

    if not use_mean:
        return jnp.zeros((), dt), mean(jnp.square(x))
    if use_fast_variance or axis_name is not None:
        mu = mean(x)
        mu2 = mean(jnp.square(x))
        var = jnp.maximum(mu2 - jnp.square(mu), 0.0)
    else:
        mu = mean(x)
        var = mean(jnp.square(x - mu))
    return mu, var


def _normalize(x, mean, var, scale, bias, epsilon, feature_axes, dtype):
    """``(x - mean) * rsqrt(var + eps) * scale + bias``; scale/bias live on feature_axes."""
    ndim = x.ndim
    stat_dt = mean.dtype
    y = (x.astype(stat_dt) - mean) * lax.rsqrt(var + jnp.asarray(epsilon, stat_dt))
    fshape = [1] * ndim
    for a in feature_axes:
        fshape[a] = x.shape[a]
    if scale is not None:
        y = y * scale.reshape(fshape).astype(stat_dt)
    if bias is not None:
        y = y + bias.reshape(fshape).astype(stat_dt)
    return y.astype(dtype)


_ABSENT = object()  # an option the norm does not have (RMSNorm: use_bias, use_fast_variance)


def _axes_option(axes):
    """A stored axes option: an int stays an int, ``None`` stays ``None``, else a tuple."""
    return axes if axes is None or isinstance(axes, int) else tuple(axes)


class _Norm(Module):
    num_features: int
    # set by _params
    scale: Param | None
    bias: Param | None
    use_fast_variance: bool  # set by _store_options for the norms that have it

    def _store_options(
        self, epsilon, dtype, param_dtype, use_bias, use_scale, axes, axis_name,
        axis_index_groups, use_fast_variance,
    ):
        """Store the options every norm shares, in the attribute order all of them use.

        ``axes`` maps the norm's axes options (``reduction_axes``, ``feature_axes``) to
        their values; ``_ABSENT`` leaves an option out.
        """
        self.epsilon = _checks.nonnegative_float(type(self).__name__, "epsilon", epsilon)
        self.dtype = dtype
        self.param_dtype = param_dtype
        if use_bias is not _ABSENT:
            self.use_bias = bool(use_bias)
        self.use_scale = bool(use_scale)
        for name, value in axes.items():
            setattr(self, name, _axes_option(value))
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        if use_fast_variance is not _ABSENT:
            self.use_fast_variance = bool(use_fast_variance)

    def _params(self, rngs, scale_init, bias_init, sm, bm):
        """``scale`` then ``bias`` of shape ``(num_features,)`` (None when not used)."""
        shape, dt = (self.num_features,), self.param_dtype
        use_bias = getattr(self, "use_bias", False)
        self.scale = make_param(scale_init, rngs.params(), shape, dt, sm) if self.use_scale else None
        self.bias = make_param(bias_init, rngs.params(), shape, dt, bm) if use_bias else None

    def _values(self):
        scale = self.scale[...] if self.scale is not None else None
        bias_param = getattr(self, "bias", None)
        bias = bias_param[...] if bias_param is not None else None
        return scale, bias

    def _out_dtype(self, x, scale, bias):
        return canonicalize_dtype(x, scale, bias, dtype=self.dtype)

    def _moments(self, x, axes, mask, **options):
        """``_stats`` over ``axes`` with this norm's cross-device options."""
        return _stats(
            x, axes, mask=mask, axis_name=self.axis_name,
            axis_index_groups=self.axis_index_groups, **options,
        )

    def _scale_shift(self, x, mean, var, feature_axes):
        """Normalize ``x`` with ``scale``/``bias`` laid out over ``feature_axes``."""
        scale, bias = self._values()
        fshape = tuple(x.shape[a] for a in feature_axes)
        scale = None if scale is None else scale.reshape(fshape)
        bias = None if bias is None else bias.reshape(fshape)
        return _normalize(
            x, mean, var, scale, bias, self.epsilon, feature_axes, self._out_dtype(x, scale, bias)
        )

    def _check_features(self, x, feature_axes):
        got = tuple(x.shape[a] for a in feature_axes)
        if math.prod(got) != self.num_features:
            raise ValueError(
                f"{type(self).__name__} expected feature axes {feature_axes} of total size "
                f"{self.num_features}, got {got} in input of shape {tuple(x.shape)}"
            )


class LayerNorm(_Norm):
    """``y = (x - mean) / sqrt(var + epsilon) * scale + bias``, stats over ``reduction_axes``.

    ``scale`` and ``bias`` have the shape of the ``feature_axes`` (default: last axis,
    ``num_features``). Defaults as in Flax NNX: ``epsilon=1e-6``.

    Args:
      num_features: the size of the feature axis (the parameters' shape).
      epsilon: added to the variance before the square root.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      use_bias: add a learned bias.
      use_scale: multiply by a learned scale.
      bias_init: the bias's initializer.
      scale_init: the scale's initializer.
      reduction_axes: the axes the statistics are taken over.
      feature_axes: the axes the scale and bias span.
      axis_name: a mapped axis name (``vmap``/``shard_map``) the statistics are averaged over; None
        for local statistics.
      axis_index_groups: groups of axis indices to average within (``lax.pmean``'s option); None for
        all.
      use_fast_variance: compute the variance as ``E[x^2] - E[x]^2`` (one pass) instead of ``E[(x -
        E[x])^2]``.
      promote_dtype: accepted for Flax NNX compatibility; ignored.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      bias_metadata: metadata for the bias :class:`Param`.
      scale_metadata: metadata for the scale :class:`Param`.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> ln = nn.LayerNorm(4, rngs=nn.Rngs(0))
    >>> y = ln(jnp.array([[1.0, 2.0, 3.0, 4.0]]))
    >>> round(float(y.mean()), 5), round(float((y ** 2).mean()), 3)
    (0.0, 1.0)
    """

    # stored by _store_options
    reduction_axes: int | tuple[int, ...]
    feature_axes: int | tuple[int, ...]

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Initializer = _init.zeros,
        scale_init: Initializer = _init.ones,
        reduction_axes: int | Sequence[int] = -1,
        feature_axes: int | Sequence[int] = -1,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: Callable[..., Any] | None = None,
        rngs: Rngs,
        bias_metadata: Mapping[str, Any] = {},
        scale_metadata: Mapping[str, Any] = {},
    ) -> None:
        del promote_dtype
        self.num_features = _checks.positive_int("LayerNorm", "num_features", num_features)
        self._store_options(
            epsilon, dtype, param_dtype, use_bias, use_scale,
            {"reduction_axes": reduction_axes, "feature_axes": feature_axes}, axis_name,
            axis_index_groups, use_fast_variance,
        )
        self._params(rngs, scale_init, bias_init, scale_metadata, bias_metadata)

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        x = check_input(self, x)
        red = _axes(self.reduction_axes, x.ndim, "LayerNorm", x.shape)
        feat = _axes(self.feature_axes, x.ndim, "LayerNorm", x.shape)
        self._check_features(x, feat)
        mean, var = self._moments(x, red, mask, use_fast_variance=self.use_fast_variance)
        return self._scale_shift(x, mean, var, feat)


class RMSNorm(_Norm):
    """``y = x / sqrt(mean(x**2) + epsilon) * scale`` (Zhang & Sennrich 2019).

    Args:
      num_features: the size of the feature axis (the parameters' shape).
      epsilon: added to the mean square before the square root.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      use_scale: multiply by a learned scale.
      scale_init: the scale's initializer.
      reduction_axes: the axes the statistics are taken over.
      feature_axes: the axes the scale and bias span.
      axis_name: a mapped axis name (``vmap``/``shard_map``) the statistics are averaged over; None
        for local statistics.
      axis_index_groups: groups of axis indices to average within (``lax.pmean``'s option); None for
        all.
      use_fast_variance: accepted for Flax NNX compatibility; ignored (RMSNorm takes no mean).
      promote_dtype: accepted for Flax NNX compatibility; ignored.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      scale_metadata: metadata for the scale :class:`Param`.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> norm = nn.RMSNorm(3, rngs=nn.Rngs(0))
    >>> [round(v, 4) for v in norm(jnp.array([3.0, 0.0, 0.0])).tolist()]
    [1.7321, 0.0, 0.0]
    """

    # stored by _store_options
    reduction_axes: int | tuple[int, ...]
    feature_axes: int | tuple[int, ...]

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        use_scale: bool = True,
        scale_init: Initializer = _init.ones,
        reduction_axes: int | Sequence[int] = -1,
        feature_axes: int | Sequence[int] = -1,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: Callable[..., Any] | None = None,
        rngs: Rngs,
        scale_metadata: Mapping[str, Any] = {},
    ) -> None:
        del promote_dtype, use_fast_variance
        self.num_features = _checks.positive_int("RMSNorm", "num_features", num_features)
        self._store_options(
            epsilon, dtype, param_dtype, _ABSENT, use_scale,
            {"reduction_axes": reduction_axes, "feature_axes": feature_axes}, axis_name,
            axis_index_groups, _ABSENT,
        )
        self._params(rngs, scale_init, None, scale_metadata, {})

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        x = check_input(self, x)
        red = _axes(self.reduction_axes, x.ndim, "RMSNorm", x.shape)
        feat = _axes(self.feature_axes, x.ndim, "RMSNorm", x.shape)
        self._check_features(x, feat)
        mean, ms = self._moments(x, red, mask, use_mean=False)
        return self._scale_shift(x, mean, ms, feat)


class GroupNorm(_Norm):
    """Normalizes each group of ``num_features // num_groups`` channels (Wu & He 2018).

    Input ``(batch, *spatial, num_features)``; stats per example and group over the
    spatial axes and the group's channels (``reduction_axes``, default all but axis 0).
    Give ``num_groups`` or ``group_size`` (not both).

    Args:
      num_features: the size of the feature axis (the parameters' shape).
      num_groups: the number of channel groups (dividing ``num_features``); give it or
        ``group_size``.
      group_size: channels per group, instead of ``num_groups``.
      epsilon: added to the variance before the square root.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      use_bias: add a learned bias.
      use_scale: multiply by a learned scale.
      bias_init: the bias's initializer.
      scale_init: the scale's initializer.
      reduction_axes: the axes the statistics are taken over; None: all but axis 0.
      axis_name: a mapped axis name (``vmap``/``shard_map``) the statistics are averaged over; None
        for local statistics.
      axis_index_groups: groups of axis indices to average within (``lax.pmean``'s option); None for
        all.
      use_fast_variance: compute the variance as ``E[x^2] - E[x]^2`` (one pass) instead of ``E[(x -
        E[x])^2]``.
      promote_dtype: accepted for Flax NNX compatibility; ignored.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      bias_metadata: metadata for the bias :class:`Param`.
      scale_metadata: metadata for the scale :class:`Param`.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> gn = nn.GroupNorm(8, num_groups=2, rngs=nn.Rngs(0))
    >>> gn(jnp.ones((2, 5, 8))).shape
    (2, 5, 8)
    """

    # stored by _store_options
    reduction_axes: int | tuple[int, ...] | None

    def __init__(
        self,
        num_features: int,
        num_groups: int | None = 32,
        group_size: int | None = None,
        *,
        epsilon: float = 1e-6,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Initializer = _init.zeros,
        scale_init: Initializer = _init.ones,
        reduction_axes: int | Sequence[int] | None = None,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: Callable[..., Any] | None = None,
        rngs: Rngs,
        bias_metadata: Mapping[str, Any] = {},
        scale_metadata: Mapping[str, Any] = {},
    ) -> None:
        del promote_dtype
        num_features = _checks.positive_int("GroupNorm", "num_features", num_features)
        num_groups = _checks.optional_positive_int("GroupNorm", "num_groups", num_groups)
        group_size = _checks.optional_positive_int("GroupNorm", "group_size", group_size)
        if (num_groups is None) == (group_size is None):
            raise ValueError(
                f"GroupNorm: give exactly one of num_groups ({num_groups}) and group_size "
                f"({group_size})"
            )
        if group_size is not None:
            if num_features % group_size:
                raise ValueError(
                    f"GroupNorm: num_features {num_features} not divisible by group_size {group_size}"
                )
            num_groups = num_features // group_size
        assert num_groups is not None  # exactly one of the two was given
        if num_groups < 1 or num_features % num_groups:
            raise ValueError(
                f"GroupNorm: num_features {num_features} not divisible by num_groups {num_groups}"
            )
        self.num_features = int(num_features)
        self.num_groups = int(num_groups)
        self.group_size = self.num_features // self.num_groups
        self._store_options(
            epsilon, dtype, param_dtype, use_bias, use_scale, {"reduction_axes": reduction_axes},
            axis_name, axis_index_groups, use_fast_variance,
        )
        self._params(rngs, scale_init, bias_init, scale_metadata, bias_metadata)

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        x = check_input(self, x, min_ndim=2)
        if x.shape[-1] != self.num_features:
            raise ValueError(
                f"GroupNorm expected last axis {self.num_features}, got {x.shape[-1]} in input "
                f"of shape {tuple(x.shape)}"
            )
        if self.reduction_axes is None:
            red = tuple(range(1, x.ndim))
        else:
            red = _axes(self.reduction_axes, x.ndim, "GroupNorm", x.shape)
            if x.ndim - 1 not in red:
                raise ValueError(f"GroupNorm: reduction_axes {self.reduction_axes} must include the last axis")
        xg = x.reshape(x.shape[:-1] + (self.num_groups, self.group_size))
        # the group axis (ndim - 1 in xg) is a batch axis; the in-group channels are reduced
        gred = tuple(a for a in red if a != x.ndim - 1) + (x.ndim,)
        mg = None
        if mask is not None:
            mg = jnp.broadcast_to(mask, x.shape).reshape(xg.shape)
        mean, var = self._moments(xg, gred, mg, use_fast_variance=self.use_fast_variance)
        scale, bias = self._values()
        dt = self._out_dtype(x, scale, bias)
        y = _normalize(xg, mean, var, None, None, self.epsilon, (), mean.dtype).reshape(x.shape)
        if scale is not None:
            y = y * scale.astype(y.dtype)
        if bias is not None:
            y = y + bias.astype(y.dtype)
        return y.astype(dt)


class InstanceNorm(_Norm):
    """Per-example, per-channel normalization over all other non-batch axes.

    Stats of ``(batch, *spatial, features)`` are taken over the spatial axes (all axes but
    the leading batch axis and ``feature_axes``).

    Args:
      num_features: the size of the feature axis (the parameters' shape).
      epsilon: added to the variance before the square root.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      use_bias: add a learned bias.
      use_scale: multiply by a learned scale.
      bias_init: the bias's initializer.
      scale_init: the scale's initializer.
      feature_axes: the feature axes (kept, with the batch axis, out of the statistics).
      axis_name: a mapped axis name (``vmap``/``shard_map``) the statistics are averaged over; None
        for local statistics.
      axis_index_groups: groups of axis indices to average within (``lax.pmean``'s option); None for
        all.
      use_fast_variance: compute the variance as ``E[x^2] - E[x]^2`` (one pass) instead of ``E[(x -
        E[x])^2]``.
      promote_dtype: accepted for Flax NNX compatibility; ignored.
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      bias_metadata: metadata for the bias :class:`Param`.
      scale_metadata: metadata for the scale :class:`Param`.
    """

    # stored by _store_options
    feature_axes: int | tuple[int, ...]

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Initializer = _init.zeros,
        scale_init: Initializer = _init.ones,
        feature_axes: int | Sequence[int] = -1,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: Callable[..., Any] | None = None,
        rngs: Rngs,
        bias_metadata: Mapping[str, Any] = {},
        scale_metadata: Mapping[str, Any] = {},
    ) -> None:
        del promote_dtype
        self.num_features = _checks.positive_int("InstanceNorm", "num_features", num_features)
        self._store_options(
            epsilon, dtype, param_dtype, use_bias, use_scale, {"feature_axes": feature_axes},
            axis_name, axis_index_groups, use_fast_variance,
        )
        self._params(rngs, scale_init, bias_init, scale_metadata, bias_metadata)

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        x = check_input(self, x, min_ndim=2)
        feat = _axes(self.feature_axes, x.ndim, "InstanceNorm", x.shape)
        if 0 in feat:
            raise ValueError("InstanceNorm: feature_axes must not include the batch axis 0")
        self._check_features(x, feat)
        red = tuple(a for a in range(1, x.ndim) if a not in feat)
        mean, var = self._moments(x, red, mask, use_fast_variance=self.use_fast_variance)
        return self._scale_shift(x, mean, var, feat)


class BatchNorm(_Norm):
    """Batch normalization (Ioffe & Szegedy 2015) with running statistics.

    Training (``use_running_average=False``): normalizes with the batch mean/variance over
    every axis except ``axis`` and updates the ``BatchStat`` running averages
    ``ra = momentum * ra + (1 - momentum) * batch_stat`` (biased variance). Evaluation
    (``use_running_average=True``, set by ``model.eval()``): normalizes with the running
    averages. The update is an in-place write to ``mean``/``var`` and flows back through
    ``nn.jit`` / ``nn.grad`` like any state change.

    Args:
      num_features: the size of the feature axis (the parameters' shape).
      use_running_average: normalize with the running averages (evaluation); False uses and updates
        the batch statistics.
      axis: the feature axis (or axes); statistics are taken over all others.
      momentum: the running averages' decay.
      epsilon: added to the variance before the square root.
      dtype: the computation dtype; None promotes the input and parameter dtypes.
      param_dtype: the dtype the parameters are stored in.
      use_bias: add a learned bias.
      use_scale: multiply by a learned scale.
      bias_init: the bias's initializer.
      scale_init: the scale's initializer.
      axis_name: a mapped axis name (``vmap``/``shard_map``) the statistics are averaged over; None
        for local statistics.
      axis_index_groups: groups of axis indices to average within (``lax.pmean``'s option); None for
        all.
      use_fast_variance: compute the variance as ``E[x^2] - E[x]^2`` (one pass) instead of ``E[(x -
        E[x])^2]``.
      promote_dtype: accepted for Flax NNX compatibility; ignored (statistics are computed in at
        least float32).
      rngs: :class:`Rngs` with a ``params`` stream (used for the initializers).
      bias_metadata: metadata for the bias :class:`Param`.
      scale_metadata: metadata for the scale :class:`Param`.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> bn = nn.BatchNorm(2, momentum=0.5, rngs=nn.Rngs(0))
    >>> _ = bn(jnp.array([[0.0, 2.0], [2.0, 4.0]]))
    >>> bn.mean[...].tolist()
    [0.5, 1.5]
    """

    def __init__(
        self,
        num_features: int,
        *,
        use_running_average: bool | None = False,
        axis: int = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-5,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Initializer = _init.zeros,
        scale_init: Initializer = _init.ones,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: Callable[..., Any] | None = None,
        rngs: Rngs,
        bias_metadata: Mapping[str, Any] = {},
        scale_metadata: Mapping[str, Any] = {},
    ) -> None:
        del promote_dtype
        self.num_features = _checks.positive_int("BatchNorm", "num_features", num_features)
        self.use_running_average = use_running_average
        self.axis = int(axis)
        self.momentum = _checks.rate("BatchNorm", "momentum", momentum)
        self._store_options(
            epsilon, dtype, param_dtype, use_bias, use_scale, {}, axis_name, axis_index_groups,
            use_fast_variance,
        )
        self.mean = BatchStat(jnp.zeros((self.num_features,), param_dtype))
        self.var = BatchStat(jnp.ones((self.num_features,), param_dtype))
        self._params(rngs, scale_init, bias_init, scale_metadata, bias_metadata)

    def set_view(self, use_running_average: bool | None = None) -> None:
        """The ``nn.view`` hook.

        Args:
          use_running_average: if True, the stored batch statistics are used instead of
            the statistics of the input.
        """
        if use_running_average is not None:
            self.use_running_average = use_running_average

    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        x = check_input(self, x)
        ura = self.use_running_average if use_running_average is None else use_running_average
        if ura is None:
            raise ValueError(
                "BatchNorm: use_running_average is None; pass it to __call__ or the constructor, "
                "or call model.train() / model.eval()"
            )
        (feat,) = _axes(self.axis, x.ndim, "BatchNorm", x.shape)
        if x.shape[feat] != self.num_features:
            raise ValueError(
                f"BatchNorm expected axis {self.axis} of size {self.num_features}, got "
                f"{x.shape[feat]} in input of shape {tuple(x.shape)}"
            )
        red = tuple(a for a in range(x.ndim) if a != feat)
        if ura:
            mean = self.mean[...].astype(jnp.promote_types(jnp.float32, x.dtype))
            var = self.var[...].astype(mean.dtype)
            fshape = [1] * x.ndim
            fshape[feat] = self.num_features
            mean, var = mean.reshape(fshape), var.reshape(fshape)
        else:
            mean, var = self._moments(x, red, mask, use_fast_variance=self.use_fast_variance)
            m = self.momentum
            pdt = self.mean[...].dtype
            self.mean[...] = (m * self.mean[...] + (1 - m) * mean.reshape(-1)).astype(pdt)
            self.var[...] = (m * self.var[...] + (1 - m) * var.reshape(-1)).astype(pdt)
        scale, bias = self._values()
        return _normalize(x, mean, var, scale, bias, self.epsilon, (feat,), self._out_dtype(x, scale, bias))
