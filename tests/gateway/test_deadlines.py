"""The dispatcher's deadlines, over recording worker connections (``test_hot_path``'s helpers):

- the first-token timeout runs from an attempt's submit to its first token, whatever the prefill's
  hand-over does in between;
- after the first token the idle timeout takes over, also when it is the shorter (the timer moves
  earlier);
- ``request_timeout_s`` bounds the request across its attempts: a migrated attempt's worker gets what is
  left, and a worker's "timeout" once it has run out is final and no worker's fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
from test_hot_path import RecordingConsumer, _connected_workers, _sent

from gateway.dispatch import DispatchConfig, Dispatcher
from gateway.errors import BadGateway, UpstreamTimeout
from gateway.policies.simple import RoundRobinPolicy
from gateway.router import Router
from workers.protocol import Abort, Error, Fault, Outputs, SamplingParams, StepOutput, Submit


def combined(n: int, config: DispatchConfig) -> tuple[Dispatcher, list, list]:  # type: ignore[type-arg]
    workers, transports = _connected_workers(asyncio.get_running_loop(), "both", n)
    policy = RoundRobinPolicy()
    return Dispatcher([], workers, Router(policy, policy), config, combined=True), workers, transports


def disaggregated(config: DispatchConfig) -> tuple[Dispatcher, list, list, list, list]:  # type: ignore[type-arg]
    """One prefill and one decode: the dispatcher, then each side's workers and transports."""
    loop = asyncio.get_running_loop()
    prefills, p_transports = _connected_workers(loop, "prefill", 1)
    decodes, d_transports = _connected_workers(loop, "decode", 1)
    policy = RoundRobinPolicy()
    return Dispatcher(prefills, decodes, Router(policy, policy), config), prefills, p_transports, decodes, d_transports


async def until(predicate, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def _half_open(worker: Any) -> Any:
    """``worker``'s breaker, opened and cooled down at once (half-open)."""
    breaker = worker.health.breaker
    breaker.cooldown_s = 0.0
    for _ in range(breaker.failures_to_open):
        breaker.record_failure()
    return breaker


class First:
    """A policy that always picks the first worker it is given on each side (a load-aware policy's
    favourite): only the dispatcher's avoiding a failed worker keeps a retry off it."""

    name = "first"

    def select(self, prefills, decodes, request):  # type: ignore[no-untyped-def]
        from gateway.policies.base import Pair
        return Pair(prefills[0] if prefills else None, decodes[0])


async def drain(gen) -> list[StepOutput]:  # type: ignore[no-untyped-def]
    return [item async for item in gen]


def test_the_idle_timeout_takes_over_from_a_longer_first_token_timeout() -> None:
    """A decode silent after its first token is given up after the idle timeout (0.2 s), not the
    first-token one (30 s): the stream migrates and the silent decode is told to abort."""
    async def main() -> None:
        config = DispatchConfig(first_token_timeout_s=30, stream_idle_timeout_s=0.2, max_migrations=1)
        dispatcher, workers, transports = combined(2, config)
        task = asyncio.create_task(drain(dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=4))))
        assert await until(lambda: any(_sent(t, Submit) for t in transports), 5)
        first = next(i for i in range(2) if _sent(transports[i], Submit))
        (submit,) = _sent(transports[first], Submit)
        workers[first]._dispatch(Outputs([StepOutput(submit.rid, [65])]))
        assert await until(lambda: bool(_sent(transports[1 - first], Submit)), 10), "no migration"
        assert [a.rid for a in _sent(transports[first], Abort)] == [submit.rid]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_outputs_taken_in_the_callback_keep_the_idle_deadline_moving() -> None:
    """Outputs a stream's direct consumer takes in the worker connection's callback (the consumer's task
    never wakes for them) count as progress: tokens every 50 ms for 0.6 s, three times the 0.2 s idle
    timeout, keep the stream on its decode; silence after them migrates it about 0.2 s later."""
    async def main() -> None:
        config = DispatchConfig(first_token_timeout_s=30, stream_idle_timeout_s=0.2, max_migrations=1)
        dispatcher, workers, transports = combined(2, config)
        taker = RecordingConsumer()
        gen = dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=40), direct=taker)
        task = asyncio.create_task(drain(gen))
        assert await until(lambda: any(_sent(t, Submit) for t in transports), 5)
        first = next(i for i in range(2) if _sent(transports[i], Submit))
        (submit,) = _sent(transports[first], Submit)
        for i in range(12):
            workers[first]._dispatch(Outputs([StepOutput(submit.rid, [60 + i])]))
            await asyncio.sleep(0.05)
        assert [t for ids, _ in taker.taken for t in ids] == list(range(60, 72)), "not taken in the callback"
        assert not _sent(transports[1 - first], Submit), "migrated while its tokens were flowing"
        silent_from = time.monotonic()
        assert await until(lambda: bool(_sent(transports[1 - first], Submit)), 5), "no migration after silence"
        assert 0.15 <= time.monotonic() - silent_from <= 1.0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_the_first_token_deadline_runs_from_the_submit() -> None:
    """The prefill's hand-over before the first token does not restart the first-token deadline."""
    async def main() -> None:
        config = DispatchConfig(first_token_timeout_s=1.0, max_retries=0)
        dispatcher, prefills, p_transports, _, _ = disaggregated(config)
        started = time.monotonic()
        task = asyncio.create_task(drain(dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=4))))
        assert await until(lambda: bool(_sent(p_transports[0], Submit)), 5)
        await asyncio.sleep(0.8)
        (p_submit,) = _sent(p_transports[0], Submit)
        prefills[0]._dispatch(Outputs([StepOutput(p_submit.rid, [], "transferred")]))  # then the decode is silent
        with pytest.raises(UpstreamTimeout, match="before the first token"):
            await asyncio.wait_for(task, 5)
        # at the first-token deadline (1 s after the submit), not 1 s after the hand-over (1.8 s)
        assert time.monotonic() - started < 1.6

    asyncio.run(main())


def test_request_timeout_bounds_the_request_across_migrations() -> None:
    async def main() -> None:
        config = DispatchConfig(request_timeout_s=1.5, max_migrations=2)
        dispatcher, workers, transports = combined(3, config)
        task = asyncio.create_task(drain(dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=8))))
        assert await until(lambda: any(_sent(t, Submit) for t in transports), 5)
        a = next(i for i in range(3) if _sent(transports[i], Submit))
        (submit,) = _sent(transports[a], Submit)
        assert 1.0 < submit.timeout_s <= 1.5
        workers[a]._dispatch(Outputs([StepOutput(submit.rid, [65])]))
        await asyncio.sleep(0.5)
        workers[a]._dispatch(Error(submit.rid, "internal", "the engine broke"))  # migrates
        assert await until(lambda: sum(len(_sent(t, Submit)) for t in transports) == 2, 5)
        b = next(i for i in range(3) if i != a and _sent(transports[i], Submit))
        (submit2,) = _sent(transports[b], Submit)
        assert submit2.timeout_s <= 1.0, "a migrated attempt gets what is left of the request's time"
        workers[b]._dispatch(Outputs([StepOutput(submit2.rid, [66])]))
        await asyncio.sleep(max(0.0, submit2.timeout_s) + 0.05)
        workers[b]._dispatch(Error(submit2.rid, "timeout", "request timed out in stage decode"))
        with pytest.raises(UpstreamTimeout, match="ran past its timeout"):
            await asyncio.wait_for(task, 5)
        assert sum(len(_sent(t, Submit)) for t in transports) == 2, "no third attempt past the deadline"
        assert workers[b].health.breaker.failures == 0, "the request's own timeout is no worker's fault"

    asyncio.run(main())


def test_a_finished_answer_waiting_for_prompt_logprobs_is_not_lost() -> None:
    """The decode finished, but the prefill (connected, passing probes) never reports the hand-over
    that carries the prompt logprobs: after the idle timeout the answer goes out without them and the
    prefill's request is aborted; it is not dropped and retried into a 504."""
    async def main() -> None:
        config = DispatchConfig(stream_idle_timeout_s=0.2, max_retries=2)
        dispatcher, prefills, p_transports, decodes, d_transports = disaggregated(config)
        params = SamplingParams(max_new_tokens=2, prompt_logprobs=True)
        task = asyncio.create_task(drain(dispatcher.generate([1, 2, 3], params)))
        assert await until(lambda: bool(_sent(d_transports[0], Submit)), 5)
        (d_submit,) = _sent(d_transports[0], Submit)
        (p_submit,) = _sent(p_transports[0], Submit)
        decodes[0]._dispatch(Outputs([StepOutput(d_submit.rid, [65]), StepOutput(d_submit.rid, [66], "length")]))
        outputs = await asyncio.wait_for(task, 5)
        assert [t for o in outputs for t in o.token_ids] == [65, 66] and outputs[-1].finish_reason == "length"
        assert outputs[-1].prompt_logprobs is None
        assert await until(lambda: [a.rid for a in _sent(p_transports[0], Abort)] == [p_submit.rid], 2)
        assert len(_sent(d_transports[0], Submit)) == 1, "no retry"
        assert prefills[0].num_active == 0 and decodes[0].num_active == 0

    asyncio.run(main())


class _Collected:
    """A ``Dispatcher.complete`` collector that keeps every output it is given."""

    def __init__(self) -> None:
        self.finish_reason: str | None = None
        self.outputs: list[StepOutput] = []

    def accept(self, output: StepOutput) -> None:
        self.outputs.append(output)
        self.finish_reason = output.finish_reason


@pytest.mark.parametrize("consumer", ["generate", "complete"])
@pytest.mark.parametrize("hand_over_first", [True, False])
def test_prompt_logprobs_come_with_the_first_output(consumer: str, hand_over_first: bool) -> None:
    """The prefill's prompt logprobs go out with the consumer's first output (a stream's first chunk
    carries the echoed prompt's logprobs), also when its hand-over trails the decode's outputs: those
    wait for it, in order, and the attempt finishes only with the last."""
    async def main() -> None:
        dispatcher, prefills, p_transports, decodes, d_transports = disaggregated(DispatchConfig())
        params = SamplingParams(max_new_tokens=3, prompt_logprobs=True)
        collected = _Collected()
        if consumer == "generate":
            task = asyncio.create_task(drain(dispatcher.generate([1, 2, 3], params)))
        else:
            task = asyncio.create_task(dispatcher.complete([1, 2, 3], params, collected, in_callback=True))
        assert await until(lambda: bool(_sent(d_transports[0], Submit)), 5)
        (d_submit,) = _sent(d_transports[0], Submit)
        (p_submit,) = _sent(p_transports[0], Submit)
        hand_over = Outputs([StepOutput(p_submit.rid, [], "transferred", prompt_logprobs=[float("nan"), -1.5, -0.5])])
        if hand_over_first:
            prefills[0]._dispatch(hand_over)
        decodes[0]._dispatch(Outputs([StepOutput(d_submit.rid, [65])]))
        await asyncio.sleep(0.05)
        decodes[0]._dispatch(Outputs([StepOutput(d_submit.rid, [66])]))
        await asyncio.sleep(0.05)
        if not hand_over_first:
            decodes[0]._dispatch(Outputs([StepOutput(d_submit.rid, [67], "length")]))
            await asyncio.sleep(0.05)
            assert not task.done(), "the decode's outputs wait for the prompt logprobs"
            prefills[0]._dispatch(hand_over)
        else:
            decodes[0]._dispatch(Outputs([StepOutput(d_submit.rid, [67], "length")]))
        result = await asyncio.wait_for(task, 5)
        outputs = result if consumer == "generate" else collected.outputs
        assert [t for o in outputs for t in o.token_ids] == [65, 66, 67]
        assert outputs[-1].finish_reason == "length"
        assert outputs[0].prompt_logprobs is not None and outputs[0].prompt_logprobs[1:] == [-1.5, -0.5]
        assert all(o.prompt_logprobs is None for o in outputs[1:])
        assert prefills[0].num_active == 0 and decodes[0].num_active == 0

    asyncio.run(main())


def _six_open_on_a_worker_that_fails(fail) -> int:  # type: ignore[no-untyped-def]
    """Twelve one-token requests over two combined workers; ``fail(worker, transport)`` ends the first
    worker's six; they go to the other and are answered there. Returns the first's breaker failures (its
    breaker must still be closed)."""
    async def main() -> int:
        config = DispatchConfig(max_retries=1, retry_backoff_s=0.01)
        dispatcher, workers, transports = combined(2, config)
        tasks = [asyncio.create_task(drain(dispatcher.generate([1, 2, i], SamplingParams(max_new_tokens=1))))
                 for i in range(12)]
        assert await until(lambda: sum(len(_sent(t, Submit)) for t in transports) == 12, 5)
        assert workers[0].num_active == 6
        fail(workers[0], transports[0])
        assert await until(lambda: len(_sent(transports[1], Submit)) == 12, 5), "the six went to the other"
        assert workers[0].health.breaker.state == "closed"
        for submit in _sent(transports[1], Submit):
            workers[1]._dispatch(Outputs([StepOutput(submit.rid, [65], "length")]))
        assert all(len(out) == 1 for out in await asyncio.wait_for(asyncio.gather(*tasks), 5))
        return int(workers[0].health.breaker.failures)

    return asyncio.run(main())


def test_a_lost_connection_is_one_failure_however_many_requests_it_had_open() -> None:
    """Six requests open on a decode whose connection drops: its breaker counts one failure (six opened
    it for its cooldown, keeping a restarted worker out of service), and the requests go elsewhere."""
    assert _six_open_on_a_worker_that_fails(lambda worker, _: worker._mark_down("connection reset")) == 1


def test_the_request_timeout_ends_a_stream_whose_decode_froze() -> None:
    """A decode frozen after its first token cannot enforce the request's ``timeout_s`` itself: the
    gateway ends the request at its deadline (1 s), not at the idle timeout (30 s), without migrating
    it or blaming the worker, and aborts it there."""
    async def main() -> None:
        config = DispatchConfig(request_timeout_s=1.0, stream_idle_timeout_s=30, max_migrations=2)
        dispatcher, workers, transports = combined(2, config)
        started = time.monotonic()
        task = asyncio.create_task(drain(dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=8))))
        assert await until(lambda: any(_sent(t, Submit) for t in transports), 5)
        a = next(i for i in range(2) if _sent(transports[i], Submit))
        (submit,) = _sent(transports[a], Submit)
        workers[a]._dispatch(Outputs([StepOutput(submit.rid, [65])]))
        with pytest.raises(UpstreamTimeout, match="ran past its timeout"):
            await asyncio.wait_for(task, 10)
        assert time.monotonic() - started < 5
        assert sum(len(_sent(t, Submit)) for t in transports) == 1, "no migration past the deadline"
        assert [x.rid for x in _sent(transports[a], Abort)] == [submit.rid]
        assert workers[a].health.breaker.failures == 0

    asyncio.run(main())


def test_outputs_waiting_for_a_late_hand_over_do_not_wait_for_ever() -> None:
    """The prefill never reports its hand-over while the decode keeps producing: the outputs held for the
    prompt logprobs go out without them after the hand-over's own wait (here the 0.3 s idle timeout), not
    once the decode has finished (each output re-armed the wait)."""
    async def main() -> None:
        dispatcher, _, p_transports, decodes, d_transports = disaggregated(
            DispatchConfig(stream_idle_timeout_s=0.3))
        params = SamplingParams(max_new_tokens=40, prompt_logprobs=True)
        got: list[StepOutput] = []

        async def consume() -> None:
            async for output in dispatcher.generate([1, 2, 3], params):
                got.append(output)

        task = asyncio.create_task(consume())
        assert await until(lambda: bool(_sent(d_transports[0], Submit)), 5)
        (d_submit,) = _sent(d_transports[0], Submit)
        (p_submit,) = _sent(p_transports[0], Submit)
        for i in range(30):  # 1.5 s of outputs, one per 50 ms
            decodes[0]._dispatch(Outputs([StepOutput(d_submit.rid, [60 + i])]))
            await asyncio.sleep(0.05)
        assert got, "outputs held until the decode stops"
        assert [a.rid for a in _sent(p_transports[0], Abort)] == [p_submit.rid]
        decodes[0]._dispatch(Outputs([StepOutput(d_submit.rid, [99], "length")]))
        await asyncio.wait_for(task, 5)
        assert [t for o in got for t in o.token_ids] == [*range(60, 90), 99]

    asyncio.run(main())


@pytest.mark.parametrize("consumer", ["generate", "complete"])
def test_an_answer_the_consumer_ends_early_counts_as_the_decodes_success(consumer: str) -> None:
    """A half-open breaker closes after ``breaker_successes`` answers also when the gateway ends them
    itself (a stop string it found, the client leaving after tokens came), not only at a final output."""
    from gateway.health import BreakerState

    async def main() -> None:
        dispatcher, workers, transports = combined(1, DispatchConfig(max_retries=0))
        breaker = _half_open(workers[0])
        assert breaker.state is BreakerState.HALF_OPEN
        for i in range(breaker.successes_to_close):
            params = SamplingParams(max_new_tokens=8)
            if consumer == "generate":
                gen = dispatcher.generate([1, 2, i], params)
                first = asyncio.ensure_future(gen.__anext__())
                assert await until(lambda n=i + 1: len(_sent(transports[0], Submit)) == n, 5)
                workers[0]._dispatch(Outputs([StepOutput(_sent(transports[0], Submit)[-1].rid, [65])]))
                assert (await asyncio.wait_for(first, 5)).token_ids == [65]
                await gen.aclose()  # the client left after its first token
            else:
                collected = _Collected()
                collected.accept = lambda out, c=collected: (c.outputs.append(out),  # type: ignore[method-assign]
                                                             setattr(c, "finish_reason", "stop"))
                task = asyncio.create_task(dispatcher.complete([1, 2, i], params, collected))
                assert await until(lambda n=i + 1: len(_sent(transports[0], Submit)) == n, 5)
                workers[0]._dispatch(Outputs([StepOutput(_sent(transports[0], Submit)[-1].rid, [65])]))
                await asyncio.wait_for(task, 5)  # its own stop string in the first output: the rest is aborted
            assert await until(lambda n=i + 1: len(_sent(transports[0], Abort)) == n, 5), "the rest was aborted"
        assert breaker.state is BreakerState.CLOSED

    asyncio.run(main())


def test_a_worker_closed_by_the_gateway_is_not_blamed_and_its_streams_go_on() -> None:
    """A removed worker's connection closed past its drain timeout: its open stream continues on another
    worker (migrated), told why, and the removed worker's breaker counts no failure."""
    async def main() -> None:
        dispatcher, workers, transports = combined(2, DispatchConfig(max_migrations=1))
        gen = dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=3))
        first = asyncio.ensure_future(gen.__anext__())
        assert await until(lambda: bool(_sent(transports[0], Submit)), 5)
        workers[0]._dispatch(Outputs([StepOutput(_sent(transports[0], Submit)[0].rid, [65])]))
        assert (await asyncio.wait_for(first, 5)).token_ids == [65]
        removed, other = workers  # (``workers`` is the dispatcher's own pool list)
        dispatcher.decodes.remove(removed)  # (the admin API's removal: out of the pool, then closed)
        await removed.aclose("removed by the admin API (its drain timeout passed)")
        second = asyncio.ensure_future(gen.__anext__())
        assert await until(lambda: bool(_sent(transports[1], Submit)), 5), "the stream went on elsewhere"
        (moved,) = _sent(transports[1], Submit)
        assert moved.input_ids == [1, 2, 3, 65]
        other._dispatch(Outputs([StepOutput(moved.rid, [66, 67], "length")]))
        assert (await asyncio.wait_for(second, 5)).token_ids == [66, 67]
        await gen.aclose()
        assert removed.health.breaker.failures == 0
        assert dispatcher.metrics.worker_failures.labels(removed.url, "both", "worker_gone").value == 0

    asyncio.run(main())


def test_tokens_sent_before_a_final_failure_are_counted() -> None:
    """A stream whose decode froze after 2 tokens and could not migrate (none allowed) ends with an error; the
    2 tokens it was sent still count as generated (the prompt and end-to-end figures count served ones only)."""
    async def main() -> None:
        config = DispatchConfig(first_token_timeout_s=30, stream_idle_timeout_s=0.2, max_migrations=0)
        dispatcher, workers, transports = combined(1, config)
        metrics = dispatcher.metrics
        gen = dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=8))
        first = asyncio.ensure_future(gen.__anext__())
        assert await until(lambda: bool(_sent(transports[0], Submit)), 5)
        rid = _sent(transports[0], Submit)[0].rid
        workers[0]._dispatch(Outputs([StepOutput(rid, [7, 8])]))
        assert (await first).token_ids == [7, 8]
        with pytest.raises(UpstreamTimeout):
            await gen.__anext__()  # (the decode sends nothing more)
        assert metrics.generation_tokens._value.value == 2
        assert metrics.prompt_tokens._value.value == 0 and sum(metrics.e2e.counts) == 0

    asyncio.run(main())


@pytest.mark.parametrize("order", ["hand_over_first", "decode_first", "client_left_first"])
def test_the_prefill_is_credited_whichever_of_the_two_answers_comes_first(order: str) -> None:
    """A one-token answer's decode may finish (it gets the first token with the KV) before the prefill's
    hand-over reaches the gateway on its own connection, or the client may leave after a first token that
    came before it. Either way the prefill did its part: a half-open prefill breaker closes on it, and the
    prefill's request is not left open."""
    from gateway.health import HealthConfig, WorkerHealth

    async def main() -> None:
        dispatcher, prefills, p_transports, decodes, d_transports = disaggregated(DispatchConfig())
        prefill = prefills[0]
        prefill.health = WorkerHealth(HealthConfig(breaker_failures=1, breaker_cooldown_s=0.05, breaker_successes=1))
        prefill.health.breaker.record_failure()
        await asyncio.sleep(0.06)
        assert prefill.health.breaker.state.value == "half_open"
        if order == "client_left_first":
            gen = dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=8))
            first = asyncio.ensure_future(gen.__anext__())
        else:
            task = asyncio.create_task(dispatcher.complete([1, 2, 3], SamplingParams(max_new_tokens=1), _Collected()))
        assert await until(lambda: bool(_sent(d_transports[0], Submit)), 5)
        (d_submit,) = _sent(d_transports[0], Submit)
        (p_submit,) = _sent(p_transports[0], Submit)
        hand_over = Outputs([StepOutput(p_submit.rid, [], "transferred")])
        if order == "client_left_first":
            decodes[0]._dispatch(Outputs([StepOutput(d_submit.rid, [7])]))
            assert (await asyncio.wait_for(first, 5)).token_ids == [7]
            await gen.aclose()  # the client left after its first token
        else:
            final = Outputs([StepOutput(d_submit.rid, [7], "length")])
            for worker, outputs in ((decodes[0], final), (prefill, hand_over)) if order == "decode_first" else \
                    ((prefill, hand_over), (decodes[0], final)):
                worker._dispatch(outputs)
                await asyncio.sleep(0.01)
            await asyncio.wait_for(task, 5)
        assert prefill.health.breaker.state.value == "closed"
        prefill._dispatch(hand_over)  # (late, if it was not in already: it ends the prefill's part)
        assert prefill.num_active == 0 and decodes[0].num_active == 0

    asyncio.run(main())


def test_a_worker_stopped_on_purpose_keeps_its_breaker_closed() -> None:
    """A worker told to stop (SIGTERM) ends its six open requests with ``shutting_down``: they go to the
    other worker, and its breaker counts none of them (six opened it, and the worker restarted on its URL
    got no requests for the breaker's cooldown)."""
    def stop(worker, transport) -> None:  # type: ignore[no-untyped-def]
        for submit in _sent(transport, Submit):
            worker._dispatch(Error(submit.rid, "shutting_down", "the worker is shutting down"))

    assert _six_open_on_a_worker_that_fails(stop) == 0


def test_a_retry_after_a_failure_nobody_is_blamed_for_goes_to_another_worker() -> None:
    """A decode whose look-up of its prefill failed at the registry (``Fault.NONE``: neither worker's
    failure, e.g. a decode restarted while the registry was down, with nothing cached) is not blamed, but
    the retry goes to another decode, which may have the address cached (it went back to the same one,
    with the same failure, for every attempt)."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        prefills, _ = _connected_workers(loop, "prefill", 1)
        decodes, d_transports = _connected_workers(loop, "decode", 2)
        policy = First()
        dispatcher = Dispatcher(prefills, decodes, Router(policy, policy),  # type: ignore[arg-type]
                                DispatchConfig(max_retries=1, retry_backoff_s=0.01))
        task = asyncio.create_task(drain(dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=1))))
        assert await until(lambda: bool(_sent(d_transports[0], Submit)), 5)
        (submit,) = _sent(d_transports[0], Submit)
        decodes[0]._dispatch(Error(submit.rid, "transfer_failed", "bootstrap registry unreachable", fault=Fault.NONE))
        assert await until(lambda: bool(_sent(d_transports[1], Submit)), 5), "the retry went to the same decode"
        (retry,) = _sent(d_transports[1], Submit)
        decodes[1]._dispatch(Outputs([StepOutput(retry.rid, [65], "length")]))
        assert [t for out in await asyncio.wait_for(task, 5) for t in out.token_ids] == [65]
        assert decodes[0].health.breaker.failures == 0

    asyncio.run(main())


def test_a_migrated_stream_goes_on_from_its_last_token_on_another_decode() -> None:
    """A decode that fails after streaming tokens: the stream goes on on another decode, whose ``Submit``
    has the prompt plus the tokens so far, the rest of the token budget and ``output_offset`` = the tokens
    so far (seeded draws continue the sequence, not repeat it; ``min_new_tokens`` counts them), and never
    goes back to the failed decode, even one the policy prefers."""
    async def main() -> None:
        workers, transports = _connected_workers(asyncio.get_running_loop(), "both", 2)
        policy = First()
        dispatcher = Dispatcher([], workers, Router(policy, policy),
                                DispatchConfig(max_migrations=1), combined=True)
        task = asyncio.create_task(drain(dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=8, seed=7))))
        assert await until(lambda: bool(_sent(transports[0], Submit)), 5)
        (submit,) = _sent(transports[0], Submit)
        assert submit.params.output_offset == 0
        workers[0]._dispatch(Outputs([StepOutput(submit.rid, [65, 66])]))
        workers[0]._dispatch(Outputs([StepOutput(submit.rid, [67])]))
        workers[0]._dispatch(Error(submit.rid, "internal", "the engine broke"))  # mid-stream: it migrates
        assert await until(lambda: bool(_sent(transports[1], Submit)), 5), "not migrated to the other decode"
        (moved,) = _sent(transports[1], Submit)
        assert moved.input_ids == [1, 2, 3, 65, 66, 67]
        assert moved.params.max_new_tokens == 5 and moved.params.output_offset == 3 and moved.params.seed == 7
        workers[1]._dispatch(Outputs([StepOutput(moved.rid, [68, 69, 70, 71, 72], "length")]))
        outputs = await asyncio.wait_for(task, 5)
        assert [t for out in outputs for t in out.token_ids] == list(range(65, 73))
        assert len(_sent(transports[0], Submit)) == 1, "the failed decode was sent the stream again"
        assert dispatcher.metrics.migrations._value.value == 1

    asyncio.run(main())


def test_retries_stop_at_max_retries_and_the_last_error_reaches_the_client() -> None:
    """``max_retries=1``: a request whose every attempt fails retryably before its first token (the KV did
    not arrive) is tried twice in all, then the client gets the last attempt's error (a third attempt would
    keep the client waiting and load yet another worker)."""
    async def main() -> None:
        dispatcher, workers, transports = combined(2, DispatchConfig(max_retries=1, retry_backoff_s=0.01))
        task = asyncio.create_task(drain(dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=4))))

        def attempts() -> int:
            return sum(len(_sent(t, Submit)) for t in transports)

        failed: set[tuple[int, int]] = set()
        for n in (1, 2):
            assert await until(lambda n=n: attempts() == n, 5)
            i, rid = next((i, m.rid) for i in range(2) for m in _sent(transports[i], Submit)
                          if (i, m.rid) not in failed)  # (this attempt's, not yet failed)
            workers[i]._dispatch(Error(rid, "transfer_failed", f"the KV did not arrive ({n})"))
            failed.add((i, rid))
        assert await until(task.done, 5), f"still going after {attempts()} attempts"
        with pytest.raises(BadGateway, match=r"the KV did not arrive \(2\)"):
            await task
        assert attempts() == 2 and dispatcher.num_retries == 1

    asyncio.run(main())


def test_a_decode_reporting_its_peers_fault_blames_the_prefill() -> None:
    """A decode whose Error says the fault is its KV peer's (``Fault.PEER``: the prefill went away, fell
    silent or could not be reached) counts against the prefill's breaker, not its own, and the retry goes
    to another prefill (the same decode is fine)."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        prefills, p_transports = _connected_workers(loop, "prefill", 2)
        decodes, d_transports = _connected_workers(loop, "decode", 1)
        policy = First()
        dispatcher = Dispatcher(prefills, decodes, Router(policy, policy),
                                DispatchConfig(max_retries=1, retry_backoff_s=0.01))
        task = asyncio.create_task(drain(dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=1))))
        assert await until(lambda: bool(_sent(d_transports[0], Submit)), 5)
        (submit,) = _sent(d_transports[0], Submit)
        decodes[0]._dispatch(Error(submit.rid, "transfer_failed", "the prefill did not answer", fault=Fault.PEER))
        assert await until(lambda: len(_sent(d_transports[0], Submit)) == 2, 5)
        assert prefills[0].health.breaker.failures == 1 and decodes[0].health.breaker.failures == 0
        assert len(_sent(p_transports[0], Submit)) == 1, "the retry went to the prefill at fault"
        (p_retry,) = _sent(p_transports[1], Submit)
        retry = _sent(d_transports[0], Submit)[1]
        prefills[1]._dispatch(Outputs([StepOutput(p_retry.rid, [], "transferred")]))
        decodes[0]._dispatch(Outputs([StepOutput(retry.rid, [65], "length")]))
        assert [t for out in await asyncio.wait_for(task, 5) for t in out.token_ids] == [65]

    asyncio.run(main())


def test_a_half_open_breaker_lets_through_as_many_trials_at_once_as_it_needs_successes() -> None:
    """A worker back from an open breaker is tried by at most ``breaker_successes`` requests at a time (not
    the whole burst that waited): the rest go to the other workers; a trial that ends frees its place;
    readiness counts the worker meanwhile."""
    from gateway.health import BreakerState

    async def main() -> None:
        dispatcher, workers, transports = combined(2, DispatchConfig(max_retries=0))
        breaker = _half_open(workers[0])
        assert breaker.state is BreakerState.HALF_OPEN and breaker.successes_to_close == 2
        params = SamplingParams(max_new_tokens=8)
        gens = [dispatcher.generate([1, 2, i], params) for i in range(6)]
        firsts = [asyncio.ensure_future(gen.__anext__()) for gen in gens]
        assert await until(lambda: len(_sent(transports[0], Submit)) + len(_sent(transports[1], Submit)) == 6, 5)
        trials = _sent(transports[0], Submit)
        assert len(trials) == 2 and not workers[0].healthy and workers[0].available and dispatcher.is_ready()
        workers[0]._dispatch(Outputs([StepOutput(trials[0].rid, [65])]))  # a trial's first token: its place is free
        assert workers[0].healthy and breaker.state is BreakerState.HALF_OPEN and len(breaker.trials) == 1
        for first in firsts:
            first.cancel()
        for gen in gens:
            with contextlib.suppress(BaseException):
                await gen.aclose()

    asyncio.run(main())


def test_an_sglang_workers_half_open_breaker_limits_its_trials_too() -> None:
    from gateway.health import BreakerState, HealthConfig
    from gateway.sglang_fleet import HttpWorker

    worker = HttpWorker("http://127.0.0.1:1", "decode", None, HealthConfig(breaker_cooldown_s=1e-9))
    worker.is_up = True
    breaker = worker.health.breaker
    for _ in range(breaker.failures_to_open):
        breaker.record_failure()
    assert breaker.state is BreakerState.HALF_OPEN and worker.healthy
    rids = [worker.opened(), worker.opened()]
    assert not worker.healthy  # (two trials open: as many as it needs successes)
    worker.closed(rids[0])
    assert worker.healthy and breaker.trials == {rids[1]}


def test_a_failure_while_half_open_opens_the_breaker_again() -> None:
    """A half-open worker that fails a trial is out again (open, taking no requests) for a whole cooldown
    from that failure: one failed trial is enough, not ``breaker_failures`` more, or a worker failing its
    trials would keep taking trial traffic."""
    from gateway.health import BreakerState, CircuitBreaker

    now = [0.0]
    breaker = CircuitBreaker(failures_to_open=3, cooldown_s=10.0, successes_to_close=2, clock=lambda: now[0])
    for _ in range(3):
        breaker.record_failure()
    now[0] = 10.0
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows
    breaker.trial_started(1)
    breaker.record_failure()  # the trial failed
    assert breaker.state is BreakerState.OPEN and not breaker.allows and not breaker.closed
    assert breaker.num_opened == 2 and not breaker.trials
    now[0] = 19.5
    assert breaker.state is BreakerState.OPEN and not breaker.allows, "its cooldown runs from the failed trial"
    now[0] = 20.0
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows


def test_an_sglang_workers_half_open_breaker_closes_on_its_trials_only() -> None:
    """As on the native path: an SGLang worker's answer to a request sent before its breaker opened does not close
    the half-open breaker; a trial's (a request sent after) does."""
    from gateway.health import BreakerState, HealthConfig
    from gateway.sglang_fleet import HttpWorker
    from gateway.sglang_relay import _record

    worker = HttpWorker("http://127.0.0.1:1", "decode", None,
                        HealthConfig(breaker_failures=2, breaker_successes=1, breaker_cooldown_s=1e-9))
    worker.is_up = True
    breaker = worker.health.breaker
    old = worker.opened()
    _record(worker, worker.opened(), 500)
    _record(worker, worker.opened(), 502)
    assert breaker.state is BreakerState.HALF_OPEN
    _record(worker, old, 200)
    assert breaker.state is BreakerState.HALF_OPEN, "an old request's answer closed the breaker without a trial"
    _record(worker, worker.opened(), 200)
    assert breaker.state is BreakerState.CLOSED and breaker.failures == 0
