"""A breaker's failure count under long requests and rare failures.

A success counts only for a request sent after the failure streak began (ce14076): a long stream that started
while its worker was good says nothing about the worker now. But the streak must start at its *first* failure:
measured from the *last* failure instead, a worker whose requests all outlast the gap between two of its rare
failures never had a success count again, its count only grew, and a worker failing ~1% of its requests opened
its breaker (and was left out of selection) as if it failed them all.
"""

from __future__ import annotations

from collections import deque

from gateway.health import BreakerState, CircuitBreaker, HealthConfig
from gateway.sglang_fleet import HttpWorker
from gateway.sglang_relay import _record

TICKS, PER_TICK, LASTS, FAIL_EVERY = 200, 10, 10, 8  # ~1.25% of requests fail; each lasts 10 ticks


def test_rare_failures_among_long_requests_do_not_open_an_sglang_workers_breaker() -> None:
    worker = HttpWorker("http://127.0.0.1:1", "decode", None, HealthConfig(breaker_failures=5))
    worker.is_up = True
    breaker = worker.health.breaker
    in_flight: deque[list[int]] = deque()
    failures = 0
    for tick in range(TICKS):
        in_flight.append([worker.opened() for _ in range(PER_TICK)])
        if len(in_flight) > LASTS:
            ending = in_flight.popleft()
            for i, rid in enumerate(ending):
                failed = i == 0 and tick % FAIL_EVERY == 0
                failures += failed
                _record(worker, rid, 500 if failed else 200)
                worker.closed(rid)
        assert breaker.state is BreakerState.CLOSED, (
            f"tick {tick}: {failures} failures among {tick * PER_TICK} requests opened the breaker "
            f"({breaker.failures} 'in a row')")
    assert failures >= 20 and breaker.num_opened == 0


def test_rare_failures_among_long_requests_do_not_open_a_breaker() -> None:
    breaker = CircuitBreaker(failures_to_open=5, cooldown_s=30.0, successes_to_close=2)
    in_flight: deque[list[int]] = deque()
    rid = 0
    for tick in range(TICKS):
        sent = []
        for _ in range(PER_TICK):
            rid += 1
            breaker.sent = rid  # (as ``WorkerClient.submit`` stamps it)
            sent.append(rid)
        in_flight.append(sent)
        if len(in_flight) > LASTS:
            for i, done in enumerate(in_flight.popleft()):
                if i == 0 and tick % FAIL_EVERY == 0:
                    breaker.record_failure()
                else:
                    breaker.record_success(done)
        assert breaker.state is BreakerState.CLOSED, f"tick {tick}: opened ({breaker.failures} 'in a row')"


def test_a_worker_failing_every_new_request_still_opens_while_old_streams_end_well() -> None:
    """What ce14076 fixed stays fixed: old streams' successes do not hide new requests' failures."""
    breaker = CircuitBreaker(failures_to_open=5, cooldown_s=30.0, successes_to_close=2)
    old = list(range(1, 101))
    breaker.sent = 100
    for n in range(5):
        breaker.sent += 1  # a new request, which fails
        breaker.record_failure()
        breaker.record_success(old[n])  # an old stream ends well meanwhile
    assert breaker.state is BreakerState.OPEN


def test_a_request_sent_during_a_streak_does_not_close_the_breaker_it_opened_without_a_trial() -> None:
    """Opening marks every request sent so far as old news: one sent between the streak's first failure and
    the open (a long stream) that ends well while half-open is no trial and does not close it."""
    now = [0.0]
    breaker = CircuitBreaker(failures_to_open=2, cooldown_s=10.0, successes_to_close=1, clock=lambda: now[0])
    breaker.sent = 1
    breaker.record_failure()  # the streak begins
    breaker.sent = 2  # a long stream, sent after the first failure
    breaker.sent = 3
    breaker.record_failure()  # opens
    assert breaker.state is BreakerState.OPEN
    now[0] = 10.0
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record_success(2)
    assert breaker.state is BreakerState.HALF_OPEN, "a request sent before the open closed it without a trial"
    breaker.sent = 4
    breaker.trial_started(4)
    breaker.record_success(4)
    assert breaker.state is BreakerState.CLOSED
