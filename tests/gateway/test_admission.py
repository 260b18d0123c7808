"""``Admission``: a slot at once, a FIFO wait for one, a 429 when the queue is full or the wait
expires, and a queued request that is cancelled (its client left) passes on a slot handed to it."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest

from gateway.admission import Admission
from gateway.errors import Overloaded
from gateway.metrics import GatewayMetrics


def test_slots_queue_timeout_and_cancellation() -> None:
    async def main() -> None:
        metrics = GatewayMetrics()
        adm = Admission(1, 2, 0.2, metrics)
        first = await adm.admit()
        waiting = asyncio.create_task(adm.admit())
        await asyncio.sleep(0)
        assert adm.num_queued == 1
        first()  # the slot moves to the oldest waiter
        second = await asyncio.wait_for(waiting, 1)
        assert adm.num_active == 1 and adm.num_queued == 0
        with pytest.raises(Overloaded, match=r"waited 0\.2s"):  # nobody releases in time
            await adm.admit()
        assert adm.num_queued == 0
        # a waiter cancelled right after its slot was handed over passes the slot on
        a, b = asyncio.create_task(adm.admit()), asyncio.create_task(adm.admit())
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="at capacity"):  # two queued: the queue is full
            await adm.admit()
        second()
        a.cancel()
        third = await asyncio.wait_for(b, 1)
        assert a.cancelled() and adm.num_active == 1 and adm.num_queued == 0
        third()
        third()  # (releasing twice frees one slot)
        assert adm.num_active == 0
        # Every wait is timed: the first one's 0, the timed-out one's and the cancelled one's included.
        assert sum(metrics.queue_time.counts) == 5 and metrics.queue_time.counts[0] >= 1
        assert metrics.queue_time.sum >= 0.2
        assert metrics.rejected.labels("queue_timeout").value == metrics.rejected.labels("queue_full").value == 1

    asyncio.run(main())


def test_a_request_waits_for_a_slot_before_it_has_a_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream takes its first steps in the read's callback, without a task (``gateway.eager``), and may
    queue there; the wait must not need one. From Python 3.12 on ``asyncio.wait_for`` does: here it is
    made to, as there."""
    from gateway import eager

    plain_wait_for = asyncio.wait_for

    async def wait_for_in_a_task(*args: Any, **kwargs: Any) -> Any:
        if asyncio.current_task() is None:
            raise RuntimeError("Timeout should be used inside a task")
        return await plain_wait_for(*args, **kwargs)

    monkeypatch.setattr(asyncio, "wait_for", wait_for_in_a_task)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        adm = Admission(1, 1, 0.1, GatewayMetrics())
        held = await adm.admit()
        outcome: list[object] = []

        async def queued() -> None:
            try:
                outcome.append(await adm.admit())
            except Overloaded as exc:
                outcome.append(exc)

        loop.call_soon(lambda: eager.start(queued(), loop, contextvars.copy_context()))
        await asyncio.sleep(0.3)
        assert len(outcome) == 1 and isinstance(outcome[0], Overloaded), outcome
        held()

    asyncio.run(main())


def test_check_room_refuses_only_what_admit_would_refuse_at_once() -> None:
    async def main() -> None:
        adm = Admission(1, 1, 5.0, GatewayMetrics())
        adm.check_room()  # a free slot
        held = await adm.admit()
        adm.check_room()  # a free queue place
        queued = asyncio.create_task(adm.admit())
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="at capacity"):
            adm.check_room()
        held()
        (await asyncio.wait_for(queued, 1))()
        adm.check_room()
        Admission(0, 0, 1.0, GatewayMetrics()).check_room()  # no limit

    asyncio.run(main())
