"""Prometheus metrics in the text exposition format (counters, gauges, histograms).

Every metric is updated on the server's event-loop thread only, so no locks. Names
follow Prometheus conventions (``_total`` counters, ``_seconds`` histograms) and carry
``model`` and ``version`` labels; ``cairn_inference_exec_total`` counts model executions,
so the mean batch size is ``cairn_inference_count_total / cairn_inference_exec_total``
(Triton's ``nv_inference_count / nv_inference_exec_count``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

Labels = tuple[tuple[str, str], ...]

_TIME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _fmt_labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{_escape(v)}"' for k, v in labels]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Metric:
    def __init__(self, name: str, help: str, kind: str) -> None:
        self.name, self.help, self.kind = name, help, kind

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing count per label set."""

    def __init__(self, name: str, help: str) -> None:
        super().__init__(name, help, "counter")
        self.values: dict[Labels, float] = {}

    def inc(self, labels: Labels, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{_fmt_labels(k)} {_num(v)}" for k, v in sorted(self.values.items())]


class Gauge(Counter):
    """A value that goes up and down per label set."""

    def __init__(self, name: str, help: str) -> None:
        super().__init__(name, help)
        self.kind = "gauge"

    def set(self, labels: Labels, value: float) -> None:
        self.values[labels] = value


class Histogram(_Metric):
    """Cumulative buckets, a sum and a count per label set."""

    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help, "histogram")
        self.buckets = tuple(buckets)
        self.values: dict[Labels, list[float]] = {}  # per-bucket counts (+Inf last), then sum

    def observe(self, labels: Labels, value: float) -> None:
        row = self.values.get(labels)
        if row is None:
            row = self.values[labels] = [0.0] * (len(self.buckets) + 2)
        row[bisect.bisect_left(self.buckets, value)] += 1
        row[-1] += value

    def render(self) -> list[str]:
        lines = self.header()
        for labels, row in sorted(self.values.items()):
            total = 0.0
            bounds = [_num(b) for b in self.buckets] + ["+Inf"]
            for le, count in zip(bounds, row[:-1]):
                total += count
                lines.append(f"{self.name}_bucket{_fmt_labels(labels, 'le=' + repr(le).replace(chr(39), chr(34)))} {_num(total)}")
            lines.append(f"{self.name}_sum{_fmt_labels(labels)} {row[-1]!r}")
            lines.append(f"{self.name}_count{_fmt_labels(labels)} {_num(total)}")
        return lines


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class Metrics:
    """The server's metrics; :meth:`render` is the ``/metrics`` body."""

    def __init__(self) -> None:
        self.success = Counter("cairn_inference_request_success_total", "Inference requests answered 200.")
        self.failure = Counter("cairn_inference_request_failure_total", "Inference requests answered with an error, by reason.")
        self.count = Counter("cairn_inference_count_total", "Rows (batch entries) inferred.")
        self.execs = Counter("cairn_inference_exec_total", "Model executions (batches).")
        self.queue_time = Histogram("cairn_inference_queue_duration_seconds", "Time from enqueue to batch start.", _TIME_BUCKETS)
        self.compute_time = Histogram("cairn_inference_compute_duration_seconds", "Model execution time per batch.", _TIME_BUCKETS)
        self.request_time = Histogram(
            "cairn_inference_request_duration_seconds", "Inference request time, from parsed to answered.", _TIME_BUCKETS
        )
        self.batch_size = Histogram("cairn_inference_batch_size", "Rows per model execution (before padding).", _BATCH_BUCKETS)
        self.padded_size = Histogram("cairn_inference_padded_batch_size", "Rows per model execution after padding to a bucket.", _BATCH_BUCKETS)
        self.queue_size = Gauge("cairn_inference_queue_size", "Requests waiting in a model's batch queue.")
        self.http = Counter("cairn_http_requests_total", "HTTP responses by status code.")
        self.gen_requests = Counter("cairn_generation_requests_total", "Generation requests finished, by finish_reason (length, stop, cancelled, error).")
        self.gen_failure = Counter("cairn_generation_request_failure_total", "Generation requests refused before running, by reason.")
        self.gen_prompt_tokens = Counter("cairn_generation_prompt_tokens_total", "Prompt tokens of the generation requests admitted.")
        self.gen_tokens = Counter("cairn_generation_output_tokens_total", "Tokens generated.")
        self.gen_ttft = Histogram("cairn_generation_time_to_first_token_seconds", "Time from parsed request to its first token.", _TIME_BUCKETS)
        self.gen_time = Histogram("cairn_generation_request_duration_seconds", "Generation request time, from parsed to last token.", _TIME_BUCKETS)
        self.gen_queue = Gauge("cairn_generation_queue_size", "Generation requests waiting for a KV-cache slot.")
        self.gen_active = Gauge("cairn_generation_active_slots", "KV-cache slots holding a running sequence.")
        self.prefix_queries = Counter("cairn_prefix_cache_query_tokens_total",
                                      "Prompt tokens admitted by a paged generation engine (prefix-cache lookups).")
        self.prefix_hits = Counter("cairn_prefix_cache_hit_tokens_total",
                                   "Of those, tokens whose keys and values came from the prefix cache (not prefilled).")
        self.kv_usage = Gauge("cairn_kv_cache_usage_ratio", "Paged KV-cache blocks held by running sequences / all blocks.")
        self.preemptions = Counter("cairn_generation_preemptions_total",
                                   "Running requests a paged generation engine preempted for want of KV blocks (recomputed later).")
        self.openai = Counter("cairn_openai_requests_total", "OpenAI API requests (/v1/...) answered, by route and status code.")
        self.all: list[Counter | Histogram] = [
            self.success,
            self.failure,
            self.count,
            self.execs,
            self.queue_time,
            self.compute_time,
            self.request_time,
            self.batch_size,
            self.padded_size,
            self.queue_size,
            self.http,
            self.gen_requests,
            self.gen_failure,
            self.gen_prompt_tokens,
            self.gen_tokens,
            self.gen_ttft,
            self.gen_time,
            self.gen_queue,
            self.gen_active,
            self.prefix_queries,
            self.prefix_hits,
            self.kv_usage,
            self.preemptions,
            self.openai,
        ]

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4)."""
        lines: list[str] = []
        for metric in self.all:
            lines.extend(metric.render())
        return ("\n".join(lines) + "\n").encode()
