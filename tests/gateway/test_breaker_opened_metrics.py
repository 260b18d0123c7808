"""``pd_gateway_worker_breaker_opened_total{worker,role,reason}``: each opening of a worker's circuit breaker is
counted under the rule that opened it, one of a fixed set of reasons (never the log's free text):
``consecutive_failures``, ``failure_rate`` (many recent outcomes failed, with successes between) and
``half_open_trial`` (a trial failed while half-open). Read at scrape time from the breaker's counts: nothing per
request. The output still parses as Prometheus text.
"""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.health import OPEN_REASONS, BreakerState, CircuitBreaker, HealthConfig
from gateway.metrics import GatewayMetrics, WorkerCollector
from gateway.sglang_fleet import HttpWorker

URL = "http://127.0.0.1:1"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def opened(metrics: GatewayMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {s.labels["reason"]: s.value for s in families["pd_gateway_worker_breaker_opened"].samples
            if s.name == "pd_gateway_worker_breaker_opened_total" and s.labels["worker"] == URL
            and s.labels["role"] == "decode"}


def test_breaker_openings_are_counted_by_reason_in_metrics() -> None:
    worker = HttpWorker(URL, "decode", None, HealthConfig(breaker_failures=5, breaker_cooldown_s=1.0))
    clock = Clock()
    breaker = worker.health.breaker = CircuitBreaker(5, 1.0, 2, clock=clock)
    metrics = GatewayMetrics()
    metrics.add_collector(WorkerCollector(lambda: [worker], lambda: {}))
    assert opened(metrics) == dict.fromkeys(OPEN_REASONS, 0.0)

    for _ in range(5):  # five in a row
        breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert opened(metrics) == {"consecutive_failures": 1, "failure_rate": 0, "half_open_trial": 0}

    clock.now += 1.0  # half-open; its trial fails
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.trial_started(100)
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert opened(metrics) == {"consecutive_failures": 1, "failure_rate": 0, "half_open_trial": 1}

    clock.now += 1.0  # closed again by two trials' successes
    for rid in (101, 102):
        breaker.trial_started(rid)
        breaker.record_success(rid)
    assert breaker.state is BreakerState.CLOSED
    rid = 200
    while breaker.state is BreakerState.CLOSED:  # two failures for every success: never five in a row
        breaker.record_failure()
        breaker.record_failure()
        rid += 1
        breaker.record_success(rid)
    assert "recent outcomes failed" in breaker.opened_because
    assert opened(metrics) == {"consecutive_failures": 1, "failure_rate": 1, "half_open_trial": 1}
    assert breaker.num_opened == 3
