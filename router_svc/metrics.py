"""Prometheus metrics of the router, on an HTTP port of their own (router.metrics_port)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from contracts.metrics_http import serve_metrics
from router_svc.replicas import ReplicaSet

_DECISION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_HIT_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _ReplicaCollector:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("picovllm_router_replica_up", "1 while the replica is routed to", labels=["replica"])
        load = GaugeMetricFamily("picovllm_router_replica_load", "Waiting + running requests", labels=["replica"])
        routable = {r.address for r in self.replicas.routable()}
        for r in self.replicas.replicas:
            up.add_metric([r.address], float(r.address in routable))
            load.add_metric([r.address], float(r.load))
        yield up
        yield load


class RouterMetrics:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter(
            "picovllm_router_requests", "Requests sent to each replica", ["replica"], registry=self.registry
        )
        self.retries = Counter(
            "picovllm_router_retries", "Requests sent again, elsewhere, before any token", registry=self.registry
        )
        self.hit_tokens = Histogram(
            "picovllm_router_prefix_hit_tokens",
            "Prompt tokens the chosen replica held, as the router saw it when routing",
            buckets=_HIT_BUCKETS,
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "picovllm_router_decision_seconds",
            "From a request's arrival to its replica chosen (tokenizing and the index lookup)",
            buckets=_DECISION_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_ReplicaCollector(replicas))

    def serve(self, port: int, host: str = "127.0.0.1") -> str:
        return serve_metrics(self.registry, port, host)
