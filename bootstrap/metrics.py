"""Prometheus metrics of one registry, computed at scrape time from plain counters.

The hot path only bumps Python ints in ``RequestStats`` (no prometheus-client call per request);
``/metrics`` turns them and the registry's state into metric families. Each app has its own
``CollectorRegistry``, so several registries can live in one process (embedded, tests).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from bootstrap.registry import Registry
    from bootstrap.rooms import RoomTable


class RequestStats:
    """Per (method, route, status) request counts and per (method, route) latency sums."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, int], int] = {}
        self.latency: dict[tuple[str, str], list[float]] = {}  # -> [count, sum_s]

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        self.counts[key] = self.counts.get(key, 0) + 1
        acc = self.latency.get((method, route))
        if acc is None:
            self.latency[(method, route)] = [1.0, seconds]
        else:
            acc[0] += 1.0
            acc[1] += seconds


class _RegistryCollector(Collector):
    def __init__(self, registry: Registry, rooms: RoomTable, stats: RequestStats) -> None:
        self._registry = registry
        self._rooms = rooms
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        reg = self._registry
        requests = CounterMetricFamily(
            "bootstrap_http_requests", "HTTP requests answered", labels=["method", "route", "status"]
        )
        for (method, route, status), n in sorted(self._stats.counts.items()):
            requests.add_metric([method, route, str(status)], n)
        yield requests
        latency = SummaryMetricFamily(
            "bootstrap_http_request_duration_seconds", "Time to answer a request", labels=["method", "route"]
        )
        for (method, route), (count, total) in sorted(self._stats.latency.items()):
            latency.add_metric([method, route], count_value=int(count), sum_value=total)
        yield latency
        for name, doc, value in (
            (
                "bootstrap_rank_registrations",
                "Accepted PUT /route (first registrations and heartbeats)",
                reg.num_registrations,
            ),
            ("bootstrap_rank_replacements", "Registrations that replaced a rank's address", reg.num_replacements),
            ("bootstrap_rank_expirations", "Rank leases that expired", reg.num_expirations),
            ("bootstrap_rank_deregistrations", "Ranks removed by DELETE /route", reg.num_deregistrations),
            ("bootstrap_rank_drains", "Ranks that turned draining (PUT /route with draining)", reg.num_drains),
            ("bootstrap_rank_puts_after_goodbye", "PUT /route refused 410: its registrant had deregistered the rank",
             reg.num_puts_after_goodbye),
            ("bootstrap_room_expirations", "Room -> DP rank entries that expired", self._rooms.num_expirations),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("bootstrap_rooms", "Live room -> DP rank entries", value=len(self._rooms))
        yield GaugeMetricFamily("bootstrap_instances", "Prefill instances with live ranks", value=len(reg.instances))
        ranks = GaugeMetricFamily("bootstrap_instance_ranks", "Live ranks per instance", labels=["instance_id"])
        expected = GaugeMetricFamily(
            "bootstrap_instance_expected_ranks", "dp x cp x tp x pp per instance", labels=["instance_id"]
        )
        ready = GaugeMetricFamily("bootstrap_instance_ready", "1 when every rank is registered", labels=["instance_id"])
        draining = GaugeMetricFamily("bootstrap_instance_draining", "1 while a rank of the instance is draining",
                                     labels=["instance_id"])
        for instance_id, instance in sorted(reg.instances.items()):
            ranks.add_metric([instance_id], len(instance.entries))
            expected.add_metric([instance_id], instance.topology.num_ranks)
            ready.add_metric([instance_id], 1.0 if instance.is_ready else 0.0)
            draining.add_metric([instance_id], 1.0 if instance.is_draining else 0.0)
        yield ranks
        yield expected
        yield ready
        yield draining


class Metrics:
    """Owns the per-app prometheus registry; ``render()`` is the ``/metrics`` body."""

    def __init__(self, registry: Registry, rooms: RoomTable) -> None:
        self.stats = RequestStats()
        self._prom = CollectorRegistry(auto_describe=False)
        self._prom.register(_RegistryCollector(registry, rooms, self.stats))

    def render(self) -> bytes:
        return generate_latest(self._prom)
