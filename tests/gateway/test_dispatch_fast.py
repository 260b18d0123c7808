"""The dispatcher's per-request shortcuts do what the general ways do: ``EventSink.start`` as ``cap_in`` then
``set_deadline``; a sink's tap is offered an event only while its reader waits with none queued (also once a
queued one has woken it, before it ran); the round-robin turns as the formula they were written from; the
router's per-attempt hooks still heard."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from gateway.event_sink import EventSink
from gateway.policies.base import Pair, RequestInfo
from gateway.policies.simple import RoundRobinPolicy
from gateway.router import Router
from workers.protocol import StepOutput


@pytest.mark.parametrize(("timeout_s", "cap_s"), [(300.0, 1800.0), (5.0, 1.0), (2.0, 2.0), (math.inf, 10.0),
                                                   (math.inf, math.inf)])
def test_start_is_cap_in_then_set_deadline(timeout_s: float, cap_s: float) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        frozen = loop.time()
        loop.time = lambda: frozen  # type: ignore[method-assign]  # (one clock reading for both ways)
        started, general = EventSink(loop=loop), EventSink(loop=loop)
        started.start(timeout_s, cap_s)
        general.cap_in(cap_s)
        general.set_deadline(timeout_s)
        for name in ("cap", "capped", "_deadline", "_slot", "_idle_s"):
            assert getattr(started, name) == getattr(general, name), name
        started.close()
        general.close()
        assert started._slot is None and general._slot is None

    asyncio.run(main())


def test_a_tap_is_offered_events_only_while_the_reader_waits_with_none_queued() -> None:
    async def main() -> None:
        sink = EventSink()
        sink.set_deadline(10)
        offered: list[Any] = []

        def tap(item: tuple[Any, Any]) -> bool:
            offered.append(item)
            return item[1].token_ids == [1]  # takes the first, not the second

        sink.tap = tap
        sink.put_nowait(("decode", StepOutput(1, [0])))  # nobody waits: queued, not offered
        assert offered == [] and await sink.get() == ("decode", StepOutput(1, [0]))
        getter = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        sink.put_nowait(("decode", StepOutput(1, [1])))  # taken by the tap: the reader sleeps on
        sink.put_nowait(("decode", StepOutput(1, [2])))  # refused: queued, the reader woken
        sink.put_nowait(("decode", StepOutput(1, [3])))  # queued behind it (the reader has not run yet)
        assert [item[1].token_ids for item in offered] == [[1], [2]]
        assert await getter == ("decode", StepOutput(1, [2]))
        assert await sink.get() == ("decode", StepOutput(1, [3]))
        sink.close()

    asyncio.run(main())


def test_a_tap_that_raises_fails_the_reader_and_is_let_go_of() -> None:
    async def main() -> None:
        sink = EventSink()
        sink.set_deadline(10)

        def tap(item: tuple[Any, Any]) -> bool:
            raise RuntimeError("a bug")

        sink.tap = tap
        getter = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        sink.put_nowait(("decode", StepOutput(1, [1])))
        sink.put_nowait(("decode", StepOutput(1, [2])))  # dropped: nothing counted or sent twice
        from gateway.event_sink import DirectPathFailed
        with pytest.raises(DirectPathFailed):
            await getter
        assert sink.tap is None and sink.failed and not sink._items
        sink.close()

    asyncio.run(main())


@pytest.mark.parametrize(("num_prefills", "num_decodes"), [(0, 1), (0, 3), (1, 1), (2, 2), (2, 4), (3, 2), (4, 6)])
def test_round_robin_turns_as_its_formula(num_prefills: int, num_decodes: int) -> None:
    prefills, decodes = [f"p{i}" for i in range(num_prefills)], [f"d{i}" for i in range(num_decodes)]
    policy = RoundRobinPolicy()
    for calls in range(3 * math.lcm(max(num_prefills, 1), num_decodes) + 5):  # (both turns: one per call)
        expected_prefill = prefills[calls % num_prefills] if prefills else None
        turn = calls + (calls // math.lcm(num_prefills, num_decodes) if prefills else 0)
        pair = policy.select(prefills, decodes, RequestInfo([1], 1))  # type: ignore[arg-type]
        assert pair == Pair(expected_prefill, decodes[turn % num_decodes])  # type: ignore[arg-type]


def test_the_router_still_calls_the_per_attempt_hooks() -> None:
    class Hooked(RoundRobinPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.heard: list[str] = []

        def on_dispatch(self, pair: Pair, request: RequestInfo) -> None:
            self.heard.append("dispatch")

        def on_finish(self, pair: Pair, request: RequestInfo, outcome: str) -> None:
            self.heard.append(outcome)

    hooked, plain = Hooked(), RoundRobinPolicy()
    router = Router(hooked, hooked)
    assert router.dispatch_hooks and router.finish_hooks
    assert not Router(plain, plain).dispatch_hooks and not Router(plain, plain).finish_hooks
    pair = Pair(None, "d0")  # type: ignore[arg-type]
    router.dispatched(pair, router.request([1], 1))
    router.finished(pair, router.request([1], 1), "cancelled")
    assert hooked.heard == ["dispatch", "cancelled"]
