"""Metrics: modules that accumulate statistics across batches (state in
:class:`MetricState` variables, so they work inside ``nn.jit``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from cairn.nn._module import Module
from cairn.nn._variables import Variable


class MetricState(Variable):
    """Accumulated state of a metric."""

    __slots__ = ()


class Metric(Module):
    """Base class: ``update(**kwargs)`` accumulates, ``compute()`` reads, ``reset()``
    clears."""

    def reset(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def update(self, **kwargs: Any) -> None:  # pragma: no cover - abstract
        """Add a batch to the accumulated state.

        Args:
          kwargs: the named values the metric reads (each metric takes what it needs).
        """
        raise NotImplementedError

    def compute(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


def _get(kwargs: dict, name: str, metric: str):
    if name not in kwargs:
        raise TypeError(
            f"{metric}.update: expected keyword argument {name!r}, got {sorted(kwargs)}"
        )
    return jnp.asarray(kwargs[name])


class Average(Metric):
    """Mean of every value passed as ``update(values=...)`` (arrays are averaged over
    all their elements; ``argname`` renames the keyword).

    Args:
      argname: the keyword ``update`` reads the values from.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> m = nn.metrics.Average()
    >>> m.update(values=jnp.array([1.0, 2.0])); m.update(values=jnp.array(6.0))
    >>> float(m.compute())
    3.0
    """

    def __init__(self, argname: str = "values") -> None:
        self.argname = argname
        self.total = MetricState(jnp.zeros((), jnp.float32))
        self.count = MetricState(jnp.zeros((), jnp.int32))

    def reset(self) -> None:
        self.total.value = jnp.zeros((), jnp.float32)
        self.count.value = jnp.zeros((), jnp.int32)

    def update(self, **kwargs: Any) -> None:
        """Add the values given under ``argname``.

        Args:
          kwargs: the values under ``argname`` (an array or scalar); other keywords are ignored.
        """
        values = _get(kwargs, self.argname, type(self).__name__)
        self.total.value = self.total.value + values.astype(jnp.float32).sum()
        self.count.value = self.count.value + values.size

    def compute(self) -> jax.Array:
        return self.total.value / self.count.value


class Accuracy(Average):
    """Fraction of correct predictions: ``update(logits=..., labels=...)`` with
    ``logits`` of shape ``labels.shape + (classes,)`` (argmax), or of the same shape as
    integer ``labels`` when ``threshold`` is given (binary: ``logits > threshold``).

    Args:
      threshold: None for argmax over the last axis of ``logits``; a float for binary predictions
        ``logits > threshold``.
    """

    def __init__(self, threshold: float | None = None) -> None:
        super().__init__("values")
        self.threshold = threshold

    def update(self, **kwargs: Any) -> None:
        """Add a batch of predictions.

        Args:
          kwargs: ``logits`` and integer ``labels`` (other keywords are ignored).

        Raises:
          TypeError: labels that are not integers.
        """
        logits = _get(kwargs, "logits", "Accuracy")
        labels = _get(kwargs, "labels", "Accuracy")
        if not jnp.issubdtype(labels.dtype, jnp.integer) and labels.dtype != jnp.bool_:
            raise TypeError(f"Accuracy: labels must be integers, got {labels.dtype}")
        if self.threshold is not None:
            if logits.shape != labels.shape:
                raise ValueError(
                    f"Accuracy(threshold=...): logits shape {logits.shape} must equal labels "
                    f"shape {labels.shape}"
                )
            pred = (logits > self.threshold).astype(labels.dtype)
        else:
            if logits.shape[:-1] != labels.shape:
                raise ValueError(
                    f"Accuracy: logits shape {logits.shape} must be labels shape "
                    f"{labels.shape} plus a class axis"
                )
            pred = jnp.argmax(logits, axis=-1)
        super().update(values=(pred == labels))


@dataclasses.dataclass(frozen=True)
class Statistics:
    """What :class:`Welford` computes.

    Args:
      mean: the mean of every value seen.
      standard_error_of_mean: the standard deviation divided by the square root of the count.
      standard_deviation: the population standard deviation.
    """
    mean: jax.Array
    standard_error_of_mean: jax.Array
    standard_deviation: jax.Array


jax.tree_util.register_dataclass(
    Statistics,
    data_fields=["mean", "standard_error_of_mean", "standard_deviation"],
    meta_fields=[],
)


class Welford(Metric):
    """Running mean and (population) standard deviation of all values passed as
    ``update(values=...)``, merged batch by batch with Chan et al.'s parallel update
    (numerically stable). ``compute()`` returns :class:`Statistics`.

    Args:
      argname: the keyword ``update`` reads the values from.
    """

    def __init__(self, argname: str = "values") -> None:
        self.argname = argname
        self.count = MetricState(jnp.zeros((), jnp.float32))
        self.mean = MetricState(jnp.zeros((), jnp.float32))
        self.m2 = MetricState(jnp.zeros((), jnp.float32))

    def reset(self) -> None:
        for v in (self.count, self.mean, self.m2):
            v.value = jnp.zeros((), jnp.float32)

    def update(self, **kwargs: Any) -> None:
        """Merge the values given under ``argname`` into the running statistics.

        Args:
          kwargs: the values under ``argname`` (flattened); other keywords are ignored.
        """
        x = _get(kwargs, self.argname, "Welford").astype(jnp.float32).reshape(-1)
        nb = jnp.float32(x.size)
        if x.size == 0:
            return
        mb = x.mean()
        m2b = ((x - mb) ** 2).sum()
        na = self.count.value
        n = na + nb
        delta = mb - self.mean.value
        self.mean.value = self.mean.value + delta * nb / n
        self.m2.value = self.m2.value + m2b + delta**2 * na * nb / n
        self.count.value = n

    def compute(self) -> Statistics:
        var = self.m2.value / self.count.value
        std = jnp.sqrt(var)
        return Statistics(self.mean.value, std / jnp.sqrt(self.count.value), std)


class MultiMetric(Metric):
    """Several named metrics updated together: ``update(**kwargs)`` passes every keyword
    to each metric (each takes what it needs); ``compute()`` returns a dict.

    Args:
      metrics: the named :class:`Metric` s.

    Raises:
      TypeError: a value is not a :class:`Metric`.
    """

    def __init__(self, **metrics: Metric) -> None:
        for name, m in metrics.items():
            if not isinstance(m, Metric):
                raise TypeError(f"MultiMetric: {name!r} is a {type(m).__name__}, not a Metric")
            setattr(self, name, m)
        self._metric_names = tuple(metrics)

    def reset(self) -> None:
        for n in self._metric_names:
            getattr(self, n).reset()

    def update(self, **kwargs: Any) -> None:
        """Update every metric with the same keyword arguments.

        Args:
          kwargs: passed to every metric's ``update`` (each takes what it needs).
        """
        for n in self._metric_names:
            getattr(self, n).update(**kwargs)

    def compute(self) -> dict[str, Any]:
        return {n: getattr(self, n).compute() for n in self._metric_names}
