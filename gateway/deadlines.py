"""One timer for the deadlines of every request on an event loop: ``DeadlineWheel``.

An event-loop timer per request is dear: uvloop's ``call_at`` plus ``cancel`` measured ~2 µs here,
and each timer is also a handle the loop allocates, starts, stops and closes. Without one per
attempt (and none per keep-alive wait), the gateway's CPU per whole response read 0.86-1.0 of what
it was, depending on the machine's phase (``docs/performance.md``, the tenth session). Deadlines of
requests are long (seconds to minutes) and almost always cancelled: the request ends first. So the
wheel keeps them in slots of ``RESOLUTION_S`` (``add``: a dict look-up and a set insertion;
``discard``: a set removal) and holds one loop timer, armed for the earliest slot. A slot that
comes due calls ``due()`` on each of its members once; a member whose deadline moved on since it
joined the slot ``add``s itself again.

A deadline therefore fires up to ``RESOLUTION_S`` late, and at most the loop clock's resolution
(``CLOCK_S``) early. Event loop only; one wheel per loop (``wheel_of``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Protocol

RESOLUTION_S = 0.05
CLOCK_S = 0.001  # uvloop's clock counts whole milliseconds: a deadline this close has come
log = logging.getLogger(__name__)
_ceil = math.ceil  # (a global: read per deadline added)


class Timed(Protocol):
    def due(self) -> None:
        """The slot it joined came due (its deadline may have moved on since: it re-``add``s itself)."""


class DeadlineWheel:
    """Deadlines in slots of ``RESOLUTION_S`` under one loop timer (see the module doc)."""

    __slots__ = ("_armed", "_firing", "_loop", "_slots", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._slots: dict[int, set[Timed]] = {}  # slot number -> its members; empty slots are removed
        self._timer: asyncio.TimerHandle | None = None
        self._armed = math.inf  # the slot number the timer fires for
        self._firing = False

    def add(self, item: Timed, deadline: float) -> int:
        """Call ``item.due()`` at ``deadline`` (loop time) or up to ``RESOLUTION_S`` after it; returns
        the slot, for ``discard``."""
        key = _ceil(deadline / RESOLUTION_S)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = set()
            if key < self._armed and not self._firing:
                self._arm(key)
        slot.add(item)
        return key

    def discard(self, item: Timed, key: int) -> None:
        """``item`` no longer waits in slot ``key`` (the timer stays armed: it finds the slot gone)."""
        slot = self._slots.get(key)
        if slot is not None:
            slot.discard(item)
            if not slot:
                del self._slots[key]

    def __len__(self) -> int:
        return sum(len(slot) for slot in self._slots.values())

    def _arm(self, key: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed = key
        self._timer = self._loop.call_at(key * RESOLUTION_S, self._fire)

    def _fire(self) -> None:
        self._timer, self._armed = None, math.inf
        slots = self._slots
        # (a slot's time in loop-clock milliseconds can divide to just under its number: within a
        # millionth of a slot it has come; fired earlier than that, it is armed again)
        now_key = math.floor(self._loop.time() / RESOLUTION_S + 1e-6)
        due = [key for key in slots if key <= now_key]
        self._firing = True
        try:
            for key in due:
                for item in slots.pop(key):
                    try:
                        item.due()
                    except Exception:  # (one member's bug must not cost the others their deadlines)
                        log.exception("a deadline's callback failed")
        finally:
            self._firing = False
            if slots:
                self._arm(min(slots))


_wheels: dict[asyncio.AbstractEventLoop, DeadlineWheel] = {}
_last: tuple[asyncio.AbstractEventLoop | None, DeadlineWheel | None] = (None, None)


def wheel_of(loop: asyncio.AbstractEventLoop) -> DeadlineWheel:
    """The wheel of ``loop`` (made on first use; those of closed loops are dropped then)."""
    global _last
    last_loop, wheel = _last
    if last_loop is loop and wheel is not None:
        return wheel
    wheel = _wheels.get(loop)
    if wheel is None:
        for old in [old for old in _wheels if old.is_closed()]:
            del _wheels[old]
        wheel = _wheels[loop] = DeadlineWheel(loop)
    _last = (loop, wheel)
    return wheel
