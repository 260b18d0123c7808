"""A whole response's decode gathers its outputs (``Submit.gather_s``, ``--gather-ms``): after the first token it
is silent for up to ``gather_s`` between outputs by design. The gateway's between-token deadline must allow for
that silence: with ``gather_s`` at or past ``--stream-idle-timeout-s`` a healthy decode was taken for a frozen
one, the answer migrated ``--max-migrations`` times (its prompt computed again each time) and then failed with a
504, "no progress from the workers ... between tokens". Over recording worker connections (``test_hot_path``'s
helpers)."""

from __future__ import annotations

import asyncio

from test_hot_path import _Collected, _connected_workers, _sent

from gateway.dispatch import DispatchConfig, Dispatcher
from gateway.policies.simple import RoundRobinPolicy
from gateway.router import Router
from workers.protocol import Outputs, SamplingParams, StepOutput, Submit


def test_a_gathering_decode_is_not_taken_for_a_frozen_one() -> None:
    async def main() -> None:
        workers, transports = _connected_workers(asyncio.get_running_loop(), "both", 2)
        policy = RoundRobinPolicy()
        config = DispatchConfig(stream_idle_timeout_s=0.2, gather_s=0.5, max_migrations=1)
        dispatcher = Dispatcher([], workers, Router(policy, policy), config, combined=True)
        collected = _Collected()
        task = asyncio.create_task(dispatcher.complete([1, 2, 3], SamplingParams(max_new_tokens=8), collected,
                                                       in_callback=True))
        for _ in range(20):
            await asyncio.sleep(0)
        first = next(i for i in range(2) if _sent(transports[i], Submit))
        (submit,) = _sent(transports[first], Submit)
        assert submit.gather_s == 0.5
        workers[first]._dispatch(Outputs([StepOutput(submit.rid, [65])]))  # the first token, at once
        await asyncio.sleep(0.45)  # the decode gathers the next ones for gather_s (0.5 s)
        workers[first]._dispatch(Outputs([StepOutput(submit.rid, [66, 67, 68])]))
        await asyncio.sleep(0.45)
        workers[first]._dispatch(Outputs([StepOutput(submit.rid, [69, 70, 71, 72], "length")]))
        await asyncio.wait_for(task, 5)
        assert not _sent(transports[1 - first], Submit), "a gathering decode's silence was taken for a failure"
        assert [t for ids, _, _ in collected.accepted for t in ids] == list(range(65, 73))
        assert dispatcher.metrics.migrations._value.value == 0

    asyncio.run(main())


def test_a_gathering_decode_that_falls_silent_still_migrates() -> None:
    """The allowance is the gather window on top of the idle timeout, not a deadline switched off."""
    async def main() -> None:
        workers, transports = _connected_workers(asyncio.get_running_loop(), "both", 2)
        policy = RoundRobinPolicy()
        config = DispatchConfig(stream_idle_timeout_s=0.2, gather_s=0.3, max_migrations=1)
        dispatcher = Dispatcher([], workers, Router(policy, policy), config, combined=True)
        task = asyncio.create_task(dispatcher.complete([1, 2, 3], SamplingParams(max_new_tokens=8), _Collected(),
                                                       in_callback=True))
        for _ in range(20):
            await asyncio.sleep(0)
        first = next(i for i in range(2) if _sent(transports[i], Submit))
        (submit,) = _sent(transports[first], Submit)
        workers[first]._dispatch(Outputs([StepOutput(submit.rid, [65])]))
        for _ in range(300):
            if _sent(transports[1 - first], Submit):
                break
            await asyncio.sleep(0.01)
        (moved,) = _sent(transports[1 - first], Submit)
        assert moved.input_ids == [1, 2, 3, 65]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
