"""The gateway's Prometheus metrics: request instruments, and a collector for worker and policy state.

Instruments are observed on the hot path (a few per request, one histogram observation per token
event for inter-token latency); per-worker figures (load as routing sees it, health, breaker) are
read at scrape time by ``WorkerCollector``, so they cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BREAKER_STATES = ("closed", "half_open", "open")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pd_gateway_requests", "Requests by route and HTTP status", ["route", "status"],
                                registry=r)
        self.active = Gauge("pd_gateway_active_requests", "Requests being served", registry=r)
        self.queued = Gauge("pd_gateway_queued_requests", "Requests waiting for admission", registry=r)
        self.queue_time = Histogram("pd_gateway_queue_time_seconds", "Time waiting for admission",
                                    buckets=LATENCY_BUCKETS_S, registry=r)
        self.rejected = Counter("pd_gateway_rejected_requests", "Requests refused by admission or drain",
                                ["reason"], registry=r)
        self.ttft = Histogram("pd_gateway_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("pd_gateway_inter_token_latency_seconds", "Gap between a stream's tokens",
                             buckets=TOKEN_GAP_BUCKETS_S, registry=r)
        self.e2e = Histogram("pd_gateway_e2e_request_latency_seconds", "Request arrival to its last token",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("pd_gateway_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("pd_gateway_cached_prompt_tokens", "Prompt tokens served from prefix caches",
                                     registry=r)
        self.generation_tokens = Counter("pd_gateway_generation_tokens", "Tokens generated", registry=r)
        self.retries = Counter("pd_gateway_retries", "Attempts retried on a new pair before the first token",
                               ["reason"], registry=r)
        self.worker_failures = Counter("pd_gateway_worker_failures", "Request failures blamed on a worker",
                                       ["worker", "role", "code"], registry=r)
        self.transfer_failures = Counter("pd_gateway_kv_transfer_failures", "Requests whose KV transfer failed",
                                         ["role"], registry=r)

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)


class WorkerCollector(Collector):
    """Per-worker routing state, health and breaker, and policy stats, read at scrape time."""

    def __init__(self, clients: Callable[[], Sequence[Any]], policy_stats: Callable[[], dict[str, float]]) -> None:
        self._clients = clients
        self._policy_stats = policy_stats

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["worker", "role"]
        gauges = {
            "prefill_tokens": "Prompt tokens queued or running (worker report + unacknowledged dispatches)",
            "running_seqs": "Sequences holding KV on the worker",
            "waiting_seqs": "Sequences admitted but waiting",
            "free_pages": "KV pages free after admitted and reserved requests",
            "active_requests": "Requests this gateway has open on the worker",
            "load_fresh": "1 if the worker's load report is fresh",
            "healthy": "1 if the worker is selectable (connected, passing probes, breaker not open)",
            "connected": "1 if the gateway's connection to the worker is up",
            "probe_failures": "Health probes the worker failed (total)",
        }
        families = {k: GaugeMetricFamily(f"pd_gateway_worker_{k}", doc, labels=labels) for k, doc in gauges.items()}
        breaker = GaugeMetricFamily("pd_gateway_worker_breaker_state", "1 for the breaker's current state",
                                    labels=[*labels, "state"])
        for c in self._clients():
            st, key = c.state, [c.url, c.role]
            values = {
                "prefill_tokens": st.num_prefill_tokens, "running_seqs": st.num_running_seqs,
                "waiting_seqs": st.num_waiting_seqs, "free_pages": st.num_free_pages,
                "active_requests": st.num_active, "load_fresh": float(st.is_load_fresh),
                "healthy": float(c.healthy), "connected": float(c.is_connected),
                "probe_failures": c.health.num_probe_failures,
            }
            for name, value in values.items():
                families[name].add_metric(key, value)
            current = c.health.breaker.state.value
            for state in BREAKER_STATES:
                breaker.add_metric([*key, state], 1.0 if state == current else 0.0)
        yield from families.values()
        yield breaker
        stats = GaugeMetricFamily("pd_gateway_policy_stat", "Figures the routing policies report", labels=["stat"])
        for name, value in self._policy_stats().items():
            stats.add_metric([name], value)
        yield stats
