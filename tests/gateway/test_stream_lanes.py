"""A stream's steady state: the decode connection hands its non-final outputs to the attempt's lane
(``WorkerClient.set_lane``, ``_Attempt._lane``) before any sink. These hold that the lane changes nothing the
consumer, the figures or the connection see (against the same outputs through the sink's tap), that it is let
go of however the request ends, and that one that raises ends its stream, not the connection."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_hot_path import RecordingConsumer, _connected_workers, _sent

from gateway.errors import APIError
from workers.protocol import Outputs, SamplingParams, StepOutput, Submit


class _Gated(RecordingConsumer):
    open = True

    def ready(self) -> bool:
        return self.open


def _dispatcher(loop: asyncio.AbstractEventLoop) -> tuple[Any, Any, Any]:
    from gateway.dispatch import Dispatcher
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router

    prefills, p_transports = _connected_workers(loop, "prefill", 1)
    decodes, d_transports = _connected_workers(loop, "decode", 1)
    policy = RoundRobinPolicy()
    return Dispatcher(prefills, decodes, Router(policy, policy)), (prefills[0], p_transports[0]), \
        (decodes[0], d_transports[0])


async def _started(dispatcher: Any, consumer: Any, d_transport: Any) -> tuple[asyncio.Task[None], int]:
    """A stream of ``dispatcher`` with ``consumer`` as its direct path, submitted: its task and the decode's rid."""
    async def consume() -> None:
        async for _ in dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=50), direct=consumer):
            pass

    task = asyncio.create_task(consume())
    for _ in range(20):
        await asyncio.sleep(0)
    (rid,) = [m.rid for m in _sent(d_transport, Submit)]
    return task, rid


def _script(lanes: bool) -> tuple[list[tuple[list[int], int]], list[list[int]], tuple[Any, ...]]:
    """One stream through a script of frames (several outputs per frame, a slow spell, the prefill's hand-over
    among them), with the lane on or off: what the consumer took, what the task yielded, and the figures."""
    consumer = _Gated()
    yielded: list[list[int]] = []

    async def main() -> tuple[Any, ...]:
        loop = asyncio.get_running_loop()
        dispatcher, (prefill, p_transport), (decode, d_transport) = _dispatcher(loop)
        if not lanes:
            decode.set_lane = lambda rid, lane: None  # the sink's tap takes everything (the way before lanes)

        async def consume() -> None:
            async for item in dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=12), direct=consumer):
                yielded.append(list(item.token_ids))

        task = asyncio.create_task(consume())
        for _ in range(20):
            await asyncio.sleep(0)
        (d_rid,) = [m.rid for m in _sent(d_transport, Submit)]
        (p_rid,) = [m.rid for m in _sent(p_transport, Submit)]
        decode._dispatch(Outputs([StepOutput(d_rid, [65], cached_tokens=2)]))
        assert bool(decode._lanes) == lanes  # (set by the first token's tap)
        decode._dispatch(Outputs([StepOutput(d_rid, [66]), StepOutput(d_rid, [67, 68], cached_tokens=3)]))
        prefill._dispatch(Outputs([StepOutput(p_rid, [], "transferred")]))
        consumer.open = False  # the client's socket is full: the next ones queue for the task, in order
        decode._dispatch(Outputs([StepOutput(d_rid, [69]), StepOutput(d_rid, [70])]))
        consumer.open = True  # ready again, but the task has not taken the queued ones yet: this one queues too
        decode._dispatch(Outputs([StepOutput(d_rid, [71])]))
        for _ in range(20):
            await asyncio.sleep(0)
        decode._dispatch(Outputs([StepOutput(d_rid, [72]), StepOutput(d_rid, [73], "length")]))
        await asyncio.wait_for(task, 5)
        metrics = dispatcher.metrics
        assert not decode._lanes and not decode._open and decode.num_active == 0 and prefill.num_active == 0
        return (sum(metrics.ttft.counts), list(metrics.itl.counts), metrics.generation_tokens._value.value,
                decode.health.breaker.closed)

    figures = asyncio.run(main())
    return consumer.taken, yielded, figures


def test_a_lane_changes_nothing_the_consumer_or_the_figures_see() -> None:
    with_lane, without = _script(lanes=True), _script(lanes=False)
    assert with_lane == without
    taken, yielded, _ = with_lane
    tokens = [t for ids, _ in taken for t in ids] + [t for ids in yielded for t in ids]
    assert sorted(tokens) == list(range(65, 74)) and len(tokens) == 9
    assert [t for ids in yielded for t in ids][-1] == 73
    assert [t for ids in yielded for t in ids][:3] == [69, 70, 71]  # (in order behind the queued ones)


@pytest.mark.parametrize("end", ["cancelled", "worker_gone", "aborted_by_overflow"])
def test_a_lane_is_let_go_of_however_its_request_ends(end: str) -> None:
    """Cancelled by the consumer, its worker gone (the stream migrates: the new attempt sets none), or stopped by
    a reader that fell behind: the connection keeps no lane for a request that is no longer open."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        dispatcher, _, (decode, d_transport) = _dispatcher(loop)
        if end == "aborted_by_overflow":
            dispatcher.config = type(dispatcher.config)(max_unread_events=2)
        consumer = _Gated()
        task, rid = await _started(dispatcher, consumer, d_transport)
        decode._dispatch(Outputs([StepOutput(rid, [65])]))
        decode._dispatch(Outputs([StepOutput(rid, [66])]))
        assert list(decode._lanes) == [rid]
        if end == "cancelled":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        elif end == "worker_gone":
            decode._fail_open("the worker went away", abort=False)
            assert not decode._lanes
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            consumer.open = False
            decode._dispatch(Outputs([StepOutput(rid, [t]) for t in range(67, 72)]))
            with pytest.raises(APIError, match="too slowly"):
                await asyncio.wait_for(task, 5)
        assert not decode._lanes and rid not in decode._open

    asyncio.run(main())


def test_a_lane_that_raises_ends_its_stream_not_the_connection() -> None:
    class Breaks(RecordingConsumer):
        def offer(self, output: StepOutput) -> bool:
            if self.taken:
                raise RuntimeError("a bug in the consumer")
            return super().offer(output)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        dispatcher, _, (decode, d_transport) = _dispatcher(loop)
        consumer = Breaks()
        task, rid = await _started(dispatcher, consumer, d_transport)
        decode._dispatch(Outputs([StepOutput(rid, [65])]))  # through the tap, which sets the lane
        decode._dispatch(Outputs([StepOutput(rid, [66]), StepOutput(rid, [67])]))  # the lane raises on the first
        with pytest.raises(APIError, match="internal error in the gateway"):
            await asyncio.wait_for(task, 5)
        assert consumer.taken == [([65], 0)]
        assert decode.is_connected and not decode._lanes and rid not in decode._open

    asyncio.run(main())


@pytest.mark.parametrize("migrated", [False, True])
def test_both_sides_get_the_prompt_as_one_encoding_of_its_ids(migrated: bool) -> None:
    """``_Attempt.submit`` encodes the prompt's ids once for the prefill's and the decode's ``Submit``: each worker
    reads the prompt as a plain list of ids (a migrated stream's: the prompt and the tokens streamed so far), and
    each frame is byte for byte the one the list itself would have made."""
    from workers.protocol import worker_codec

    async def main() -> None:
        loop = asyncio.get_running_loop()
        dispatcher, (_, p_transport), (decode, d_transport) = _dispatcher(loop)
        prompt = list(range(300, 700))
        consumer = RecordingConsumer()

        async def consume() -> None:
            async for _ in dispatcher.generate(prompt, SamplingParams(max_new_tokens=50), direct=consumer):
                pass

        task = asyncio.create_task(consume())
        for _ in range(20):
            await asyncio.sleep(0)
        expected = prompt
        if migrated:  # (its next pair: the one other prefill and decode would do, but one of each is here: again)
            (rid,) = [m.rid for m in _sent(d_transport, Submit)]
            decode._dispatch(Outputs([StepOutput(rid, [65, 66])]))
            decode._fail_open("the worker went away", abort=False)
            for _ in range(50):
                await asyncio.sleep(0)
            expected = [*prompt, 65, 66]
        (d_submit, p_submit) = _sent(d_transport, Submit)[-1], _sent(p_transport, Submit)[-1]
        assert d_submit.input_ids == p_submit.input_ids == expected
        assert type(d_submit.input_ids) is list
        encode = worker_codec()._encoder.encode
        for transport, submit in ((d_transport, d_submit), (p_transport, p_submit)):
            plain = Submit(submit.rid, list(expected), submit.params, submit.bootstrap, submit.timeout_s,
                           submit.request_id, submit.gather_s)
            assert encode(plain) in b"".join(transport.writes)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
