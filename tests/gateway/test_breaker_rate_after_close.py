"""A breaker's failure-rate count starts afresh when it closes again.

While a breaker is open the requests sent to the worker before it opened (long streams) go on failing, and each is
recorded. Those failures belong to the episode that opened the breaker: once its half-open trials succeed and it
closes, a worker that recovered must not have its breaker re-opened by its first ordinary failure because the open
episode's failures still weigh in its failure rate.
"""

from __future__ import annotations

from gateway.health import BreakerState, CircuitBreaker


def test_failures_recorded_while_open_do_not_reopen_a_recovered_worker() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failures_to_open=5, cooldown_s=10.0, successes_to_close=2, clock=lambda: now[0])
    for _ in range(5):
        breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    for _ in range(20):  # the streams it still had fail while it is open
        breaker.record_failure()
    now[0] = 11.0
    assert breaker.state is BreakerState.HALF_OPEN
    for rid in (101, 102):
        breaker.trial_started(rid)
        breaker.record_success(rid)
    assert breaker.state is BreakerState.CLOSED
    for rid in range(200, 210):  # the worker is well again: 10 successes...
        breaker.record_success(rid)
    breaker.record_failure()  # ...then one failure in 11
    assert breaker.state is BreakerState.CLOSED, "one failure after recovering re-opened the breaker"
