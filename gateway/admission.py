"""Admission control: at most ``max_concurrent`` requests served, a bounded queue for the rest.

Lifecycle (event loop only): ``await admit()`` either returns at once (a free slot), waits in FIFO
order for a slot up to ``queue_timeout_s``, or raises ``Overloaded`` (429 with ``Retry-After``)
when the queue is full or the wait timed out. The caller must call the returned release function
exactly once when the request ends (a stream: when its body ends or the client leaves).
``max_concurrent = 0`` disables the limit.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from gateway.errors import Overloaded
from gateway.metrics import GatewayMetrics


class Admission:
    def __init__(self, max_concurrent: int, max_queued: int, queue_timeout_s: float, metrics: GatewayMetrics) -> None:
        if max_concurrent < 0 or max_queued < 0 or not queue_timeout_s > 0:
            raise ValueError("admission: limits must be >= 0 and the queue timeout positive")
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.metrics = metrics
        self.num_active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    def check_room(self) -> None:
        """Raise ``Overloaded`` now if ``admit`` would refuse at once (for a caller that reads the
        request's body before it waits: a full queue costs no upload)."""
        if self.max_concurrent and self.num_active >= self.max_concurrent and len(self._waiters) >= self.max_queued:
            self._refuse_full()

    def _refuse_full(self) -> None:
        self.metrics.rejected.labels("queue_full").inc()
        raise Overloaded(f"the gateway is at capacity ({self.max_concurrent} requests, {self.max_queued} queued)",
                         code="rate_limit_exceeded", retry_after_s=1.0)

    async def admit(self) -> Callable[[], None]:
        if not self.max_concurrent or (self.num_active < self.max_concurrent and not self._waiters):
            return self._take()
        if len(self._waiters) >= self.max_queued:
            self._refuse_full()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        self.metrics.queued.set(len(self._waiters))
        started = time.monotonic()
        try:
            # (``asyncio.wait``, not ``wait_for``: a stream may wait here in its eager first step, before it
            # has a task, and from Python 3.12 on ``wait_for`` needs one.)
            done, _ = await asyncio.wait((future,), timeout=self.queue_timeout_s)
            if not done:
                self.metrics.queue_time.observe(time.monotonic() - started)  # (the longest waits count too)
                self.metrics.rejected.labels("queue_timeout").inc()
                raise Overloaded(f"waited {self.queue_timeout_s:g}s for a free slot", code="rate_limit_exceeded",
                                 retry_after_s=1.0)
        except asyncio.CancelledError:  # (the client left: its wait counts too, the longest ones most of all)
            self.metrics.queue_time.observe(time.monotonic() - started)
            if future.done() and not future.cancelled():
                self._release()  # the slot was handed to us: pass it on
            raise
        finally:
            if future in self._waiters:
                self._waiters.remove(future)
            self.metrics.queued.set(len(self._waiters))
        return self._granted(started)

    def _granted(self, started: float) -> Callable[[], None]:
        self.metrics.queue_time.observe(time.monotonic() - started)
        return self._release_once()  # the slot was transferred by _release: already counted

    def _take(self) -> Callable[[], None]:
        self.num_active += 1
        if self.max_concurrent:  # (a wait of 0: with no limit there is no queue to time)
            self.metrics.queue_time.observe(0.0)
        return self._release_once()

    def _release_once(self) -> Callable[[], None]:
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self._release()

        return release

    def _release(self) -> None:
        """Hand the slot to the oldest live waiter, or free it."""
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                future.set_result(None)  # num_active unchanged: the slot moves to the waiter
                return
        self.num_active -= 1
