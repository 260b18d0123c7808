"""Where the worker connections deliver one dispatch attempt's events: ``EventSink``.

Lifecycle (event loop only): the dispatcher makes one per attempt and hands it to both workers'
``WorkerClient.submit``; the connections' frame callbacks ``put_nowait((side, event))`` (a plain call:
no task switch, no queue object); the attempt's generator ``get``s them, its deadline waiting in the
loop's ``DeadlineWheel`` (``set_deadline`` only moves a number, unless it comes earlier; between a
stream's tokens, ``slide``: whoever sees progress sets ``active``, and the slot finds it when due). Decode
outputs queued behind one another are merged into one (``merge_ready``). While ``get`` waits with
nothing queued, an event may be taken in the callback itself by ``tap`` (the dispatcher's direct
path), or before it reaches the sink by a lane on the worker connection (``WorkerClient.set_lane``: a
stream's steady state), under the same rule (``waiter``). Past ``limit`` unread events the sink drops
them, calls ``on_overflow`` once and ``get`` raises ``SinkOverflow``. A ``tap`` (or lane) that raises
may have done part of its bookkeeping, so its event is not replayed through ``get``: the sink drops
everything from then on and ``get`` raises ``DirectPathFailed`` (the stream ends with an error; nothing
is counted or sent twice). ``close`` takes the deadline off the wheel and ends the tap.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Any

from gateway.deadlines import CLOCK_S, RESOLUTION_S, wheel_of
from gateway.worker_client import Event
from workers.protocol import StepOutput, joined

log = logging.getLogger(__name__)


class EventSink:
    """Where the worker connections deliver one attempt's ``(side, event)`` pairs.

    ``put_nowait`` is a plain call from the connection's reader (no task switch, no queue object);
    ``get`` returns a queued event at once or waits for the next. The deadline waits in the loop's
    ``DeadlineWheel`` (no loop timer per attempt): ``set_deadline`` only moves a number unless the
    deadline comes earlier than its slot, and a slot that comes due before the deadline puts the
    sink in a later one, so a busy stream costs no timer work per event.
    """

    # (no ``__slots__``: the fields that start the same for every sink are these class defaults, not stores
    # made per attempt; each is set on the instance when it changes)
    overflowed = False
    failed = False  # the tap raised: ``get`` raises ``DirectPathFailed``
    # Offered each event while ``get`` waits with none queued; True: it took the event (nobody is woken).
    tap: Callable[[tuple[Any, Event]], bool] | None = None
    # The reader's future while ``get`` waits with none queued (None otherwise): a tap, or a lane that takes events
    # beside the sink (``WorkerClient.set_lane``), may take an event only then (the order holds).
    waiter: asyncio.Future[None] | None = None
    _deadline = math.inf
    _idle_s: float | None = None  # (``slide``) the deadline is this long after ``active``
    active = 0.0  # (``slide``) the loop's time of the last progress, set by whoever sees it
    cap = math.inf  # no deadline later than this (the loop's time; the request's own deadline)
    capped = False  # the deadline set last is ``cap``
    _slot: int | None = None  # the wheel's slot it waits in

    def __init__(self, limit: int = 4096, on_overflow: Callable[[], None] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.limit = limit  # events queued unread past this: ``on_overflow()``, then ``get`` raises
        self._on_overflow = on_overflow
        self._items: deque[tuple[Any, Event]] = deque()
        if loop is None:  # (passed in: on Python 3.11 the look-up is a syscall)
            loop = asyncio.get_running_loop()
        self._loop = loop
        self.clock = loop.time  # (what ``active`` is read from)
        self._wheel = wheel_of(loop)

    def put_nowait(self, item: tuple[Any, Event]) -> None:
        tap = self.tap
        if tap is not None:  # (so neither overflowed nor failed: either lets go of it)
            # (a waiter means none queued: whoever queues one, or fails it, wakes it and lets go of it)
            if self.waiter is not None:
                try:
                    if tap(item):
                        return
                except Exception:  # a bug in a consumer must not drop the worker connection whose callback this is
                    self.direct_failed()
                    return
        elif self.overflowed or self.failed:
            return
        items = self._items
        items.append(item)
        if len(items) > self.limit:
            self.overflowed = True
            self.tap = None
            items.clear()
            if self._on_overflow is not None:
                self._on_overflow()
        waiter = self.waiter  # (``_wake``, inline: once per event queued)
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def direct_failed(self) -> None:
        """(In an ``except`` block) the tap, or a lane beside it, raised while taking an event: logged; the sink
        takes nothing more and ``get`` raises ``DirectPathFailed``."""
        log.exception("the direct path failed; this stream ends with an error")
        self.tap = None
        self.failed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def cap_in(self, timeout_s: float) -> None:
        """No deadline set from now on comes later than ``timeout_s`` from now (``cap``)."""
        self.cap = self._loop.time() + timeout_s

    def start(self, timeout_s: float, cap_s: float) -> None:
        """``cap_in(cap_s)`` then ``set_deadline(timeout_s)`` in one call (the two from one reading of the
        clock), on a fresh sink: no deadline set yet, it waits in no slot (an attempt's, at its start)."""
        now = self.clock()
        self.cap = cap = now + cap_s
        deadline = now + timeout_s
        if deadline >= cap:  # (else ``capped`` stays False: fresh)
            self.capped = True
            deadline = cap
        self._deadline = deadline
        if deadline != math.inf:
            self._slot = self._wheel.add(self, deadline)

    def set_deadline(self, timeout_s: float) -> None:
        """No event for ``timeout_s`` from now, or by ``cap``, makes ``get`` raise ``TimeoutError`` (up to
        the wheel's ``RESOLUTION_S`` later)."""
        self._idle_s = None
        deadline = self._loop.time() + timeout_s
        self.capped = capped = deadline >= self.cap
        if capped:
            deadline = self.cap
        self._deadline = deadline
        if deadline == math.inf:  # (no deadline: a slot it holds finds so when it comes due)
            return
        slot = self._slot
        if slot is None:
            self._slot = self._wheel.add(self, deadline)
        elif deadline <= (slot - 1) * RESOLUTION_S:  # earlier than its slot's time, e.g. the first token's
            self._wheel.discard(self, slot)  # timeout giving way to the idle one (later: see ``due``)
            self._slot = self._wheel.add(self, deadline)

    def slide(self, idle_s: float) -> None:
        """From now on ``get`` raises ``TimeoutError`` once ``idle_s`` pass after ``active`` (or by ``cap``):
        whoever sees progress sets ``active = loop.time()``, which costs no call and no slot change per
        event (the slot, when it comes due, finds the deadline moved on). ``set_deadline`` ends it."""
        self.set_deadline(idle_s)
        self._idle_s = idle_s
        self.active = self._loop.time()

    def _current(self) -> float:
        """The deadline now (``slide``: from ``active``); sets ``capped``."""
        idle_s = self._idle_s
        if idle_s is None:
            return self._deadline
        deadline = self.active + idle_s
        self.capped = capped = deadline >= self.cap
        self._deadline = deadline = self.cap if capped else deadline
        return deadline

    def due(self) -> None:
        """(``DeadlineWheel``) its slot came due."""
        self._slot = None
        deadline = self._current()
        if self._loop.time() + CLOCK_S < deadline:  # moved on since it joined the slot: wait for the new one
            if deadline != math.inf:
                self._slot = self._wheel.add(self, deadline)
            return
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError())
            # (the reader is timed out: an event from now on, in this loop pass, is queued for it to take
            # instead of the timeout, not handed to the tap behind its back)
            self.waiter = None

    async def get(self) -> tuple[Any, Event]:
        while not self._items:
            if self.tap is None:  # (a tap means neither: either lets go of it)
                if self.overflowed:
                    raise SinkOverflow
                if self.failed:
                    raise DirectPathFailed
            deadline = self._deadline if self._idle_s is None else self._current()
            if self._loop.time() >= deadline:
                raise TimeoutError
            if self._slot is None and deadline != math.inf:  # (``due`` came within ``CLOCK_S`` of it, nobody
                self._slot = self._wheel.add(self, deadline)  # waiting then: it would wait without a timer)
            self.waiter = self._loop.create_future()
            try:
                await self.waiter
            except TimeoutError:
                if not self._items:  # (an event that came in the same loop pass as the deadline is not lost)
                    raise
            finally:
                self.waiter = None
        return self._items.popleft()

    def merge_ready(self, first: StepOutput, side: Any = "decode") -> StepOutput:
        """``first`` plus the outputs of ``side`` queued right behind it, as one ``StepOutput``."""
        items = self._items
        merged = first
        while items and items[0][0] == side and isinstance(items[0][1], StepOutput):
            nxt = items.popleft()[1]
            assert isinstance(nxt, StepOutput)
            merged = joined(merged, nxt)
            if merged.finish_reason is not None:
                break
        return merged

    def close(self) -> None:
        self.tap = None
        self._on_overflow = None  # (it may refer back to this sink's owner: freed by reference counting)
        slot = self._slot
        if slot is not None:
            self._wheel.discard(self, slot)
            self._slot = None


class SinkOverflow(Exception):
    """``EventSink.get``: the consumer left more than ``limit`` events unread; they were dropped."""


class DirectPathFailed(Exception):
    """``EventSink.get``: the ``tap`` raised while taking an event (a bug); the stream cannot go on exactly."""
