"""The gateway's Prometheus metrics: request instruments, and a collector for worker and policy state.

Instruments are observed on the hot path (a few per request, one histogram observation per token
event for inter-token latency). Everything that touches them runs on the one event loop, scrapes
included, so they are plain numbers with no lock (prometheus_client's own instruments take a lock
per increment and walk the buckets in Python: a few µs per request and per token); ``_Instruments``
turns them into metric families at scrape time. Per-worker figures (load as routing sees it, health,
breaker) are read at scrape time by ``WorkerCollector``, and the client port's connections under
``--max-client-connections`` by ``ClientConnectionCollector``, the Responses API's store by
``ResponseStoreCollector``, so they cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.http_connections import ConnectionCap, cap_metrics
from workers.metrics import PlainHistogram

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                     1800.0)  # (up to the default --request-timeout-s)
TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BREAKER_STATES = ("closed", "half_open", "open")
_I = TypeVar("_I", "Family", "Histogram")


class Value:
    """One counter or gauge sample: a plain number (event-loop thread only)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class Family:
    """A counter or gauge: unlabelled (``inc``/``dec``/``set`` on the family) or by ``labels(...)``."""

    def __init__(self, kind: str, name: str, doc: str, labelnames: Sequence[str] = ()) -> None:
        self.kind, self.name, self.doc, self.labelnames = kind, name, doc, tuple(labelnames)
        self._children: dict[tuple[str, ...], Value] = {}
        self._value = Value()
        if not self.labelnames:
            self._children[()] = self._value
        self.inc, self.dec, self.set = self._value.inc, self._value.dec, self._value.set

    def labels(self, *values: str) -> Value:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = Value()
        return child

    def forget(self, label: str, value: str) -> None:
        """Drop the children whose ``label`` is ``value`` (a removed worker's series)."""
        at = self.labelnames.index(label)
        for values in [v for v in self._children if v[at] == value]:
            del self._children[values]

    def family(self) -> Metric:
        cls = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        family = cls(self.name, self.doc, labels=list(self.labelnames))
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        return family


class Histogram(PlainHistogram):
    """An unlabelled histogram (``observe``: one bisect and two adds)."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float]) -> None:
        super().__init__(buckets)
        self.name, self.doc = name, doc

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.doc, labels=[])
        buckets, total = self.buckets()
        family.add_metric([], buckets, total)
        return family


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._instruments: list[Family | Histogram] = []
        add = self._add
        self.requests = add(Family("counter", "pd_gateway_requests", "Requests by route and HTTP status",
                                   ["route", "status"]))
        self.active = add(Family("gauge", "pd_gateway_active_requests", "Requests being served"))
        self.queued = add(Family("gauge", "pd_gateway_queued_requests", "Requests waiting for admission"))
        self.queue_time = add(Histogram("pd_gateway_queue_time_seconds", "Time waiting for admission",
                                        LATENCY_BUCKETS_S))
        self.rejected = add(Family("counter", "pd_gateway_rejected_requests",
                                   "Requests refused by admission, the drain or a wrong key",
                                   ["reason"]))
        self.ttft = add(Histogram("pd_gateway_time_to_first_token_seconds", "Request arrival to its first token",
                                  LATENCY_BUCKETS_S))
        self.itl = add(Histogram("pd_gateway_inter_token_latency_seconds", "Gap between a response's tokens",
                                 TOKEN_GAP_BUCKETS_S))
        self.e2e = add(Histogram("pd_gateway_e2e_request_latency_seconds", "Request arrival to its last token",
                                 LATENCY_BUCKETS_S))
        self.prompt_tokens = add(Family("counter", "pd_gateway_prompt_tokens", "Prompt tokens of finished requests"))
        self.cached_tokens = add(Family("counter", "pd_gateway_cached_prompt_tokens",
                                        "Prompt tokens served from prefix caches"))
        self.generation_tokens = add(Family("counter", "pd_gateway_generation_tokens", "Tokens generated"))
        self.migrations = add(Family("counter", "pd_gateway_migrations",
                                     "Streams continued on a new pair after their decode failed"))
        self.retries = add(Family("counter", "pd_gateway_retries",
                                  "Attempts retried on a new pair before the first token", ["reason"]))
        self.worker_failures = add(Family("counter", "pd_gateway_worker_failures",
                                          "Request failures blamed on a worker", ["worker", "role", "code"]))
        self.transfer_failures = add(Family("counter", "pd_gateway_kv_transfer_failures",
                                            "Requests whose KV transfer failed", ["role"]))
        self.slow_clients = add(Family("counter", "pd_gateway_slow_client_aborts",
                                       "Streams stopped because their client left too many events unread"))
        self.registry.register(_Instruments(self._instruments))

    def _add(self, instrument: _I) -> _I:
        self._instruments.append(instrument)
        return instrument

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)


class _Instruments(Collector):
    def __init__(self, instruments: list[Family | Histogram]) -> None:
        self._instruments = instruments

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Metric]:
        for instrument in self._instruments:
            yield instrument.family()


class WorkerCollector(Collector):
    """Per-worker routing state, health and breaker, and policy stats, read at scrape time."""

    def __init__(self, clients: Callable[[], Sequence[Any]], policy_stats: Callable[[], dict[str, float]],
                 policy_errors: Callable[[], int] = lambda: 0) -> None:
        self._clients = clients
        self._policy_stats = policy_stats
        self._policy_errors = policy_errors

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Metric]:
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
        }
        families = {k: GaugeMetricFamily(f"pd_gateway_worker_{k}", doc, labels=labels) for k, doc in gauges.items()}
        probe_failures = CounterMetricFamily("pd_gateway_worker_probe_failures", "Health probes the worker failed",
                                             labels=labels)
        breaker = GaugeMetricFamily("pd_gateway_worker_breaker_state", "1 for the breaker's current state",
                                    labels=[*labels, "state"])
        opened = CounterMetricFamily("pd_gateway_worker_breaker_opened", "Times the worker's breaker opened, by "
                                     "reason (consecutive_failures, failure_rate, half_open_trial)",
                                     labels=[*labels, "reason"])
        resent = CounterMetricFamily("pd_gateway_worker_resent_requests", "SGLang relay requests sent again on a "
                                     "fresh connection: they crossed the worker's close of an idle one", labels=labels)
        for c in self._clients():
            st, key = c.state, [c.url, c.role]
            values = {
                "prefill_tokens": st.num_prefill_tokens, "running_seqs": st.num_running_seqs,
                "waiting_seqs": st.num_waiting_seqs, "free_pages": st.num_free_pages,
                "active_requests": st.num_active, "load_fresh": float(st.is_load_fresh),
                "healthy": float(c.healthy), "connected": float(c.is_connected),
            }
            for name, value in values.items():
                families[name].add_metric(key, value)
            probe_failures.add_metric(key, c.health.num_probe_failures)
            current = c.health.breaker.state.value
            for state in BREAKER_STATES:
                breaker.add_metric([*key, state], 1.0 if state == current else 0.0)
            for reason, n in c.health.breaker.num_opened_by.items():
                opened.add_metric([*key, reason], n)
            num_resent = getattr(c, "num_resent", None)  # (SGLang workers: ``gateway/sglang_fleet.py``)
            if num_resent is not None:
                resent.add_metric(key, num_resent)
        yield from families.values()
        yield probe_failures
        yield breaker
        yield opened
        yield resent
        stats = GaugeMetricFamily("pd_gateway_policy_stat", "Figures the routing policies report", labels=["stat"])
        for name, value in self._policy_stats().items():
            stats.add_metric([name], value)
        yield stats
        errors = CounterMetricFamily("pd_gateway_policy_errors", "Calls into the routing policies that raised "
                                     "(select: that request's 500; a hook or stats(): ignored)")
        errors.add_metric([], self._policy_errors())
        yield errors


class ResponseStoreCollector(Collector):
    """The Responses API's stored responses (``gateway/response_store.py``), read at scrape time."""

    def __init__(self, stats: Callable[[], tuple[int, int, int]]) -> None:
        self._stats = stats  # ``ResponseStore.stats``

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Metric]:
        entries, held, evicted = self._stats()
        yield GaugeMetricFamily("pd_gateway_responses_stored", "Responses kept for previous_response_id and GET "
                                "/v1/responses/{id}", value=entries)
        yield GaugeMetricFamily("pd_gateway_responses_stored_bytes", "The memory the stored responses hold, as "
                                "counted against --responses-store-max-mib", value=held)
        yield CounterMetricFamily("pd_gateway_responses_evicted", "Stored responses pushed out by "
                                  "--responses-store-max or --responses-store-max-mib (not expired ones)",
                                  value=evicted)


class ClientConnectionCollector(Collector):
    """The client HTTP port's connections under ``--max-client-connections`` (``gateway/http_connections.py``),
    read at scrape time."""

    def __init__(self, cap: ConnectionCap) -> None:
        self._cap = cap

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from cap_metrics(self._cap, "pd_gateway_client_connections", "Client", {})
