"""A breaker's failure count under many concurrent long requests with rare failures, and its half-open trials.

Failures count in the order outcomes come and any success resets them. This session first tried counting by send
order (a success counts only for a request sent after the failure streak began); with N long streams in flight
failing at a small rate r, N x r failures then piled up before any success counted again, and a decode with 1000
streams in flight failing 1% of them opened its breaker as if it failed them all. What send order is kept for: a
half-open breaker closes only on its trials, requests sent after it opened.

Consecutive failures alone miss a worker failing most new requests while its older long streams end well (a success
every few failures resets the count): the breaker's failure rate over its recent outcomes opens it then.
"""

from __future__ import annotations

from collections import deque

import pytest

from gateway.health import BreakerState, CircuitBreaker, HealthConfig
from gateway.sglang_fleet import HttpWorker
from gateway.sglang_relay import _record

TICKS, LASTS = 200, 10  # each request lasts 10 ticks


@pytest.mark.parametrize(("per_tick", "fail_every"), [(10, 8), (100, 1)], ids=["100-in-flight", "1000-in-flight"])
def test_rare_failures_among_many_long_streams_do_not_open_a_breaker(per_tick: int, fail_every: int) -> None:
    breaker = CircuitBreaker(failures_to_open=5, cooldown_s=30.0, successes_to_close=2)
    in_flight: deque[list[int]] = deque()
    rid = failures = 0
    for tick in range(TICKS):
        sent = []
        for _ in range(per_tick):
            rid += 1
            sent.append(rid)
        in_flight.append(sent)
        if len(in_flight) > LASTS:
            for i, done in enumerate(in_flight.popleft()):
                if i == 0 and tick % fail_every == 0:
                    failures += 1
                    breaker.record_failure()
                else:
                    breaker.record_success(done)
        assert breaker.state is BreakerState.CLOSED, (
            f"tick {tick}: {failures} failures among {rid} requests opened it ({breaker.failures} 'in a row')")
    assert failures >= 20


def test_rare_failures_among_many_long_streams_do_not_open_an_sglang_workers_breaker() -> None:
    worker = HttpWorker("http://127.0.0.1:1", "decode", None, HealthConfig(breaker_failures=5))
    worker.is_up = True
    in_flight: deque[list[int]] = deque()
    for tick in range(TICKS):
        in_flight.append([worker.opened() for _ in range(100)])
        if len(in_flight) > LASTS:
            for i, rid in enumerate(in_flight.popleft()):
                _record(worker, rid, 500 if i == 0 else 200)
                worker.closed(rid)
        assert worker.health.breaker.state is BreakerState.CLOSED, f"tick {tick}: opened"


def test_failures_in_a_row_still_open() -> None:
    breaker = CircuitBreaker(failures_to_open=5, cooldown_s=30.0, successes_to_close=2)
    for _ in range(5):
        breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert breaker.opened_because == "5 failures in a row"


def test_a_request_sent_before_the_breaker_opened_does_not_close_it_half_open() -> None:
    """Only a trial (a request sent while half-open) closes it: one sent before the opening (a long stream) that
    ends well while half-open does not; a trial still counts after its place was freed at its first token."""
    now = [0.0]
    breaker = CircuitBreaker(failures_to_open=2, cooldown_s=10.0, successes_to_close=1, clock=lambda: now[0])
    breaker.record_failure()
    breaker.record_failure()  # opens (rid 2: a long stream, sent before)
    assert breaker.state is BreakerState.OPEN
    now[0] = 10.0
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record_success(2)
    assert breaker.state is BreakerState.HALF_OPEN, "a request sent before the open closed it without a trial"
    breaker.trial_started(4)
    breaker.trials.discard(4)  # (its first token: its place is free again)
    breaker.record_success(4)
    assert breaker.state is BreakerState.CLOSED


@pytest.mark.parametrize("fail_of_4", [2, 3])
def test_a_worker_failing_new_requests_while_old_streams_end_well_opens(fail_of_4: int) -> None:
    """Out of every 4 outcomes, ``fail_of_4`` are new requests failing at once and the rest old long streams ending
    well: never 5 failures in a row, yet half or more of what the worker does fails."""
    breaker = CircuitBreaker(failures_to_open=5, cooldown_s=30.0, successes_to_close=2)
    for rid in range(1, 500):  # a long healthy history first: it must not hide the failures for long
        breaker.record_success(rid)
    outcomes = 0
    while breaker.state is BreakerState.CLOSED:
        for i in range(4):
            outcomes += 1
            if i < fail_of_4:
                breaker.record_failure()
            else:
                breaker.record_success(1000 + outcomes)
            assert breaker.failures < 5
        assert outcomes < 400, "a worker failing half its requests or more kept its breaker closed"
    assert breaker.num_opened == 1
    assert "recent outcomes failed" in breaker.opened_because  # (the log says why: not "N failures in a row")


def test_a_worker_failing_a_third_stays_closed() -> None:
    """Below the rate (0.5 by default), interleaved failures do not open it, however long they go on."""
    breaker = CircuitBreaker(failures_to_open=5, cooldown_s=30.0, successes_to_close=2)
    for rid in range(3000):
        if rid % 3 == 0:
            breaker.record_failure()
        else:
            breaker.record_success(rid)
    assert breaker.state is BreakerState.CLOSED


def test_the_rate_needs_at_least_breaker_failures_failures() -> None:
    """A fresh worker whose first outcomes are 2 failures of 3 is not opened by the rate: too few to judge."""
    breaker = CircuitBreaker(failures_to_open=5, cooldown_s=30.0, successes_to_close=2)
    for _ in range(2):
        breaker.record_failure()
        breaker.record_failure()
        breaker.record_success(1)
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure()  # 5 of 7
    assert breaker.state is BreakerState.OPEN


def test_the_rate_counts_afresh_after_the_breaker_closes_again() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failures_to_open=5, cooldown_s=10.0, successes_to_close=1, clock=lambda: now[0])
    for _ in range(5):
        breaker.record_failure()
    for _ in range(6):  # requests that were open when it opened fail while it is open
        breaker.record_failure()
    now[0] = 10.0
    breaker.trial_started(7)
    breaker.record_success(7)
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure()  # 1 failure of 2 recent outcomes: the 11 before it closed are forgotten
    assert breaker.state is BreakerState.CLOSED


def test_failure_rate_is_configurable_and_checked() -> None:
    with pytest.raises(ValueError, match="breaker_failure_rate"):
        HealthConfig(breaker_failure_rate=0)
    with pytest.raises(ValueError, match="breaker_failure_rate"):
        HealthConfig(breaker_failure_rate=1.5)
    worker = HttpWorker("http://127.0.0.1:1", "decode", None, HealthConfig(breaker_failures=5,
                                                                           breaker_failure_rate=0.3))
    worker.is_up = True
    for i in range(30):  # one failure in three: opens at 0.3, not at the default 0.5
        rid = worker.opened()
        _record(worker, rid, 500 if i % 3 == 0 else 200)
        worker.closed(rid)
    assert worker.health.breaker.state is BreakerState.OPEN
