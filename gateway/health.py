"""Worker health as the gateway judges it: active probes and a circuit breaker per worker.

Lifecycle (event loop only):
1. ``WorkerClient`` sends ``Ping`` every ``probe_interval_s`` while connected and reports each
   outcome here: ``probe_passed(stalled_s)`` or ``probe_failed(reason)`` (no ``Pong`` within
   ``probe_timeout_s``). ``unhealthy_after`` consecutive failures (or a scheduler stalled longer
   than ``stall_timeout_s``) make the worker unhealthy: it leaves selection and its open requests
   fail over; ``healthy_after`` consecutive passes bring it back. A frozen (SIGSTOPped) worker is
   caught this way, not only a closed socket.
2. The dispatcher reports each request's outcome on this worker (``request_succeeded`` /
   ``request_failed``) to its ``CircuitBreaker``: closed -> open after ``breaker_failures``
   consecutive failures, or as many among its recent outcomes making up at least ``breaker_failure_rate`` of
   them (below) -> half-open after ``breaker_cooldown_s`` (trial requests may try it, at most
   ``breaker_successes`` at a time until their first token: a worker just back does not take a burst,
   nor wait for whole generations to take the next) -> closed after
   ``breaker_successes`` successes of requests sent while it is half-open (its trials: a long stream that
   started before it opened says nothing about the worker now); a failure while half-open opens it again. Failures
   count in the order outcomes come, and any success resets them (as Envoy's consecutive-5xx detection): a
   rule by send order instead (a success counts only for a request sent after the streak began) opened the
   breaker of a busy worker failing ~1% of many long streams, its rare failures adding up while each long
   success came too late to count. Consecutive failures alone miss a worker that fails most *new* requests while
   its older long streams end well, one success every few failures: the breaker also keeps a decaying count of
   recent outcomes (both halved, when a failure comes, until they add up to less than ``RATE_WINDOW``: about the
   last 32-64 outcomes weigh) and opens when at least ``breaker_failures`` of them failed and they make up
   ``breaker_failure_rate`` (0.5) or more of them; a worker failing 1% of its requests stays far below it.
3. ``is_selectable`` = probes healthy and the breaker not open. Prefill and decode outcomes are
   counted separately because each worker has one role: a request that fails on its prefill is not
   held against its decode (the dispatcher blames only the side that reported the failure).

Every change that can move a worker in or out of selection (a probe verdict turning, a breaker leaving or
entering closed, and ``WorkerClient``'s own: connection up or lost, drain, stop, pool membership) bumps
``Selectability.epoch``: the dispatcher keeps its lists of selectable workers while it stays the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class HealthConfig:
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    unhealthy_after: int = 2
    healthy_after: int = 2
    stall_timeout_s: float = 60.0
    breaker_failures: int = 5
    breaker_cooldown_s: float = 30.0
    breaker_successes: int = 2
    breaker_failure_rate: float = 0.5

    def __post_init__(self) -> None:
        for name in ("probe_interval_s", "probe_timeout_s", "stall_timeout_s", "breaker_cooldown_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if not 0 < self.breaker_failure_rate <= 1:
            raise ValueError("breaker_failure_rate must be in (0, 1]")
        for name in ("unhealthy_after", "healthy_after", "breaker_failures", "breaker_successes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


class Selectability:
    """``epoch``: a count of the changes that can make any worker selectable or not. The dispatcher reuses its views
    of the selectable workers while it is unchanged (``Dispatcher._views``: one per request otherwise, O(workers)),
    and only while every breaker is closed (half-open trials come and go per request, and open moves on to half-open
    by time alone). One count for all: a change of any worker's recomputes every pool's view, which is rare."""

    epoch = 0


def selectability_changed() -> None:
    Selectability.epoch += 1


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# The recent outcomes a breaker's failure rate weighs: at a failure, both counts are halved until below this.
RATE_WINDOW = 64
# Why a breaker opened, as counted (``CircuitBreaker.num_opened_by``, the metric's ``reason`` label): a fixed set.
OPEN_REASONS = ("consecutive_failures", "failure_rate", "half_open_trial")


class CircuitBreaker:
    def __init__(self, failures_to_open: int, cooldown_s: float, successes_to_close: int,
                 clock: Callable[[], float] = time.monotonic, failure_rate: float = 0.5) -> None:
        self.failures_to_open = failures_to_open
        self.cooldown_s = cooldown_s
        self.successes_to_close = successes_to_close
        self.failure_rate = failure_rate
        self._clock = clock
        self._state = BreakerState.CLOSED
        self.closed = True  # (``_state is CLOSED``, read per request: a plain attribute)
        self._failures = 0  # consecutive
        # recent outcomes for the failure rate (a success only adds; a failure first decays both)
        self._recent_ok = 0
        self._recent_failed = 0
        self._successes = 0  # consecutive, while half-open
        self._opened_at = 0.0
        self.num_opened = 0
        self.opened_because = ""  # why it last opened (for the log)
        self.num_opened_by = dict.fromkeys(OPEN_REASONS, 0)  # openings by reason (``/metrics``)
        # half-open: the requests (the worker client's rids) trying the worker now, at most
        # ``successes_to_close`` (the worker is not selectable while that many are open); a trial's place is
        # free again at its first token (a decode) or hand-over (a prefill), its success counted at its end
        self.trials: set[int] = set()
        # every rid sent while half-open (not only those still before their first token): only their successes
        # close it (no hot-path cost: sends are noted only while the breaker is not closed)
        self._trial_rids: set[int] = set()

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self._state, self._successes = BreakerState.HALF_OPEN, 0
            self.trials.clear()
            self._trial_rids.clear()
        return self._state

    @property
    def is_open(self) -> bool:
        """Open as last moved on (no clock read: does not move it on to half-open, so any thread may ask)."""
        return self._state is BreakerState.OPEN

    @property
    def allows(self) -> bool:
        # (closed, the common case, without ``state``'s clock read: this runs per worker per request)
        if self.closed:
            return True
        state = self.state
        return state is BreakerState.HALF_OPEN and len(self.trials) < self.successes_to_close

    def trial_started(self, rid: int) -> None:
        """Request ``rid`` was sent to the worker (only while not closed); whoever sent it takes it out of
        ``trials`` at its first token, hand-over or end."""
        if self.state is BreakerState.HALF_OPEN:
            self.trials.add(rid)
            self._trial_rids.add(rid)

    def record_success(self, rid: int) -> None:
        """Request ``rid`` succeeded: the failures in a row end; while half-open, a trial's success (a request
        sent while half-open) counts towards closing it."""
        self._failures = 0
        self._recent_ok += 1  # (decayed when a failure comes: nothing more per request)
        if not self.closed and self.state is BreakerState.HALF_OPEN and rid in self._trial_rids:
            self._successes += 1
            if self._successes >= self.successes_to_close:
                self._state, self.closed = BreakerState.CLOSED, True
                selectability_changed()
                # a fresh failure-rate count: the outcomes recorded while it was open or half-open (the streams
                # of the episode that opened it, failing on) must not re-open it at the next ordinary failure
                self._recent_ok = self._recent_failed = 0
                self.trials.clear()
                self._trial_rids.clear()

    def record_failure(self) -> None:
        state = self.state
        self._failures += 1
        ok, failed = self._recent_ok, self._recent_failed
        while ok + failed >= RATE_WINDOW:
            ok, failed = ok // 2, failed // 2
        failed += 1
        self._recent_ok, self._recent_failed = ok, failed
        tripped = state is BreakerState.CLOSED and (
            self._failures >= self.failures_to_open
            or (failed >= self.failures_to_open and failed >= self.failure_rate * (ok + failed)))
        if state is BreakerState.HALF_OPEN or tripped:
            if state is BreakerState.HALF_OPEN:
                reason, self.opened_because = "half_open_trial", "a half-open trial failed"
            elif self._failures >= self.failures_to_open:
                reason, self.opened_because = "consecutive_failures", f"{self._failures} failures in a row"
            else:
                reason, self.opened_because = "failure_rate", f"{failed} of its {ok + failed} recent outcomes failed"
            self.num_opened_by[reason] += 1
            self._state, self._opened_at, self.closed = BreakerState.OPEN, self._clock(), False
            selectability_changed()
            self.num_opened += 1
            self._recent_ok = self._recent_failed = 0  # (a fresh count once it closes again)
            self.trials.clear()
            self._trial_rids.clear()

    @property
    def failures(self) -> int:
        """Consecutive failures so far (reset by a success)."""
        return self._failures

    def reset(self) -> None:
        self._state, self._failures, self._successes, self.closed = BreakerState.CLOSED, 0, 0, True
        selectability_changed()
        self._recent_ok = self._recent_failed = 0
        self.trials.clear()
        self._trial_rids.clear()


class WorkerHealth:
    """Probe verdicts and the breaker of one worker."""

    def __init__(self, config: HealthConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s, config.breaker_successes,
                                      clock, config.breaker_failure_rate)
        self._probe_healthy = True
        self.last_probe_error: str | None = None
        self._fails = 0
        self._passes = 0
        self.num_probe_failures = 0

    @property
    def is_probe_healthy(self) -> bool:
        """The probes' verdict (a fresh connection starts healthy)."""
        return self._probe_healthy

    @is_probe_healthy.setter
    def is_probe_healthy(self, value: bool) -> None:
        if value != self._probe_healthy:
            self._probe_healthy = value
            selectability_changed()

    @property
    def is_selectable(self) -> bool:
        return self.is_probe_healthy and self.breaker.allows

    @property
    def is_available(self) -> bool:
        """``is_selectable``, or only waiting for its half-open trials to end (readiness: no flapping)."""
        return self.is_probe_healthy and self.breaker.state is not BreakerState.OPEN

    def probe_passed(self, stalled_s: float) -> bool:
        """Record a ``Pong``; returns True when this turned the worker unhealthy (a stalled scheduler)."""
        if stalled_s > self.config.stall_timeout_s:
            return self.probe_failed(f"scheduler made no progress for {stalled_s:.0f}s")
        self._fails = 0
        self._passes += 1
        if not self.is_probe_healthy and self._passes >= self.config.healthy_after:
            self.is_probe_healthy, self.last_probe_error = True, None
        return False

    def probe_failed(self, reason: str) -> bool:
        """Record a failed probe; returns True when this turned the worker unhealthy."""
        self.num_probe_failures += 1
        self._passes = 0
        self._fails += 1
        self.last_probe_error = reason
        if self.is_probe_healthy and self._fails >= self.config.unhealthy_after:
            self.is_probe_healthy = False
            return True
        return False

    def connected(self) -> None:
        """A fresh handshake: the process answers; the breaker keeps its memory of failures."""
        self.is_probe_healthy, self._fails, self._passes = True, 0, 0

    def describe(self) -> dict[str, object]:
        return {"probe_healthy": self.is_probe_healthy, "probe_error": self.last_probe_error,
                "breaker": self.breaker.state.value}
