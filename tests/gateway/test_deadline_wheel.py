"""Unit tests for ``gateway.deadlines.DeadlineWheel``: deadlines fire in order, never early and at most
a slot late; discarded ones never fire and leave nothing behind; many deadlines share one loop timer;
and ``EventSink``'s deadlines on it, moved later and earlier."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import uvloop

from gateway.deadlines import CLOCK_S, RESOLUTION_S, DeadlineWheel, wheel_of
from gateway.event_sink import EventSink
from workers.protocol import StepOutput

LATE_S = RESOLUTION_S + 0.05  # a slot, plus the loop's own lateness on a busy machine


class _Item:
    def __init__(self, wheel: DeadlineWheel, loop: asyncio.AbstractEventLoop, deadline: float,
                 fired: list[tuple[_Item, float]]) -> None:
        self.wheel, self.loop, self.deadline, self.fired = wheel, loop, deadline, fired
        self.slot = wheel.add(self, deadline)

    def due(self) -> None:
        self.fired.append((self, self.loop.time()))


def counted_wheel(loop: asyncio.AbstractEventLoop) -> tuple[DeadlineWheel, list[int]]:
    """A wheel on ``loop``, and a one-item list counting the loop timers it arms."""
    wheel = DeadlineWheel(loop)
    armed = [0]
    call_at = loop.call_at

    def counting(when, callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        armed[0] += callback == wheel._fire
        return call_at(when, callback, *args, **kwargs)

    loop.call_at = counting  # type: ignore[method-assign]
    return wheel, armed


def test_deadlines_fire_in_order_never_early_and_discarded_ones_never() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        wheel = DeadlineWheel(loop)
        fired: list[tuple[_Item, float]] = []
        rng = random.Random(7)
        now = loop.time()
        items = [_Item(wheel, loop, now + rng.uniform(0.0, 0.4), fired) for _ in range(200)]
        dropped = set(rng.sample(items, 60))
        for item in dropped:
            wheel.discard(item, item.slot)
        await asyncio.sleep(0.4 + LATE_S + 0.1)
        assert {item for item, _ in fired} == set(items) - dropped
        assert len(fired) == len(items) - len(dropped), "an item fired twice"
        for item, at in fired:
            assert item.deadline - 1e-6 <= at <= item.deadline + LATE_S, (item.deadline, at)
        assert [s for s, _ in sorted((it.slot, at) for it, at in fired)] == sorted(it.slot for it, _ in fired)
        assert len(wheel) == 0 and not wheel._slots and wheel._timer is None

    asyncio.run(main())


def test_many_deadlines_share_one_loop_timer() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        wheel, armed = counted_wheel(loop)
        fired: list[tuple[_Item, float]] = []
        items = []
        for _ in range(1000):  # a request's deadline each: now + its timeout, added and mostly discarded
            items.append(_Item(wheel, loop, loop.time() + 30.0, fired))
            if len(items) > 64:
                old = items.pop(0)
                wheel.discard(old, old.slot)
            await asyncio.sleep(0)
        assert armed[0] == 1, f"{armed[0]} loop timers for 1000 deadlines"
        assert len(wheel) == 64 and len(wheel._slots) <= 2, "emptied slots are kept"
        soon = _Item(wheel, loop, loop.time() + 0.05, fired)  # earlier than every other: the timer moves
        assert armed[0] == 2
        await asyncio.sleep(0.05 + LATE_S)
        assert [item for item, _ in fired] == [soon]

    asyncio.run(main())


def test_an_item_re_added_from_due_fires_again_later() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        wheel = DeadlineWheel(loop)
        times: list[float] = []

        class Again:
            def due(self) -> None:
                times.append(loop.time())
                if len(times) < 3:
                    wheel.add(self, loop.time() + 0.1)

        start = loop.time()
        wheel.add(Again(), start + 0.1)
        await asyncio.sleep(0.3 + 3 * LATE_S)
        assert len(times) == 3
        assert all(b - a >= 0.1 for a, b in zip([start, *times[:-1]], times, strict=True)), times

    asyncio.run(main())


def test_one_wheel_per_loop() -> None:
    async def one() -> DeadlineWheel:
        loop = asyncio.get_running_loop()
        assert wheel_of(loop) is wheel_of(loop)
        return wheel_of(loop)

    assert asyncio.run(one()) is not asyncio.run(one())


@pytest.mark.parametrize("first_s, then_s", [(5.0, 0.1), (0.1, 0.3)], ids=["moved-earlier", "moved-later"])
def test_event_sink_deadline_moved_either_way_on_the_wheel(first_s: float, then_s: float) -> None:
    """As an attempt's: the first token's timeout, then the idle one (shorter or longer) per event."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        sink = EventSink()
        sink.set_deadline(first_s)
        await asyncio.sleep(0.05)
        sink.put_nowait(("decode", StepOutput(1, [1])))
        await sink.get()
        sink.set_deadline(then_s)
        moved = loop.time()
        with pytest.raises(TimeoutError):
            await sink.get()
        waited = loop.time() - moved
        assert then_s - CLOCK_S <= waited <= then_s + LATE_S, waited
        sink.close()
        assert len(wheel_of(loop)) == 0

    asyncio.run(main())


@pytest.mark.parametrize("make_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_event_sink_slide_fires_idle_s_after_the_last_progress(make_loop) -> None:  # type: ignore[no-untyped-def]
    """``slide``: progress set as ``active`` (no call, no slot change) keeps the deadline moving; it
    fires ``idle_s`` after the last progress, not after ``slide`` nor after the slot first came due;
    ``cap`` still bounds it (``capped``)."""
    idle_s = 0.15

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sink = EventSink()
        sink.slide(idle_s)
        getter = asyncio.ensure_future(sink.get())
        for _ in range(6):  # 0.3 s of progress every 0.05 s: twice idle_s, and the first slot long due
            await asyncio.sleep(0.05)
            sink.active = loop.time()
        last = sink.active
        with pytest.raises(TimeoutError):
            await getter
        waited = loop.time() - last
        assert idle_s - CLOCK_S <= waited <= idle_s + LATE_S, waited
        assert not sink.capped
        sink.close()
        assert len(wheel_of(loop)) == 0

        capped = EventSink()
        start = loop.time()  # (before the deadline is set: a process descheduled in between reads no early firing)
        capped.cap_in(0.1)
        capped.slide(10.0)
        getter = asyncio.ensure_future(capped.get())
        await asyncio.sleep(0.05)
        capped.active = loop.time()  # (progress does not move it past the cap)
        with pytest.raises(TimeoutError):
            await getter
        assert capped.capped and 0.1 - CLOCK_S <= loop.time() - start <= 0.1 + LATE_S
        capped.close()

        fixed = EventSink()  # set_deadline ends the sliding: progress no longer moves it
        fixed.slide(10.0)
        start = loop.time()
        fixed.set_deadline(0.1)
        getter = asyncio.ensure_future(fixed.get())
        await asyncio.sleep(0.05)
        fixed.active = loop.time()
        with pytest.raises(TimeoutError):
            await getter
        assert 0.1 - CLOCK_S <= loop.time() - start <= 0.1 + LATE_S
        fixed.close()

    loop = make_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_slots_on_the_clocks_own_milliseconds_fire_once_each() -> None:
    """uvloop's clock counts whole milliseconds, so a slot's timer fires at its exact time, whose
    quotient by the resolution can come out just under the slot's number: that must count as due,
    not re-arm the timer for nothing (it spun on call_soon until the millisecond turned)."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        wheel, armed = counted_wheel(loop)
        fired: list[tuple[_Item, float]] = []
        start = loop.time()
        for i in range(1, 21):  # deadlines on 20 consecutive slot times
            _Item(wheel, loop, (int(start / RESOLUTION_S) + i) * RESOLUTION_S, fired)
        await asyncio.sleep(21 * RESOLUTION_S + LATE_S)
        assert len(fired) == 20
        assert armed[0] <= 24, f"{armed[0]} timers armed for 20 slots"

    uvloop.run(main())  # (the gateway's loop, whose clock this is about)


def test_no_deadline_at_all() -> None:
    """An infinite timeout (``--stream-idle-timeout-s inf``) is no deadline, before or after a finite one."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        sink = EventSink()
        sink.set_deadline(math.inf)
        sink.set_deadline(0.05)
        sink.set_deadline(math.inf)  # (its slot comes due, finds no deadline and leaves the wheel)
        sink.set_deadline(0.05)
        sink.slide(math.inf)  # (the same, sliding: progress or not, never due)
        sink.active = loop.time()
        getter = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0.05 + LATE_S)
        assert not getter.done() and len(wheel_of(loop)) == 0
        sink.put_nowait(("decode", StepOutput(1, [1])))
        assert (await getter)[1] == StepOutput(1, [1])
        sink.close()

    asyncio.run(main())


def test_a_deadline_due_while_nobody_waits_still_fires_for_the_next_get(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wheel's slot came due within ``CLOCK_S`` of the deadline while the reader was busy elsewhere (no
    waiter): the slot was dropped, and a ``get`` in that last millisecond waited with no timer at all."""
    from gateway import event_sink

    monkeypatch.setattr(event_sink, "CLOCK_S", 10.0)  # (the window made wide: any deadline counts as come)

    async def main() -> None:
        sink = EventSink()
        sink.set_deadline(0.3)
        assert sink._slot is not None
        sink._wheel.discard(sink, sink._slot)
        sink.due()  # (as the wheel calls it), nobody waiting
        waiting = asyncio.ensure_future(sink.get())
        done, _ = await asyncio.wait({waiting}, timeout=5.0)
        assert done, "get() waited past its deadline"
        assert isinstance(waiting.exception(), TimeoutError)
        sink.close()

    asyncio.run(main())
