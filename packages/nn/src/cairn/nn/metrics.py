"""Metrics that accumulate across batches: ``Average``, ``Accuracy``, ``Welford``,
``MultiMetric`` (NNX names)."""

from cairn.nn._metrics import (
    Accuracy,
    Average,
    Metric,
    MetricState,
    MultiMetric,
    Statistics,
    Welford,
)

__all__ = [
    "Accuracy",
    "Average",
    "Metric",
    "MetricState",
    "MultiMetric",
    "Statistics",
    "Welford",
]
