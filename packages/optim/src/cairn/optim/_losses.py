"""Loss functions with Optax's names, signatures and defaults.

Every loss is a pure ``jax.numpy`` function: it works on any leading batch
shape, traces under ``jax.jit``/``jax.vmap`` and differentiates with
``jax.grad``. Normalisers are computed with a max-shifted log-sum-exp,
``log(1 + x)`` with ``log1p``, and masked entries are kept out of both the value
and the gradient (a fully masked row gives loss 0 and gradient 0, not NaN).

Inputs in a floating dtype narrower than 32 bits (bfloat16, float16) are
computed in float32 and the result is cast back to the input dtype, so a
bfloat16 loss is the float32 loss rounded once.

Shapes and dtypes are checked eagerly: a non-floating ``logits`` raises
``TypeError``, mismatched shapes raise ``ValueError`` naming both arguments and
their shapes, and integer labels outside ``[0, num_classes)`` raise
``ValueError`` when the labels are concrete (under ``jit`` they cannot be
inspected; an out-of-range label then gives a NaN loss).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "convex_kl_divergence",
    "cosine_distance",
    "cosine_similarity",
    "ctc_loss",
    "ctc_loss_with_forward_probs",
    "hinge_loss",
    "huber_loss",
    "kl_divergence",
    "l2_loss",
    "log_cosh",
    "poly_loss_cross_entropy",
    "ranking_softmax_loss",
    "safe_softmax_cross_entropy",
    "sigmoid_binary_cross_entropy",
    "sigmoid_focal_loss",
    "smooth_labels",
    "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels",
    "squared_error",
    "triplet_margin_loss",
    "sparsemax_loss",
    "multiclass_sparsemax_loss",
]

Axis = int | tuple[int, ...] | None


# --- checks and dtype helpers ---


def _float(fn: str, name: str, x: Any) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: `{name}` must have a floating dtype, got {x.dtype}")
    return x


def _int(fn: str, name: str, x: Any) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{fn}: `{name}` must have an integer dtype, got {x.dtype}")
    return x


def _wide(x: jax.Array) -> jax.Array:
    """``x`` in a dtype of at least 32 bits for the arithmetic."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4:
        return x.astype(jnp.float32)
    return x


def _same_shape(fn: str, a_name: str, a: jax.Array, b_name: str, b: jax.Array) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{fn}: `{a_name}` and `{b_name}` must have the same shape, got "
            f"{a_name}.shape={a.shape} and {b_name}.shape={b.shape}"
        )


def _broadcast(fn: str, *named: tuple[str, jax.Array]) -> tuple[int, ...]:
    try:
        return np.broadcast_shapes(*(x.shape for _, x in named))
    except ValueError:
        shapes = ", ".join(f"{n}.shape={x.shape}" for n, x in named)
        raise ValueError(f"{fn}: shapes do not broadcast together: {shapes}") from None


def _canonical_axes(fn: str, axis: Axis, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if not isinstance(axis, tuple | list) else tuple(axis)
    out = []
    for a in axes:
        try:
            a = operator.index(a)
        except TypeError:
            raise TypeError(
                f"{fn}: `axis` must be an int or a tuple of ints, got {axis!r}"
            ) from None
        if not -ndim <= a < ndim:
            raise ValueError(f"{fn}: axis {a} is out of bounds for an array of rank {ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{fn}: `axis` repeats an axis: {axis!r}")
    return tuple(out)


def _expand_where(
    fn: str, where: Any, shape: tuple[int, ...], axes: tuple[int, ...]
) -> jax.Array | None:
    """A mask of the inputs' rank: either given so, or missing exactly ``axes``."""
    if where is None:
        return None
    ndim = len(shape)
    where = jnp.asarray(where, dtype=bool)
    if where.ndim != ndim and where.ndim == ndim - len(axes):
        where = jnp.expand_dims(where, axes)
    if where.ndim != ndim or not _broadcastable(where.shape, shape):
        raise ValueError(
            f"{fn}: `where` must be broadcastable to the inputs' shape {shape} or to "
            f"their batch shape (without axis {axes}), got shape {where.shape}"
        )
    return where


def _broadcastable(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return True


def _residual(fn: str, p: jax.Array, targets: Any, *, same_shape: bool) -> jax.Array:
    """``p - targets`` (``p`` when ``targets`` is None) in at least 32 bits; ``targets``
    must have ``p``'s shape (``same_shape``) or broadcast with it."""
    if targets is None:
        return _wide(p)
    t = jnp.asarray(targets)
    if same_shape:
        _same_shape(fn, "predictions", p, "targets", t)
    else:
        _broadcast(fn, ("predictions", p), ("targets", t))
    return _wide(p) - _wide(t)


def _logits_and_labels(fn: str, logits: Any, labels: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Checked ``(logits, wide logits, labels in the wide dtype)`` for element-wise losses."""
    x = _float(fn, "logits", logits)
    y = jnp.asarray(labels)
    _broadcast(fn, ("logits", x), ("labels", y))
    xw = _wide(x)
    return x, xw, y.astype(xw.dtype)


def _class_log_softmax(fn: str, x: jax.Array, y: jax.Array, axis: Axis, where: Any):
    """Shape checks, class ``axes``, the ``where`` mask and the masked log-softmax of
    ``x`` for the cross entropies over class probabilities ``y``."""
    _broadcast(fn, ("logits", x), ("labels", y))
    axes = _canonical_axes(fn, axis, x.ndim)
    mask = _expand_where(fn, where, _broadcast(fn, ("logits", x), ("labels", y)), axes)
    xw = _wide(x)
    return axes, mask, xw, _log_softmax(xw, axes, mask)


def _paired(fn: str, a_name: str, a: Any, b_name: str, b: Any, axis: Axis, where: Any):
    """Checked floating ``a``, ``b``, reduction ``axes``, ``where`` mask and result dtype
    of a reduction over two broadcast inputs."""
    a = _float(fn, a_name, a)
    b = _float(fn, b_name, b)
    shape = _broadcast(fn, (a_name, a), (b_name, b))
    axes = _canonical_axes(fn, axis, len(shape))
    if where is not None:
        where = jnp.asarray(where, dtype=bool)
        _broadcast(fn, (a_name, a), ("where", where))
    return a, b, axes, where, jnp.result_type(a, b)


def _shifted_exp_sum(x: jax.Array, axes: tuple[int, ...], where: jax.Array | None):
    """``(m, x - m, sum of exp(x - m))`` over ``axes`` (masked by ``where``), with ``m``
    the masked max held constant for the gradient (0 where no entry is finite)."""
    m = jnp.max(x, axis=axes, where=where, initial=-jnp.inf, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    shifted = x - m
    e = jnp.exp(shifted)
    if where is not None:
        e = jnp.where(where, e, 0.0)
    return m, shifted, jnp.sum(e, axis=axes, keepdims=True)


def _log_softmax(x: jax.Array, axes: tuple[int, ...], where: jax.Array | None) -> jax.Array:
    """Max-shifted log-softmax over ``axes``; rows with no valid entry stay finite."""
    _, shifted, s = _shifted_exp_sum(x, axes, where)
    return shifted - jnp.log(jnp.where(s > 0, s, 1.0))


def _logsumexp(x: jax.Array, axes: tuple[int, ...], where: jax.Array | None) -> jax.Array:
    m, _, s = _shifted_exp_sum(x, axes, where)
    out = jnp.log(s) + m
    return jnp.squeeze(out, axes)


def _softplus(x: jax.Array) -> jax.Array:
    """log(1 + exp(x)) without overflow (log-sum-exp of (x, 0))."""
    return jnp.logaddexp(x, 0.0)


# --- regression ---


def squared_error(
    predictions: jax.typing.ArrayLike,
    targets: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Element-wise squared error :math:`(p - t)^2`.

    Args:
      predictions: floating array of any shape.
      targets: array of the same shape (zeros when omitted).

    Returns:
      An array shaped like ``predictions``; ``.mean()`` of it is the MSE.

    >>> from cairn import optim
    >>> optim.squared_error(jnp.array([1.0, 2.0]), jnp.array([0.0, 4.0]))
    Array([1., 4.], dtype=float32)
    """
    fn = "squared_error"
    p = _float(fn, "predictions", predictions)
    e = _residual(fn, p, targets, same_shape=True)
    return (e * e).astype(p.dtype)


def l2_loss(
    predictions: jax.typing.ArrayLike,
    targets: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Element-wise half squared error :math:`\tfrac12 (p - t)^2`.

    Args:
      predictions: the predictions :math:`p`, a float array.
      targets: the targets :math:`t`, same shape as ``predictions``; None means zeros (the loss of
        ``predictions`` as residuals).

    >>> from cairn import optim
    >>> optim.l2_loss(jnp.array([1.0, 2.0]), jnp.array([0.0, 4.0]))
    Array([0.5, 2. ], dtype=float32)

    Returns:
      the element-wise loss, shaped and typed like ``predictions``.
    """
    fn = "l2_loss"
    p = _float(fn, "predictions", predictions)
    e = _residual(fn, p, targets, same_shape=True)
    return (0.5 * e * e).astype(p.dtype)


def huber_loss(
    predictions: jax.typing.ArrayLike,
    targets: jax.typing.ArrayLike | None = None,
    *,
    delta: jax.typing.ArrayLike = 1.0,
) -> jax.Array:
    r"""Element-wise Huber loss: quadratic near 0, linear beyond ``delta``.

    With :math:`e = p - t`:

    .. math::
       \ell(e) = \begin{cases} \tfrac12 e^2 & |e| \le \delta \\
       \delta\,(|e| - \tfrac12\delta) & |e| > \delta \end{cases}

    Its gradient is :math:`\operatorname{clip}(e, -\delta, \delta)`.

    Args:
      predictions: floating array of any shape.
      targets: array broadcastable with ``predictions`` (zeros when omitted).
      delta: the threshold :math:`\delta > 0`.

    >>> from cairn import optim
    >>> optim.huber_loss(jnp.array([0.5, 3.0]))
    Array([0.125, 2.5  ], dtype=float32)
    """
    fn = "huber_loss"
    p = _float(fn, "predictions", predictions)
    if not isinstance(delta, jax.core.Tracer) and np.ndim(delta) == 0 and not float(delta) > 0:  # type: ignore[arg-type]
        raise ValueError(f"{fn}: `delta` must be > 0, got {delta}")
    e = _residual(fn, p, targets, same_shape=False)
    a = jnp.abs(e)
    quad = jnp.minimum(a, delta)
    # `a - quad` rather than max(a - delta, 0): one gradient path at |e| = delta.
    return (0.5 * quad * quad + delta * (a - quad)).astype(p.dtype)


def log_cosh(
    predictions: jax.typing.ArrayLike,
    targets: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Element-wise :math:`\log\cosh(p - t)`.

    About :math:`e^2/2` near zero and :math:`|e| - \log 2` far from it. It is
    computed as :math:`\operatorname{log1p}(2\sinh^2(e/2))` for :math:`|e| < 1`
    (no cancellation for tiny errors) and
    :math:`|e| + \operatorname{log1p}(e^{-2|e|}) - \log 2` otherwise (no overflow).

    Args:
      predictions: the predictions :math:`p`, a float array.
      targets: the targets :math:`t`, broadcastable to ``predictions``; None means zeros.

    >>> from cairn import optim
    >>> print(f"{float(optim.log_cosh(jnp.array(1.0))):.6f}")
    0.433781

    Returns:
      the element-wise loss, in the dtype of ``predictions``.
    """
    fn = "log_cosh"
    p = _float(fn, "predictions", predictions)
    e = _residual(fn, p, targets, same_shape=False)
    a = jnp.abs(e)
    small = a < 1.0
    e_small = jnp.where(small, e, 0.0)  # keep the unused branch finite for grads
    a_large = jnp.where(small, 1.0, a)
    sh = jnp.sinh(0.5 * e_small)
    near = jnp.log1p(2.0 * sh * sh)
    far = a_large + jnp.log1p(jnp.exp(-2.0 * a_large)) - np.log(2.0)
    return jnp.where(small, near, far).astype(p.dtype)


def cosine_similarity(
    predictions: jax.typing.ArrayLike,
    targets: jax.typing.ArrayLike,
    *,
    epsilon: jax.typing.ArrayLike = 0.0,
    axis: Axis = -1,
    where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Cosine of the angle between ``predictions`` and ``targets`` along ``axis``.

    .. math::
       \cos(p, t) = \sum_i \frac{p_i}{\sqrt{\max(\|p\|^2, \epsilon)}}
       \frac{t_i}{\sqrt{\max(\|t\|^2, \epsilon)}}

    Args:
      predictions: floating array ``[..., dim]``.
      targets: floating array broadcastable with ``predictions``.
      epsilon: lower bound on the squared norms (guards zero vectors).
      axis: axis or axes reduced over.
      where: optional mask of the elements that take part.

    Returns:
      The similarities, shape ``[...]``.

    >>> from cairn import optim
    >>> optim.cosine_similarity(jnp.array([1.0, 0.0]), jnp.array([1.0, 1.0]))
    Array(0.70710677, dtype=float32)
    """
    fn = "cosine_similarity"
    return _cosine(fn, predictions, targets, epsilon, axis, where)


def _cosine(fn, predictions, targets, epsilon, axis, where):
    p, t, axes, where, dtype = _paired(fn, "predictions", predictions, "targets", targets,
                                       axis, where)
    a, b = _wide(p), _wide(t)
    na = jnp.sum(a * a, axis=axes, where=where, keepdims=True)
    nb = jnp.sum(b * b, axis=axes, where=where, keepdims=True)
    na = jnp.sqrt(jnp.maximum(na, epsilon))
    nb = jnp.sqrt(jnp.maximum(nb, epsilon))
    out = jnp.sum((a / na) * (b / nb), axis=axes, where=where)
    return out.astype(dtype)


def cosine_distance(
    predictions: jax.typing.ArrayLike,
    targets: jax.typing.ArrayLike,
    *,
    epsilon: jax.typing.ArrayLike = 0.0,
    axis: Axis = -1,
    where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Cosine distance :math:`1 - \cos(p, t)`; see :func:`cosine_similarity`.

    Args:
      predictions: the predicted vectors along ``axis``.
      targets: the target vectors, broadcastable to ``predictions``.
      epsilon: lower bound on each squared norm before the square root (guards against 0/0).
      axis: the axis (or axes) holding the vector coordinates.
      where: optional bool mask, broadcastable to the inputs; False coordinates are left out.

    >>> from cairn import optim
    >>> optim.cosine_distance(jnp.array([1.0, 0.0]), jnp.array([-1.0, 0.0]))
    Array(2., dtype=float32)

    Returns:
      :math:`1 - \cos(p, t)`, the inputs' shape without ``axis``.
    """
    fn = "cosine_distance"
    sim = _cosine(fn, predictions, targets, epsilon, axis, where)
    return (1.0 - _wide(sim)).astype(sim.dtype)


# --- classification ---


def sigmoid_binary_cross_entropy(
    logits: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
) -> jax.Array:
    r"""Element-wise binary cross entropy of sigmoid probabilities.

    .. math::
       \ell(x, y) = -y \log\sigma(x) - (1 - y)\log(1 - \sigma(x))
                 = y\,\operatorname{softplus}(-x) + (1 - y)\operatorname{softplus}(x)

    with a stable softplus, so large ``|x|`` neither overflows nor loses the
    gradient :math:`\sigma(x) - y`.

    Args:
      logits: floating array, one logit per binary prediction.
      labels: targets in ``[0, 1]`` (hard or soft), broadcastable with ``logits``.

    >>> from cairn import optim
    >>> optim.sigmoid_binary_cross_entropy(jnp.array([0.0, 100.0]), jnp.array([1.0, 1.0]))
    Array([0.6931472, 0.       ], dtype=float32)
    """
    fn = "sigmoid_binary_cross_entropy"
    x, xw, y = _logits_and_labels(fn, logits, labels)
    out = y * _softplus(-xw) + (1.0 - y) * _softplus(xw)
    return out.astype(x.dtype)


def sigmoid_focal_loss(
    logits: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    *,
    alpha: jax.typing.ArrayLike | None = None,
    gamma: jax.typing.ArrayLike = 2.0,
) -> jax.Array:
    r"""Element-wise sigmoid focal loss (Lin et al., 2017).

    With :math:`p = \sigma(x)`, :math:`p_t = y p + (1 - y)(1 - p)`:

    .. math::
       \ell = \alpha_t\,(1 - p_t)^{\gamma}\;\mathrm{BCE}(x, y),\qquad
       \alpha_t = \alpha y + (1 - \alpha)(1 - y)

    (:math:`\alpha_t = 1` when ``alpha`` is None). :math:`(1 - p_t)^\gamma` is
    computed as :math:`\exp(\gamma \log(1 - p_t))` with
    :math:`\log(1 - p_t) = \operatorname{logaddexp}(\log(1-y) + \log p,\ \log y + \log(1-p))`,
    which is exact for soft labels and stable for large logits.

    Args:
      logits: the logits :math:`x`, any shape.
      labels: the targets :math:`y \in [0, 1]` (hard or soft), broadcastable to ``logits``.
      alpha: :math:`\alpha \in [0, 1]`, the weight of the positive class; None weighs both classes
        1.
      gamma: :math:`\gamma \ge 0`, the focusing exponent (0 gives plain BCE).

    >>> from cairn import optim
    >>> print(f"{float(optim.sigmoid_focal_loss(jnp.array(0.0), jnp.array(1.0))):.6f}")
    0.173287
    """
    fn = "sigmoid_focal_loss"
    x, xw, y = _logits_and_labels(fn, logits, labels)
    log_p = -_softplus(-xw)
    log_q = -_softplus(xw)
    ce = -y * log_p - (1.0 - y) * log_q
    log_one_minus_pt = jnp.logaddexp(jnp.log1p(-y) + log_p, jnp.log(y) + log_q)
    out = ce * jnp.exp(gamma * log_one_minus_pt)
    if alpha is not None:
        out = (alpha * y + (1.0 - alpha) * (1.0 - y)) * out  # type: ignore[assignment]
    return out.astype(x.dtype)


def hinge_loss(
    predictor_outputs: jax.typing.ArrayLike,
    targets: jax.typing.ArrayLike,
) -> jax.Array:
    r"""Binary hinge loss :math:`\max(0, 1 - s\,y)` for targets :math:`y \in \{-1, 1\}`.

    Args:
      predictor_outputs: the scores :math:`s`, any shape.
      targets: :math:`y \in \{-1, 1\}`, broadcastable to ``predictor_outputs``.

    >>> from cairn import optim
    >>> optim.hinge_loss(jnp.array([2.0, 0.5, -1.0]), jnp.array([1.0, 1.0, 1.0]))
    Array([0. , 0.5, 2. ], dtype=float32)

    Returns:
      the elementwise loss, the broadcast shape.
    """
    fn = "hinge_loss"
    s = jnp.asarray(predictor_outputs)
    y = jnp.asarray(targets)
    _broadcast(fn, ("predictor_outputs", s), ("targets", y))
    return jnp.maximum(0, 1 - s * y)


def softmax_cross_entropy(
    logits: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    axis: Axis = -1,
    where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Cross entropy between target distributions and ``softmax(logits)``.

    .. math::
       \ell = -\sum_{j} y_j \Bigl(x_j - \log \sum_k e^{x_k}\Bigr)

    the sums running over ``axis`` and, with ``where``, only over the entries
    it marks. Rows with no marked entry give 0.

    Args:
      logits: floating array ``[..., num_classes]``.
      labels: class probabilities broadcastable to ``logits``.
      axis: the class axis or axes.
      where: mask shaped like ``logits`` or like the batch shape.

    Returns:
      The losses, shape ``[...]``.

    >>> from cairn import optim
    >>> logits = jnp.array([[1.0, 2.0, 3.0]])
    >>> print(optim.softmax_cross_entropy(logits, jnp.array([[0.0, 0.0, 1.0]])).round(4))
    [0.4076]
    """
    fn = "softmax_cross_entropy"
    x = _float(fn, "logits", logits)
    y = jnp.asarray(labels)
    axes, mask, xw, logp = _class_log_softmax(fn, x, y, axis, where)
    out = -jnp.sum(y.astype(xw.dtype) * logp, axis=axes, where=mask)
    return out.astype(x.dtype)


def _check_label_range(fn: str, labels, num_classes: int) -> None:
    """Raise ValueError when a concrete label lies outside ``[0, num_classes)``.

    Reads the caller's object, in NumPy: under an outer jit even jnp.asarray of a
    constant is staged (a tracer) and could not be inspected."""
    concrete = np.asarray(labels)
    lo, hi = int(concrete.min()), int(concrete.max())
    if lo < 0 or hi >= num_classes:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"{fn}: `labels` must lie in [0, {num_classes}) (num_classes), found {bad}"
        )


def _class_mask(fn: str, where, shape: tuple, batch_shape: tuple, class_axes: tuple) -> jax.Array:
    """``where`` (shaped like the logits, or like the labels: whole rows) as a logits-shaped mask."""
    where = jnp.asarray(where, dtype=bool)
    if where.shape == batch_shape:
        return jnp.broadcast_to(jnp.expand_dims(where, class_axes), shape)
    if where.shape == shape:
        return where
    raise ValueError(
        f"{fn}: `where` must have the shape of `logits` {shape} or of "
        f"`labels` {batch_shape}, got {where.shape}"
    )


def softmax_cross_entropy_with_integer_labels(
    logits: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    axis: int | tuple[int, ...] = -1,
    where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Cross entropy of ``softmax(logits)`` against integer class labels.

    .. math:: \ell = \log \sum_k e^{x_k} - x_{y}

    Args:
      logits: floating array; ``axis`` holds the classes.
      labels: integer array shaped like ``logits`` without ``axis``, values in
        ``[0, num_classes)``. With a tuple ``axis`` the label is a flat
        (row-major) index into the class axes, ``num_classes`` their product.
      axis: the class axis, or a tuple of class axes.
      where: mask shaped like ``logits`` (classes outside it are left out of
        the normaliser) or like ``labels`` (whole rows left out: loss 0).

    Returns:
      The losses, shaped like ``labels``.

    Raises:
      TypeError: non-floating ``logits`` or non-integer ``labels``.
      ValueError: ``labels`` of the wrong shape, or (when concrete) outside
        ``[0, num_classes)``.

    >>> from cairn import optim
    >>> logits = jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    >>> print(optim.softmax_cross_entropy_with_integer_labels(logits, jnp.array([2, 0])).round(4))
    [0.4076 1.0986]
    """
    fn = "softmax_cross_entropy_with_integer_labels"
    x = _float(fn, "logits", logits)
    lab = _int(fn, "labels", labels)
    if not isinstance(axis, int | tuple):
        raise ValueError(
            f"{fn}: `axis` must be an int or a tuple of ints, got {type(axis).__name__}"
        )
    class_axes = _canonical_axes(fn, axis, x.ndim)
    batch_axes = tuple(i for i in range(x.ndim) if i not in class_axes)
    batch_shape = tuple(x.shape[i] for i in batch_axes)
    if lab.shape != batch_shape:
        raise ValueError(
            f"{fn}: `labels` must have logits' shape without the class axis {axis!r}, "
            f"i.e. {batch_shape}, got {lab.shape}"
        )
    num_classes = int(np.prod([x.shape[i] for i in class_axes]))
    if not isinstance(labels, jax.core.Tracer) and lab.size:
        _check_label_range(fn, labels, num_classes)
    mask = None if where is None else _class_mask(fn, where, x.shape, batch_shape, class_axes)
    perm = batch_axes + class_axes
    xw = _wide(x).transpose(perm).reshape(batch_shape + (num_classes,))
    if mask is not None:
        mask = mask.transpose(perm).reshape(batch_shape + (num_classes,))
        any_valid = jnp.any(mask, axis=-1)
        # A row with no valid class is computed unmasked and then zeroed, which
        # keeps its value and its gradient at 0 instead of NaN.
        mask = mask | ~any_valid[..., None]
    label_logit = jnp.take_along_axis(
        xw, lab[..., None].astype(jnp.int32), axis=-1, mode="fill", fill_value=jnp.nan
    )[..., 0]
    out = _logsumexp(xw, (-1 % xw.ndim,), mask) - label_logit
    if where is not None:
        out = jnp.where(any_valid, out, 0.0)
    return out.astype(x.dtype)


def safe_softmax_cross_entropy(
    logits: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
) -> jax.Array:
    r"""Softmax cross entropy over the last axis with :math:`0 \log 0 = 0`.

    Like :func:`softmax_cross_entropy`, but a logit of :math:`-\infty` whose
    label is 0 contributes 0 (not NaN) to the loss and to its gradient.

    .. math:: \ell = -\sum_{j:\,y_j \ne 0} y_j \log\operatorname{softmax}(x)_j

    Args:
      logits: ``[..., K]`` unnormalised log-probabilities (:math:`-\infty` allowed where the label
        is 0).
      labels: ``[..., K]`` target probabilities.

    >>> from cairn import optim
    >>> logits = jnp.array([0.0, -jnp.inf, 0.0])
    >>> print(optim.safe_softmax_cross_entropy(logits, jnp.array([0.5, 0.0, 0.5])).round(4))
    0.6931

    Returns:
      the loss, shape ``logits.shape[:-1]``.
    """
    fn = "safe_softmax_cross_entropy"
    x, xw, y = _logits_and_labels(fn, logits, labels)
    logp = _log_softmax(xw, (xw.ndim - 1,), None)
    nz = y != 0
    terms = jnp.where(nz, y * jnp.where(nz, logp, 0.0), 0.0)
    return (-jnp.sum(terms, axis=-1)).astype(x.dtype)


def poly_loss_cross_entropy(
    logits: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    *,
    epsilon: jax.typing.ArrayLike = 2.0,
    axis: Axis = -1,
    where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Poly-1 loss (Leng et al., 2022): cross entropy plus a first-order term.

    .. math::
       \ell = \mathrm{CE}(x, y) + \epsilon \sum_j y_j\,(1 - \operatorname{softmax}(x)_j)

    Args:
      logits: floating array ``[..., num_classes]``.
      labels: floating class probabilities broadcastable to ``logits``.
      epsilon: weight of the :math:`(1 - p_t)` term.
      axis: the class axis or axes.
      where: mask shaped like ``logits`` or like the batch shape.

    >>> from cairn import optim
    >>> logits = jnp.array([[1.0, 2.0, 3.0]])
    >>> loss = optim.poly_loss_cross_entropy(logits, jnp.array([[0.0, 0.0, 1.0]]))
    >>> print(f"{float(loss[0]):.4f}")
    1.0771
    """
    fn = "poly_loss_cross_entropy"
    x = _float(fn, "logits", logits)
    y = _float(fn, "labels", labels)
    axes, mask, xw, logp = _class_log_softmax(fn, x, y, axis, where)
    yw = y.astype(xw.dtype)
    ce = -jnp.sum(yw * logp, axis=axes, where=mask)
    one_minus_pt = jnp.sum(yw * (1.0 - jnp.exp(logp)), axis=axes, where=mask)
    return (ce + epsilon * one_minus_pt).astype(x.dtype)


def kl_divergence(
    log_predictions: jax.typing.ArrayLike,
    targets: jax.typing.ArrayLike,
    axis: Axis = -1,
    where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Kullback-Leibler divergence :math:`\mathrm{KL}(t \,\|\, p)` with :math:`0\log 0 = 0`.

    .. math:: \mathrm{KL} = \sum_j t_j\,(\log t_j - \log p_j)

    Args:
      log_predictions: :math:`\log p`, floating ``[..., dim]``.
      targets: :math:`t \ge 0`, broadcastable to ``log_predictions``.
      axis: axis or axes summed over.
      where: optional mask of entries to include.

    >>> from cairn import optim
    >>> p = jnp.log(jnp.array([0.5, 0.5]))
    >>> print(optim.kl_divergence(p, jnp.array([1.0, 0.0])).round(4))
    0.6931
    """
    fn = "kl_divergence"
    return _kl(fn, log_predictions, targets, axis, where, convex=False)


def _kl(fn, log_predictions, targets, axis, where, *, convex):
    lp, t, axes, where, dtype = _paired(fn, "log_predictions", log_predictions,
                                        "targets", targets, axis, where)
    lpw, tw = _wide(lp), _wide(t)
    zero = tw == 0
    log_t = jnp.log(jnp.where(zero, 1.0, tw))
    terms = jnp.where(zero, 0.0, tw * (log_t - jnp.where(zero, 0.0, lpw)))
    if convex:
        terms = terms + jnp.exp(lpw) - tw
    return jnp.sum(terms, axis=axes, where=where).astype(dtype)


def convex_kl_divergence(
    log_predictions: jax.typing.ArrayLike,
    targets: jax.typing.ArrayLike,
    axis: Axis = -1,
    where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Generalised KL divergence, convex in :math:`p` and valid for unnormalised
    measures (the Bregman divergence of :math:`x\log x - x`).

    .. math:: \sum_j t_j(\log t_j - \log p_j) + p_j - t_j

    Args:
      log_predictions: :math:`\log p`, log of the (possibly unnormalised) predicted measure.
      targets: :math:`t \ge 0`, same shape as ``log_predictions`` (or broadcastable).
      axis: the axis (or axes) summed over; the others are kept.
      where: optional bool mask, broadcastable to the inputs; False elements are left out of the
        sum.

    >>> from cairn import optim
    >>> p = jnp.log(jnp.array([1.0, 1.0]))
    >>> print(optim.convex_kl_divergence(p, jnp.array([1.0, 0.0])).round(4))
    1.0

    Returns:
      the divergence, the inputs' shape without ``axis``.
    """
    return _kl("convex_kl_divergence", log_predictions, targets, axis, where, convex=True)


def smooth_labels(
    labels: jax.typing.ArrayLike,
    alpha: jax.typing.ArrayLike,
    *,
    axis: Axis = -1,
    where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Label smoothing: :math:`(1 - \alpha)\,y + \alpha / K`.

    :math:`K` is the size of ``axis`` (the product of sizes for a tuple), or,
    with ``where``, the number of marked entries along it.

    Args:
      labels: the one-hot (or soft) labels :math:`y`, floating.
      alpha: :math:`\alpha \in [0, 1]`, the mass moved to the uniform distribution.
      axis: the class axis (or axes).
      where: optional bool mask; :math:`K` counts the marked entries along ``axis``.

    >>> from cairn import optim
    >>> optim.smooth_labels(jnp.array([0.0, 1.0, 0.0, 0.0]), 0.2)
    Array([0.05, 0.85, 0.05, 0.05], dtype=float32)
    """
    fn = "smooth_labels"
    y = _float(fn, "labels", labels)
    axes = _canonical_axes(fn, axis, y.ndim)
    k: Any
    if where is None:
        k = int(np.prod([y.shape[a] for a in axes]))
    else:
        where = jnp.asarray(where, dtype=bool)
        _broadcast(fn, ("labels", y), ("where", where))
        k = jnp.sum(where, axis=axes, keepdims=True)
    yw = _wide(y)
    return ((1.0 - alpha) * yw + alpha / k).astype(y.dtype)


# --- sequences: CTC ---


def _check_ctc_args(fn: str, x, lab, lpad, ypad, blank_id: int) -> int:
    """Check the ranks and shapes of CTC's arguments and ``blank_id``; returns ``blank_id``."""
    if x.ndim != 3:
        raise ValueError(f"{fn}: `logits` must have rank 3 [B, T, K], got shape {x.shape}")
    if lab.ndim != 2:
        raise ValueError(f"{fn}: `labels` must have rank 2 [B, N], got shape {lab.shape}")
    batch, frames, num_classes = x.shape
    if lpad.shape != (batch, frames):
        raise ValueError(
            f"{fn}: `logit_paddings` must have shape [B, T] = {(batch, frames)}, got {lpad.shape}"
        )
    if ypad.shape != lab.shape:
        raise ValueError(
            f"{fn}: `label_paddings` must have the shape of `labels` {lab.shape}, got {ypad.shape}"
        )
    if lab.shape[0] != batch:
        raise ValueError(
            f"{fn}: `labels` must have batch size {batch} (from `logits`), got {lab.shape[0]}"
        )
    blank_id = operator.index(blank_id)
    if not 0 <= blank_id < num_classes:
        raise ValueError(f"{fn}: `blank_id` must be in [0, {num_classes}), got {blank_id}")
    if frames == 0:
        raise ValueError(f"{fn}: `logits` has no time frames (T = 0)")
    return blank_id


def _check_ctc_labels(fn: str, labels, label_paddings, num_classes: int, blank_id: int) -> None:
    """Concrete labels: every unpadded one in ``[0, num_classes)`` and not the blank."""
    real = np.asarray(label_paddings) == 0
    lv = np.asarray(labels)[real]
    if lv.size and (lv.min() < 0 or lv.max() >= num_classes):
        bad = lv.min() if lv.min() < 0 else lv.max()
        raise ValueError(
            f"{fn}: unpadded `labels` must lie in [0, {num_classes}) (num_classes), found {bad}"
        )
    if np.any(lv == blank_id):
        raise ValueError(
            f"{fn}: unpadded `labels` must not be the blank id {blank_id}"
        )


def ctc_loss_with_forward_probs(
    logits: jax.typing.ArrayLike,
    logit_paddings: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    label_paddings: jax.typing.ArrayLike,
    *,
    blank_id: int = 0,
    log_epsilon: jax.typing.ArrayLike = -1e5,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""CTC loss (Graves et al., 2006) and its forward (alpha) variables.

    The labels are interleaved with blanks,
    :math:`\ell' = (\varnothing, l_1, \varnothing, l_2, \dots, l_N, \varnothing)`,
    and the forward variables follow, in log space,

    .. math::
       \alpha_t(s) = \bigl[\alpha_{t-1}(s) + \alpha_{t-1}(s-1)
       + [\ell'_s \ne \varnothing,\ \ell'_s \ne \ell'_{s-2}]\,\alpha_{t-1}(s-2)\bigr]\;
       y_t(\ell'_s)

    from :math:`\alpha_{-1} = (1, 0, 0, \dots)`, where :math:`y_t` is
    ``softmax(logits[:, t])``; padded frames leave :math:`\alpha` unchanged.
    The loss is :math:`-\log(\alpha_T(2L) + \alpha_T(2L-1))` for a label
    sequence of length :math:`L`. "Zero" probabilities are represented by
    ``log_epsilon`` rather than :math:`-\infty`, which keeps gradients finite.

    Args:
      logits: floating ``[B, T, K]``; class ``blank_id`` is the blank.
      logit_paddings: ``[B, T]``, 1.0 for padded frames, else 0.0.
      labels: integer ``[B, N]`` label ids (not ``blank_id``), right-padded.
      label_paddings: ``[B, N]``, 1.0 for padded labels, else 0.0.
      blank_id: id of the blank class.
      log_epsilon: the stand-in for :math:`\log 0`.

    The recursion runs in float32 at least: bfloat16/float16 logits give
    float32 results (as in Optax), float64 logits float64.

    Returns:
      ``(loss [B], logalpha_blank [T, B, N+1], logalpha_nonblank [T, B, N])``:
      ``logalpha_blank[t, b, n]`` is :math:`\log\alpha_t(2n)` (in a blank
      after ``n`` labels) and ``logalpha_nonblank[t, b, n]`` is
      :math:`\log\alpha_t(2n+1)` (on label ``n``). As in Optax, the last
      blank row also counts the paths that end on label ``n-1``.

    Raises:
      ValueError: on wrong ranks or shapes, a bad ``blank_id``, or (when the
        labels are concrete) an unpadded label that is ``blank_id`` or outside
        ``[0, K)``.
    """
    fn = "ctc_loss"
    x = _float(fn, "logits", logits)
    lab = _int(fn, "labels", labels)
    lpad = jnp.asarray(logit_paddings)
    ypad = jnp.asarray(label_paddings)
    blank_id = _check_ctc_args(fn, x, lab, lpad, ypad, blank_id)
    if not isinstance(labels, jax.core.Tracer) and not isinstance(label_paddings, jax.core.Tracer):
        _check_ctc_labels(fn, labels, label_paddings, x.shape[-1], blank_id)

    return _ctc_forward(x, lpad, lab, ypad, blank_id, log_epsilon)


@functools.partial(jax.jit, static_argnums=(4,))
def _ctc_forward(x, lpad, lab, ypad, blank_id, log_epsilon):
    """The checked-argument core of the CTC forward pass, compiled once per
    shape (an eager call would otherwise dispatch and compile op by op)."""
    batch, frames, _ = x.shape
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    logprobs = _log_softmax(x.astype(dtype), (2,), None)  # [B, T, K]
    n = lab.shape[1]
    states = 2 * n + 1
    lab32 = lab.astype(jnp.int32)
    ext = jnp.full((batch, states), blank_id, jnp.int32).at[:, 1::2].set(lab32)
    # log y_t(l'_s) for every frame and extended state: [T, B, S].
    emit = jnp.take_along_axis(logprobs, jnp.broadcast_to(ext[:, None, :], (batch, frames, states)), axis=2)
    emit = jnp.transpose(emit, (1, 0, 2))
    eps = jnp.asarray(log_epsilon, dtype)
    # Skips s-2 -> s are allowed into a label that differs from the previous one.
    can_skip = jnp.zeros((batch, states), bool)
    if n > 1:
        can_skip = can_skip.at[:, 3::2].set(lab32[:, 1:] != lab32[:, :-1])
    skip_penalty = jnp.where(can_skip, 0.0, eps).astype(dtype)
    pad_t = jnp.transpose(lpad.astype(dtype), (1, 0))[:, :, None]  # [T, B, 1]

    alpha0 = jnp.full((batch, states), eps, dtype).at[:, 0].set(0.0)
    fill1 = jnp.full((batch, 1), eps, dtype)
    fill2 = jnp.full((batch, 2), eps, dtype)

    def step(prev, xs):
        e, pad = xs
        from_prev = jnp.concatenate([fill1, prev[:, :-1]], axis=1)
        from_skip = jnp.concatenate([fill2, prev[:, :-2]], axis=1) + skip_penalty
        m = jax.lax.stop_gradient(jnp.maximum(jnp.maximum(prev, from_prev), from_skip))
        total = m + jnp.log(jnp.exp(prev - m) + jnp.exp(from_prev - m) + jnp.exp(from_skip - m))
        new = total + e
        new = pad * prev + (1.0 - pad) * new
        return new, new

    _, alphas = jax.lax.scan(step, alpha0, (emit, pad_t))  # [T, B, S]
    log_blank = alphas[:, :, 0::2]
    log_label = alphas[:, :, 1::2]
    last = alphas[-1]
    final = jnp.concatenate(
        [last[:, :1], jnp.logaddexp(last[:, 2::2], last[:, 1::2])], axis=1
    )  # [B, N+1]
    log_blank = log_blank.at[-1].set(final)
    label_len = n - jnp.sum(ypad, axis=1).astype(jnp.int32)
    loss = -jnp.take_along_axis(final, label_len[:, None], axis=1)[:, 0]
    return loss, log_blank, log_label


def ctc_loss(
    logits: jax.typing.ArrayLike,
    logit_paddings: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    label_paddings: jax.typing.ArrayLike,
    *,
    blank_id: int = 0,
    log_epsilon: jax.typing.ArrayLike = -1e5,
) -> jax.Array:
    r"""CTC loss per sequence, ``[B]``; see :func:`ctc_loss_with_forward_probs`.

    Args:
      logits: ``[B, T, K]`` unnormalised log-probabilities over ``K`` classes (the blank included)
        per frame.
      logit_paddings: ``[B, T]``, 1.0 on padded frames and 0.0 on real ones.
      labels: ``[B, N]`` int label ids (no blanks).
      label_paddings: ``[B, N]``, 1.0 on padded labels and 0.0 on real ones.
      blank_id: the class id of the blank.
      log_epsilon: the log-probability used for impossible transitions (instead of :math:`-\infty`).

    >>> from cairn import optim
    >>> logits = jnp.zeros((1, 3, 2))          # uniform over {blank, 1}
    >>> loss = optim.ctc_loss(logits, jnp.zeros((1, 3)), jnp.array([[1]]), jnp.zeros((1, 1)))
    >>> print(loss.round(4))                   # 6 alignments of 8: -log(6/8)
    [0.2877]
    """
    loss, _, _ = ctc_loss_with_forward_probs(
        logits, logit_paddings, labels, label_paddings,
        blank_id=blank_id, log_epsilon=log_epsilon,
    )
    return loss


# --- metric learning and ranking ---


def triplet_margin_loss(
    anchors: jax.typing.ArrayLike,
    positives: jax.typing.ArrayLike,
    negatives: jax.typing.ArrayLike,
    axis: int = -1,
    norm_degree: jax.typing.ArrayLike = 2,
    margin: jax.typing.ArrayLike = 1.0,
    eps: jax.typing.ArrayLike = 1e-6,
) -> jax.Array:
    r"""Triplet margin loss (Balntas et al., 2016).

    .. math::
       d(u, v) = \Bigl(\sum_i |u_i - v_i|^{q} + \varepsilon\Bigr)^{1/q},\qquad
       \ell = \max\bigl(d(a, p) - d(a, n) + m,\ 0\bigr)

    (Optax raises :math:`u_i - v_i` to the power without the absolute value;
    the two agree for even ``norm_degree``, and this one is a norm for every
    :math:`q \ge 1`.)

    Args:
      anchors: floating ``[..., dim]``.
      positives: floating ``[..., dim]``, broadcastable with ``anchors``.
      negatives: floating ``[..., dim]``, broadcastable with ``anchors``.
      axis: the feature axis.
      norm_degree: :math:`q`.
      margin: :math:`m`.
      eps: :math:`\varepsilon`, keeps the root differentiable at 0.

    >>> from cairn import optim
    >>> a = jnp.array([[0.0, 0.0]]); p = jnp.array([[0.0, 0.1]]); n = jnp.array([[1.0, 0.0]])
    >>> print(f"{float(optim.triplet_margin_loss(a, p, n)[0]):.4f}")
    0.1000
    """
    fn = "triplet_margin_loss"
    a = _float(fn, "anchors", anchors)
    p = _float(fn, "positives", positives)
    ng = _float(fn, "negatives", negatives)
    shape = _broadcast(fn, ("anchors", a), ("positives", p), ("negatives", ng))
    (ax,) = _canonical_axes(fn, axis, len(shape))
    dtype = jnp.result_type(a, p, ng)
    aw, pw, nw = _wide(a), _wide(p), _wide(ng)

    def dist(u, v):
        return (jnp.sum(jnp.abs(u - v) ** norm_degree, axis=ax) + eps) ** (1.0 / norm_degree)

    return jnp.maximum(dist(aw, pw) - dist(aw, nw) + margin, 0.0).astype(dtype)


def ranking_softmax_loss(
    logits: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    *,
    where: jax.typing.ArrayLike | None = None,
    weights: jax.typing.ArrayLike | None = None,
    reduce_fn: Callable[..., jax.Array] | None = jnp.mean,
) -> jax.Array:
    r"""Listwise softmax ranking loss over the last axis.

    .. math:: \ell(s, y) = -\sum_i w_i\,y_i \log\frac{e^{s_i}}{\sum_{j \in V} e^{s_j}}

    with :math:`V` the valid items (``where``). Lists with no valid item are
    left out of the reduction (loss 0 when unreduced); a mean over no valid
    list is 0.

    Args:
      logits: floating scores ``[..., list_size]``.
      labels: relevance labels, same shape.
      where: optional validity mask, same shape.
      weights: optional per-item weights, same shape.
      reduce_fn: ``jnp.mean`` (default), ``jnp.sum``, or None for the
        per-list losses ``[...]``.

    >>> from cairn import optim
    >>> print(optim.ranking_softmax_loss(jnp.array([1.0, 2.0, 3.0]), jnp.array([0.0, 0.0, 1.0])).round(4))
    0.4076
    """
    fn = "ranking_softmax_loss"
    s = _float(fn, "logits", logits)
    y = jnp.asarray(labels)
    _same_shape(fn, "logits", s, "labels", y)
    sw = _wide(s)
    y = y.astype(sw.dtype)
    if weights is not None:
        w = jnp.asarray(weights)
        _same_shape(fn, "logits", s, "weights", w)
        y = y * w.astype(sw.dtype)
    list_valid = None
    if where is not None:
        where = jnp.asarray(where, dtype=bool)
        _same_shape(fn, "logits", s, "where", where)
        list_valid = jnp.any(where, axis=-1)
        y = jnp.where(where, y, 0.0)
        mask = where | ~list_valid[..., None]
    else:
        mask = None
    axes = (sw.ndim - 1,)
    logp = _log_softmax(sw, axes, mask)
    terms = y * (jnp.where(mask, logp, 0.0) if mask is not None else logp)
    loss = -jnp.sum(terms, axis=-1)
    if list_valid is not None:
        loss = jnp.where(list_valid, loss, 0.0)
    if reduce_fn is None:
        return loss.astype(s.dtype)
    if list_valid is None:
        return reduce_fn(loss).astype(s.dtype)
    out = reduce_fn(loss, where=list_valid)
    if reduce_fn is jnp.mean:
        out = jnp.where(jnp.any(list_valid), out, 0.0)
    return out.astype(s.dtype)


def generalized_kl_divergence(
    log_predictions: jax.typing.ArrayLike,
    targets: jax.typing.ArrayLike,
    axis: Axis = -1,
    where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Optax's name for :func:`convex_kl_divergence`:
    :math:`\sum_j t_j(\log t_j - \log p_j) + p_j - t_j`.

    Args:
      log_predictions: :math:`\log p`, log of the (possibly unnormalised) predicted measure.
      targets: :math:`t \ge 0`, same shape as ``log_predictions`` (or broadcastable).
      axis: the axis (or axes) summed over.
      where: optional bool mask, broadcastable to the inputs; False elements are left out.

    >>> from cairn import optim
    >>> p = jnp.log(jnp.array([1.0, 1.0]))
    >>> print(optim.generalized_kl_divergence(p, jnp.array([1.0, 0.0])).round(4))
    1.0
    """
    return _kl("generalized_kl_divergence", log_predictions, targets, axis, where, convex=True)


def kl_divergence_with_log_targets(
    log_predictions: jax.typing.ArrayLike,
    log_targets: jax.typing.ArrayLike,
    axis: Axis = -1,
    where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""KL divergence with the targets in log space: :math:`\sum_j e^{\ell_j}(\ell_j -
    \log p_j)` for :math:`\ell = \log t`.

    Args:
      log_predictions: :math:`\log p`, the predicted log-probabilities.
      log_targets: :math:`\ell = \log t`, the target log-probabilities, broadcastable to
        ``log_predictions``.
      axis: the axis (or axes) summed over.
      where: optional bool mask, broadcastable to the inputs; False elements are left out.

    >>> from cairn import optim
    >>> lp = jnp.log(jnp.array([0.5, 0.5]))
    >>> print(optim.kl_divergence_with_log_targets(lp, jnp.log(jnp.array([0.9, 0.1]))).round(4))
    0.3681
    """
    fn = "kl_divergence_with_log_targets"
    lp, lt, axes, where, dtype = _paired(fn, "log_predictions", log_predictions,
                                         "log_targets", log_targets, axis, where)
    lpw, ltw = _wide(lp), _wide(lt)
    return jnp.sum(jnp.exp(ltw) * (ltw - lpw), axis=axes, where=where).astype(dtype)


def perceptron_loss(
    predictor_outputs: jax.typing.ArrayLike,
    targets: jax.typing.ArrayLike,
) -> jax.Array:
    r"""Binary perceptron loss :math:`\max(0, -s\,y)` for targets :math:`y \in \{-1, 1\}`.

    Args:
      predictor_outputs: the scores :math:`s`.
      targets: :math:`y \in \{-1, 1\}`, same shape as ``predictor_outputs``.

    >>> from cairn import optim
    >>> optim.perceptron_loss(jnp.array([2.0, -0.5]), jnp.array([1.0, 1.0]))
    Array([0. , 0.5], dtype=float32)

    Returns:
      the element-wise loss.
    """
    s = jnp.asarray(predictor_outputs)
    y = jnp.asarray(targets)
    _same_shape("perceptron_loss", "predictor_outputs", s, "targets", y)
    return jnp.maximum(0, -s * y)


def _margin(fn: str, scores: Any, labels: Any, margin: float) -> jax.Array:
    s = jnp.asarray(scores)
    y = jnp.asarray(labels)
    if s.shape[:-1] != y.shape or not jnp.issubdtype(y.dtype, jnp.integer):
        raise ValueError(f"{fn}: `labels` must be integers of shape scores.shape[:-1]="
                         f"{s.shape[:-1]}, got {y.dtype} of shape {y.shape}")
    true = jnp.take_along_axis(s, y[..., None], axis=-1)[..., 0]
    off = margin * (1 - jax.nn.one_hot(y, s.shape[-1], dtype=s.dtype))
    return jnp.max(s + off, axis=-1) - true


def multiclass_perceptron_loss(scores: jax.typing.ArrayLike,
                               labels: jax.typing.ArrayLike) -> jax.Array:
    r"""Multiclass perceptron loss :math:`\max_j s_j - s_y`.

    Args:
      scores: ``[..., K]`` class scores.
      labels: int class ids of shape ``scores.shape[:-1]``.

    Raises:
      ValueError: ``labels`` not integers of shape ``scores.shape[:-1]``.

    >>> from cairn import optim
    >>> optim.multiclass_perceptron_loss(jnp.array([[1.0, 3.0, 2.0]]), jnp.array([2]))
    Array([1.], dtype=float32)

    Returns:
      the loss, shape ``scores.shape[:-1]``.
    """
    return _margin("multiclass_perceptron_loss", scores, labels, 0.0)


def multiclass_hinge_loss(scores: jax.typing.ArrayLike,
                          labels: jax.typing.ArrayLike) -> jax.Array:
    r"""Multiclass hinge loss :math:`\max_j (s_j + [j \ne y]) - s_y`.

    Args:
      scores: ``[..., K]`` class scores.
      labels: int class ids of shape ``scores.shape[:-1]``.

    Raises:
      ValueError: ``labels`` not integers of shape ``scores.shape[:-1]``.

    >>> from cairn import optim
    >>> optim.multiclass_hinge_loss(jnp.array([[1.0, 3.0, 2.0]]), jnp.array([2]))
    Array([2.], dtype=float32)

    Returns:
      the loss, shape ``scores.shape[:-1]``.
    """
    return _margin("multiclass_hinge_loss", scores, labels, 1.0)


def sparsemax_loss(logits: jax.typing.ArrayLike, labels: jax.typing.ArrayLike) -> jax.Array:
    r"""Binary sparsemax loss (Blondel, Martins and Niculae, "Learning with Fenchel-Young
    losses", 2020, sec. 4.4): with :math:`z = -x` for label 1 and :math:`z = x` for label 0,

    .. math::

        \ell = \begin{cases} 0 & z \le -1 \\ (z+1)^2/4 & -1 < z < 1 \\ z & z \ge 1\end{cases}

    zero exactly when the sparse sigmoid of ``logits`` equals ``labels``.

    Args:
      logits: floating scores, any shape.
      labels: 0/1 (or bool) of a shape that broadcasts with ``logits``.

    >>> from cairn import optim
    >>> print(optim.losses.sparsemax_loss(jnp.array([2.0, 0.0, -0.5]), jnp.array([1, 1, 0])))
    [0.     0.25   0.0625]
    """
    fn = "sparsemax_loss"
    x = _float(fn, "logits", logits)
    y = jnp.asarray(labels)
    _broadcast(fn, ("logits", x), ("labels", y))
    xw = _wide(x)
    z = jnp.where(y != 0, -xw, xw)
    quad = jnp.square(jnp.clip(z, -1.0, 1.0) + 1.0) / 4.0
    return jnp.where(z >= 1.0, z, quad).astype(x.dtype)


def _sparsemax(s: jax.Array) -> jax.Array:
    r"""Euclidean projection of each row (last axis) onto the probability simplex (Martins
    and Astudillo, 2016): :math:`p = \max(s - \tau, 0)`, :math:`\tau` from the sorted
    scores."""
    k = s.shape[-1]
    desc = -jnp.sort(-s, axis=-1)
    cumsum = jnp.cumsum(desc, axis=-1)
    ranks = jnp.arange(1, k + 1, dtype=s.dtype)
    support = (1.0 + ranks * desc) > cumsum
    size = jnp.sum(support, axis=-1, keepdims=True)
    tau = (jnp.take_along_axis(cumsum, size - 1, axis=-1) - 1.0) / size.astype(s.dtype)
    return jnp.maximum(s - tau, 0.0)


def multiclass_sparsemax_loss(scores: jax.typing.ArrayLike,
                              labels: jax.typing.ArrayLike) -> jax.Array:
    r"""Multiclass sparsemax loss (Martins and Astudillo, 2016), the Fenchel-Young loss of
    the Gini entropy: with :math:`p = \operatorname{sparsemax}(s)`,

    .. math:: \ell = \langle p, s\rangle - s_y + \tfrac12\bigl(1 - \lVert p\rVert^2\bigr)

    with gradient :math:`p - e_y` and Hessian the Jacobian of sparsemax (both by autodiff
    through the sort). Zero exactly when sparsemax puts all mass on :math:`y`.

    Args:
      scores: floating ``[..., K]``.
      labels: integer ``[...]`` in ``[0, K)``.

    Raises:
      ValueError: ``labels`` not integers of shape ``scores.shape[:-1]``, or (when concrete)
        outside ``[0, K)``.

    >>> from cairn import optim
    >>> print(optim.losses.multiclass_sparsemax_loss(jnp.array([[1.0, 0.5, -2.0]]), jnp.array([1])))
    [0.5625]
    """
    fn = "multiclass_sparsemax_loss"
    s = _float(fn, "scores", scores)
    y = jnp.asarray(labels)
    if s.ndim < 1 or s.shape[:-1] != y.shape or not jnp.issubdtype(y.dtype, jnp.integer):
        raise ValueError(f"{fn}: `labels` must be integers of shape scores.shape[:-1]="
                         f"{s.shape[:-1]}, got {y.dtype} of shape {y.shape}")
    if not isinstance(labels, jax.core.Tracer) and y.size:
        _check_label_range(fn, labels, s.shape[-1])
    sw = _wide(s)
    p = _sparsemax(sw)
    true = jnp.take_along_axis(sw, y[..., None].astype(jnp.int32), axis=-1)[..., 0]
    out = jnp.sum(p * sw, axis=-1) - true + 0.5 * (1.0 - jnp.sum(p * p, axis=-1))
    return out.astype(s.dtype)
