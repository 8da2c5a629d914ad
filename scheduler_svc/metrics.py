"""Prometheus metrics of the scheduler service, on an HTTP port of their own.

Gauges and engine counters are read from the engine's last stats when scraped (the engine
process sends them with every step: scheduler_svc.engine_wire.EngineStats); latencies and
token counts are observed by the Generate handler per message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector:
    """Queue lengths, pool usage and engine counters, read at scrape time."""

    def __init__(self, get_stats: Callable[[], Any]) -> None:
        self.get_stats = get_stats

    def describe(self) -> list[Metric]:
        return []  # collected lazily; nothing to register up front

    def collect(self) -> Iterator[Metric]:
        stats = self.get_stats()
        if stats is None:
            return
        queues = GaugeMetricFamily("picovllm_num_requests", "Requests per scheduler queue", labels=["state"])
        queues.add_metric(["running"], stats.num_running)
        queues.add_metric(["waiting"], stats.num_waiting)
        queues.add_metric(["swapped"], stats.num_swapped)
        yield queues
        usage = GaugeMetricFamily(
            "picovllm_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", labels=["pool"]
        )
        usage.add_metric(["device"], stats.device_usage)
        usage.add_metric(["host"], stats.host_usage)
        yield usage
        yield CounterMetricFamily(
            "picovllm_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=stats.num_prefix_queries,
        )
        yield CounterMetricFamily(
            "picovllm_prefix_cache_hits", "Prompt tokens served from the prefix cache", value=stats.num_prefix_hits
        )
        yield CounterMetricFamily(
            "picovllm_num_preemptions", "Requests preempted (swap or recompute)", value=stats.num_preemptions
        )


class SchedulerMetrics:
    def __init__(self, get_stats: Callable[[], Any]) -> None:
        """`get_stats`: the engine's last EngineStats, or None before there is an engine."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(get_stats))
        r = self.registry
        self.ttft = Histogram(
            "picovllm_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "picovllm_inter_token_latency_seconds", "Time between streamed tokens", buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "picovllm_e2e_request_latency_seconds",
            "Request latency, arrival to finish",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("picovllm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("picovllm_generation_tokens", "Tokens generated", registry=r)
        # finish_reason: stop, length or abort (finished), cancelled (the client went away) or
        # error (failed after admission: a request refused at admission is not counted)
        self.requests = Counter("picovllm_requests", "Requests by how they ended", ["finish_reason"], registry=r)

    def serve(self, port: int, host: str = "127.0.0.1") -> str:
        """Serve /metrics on host:port; returns its URL. ListenError when the port is taken."""
        from contracts.metrics_http import serve_metrics

        return serve_metrics(self.registry, port, host)


class StreamTimer:
    """Latency bookkeeping of one Generate stream."""

    def __init__(self, metrics: SchedulerMetrics | None, now: float) -> None:
        self.metrics = metrics
        self.start = now
        self.last_token: float | None = None

    def on_output(self, now: float, num_new_tokens: int) -> None:
        m = self.metrics
        if m is None or num_new_tokens == 0:
            return
        if self.last_token is None:
            m.ttft.observe(now - self.start)
        else:
            m.itl.observe((now - self.last_token) / num_new_tokens)
        m.generation_tokens.inc(num_new_tokens)
        self.last_token = now

    def on_finish(self, now: float, num_prompt_tokens: int, finish_reason: str | None) -> None:
        m = self.metrics
        if m is None:
            return
        m.e2e.observe(now - self.start)
        m.prompt_tokens.inc(num_prompt_tokens)
        m.requests.labels(finish_reason or "unknown").inc()
