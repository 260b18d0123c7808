"""Unit tests for the gateway's hot-path pieces: the event sink, output merging, frame parsing and
the SSE byte templates (each must give exactly what the plain, slower construction gives)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from gateway.api import Prepared
from gateway.event_sink import DirectPathFailed, EventSink, SinkOverflow
from gateway.shapes import ChatShape, CompletionShape, Run
from gateway.worker_client import _FrameProtocol
from workers.protocol import Error, KVEvents, LoadReport, Outputs, SamplingParams, StepOutput, gateway_codec


def _tokens(item: tuple[Any, object]) -> list[int]:
    event = item[1]
    assert isinstance(event, StepOutput)
    return event.token_ids


def test_sink_returns_queued_events_in_order_and_wakes_a_waiter() -> None:
    async def main() -> None:
        sink = EventSink()
        sink.set_deadline(10)
        sink.put_nowait(("decode", StepOutput(1, [5])))
        assert await sink.get() == ("decode", StepOutput(1, [5]))
        getter = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        assert not getter.done()
        sink.put_nowait(("prefill", Error(1, "internal", "x")))
        assert await getter == ("prefill", Error(1, "internal", "x"))
        sink.close()

    asyncio.run(main())


def test_sink_overflow_stops_the_producers_once_and_fails_the_reader() -> None:
    async def main() -> None:
        calls: list[int] = []
        sink = EventSink(limit=3, on_overflow=lambda: calls.append(1))
        sink.set_deadline(10)
        for i in range(3):
            sink.put_nowait(("decode", StepOutput(1, [i])))
        assert _tokens(await sink.get()) == [0] and not calls, "at the limit, not past it: nothing lost"
        getter = asyncio.ensure_future(sink.get())
        assert _tokens(await getter) == [1]
        for i in range(3, 6):  # 4 unread now: past the limit
            sink.put_nowait(("decode", StepOutput(1, [i])))
        assert calls == [1] and sink.overflowed
        sink.put_nowait(("decode", StepOutput(1, [9])))  # late events are dropped, no second call
        assert calls == [1]
        with pytest.raises(SinkOverflow):
            await sink.get()
        sink.close()

    asyncio.run(main())


def test_a_tap_that_raises_ends_the_stream_instead_of_replaying_its_event() -> None:
    """The tap may have recorded part of an event before it raised: the event must not go through
    ``get`` a second time (its tokens would count twice), nor may the exception reach the worker
    connection's callback; the reader gets ``DirectPathFailed`` and later events are dropped."""
    async def main() -> None:
        taken: list[list[int]] = []

        def tap(item: tuple[Any, object]) -> bool:
            taken.append(_tokens(item))
            if len(taken) == 2:
                raise RuntimeError("a bug in the consumer")
            return True

        sink = EventSink()
        sink.set_deadline(10)
        sink.tap = tap
        getter = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        sink.put_nowait(("decode", StepOutput(1, [1])))  # taken by the tap: nobody woken
        assert not getter.done()
        sink.put_nowait(("decode", StepOutput(1, [2])))  # the tap raises here, not in this caller
        sink.put_nowait(("decode", StepOutput(1, [3])))  # after the failure: dropped
        with pytest.raises(DirectPathFailed):
            await getter
        assert taken == [[1], [2]] and sink.tap is None
        with pytest.raises(DirectPathFailed):
            await sink.get()
        sink.close()

    asyncio.run(main())


def test_sink_deadline_expires_and_moving_it_rearms_the_one_timer() -> None:
    async def main() -> None:
        sink = EventSink()
        sink.set_deadline(0.05)
        with pytest.raises(TimeoutError):
            await sink.get()
        # A deadline moved forward by each event: get() keeps working while events arrive in time,
        # and times out once they stop.
        sink = EventSink()
        sink.set_deadline(0.2)
        for i in range(5):
            await asyncio.sleep(0.1)  # half the deadline: each event arrives in time
            sink.put_nowait(("decode", StepOutput(1, [i])))
            assert _tokens(await sink.get()) == [i]
            sink.set_deadline(0.2)
        with pytest.raises(TimeoutError):
            await sink.get()
        sink.close()

    asyncio.run(main())


def test_an_event_arriving_in_the_loop_pass_its_deadline_fires_is_returned() -> None:
    """The deadline's slot comes due and the worker's output arrives in the same loop pass (before the
    reader's task runs): the reader gets the output, not a timeout (a migration or a 504 for an answer
    that had come)."""
    async def main() -> None:
        for tapped in (False, True):  # (a tap, the direct path's, must not take it behind the reader's back)
            sink = EventSink()
            taken: list[object] = []
            if tapped:
                sink.tap = lambda item, taken=taken: taken.append(item) or True
            sink.set_deadline(10)
            reader = asyncio.create_task(sink.get())
            await asyncio.sleep(0)  # (waiting, nothing queued)
            sink._deadline = asyncio.get_running_loop().time() - 1  # (as if the 10 s had passed)
            sink.due()
            sink.put_nowait(("decode", StepOutput(1, [7])))
            assert _tokens(await reader) == [7] and not taken
            sink.close()

    asyncio.run(main())


def test_sink_merges_only_queued_decode_outputs_up_to_the_final_one() -> None:
    async def main() -> None:
        sink = EventSink()
        for item in [("decode", StepOutput(1, [2], logprobs=[-0.2], cached_tokens=3)),
                     ("decode", StepOutput(1, [3, 4], logprobs=[-0.3, -0.4])),
                     ("decode", StepOutput(1, [5], "length", logprobs=[-0.5], prompt_tokens=9)),
                     ("decode", StepOutput(1, [6]))]:
            sink.put_nowait(item)
        merged = sink.merge_ready(StepOutput(1, [1], logprobs=[-0.1]))
        assert merged.token_ids == [1, 2, 3, 4, 5]
        assert merged.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
        assert (merged.finish_reason, merged.cached_tokens, merged.prompt_tokens) == ("length", 3, 9)
        assert _tokens(await sink.get()) == [6]  # after the final one: left alone

        sink.put_nowait(("prefill", StepOutput(1, [], "transferred")))
        sink.put_nowait(("decode", StepOutput(1, [8])))
        assert sink.merge_ready(StepOutput(1, [7])).token_ids == [7]  # a prefill event stops the merge
        sink.close()

    asyncio.run(main())


def test_frame_protocol_parses_any_split_of_the_byte_stream() -> None:
    async def main() -> None:
        codec = gateway_codec()
        messages: list[Any] = [
            Outputs([StepOutput(i, list(range(i % 7)), None if i % 5 else "stop") for i in range(1, 4)]),
            LoadReport(num_running=3, num_waiting=1, num_free_pages=10, num_total_pages=20),
            KVEvents(stored=[b"\x01" * 16, b"\x02" * 16]),
            Error(4, "timeout", "late"),
        ] * 20
        stream = b"".join(codec.encode(m) for m in messages)
        rng = random.Random(7)
        for _ in range(30):
            got: list[object] = []
            proto = _FrameProtocol(codec.decode)
            proto.on_message = got.append
            pos = 0
            while pos < len(stream):
                step = rng.choice([1, 2, 3, 5, 17, 64, 1000])
                proto.data_received(stream[pos:pos + step])
                pos += step
            assert got == messages
            assert not proto.closed.done()

    asyncio.run(main())


def test_frame_protocol_closes_on_an_oversized_or_garbled_frame() -> None:
    class Transport:
        closed = False

        def close(self) -> None:
            self.closed = True

    async def main() -> None:
        for data in [(1 << 31).to_bytes(4, "big"), (3).to_bytes(4, "big") + b"\xc1\xc1\xc1"]:
            proto = _FrameProtocol(gateway_codec().decode)
            transport = Transport()
            proto.connection_made(transport)  # type: ignore[arg-type]
            proto.data_received(data)
            assert transport.closed and proto.closed.done()

    asyncio.run(main())


class _Frontend:
    model_name = 'model "with" quotes/ünïcode'


def _run(include_usage: bool, want_logprobs: bool = False) -> Run:
    prep = Prepared([1, 2, 3], SamplingParams(), 1, [], True, include_usage, want_logprobs)
    return Run(_Frontend(), prep, "chatcmpl-abc")  # type: ignore[arg-type]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", ["plain", 'quote " backslash \\ newline \n', "ünïcödé 漢字 🎉", "\x00\x1f ctrl"])
def test_chat_chunk_template_equals_the_plain_chunk(include_usage: bool, text: str) -> None:
    shape, run = ChatShape(), _run(include_usage)
    for index in (0, 3):
        before, after = shape._template(run, index)
        fast = before + json.dumps(text).encode() + after
        plain = shape._chunk(run, [{"index": index, "delta": {"content": text}, "logprobs": None,
                                    "finish_reason": None}])
        assert fast.startswith(b"data: ") and fast.endswith(b"\n\n")
        assert json.loads(fast[6:]) == json.loads(plain[6:])


@pytest.mark.parametrize("text", ["plain", 'q"uote', "🎉"])
def test_completion_chunk_template_equals_the_plain_chunk(text: str) -> None:
    shape, run = CompletionShape(), _run(False)
    before, after = shape._template(run, 1)
    fast = before + json.dumps(text).encode() + after
    assert json.loads(fast[6:]) == json.loads(shape._chunk(run, 1, text, None, None)[6:])


def test_sink_tap_takes_events_only_while_the_reader_waits_with_none_queued() -> None:
    """The tap (the direct path) must never overtake an event the reader has not handled yet."""
    async def main() -> None:
        taken: list[list[int]] = []
        accept = [True]
        sink = EventSink()
        sink.set_deadline(10)
        sink.tap = lambda item: accept[0] and not taken.append(_tokens(item))  # type: ignore[func-returns-value]
        sink.put_nowait(("decode", StepOutput(1, [1])))  # nobody waits in get(): queued
        assert taken == [] and await sink.get() == ("decode", StepOutput(1, [1]))
        getter = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        sink.put_nowait(("decode", StepOutput(1, [2])))  # the reader waits, nothing queued: the tap takes it
        assert taken == [[2]] and not getter.done()
        accept[0] = False
        sink.put_nowait(("decode", StepOutput(1, [3])))  # the tap declines: queued, the reader woken
        accept[0] = True
        sink.put_nowait(("decode", StepOutput(1, [4])))  # one is queued: behind it, not to the tap
        assert _tokens(await getter) == [3] and _tokens(await sink.get()) == [4] and taken == [[2]]
        sink.close()
        assert sink.tap is None

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(5))
def test_accept_middle_equals_accept(seed: int) -> None:
    """The direct path's detokenizing (``ChoiceState.accept_middle``) gives what ``accept`` gives, split
    UTF-8 sequences and non-byte ids included."""
    from gateway.text import ChoiceState
    from gateway.tokenizer import ByteTokenizer

    rng = random.Random(seed)
    ids = [*"día ☃ — 火 ok".encode(), 256, 257, *b"end"]
    plain, fast = ChoiceState(0, ByteTokenizer(), [], False), ChoiceState(0, ByteTokenizer(), [], False)
    pos = 0
    while pos < len(ids):
        step = ids[pos:pos + rng.randint(1, 3)]
        pos += len(step)
        event = StepOutput(1, step, cached_tokens=rng.randint(0, 9))
        text, _ = plain.accept(StepOutput(1, step, cached_tokens=event.cached_tokens))
        assert fast.accept_middle(event) == text
    assert fast.text == plain.text and fast.token_ids == plain.token_ids
    assert fast.cached_tokens == plain.cached_tokens


class _Capture:
    """An ``Exchange``'s writes from outside the task: what the direct path sent, in order. ``full``:
    the numbers of the offers (0, 1, ...) it refuses, as a client's full socket does."""

    def __init__(self, full: frozenset[int] = frozenset(), lane: bool = False) -> None:
        self.lane = lane
        self.chunks: list[bytes] = []
        self.started = False
        self.full = full
        self.offers = 0
        self.room = False  # the last answer to ``can_start`` / ``is_writable``

    def _has_room(self) -> bool:
        self.offers += 1
        self.room = self.offers - 1 not in self.full
        return self.room

    def can_start(self) -> bool:
        return self._has_room() and not self.started

    def is_writable(self) -> bool:
        return self._has_room() and self.started

    def start_now(self, first: bytes) -> None:
        assert self.room, "a write from outside the task after the exchange said it had no room"
        self.started = True
        self.chunks.append(first)

    def write_now(self, chunk: bytes) -> None:
        assert self.room, "a write from outside the task after the exchange said it had no room"
        assert self.started, "a middle chunk before the response's head"
        self.chunks.append(chunk)

    def text_lane(self, accept: Any, encode: Any, before: bytes, after: bytes) -> Any:
        """``HotCycle.text_lane``'s contract over this exchange's own calls (None: ``lane`` is off)."""
        if not self.lane:
            return None

        def lane(output: StepOutput) -> bool:
            if not self.is_writable():
                return False
            text = accept(output)
            if text:
                self.write_now(before + encode(text) + after)
            return True
        return lane


class _OneChoice:
    """``Frontend`` for a shape's ``events``: one choice's outputs, the non-final ones to the emitter when
    there is one (as the dispatcher's direct path does), the rest yielded."""

    model_name = "m"

    def __init__(self, outputs: list[StepOutput]) -> None:
        from gateway.tokenizer import ByteTokenizer

        self.tokenizer = ByteTokenizer()
        self.outputs = outputs

    async def run_choices(self, prep: Prepared, emitter: Any = None) -> Any:
        from gateway.text import ChoiceState

        state = ChoiceState(0, self.tokenizer, [], False)
        direct = emitter.direct(state) if emitter is not None else None
        for output in self.outputs:
            if direct is not None and output.finish_reason is None and direct.offer(output):
                continue
            text, entries = state.accept(output)
            yield state, text, entries


@pytest.mark.parametrize("route", ["chat", "completions", "completions-echo", "generate"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("full", [frozenset(), frozenset({0}), frozenset({1, 2})], ids=["room", "first-full",
                                                                                      "middle-full"])
@pytest.mark.parametrize("first_empty", [False, True], ids=["first-text", "first-empty"])
@pytest.mark.parametrize("lane", [False, True], ids=["no-lane", "lane"])
def test_a_stream_through_the_direct_path_equals_the_stream_through_the_task(route: str, include_usage: bool,
                                                                           full: frozenset[int],
                                                                           first_empty: bool, lane: bool,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks written from the worker connection's callback (the first one with the head included) are
    byte for byte what the request's task would have sent, also when the client's socket is full for
    some outputs (those the direct path refuses go through the task, unchanged), with or without the
    exchange's ``text_lane`` for the middle chunks."""
    from gateway.responder import _StreamEmitter
    from gateway.shapes import GenerateShape

    monkeypatch.setattr("gateway.shapes._monotonic", lambda: 5.0)  # (``/generate``'s ``e2e_latency``: 0 in both)
    shape = {"chat": ChatShape, "generate": GenerateShape}.get(route, CompletionShape)()
    outputs = [StepOutput(1, list(b"He")), StepOutput(1, [*"ll\u00f6".encode()][:3]),
               StepOutput(1, [*"\u00f6".encode()][1:] + list(b" w")), StepOutput(1, list(b"orld"), "length")]
    if first_empty:  # the first output decodes to no text yet (half a character): completions send nothing
        outputs = [StepOutput(1, [*"\u00e9".encode()][:1]), StepOutput(1, [*"\u00e9".encode()][1:] + list(b"t")),
                   *outputs]

    async def chunks(direct: bool) -> list[bytes]:
        prep = Prepared(list(b"prompt"), SamplingParams(), 1, [], True, include_usage, False,
                        echo=route == "completions-echo")
        run = Run(_OneChoice(outputs), prep, "id-1")  # type: ignore[arg-type]
        run.created = 1
        capture = _Capture(full, lane)
        if direct:
            run.emitter = _StreamEmitter(run, shape, capture)  # type: ignore[arg-type]
        async for chunk in shape.events(run):  # (the task's chunks, in order with the direct path's)
            capture.chunks.append(chunk)
        return capture.chunks

    plain, direct = asyncio.run(chunks(False)), asyncio.run(chunks(True))
    assert len(plain) >= 4 and direct == plain


def test_writes_gathered_during_a_frame_go_out_at_its_end_in_order() -> None:
    """``write_batch``: writes between ``begin`` and ``end`` wait for ``end`` and keep their order per
    transport; outside a batch (or in a nested one) they go at once; a transport closed by then is skipped."""
    from gateway import write_batch

    class Transport:
        def __init__(self) -> None:
            self.data: list[bytes] = []
            self.closing = False

        def write(self, data: bytes) -> None:
            assert not self.closing
            self.data.append(data)

        def is_closing(self) -> bool:
            return self.closing

    a, b, gone = Transport(), Transport(), Transport()
    write_batch.write(a, b"now")
    assert a.data == [b"now"]
    assert write_batch.begin()
    assert not write_batch.begin()  # nested: the outer batch ends it
    write_batch.write(a, b"1")
    write_batch.write(b, b"x")
    write_batch.write(gone, b"lost")
    write_batch.write(a, b"2")
    assert a.data == [b"now"] and b.data == []
    gone.closing = True
    write_batch.end()
    assert a.data == [b"now", b"1", b"2"] and b.data == [b"x"] and gone.data == []
    write_batch.write(b, b"after")
    assert b.data == [b"x", b"after"]

    class HalfClosed(Transport):  # (uvloop's transport after write_eof: not closing, and writes raise)
        def write(self, data: bytes) -> None:
            raise RuntimeError("Cannot call write() after write_eof()")

        def close(self) -> None:
            self.closing = True

    refusing = HalfClosed()
    assert write_batch.begin()
    write_batch.write(refusing, b"lost")
    write_batch.write(a, b"3")
    write_batch.end()  # (raising here would drop the worker connection whose frame this batch is)
    assert a.data[-1] == b"3" and refusing.closing


def test_submits_go_out_together_at_the_end_of_the_loop_pass_unless_urgent() -> None:
    """``WorkerClient.submit``: frames queued in one pass of the loop go out in one write after it;
    an ``urgent`` one (a stream's) goes out at once, behind whatever was queued before it, in order."""
    from gateway.worker_client import WorkerClient
    from workers.protocol import Submit

    def prompts(data: bytes) -> list[list[int]]:
        messages = _worker_reads(data)
        assert all(isinstance(m, Submit) for m in messages), messages
        return [m.input_ids for m in messages if isinstance(m, Submit)]

    async def main() -> None:
        client = WorkerClient("pd://127.0.0.1:1", "decode")
        client.loop = asyncio.get_running_loop()
        transport = _RecordingTransport()
        client._transport = transport  # type: ignore[assignment]

        def submit(prompt: int, urgent: bool = False) -> None:
            client.submit(Submit(0, [prompt], SamplingParams()), _NoSink(), "decode", urgent=urgent)

        submit(1)
        submit(2)
        assert transport.writes == []  # until the end of this pass
        submit(3, urgent=True)
        assert [prompts(w) for w in transport.writes] == [[[1], [2], [3]]]
        await asyncio.sleep(0)
        assert len(transport.writes) == 1  # the flush scheduled for 1 and 2 found nothing left
        submit(4)
        submit(5)
        await asyncio.sleep(0)
        assert [prompts(w) for w in transport.writes[1:]] == [[[4], [5]]]
        submit(6, urgent=True)
        assert [prompts(w) for w in transport.writes[2:]] == [[[6]]]

    asyncio.run(main())


class RecordingConsumer:
    """A direct consumer (``Dispatcher.generate``'s ``direct``), always ready: each output it took, as
    (its token ids, its cached tokens) when taken."""

    def __init__(self) -> None:
        self.taken: list[tuple[list[int], int]] = []

    def ready(self) -> bool:
        return True

    def take(self, output: StepOutput) -> None:
        self.taken.append((list(output.token_ids), output.cached_tokens))

    def offer(self, output: StepOutput) -> bool:
        if not self.ready():
            return False
        self.take(output)
        return True


class _RecordingTransport:
    """A worker connection's transport that keeps every write (what ``WorkerClient`` sent, write by write)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def get_write_buffer_size(self) -> int:
        return 0


def _worker_reads(data: bytes) -> list[object]:
    """The whole messages in one write, split by the gateway's own frame reader and decoded as a worker
    does (call it inside a running loop: the reader makes a future)."""
    from workers.protocol import worker_codec

    messages: list[object] = []
    reader = _FrameProtocol(worker_codec().decode)
    reader.on_message = messages.append
    reader.data_received(data)
    assert not reader._buf, "a write ending in a partial frame"
    return messages


class _NoSink:
    def put_nowait(self, item: object) -> None:
        raise AssertionError(f"no event expected, got {item!r}")


def test_a_migrated_stream_keeps_its_own_cache_hits_on_the_direct_path() -> None:
    """After a migration the new pair reports cache hits on the new prompt (the client's prompt plus the
    tokens streamed so far); the client's usage must keep the first pair's. ``record`` rewrites them, so
    it must run before the direct consumer counts an output. Two combined workers in-process (real
    ``WorkerClient``s over a recording transport), the first one lost mid-stream."""
    from gateway.dispatch import Dispatcher
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router
    from workers.protocol import Outputs, StepOutput, Submit

    def submitted(transport: _RecordingTransport) -> list[int]:
        return [m.rid for data in transport.writes for m in _worker_reads(data) if isinstance(m, Submit)]

    async def main() -> None:
        workers, transports = _connected_workers(asyncio.get_running_loop(), "both", 2)
        policy = RoundRobinPolicy()
        dispatcher = Dispatcher([], workers, Router(policy, policy), combined=True)
        consumer = RecordingConsumer()
        yielded: list[StepOutput] = []

        async def consume() -> None:
            async for item in dispatcher.generate([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=4),
                                                  direct=consumer):
                yielded.append(item)

        task = asyncio.create_task(consume())
        for _ in range(20):
            await asyncio.sleep(0)
        first = next(i for i in range(2) if submitted(transports[i]))
        other = 1 - first
        (rid,) = submitted(transports[first])
        workers[first]._dispatch(Outputs([StepOutput(rid, [65], cached_tokens=4)]))
        workers[first]._fail_open("the worker went away", abort=False)  # mid-stream: the stream migrates
        for _ in range(200):
            if submitted(transports[other]):
                break
            await asyncio.sleep(0.005)
        (rid2,) = submitted(transports[other])
        # The new pair has the new prompt (5 + 1 tokens) cached: not the client's cache hits.
        # (the second of them would go the direct path's steady way, ``_Attempt._lane``, which a migrated stream's
        # attempt does not set)
        workers[other]._dispatch(Outputs([StepOutput(rid2, [66], cached_tokens=6)]))
        workers[other]._dispatch(Outputs([StepOutput(rid2, [67], cached_tokens=6)]))
        workers[other]._dispatch(Outputs([StepOutput(rid2, [68], "length", cached_tokens=6)]))
        await asyncio.wait_for(task, 5)
        assert consumer.taken == [([65], 4), ([66], 4), ([67], 4)]
        assert [(list(o.token_ids), o.cached_tokens) for o in yielded] == [([68], 4)]

    asyncio.run(main())


def test_the_direct_path_records_every_output_it_takes_and_still_hears_the_prefill() -> None:
    """Outputs taken in the worker connection's callback after the first token (the direct path's steady
    way) are recorded as the task's would be: one inter-token gap per token, every token counted; a
    slow reader's outputs queue in order behind them; the prefill's hand-over arriving among them still
    ends its part (its count returns to zero)."""
    from gateway.dispatch import Dispatcher
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router
    from workers.protocol import Outputs, StepOutput, Submit

    class Gated(RecordingConsumer):
        open = True

        def ready(self) -> bool:
            return self.open

    async def main() -> None:
        loop = asyncio.get_running_loop()
        prefills, p_transports = _connected_workers(loop, "prefill", 1)
        decodes, d_transports = _connected_workers(loop, "decode", 1)
        policy = RoundRobinPolicy()
        dispatcher = Dispatcher(prefills, decodes, Router(policy, policy))
        consumer = Gated()
        yielded: list[StepOutput] = []

        async def consume() -> None:
            async for item in dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=8), direct=consumer):
                yielded.append(item)

        task = asyncio.create_task(consume())
        for _ in range(20):
            await asyncio.sleep(0)
        (d_rid,) = [m.rid for m in _sent(d_transports[0], Submit)]
        (p_rid,) = [m.rid for m in _sent(p_transports[0], Submit)]
        decode = decodes[0]
        decode._dispatch(Outputs([StepOutput(d_rid, [65])]))
        decode._dispatch(Outputs([StepOutput(d_rid, [66, 67])]))
        prefills[0]._dispatch(Outputs([StepOutput(p_rid, [], "transferred")]))
        assert prefills[0].num_active == 0
        consumer.open = False  # the client's socket is full: these queue for the task
        decode._dispatch(Outputs([StepOutput(d_rid, [68])]))
        decode._dispatch(Outputs([StepOutput(d_rid, [69])]))
        for _ in range(20):
            await asyncio.sleep(0)
        consumer.open = True
        decode._dispatch(Outputs([StepOutput(d_rid, [70])]))
        decode._dispatch(Outputs([StepOutput(d_rid, [71], "length")]))
        await asyncio.wait_for(task, 5)
        tokens = [t for ids, _ in consumer.taken for t in ids] + [t for o in yielded for t in o.token_ids]
        assert sorted(tokens) == list(range(65, 72)) and len(tokens) == 7
        assert [t for ids, _ in consumer.taken for t in ids][:3] == [65, 66, 67]
        assert [t for o in yielded for t in o.token_ids][-1] == 71
        metrics = dispatcher.metrics
        assert sum(metrics.ttft.counts) == 1 and sum(metrics.itl.counts) == 6
        assert metrics.generation_tokens._value.value == 7
        assert decode.num_active == 0

    asyncio.run(main())


def _connected_workers(loop: asyncio.AbstractEventLoop, role: str,
                       n: int) -> tuple[list[Any], list[_RecordingTransport]]:
    """``n`` connected ``WorkerClient``s of ``role`` over recording transports (nothing is really sent);
    a prefill announces a bootstrap address."""
    from gateway.worker_client import WorkerClient
    from workers.protocol import PROTOCOL_VERSION, HelloAck

    workers, transports = [], []
    base = {"prefill": 10, "decode": 20}.get(role, 0)
    for i in range(n):
        client = WorkerClient(f"pd://127.0.0.1:{base + i + 1}", role)
        client.loop = loop
        transport = _RecordingTransport()
        client._transport = transport  # type: ignore[assignment]
        boot = ("127.0.0.1", 9000 + i, f"inst-{role}{i}") if role == "prefill" else (None, None, None)
        client.info = HelloAck(PROTOCOL_VERSION, f"{role}{i}", role, "sim", "m", "byte", 4, 4096, 4096, *boot)
        client.state.connected(client.info)
        workers.append(client)
        transports.append(transport)
    return workers, transports


def _sent(transport: _RecordingTransport, kind: type) -> list[Any]:
    return [m for data in transport.writes for m in _worker_reads(data) if isinstance(m, kind)]


class _Collected:
    """A ``Collector`` that keeps what it is given; it finishes itself after ``stop_after`` tokens."""

    def __init__(self, stop_after: int = 0) -> None:
        self.accepted: list[tuple[list[int], int, str | None]] = []
        self.finish_reason: str | None = None
        self.stop_after = stop_after

    def accept(self, output: StepOutput) -> None:
        self.accepted.append((list(output.token_ids), output.cached_tokens, output.finish_reason))
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
        elif self.stop_after and sum(len(ids) for ids, _, _ in self.accepted) >= self.stop_after:
            self.finish_reason = "stop"


def test_complete_takes_outputs_in_the_callback_and_migrates_like_generate() -> None:
    """``Dispatcher.complete`` (a whole response): non-final outputs reach the collector inside the
    worker connection's callback (the request's task is not woken for them); a decode lost after the
    first token migrates the request to a new pair with the prompt plus the tokens so far, keeping the
    client's own cache hits; the request's figures are counted once."""
    from gateway.dispatch import Dispatcher
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router
    from workers.protocol import Outputs, Submit

    async def main() -> None:
        workers, transports = _connected_workers(asyncio.get_running_loop(), "both", 2)
        policy = RoundRobinPolicy()
        dispatcher = Dispatcher([], workers, Router(policy, policy), combined=True)
        collected = _Collected()
        task = asyncio.create_task(dispatcher.complete([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=3),
                                                       collected, in_callback=True))
        for _ in range(20):
            await asyncio.sleep(0)
        first = next(i for i in range(2) if _sent(transports[i], Submit))
        other = 1 - first
        (submit,) = _sent(transports[first], Submit)
        workers[first]._dispatch(Outputs([StepOutput(submit.rid, [65], cached_tokens=4)]))
        assert collected.accepted == [([65], 4, None)]  # taken in the callback itself
        workers[first]._fail_open("the worker went away", abort=False)
        for _ in range(200):
            if _sent(transports[other], Submit):
                break
            await asyncio.sleep(0.005)
        (submit2,) = _sent(transports[other], Submit)
        assert submit2.input_ids == [1, 2, 3, 4, 5, 65] and submit2.params.max_new_tokens == 2
        workers[other]._dispatch(Outputs([StepOutput(submit2.rid, [66], cached_tokens=6)]))
        assert collected.accepted[-1] == ([66], 4, None)
        assert not task.done()
        workers[other]._dispatch(Outputs([StepOutput(submit2.rid, [67], "length", cached_tokens=6)]))
        await asyncio.wait_for(task, 5)
        assert collected.accepted == [([65], 4, None), ([66], 4, None), ([67], 4, "length")]
        assert dispatcher.metrics.migrations._value.value == 1
        assert dispatcher.metrics.generation_tokens._value.value == 3
        assert all(w.num_active == 0 for w in workers)

    asyncio.run(main())


def test_complete_ends_when_the_collector_is_done_and_aborts_the_rest() -> None:
    """A collector that finishes on a non-final output (a stop string) ends ``complete`` at once: the
    request is aborted on its worker, the policy hears it was cancelled, and what it produced counts
    as served."""
    from gateway.dispatch import Dispatcher
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router
    from workers.protocol import Abort, Outputs, Submit

    class Policy(RoundRobinPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.outcomes: list[str] = []

        def on_finish(self, pair: object, request: object, outcome: str) -> None:
            self.outcomes.append(outcome)

    async def main() -> None:
        workers, transports = _connected_workers(asyncio.get_running_loop(), "both", 1)
        policy = Policy()
        dispatcher = Dispatcher([], workers, Router(policy, policy), combined=True)
        collected = _Collected(stop_after=2)
        task = asyncio.create_task(dispatcher.complete([1, 2, 3], SamplingParams(max_new_tokens=8), collected))
        for _ in range(20):
            await asyncio.sleep(0)
        (submit,) = _sent(transports[0], Submit)
        workers[0]._dispatch(Outputs([StepOutput(submit.rid, [65])]))
        workers[0]._dispatch(Outputs([StepOutput(submit.rid, [66])]))
        await asyncio.wait_for(task, 5)
        assert [t for ids, _, _ in collected.accepted for t in ids] == [65, 66]
        assert all(reason is None for _, _, reason in collected.accepted)
        for _ in range(5):
            await asyncio.sleep(0)  # (the abort goes out with the loop pass's frames)
        assert [a.rid for a in _sent(transports[0], Abort)] == [submit.rid]
        assert policy.outcomes == ["cancelled"]
        assert workers[0].num_active == 0
        assert dispatcher.metrics.generation_tokens._value.value == 2

    asyncio.run(main())


def test_complete_frees_a_failed_pair_before_the_retry_backoff() -> None:
    """A decode that fails before the first token (transfer failed) is retried on a new pair after a
    backoff; the failed attempt's prefill is aborted at once, not after the backoff."""
    from gateway.dispatch import DispatchConfig, Dispatcher
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router
    from gateway.worker_client import WorkerClient
    from workers.protocol import Abort, Submit

    async def main() -> None:
        loop = asyncio.get_running_loop()
        clients: dict[str, list[WorkerClient]] = {}
        transports: dict[str, list[_RecordingTransport]] = {}
        for role in ("prefill", "decode"):
            clients[role], transports[role] = _connected_workers(loop, role, 2)
        policy = RoundRobinPolicy()
        dispatcher = Dispatcher(clients["prefill"], clients["decode"], Router(policy, policy),
                                DispatchConfig(retry_backoff_s=1.5))
        task = asyncio.create_task(dispatcher.complete([1, 2, 3], SamplingParams(max_new_tokens=4), _Collected(),
                                                       in_callback=True))
        for _ in range(20):
            await asyncio.sleep(0)
        p = next(i for i in range(2) if _sent(transports["prefill"][i], Submit))
        d = next(i for i in range(2) if _sent(transports["decode"][i], Submit))
        (prefill_submit,) = _sent(transports["prefill"][p], Submit)
        (decode_submit,) = _sent(transports["decode"][d], Submit)
        assert decode_submit.gather_s == dispatcher.config.gather_s > 0 and prefill_submit.gather_s == 0
        clients["decode"][d]._dispatch(Error(decode_submit.rid, "transfer_failed", "the KV did not arrive"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert [a.rid for a in _sent(transports["prefill"][p], Abort)] == [prefill_submit.rid]
        assert all(c.num_active == 0 for role in clients.values() for c in role)
        assert not task.done()  # (waiting out the backoff before the next pair)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_whole_response_with_stop_strings_is_gathered_only_by_a_decode_that_stops_at_them() -> None:
    """``Submit.gather_s`` for a whole response with stop strings: sent, with the strings in the params,
    to a decode that ends requests at them itself (``HelloAck.stop_strings``); not to one that does not
    (the gateway finds the string and aborts: held outputs would keep that decode running past it).
    A decode watching the text of another tokenizer file (``HelloAck.tokenizer_digest``) is sent neither
    the gathering nor the strings: it could stop where the gateway's text has none."""
    import msgspec

    from gateway.dispatch import DispatchConfig, Dispatcher
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router
    from workers.protocol import Outputs, Submit

    async def gather_sent(stops_at_strings: bool, stop: list[str], digests: tuple[str, str] = ("", "")
                          ) -> tuple[float, list[str]]:
        workers, transports = _connected_workers(asyncio.get_running_loop(), "both", 1)
        workers[0].info = msgspec.structs.replace(workers[0].info, stop_strings=stops_at_strings,
                                                  tokenizer_digest=digests[1])
        policy = RoundRobinPolicy()
        dispatcher = Dispatcher([], workers, Router(policy, policy), combined=True)
        dispatcher.tokenizer_digest = digests[0]
        params = SamplingParams(max_new_tokens=4, stop=stop)
        task = asyncio.create_task(dispatcher.complete([1, 2, 3], params, _Collected(), in_callback=not stop))
        for _ in range(20):
            await asyncio.sleep(0)
        (submit,) = _sent(transports[0], Submit)
        workers[0]._dispatch(Outputs([StepOutput(submit.rid, [65, 66], "stop")]))
        await asyncio.wait_for(task, 5)
        return submit.gather_s, submit.params.stop

    async def main() -> None:
        gather_s = DispatchConfig().gather_s
        assert gather_s > 0
        assert await gather_sent(True, ["\n\n"]) == (gather_s, ["\n\n"])
        assert await gather_sent(False, ["\n\n"]) == (0.0, ["\n\n"])
        assert await gather_sent(False, []) == (gather_s, [])
        # the gateway's tokenizer digest, the decode's
        assert await gather_sent(True, ["\n\n"], ("ab12", "ab12")) == (gather_s, ["\n\n"])
        assert await gather_sent(True, ["\n\n"], ("ab12", "cd34")) == (0.0, [])
        assert await gather_sent(True, ["\n\n"], ("ab12", "")) == (gather_s, ["\n\n"])  # an older decode
        assert await gather_sent(True, ["\n\n"], ("", "cd34")) == (gather_s, ["\n\n"])
        assert await gather_sent(True, [], ("ab12", "cd34")) == (gather_s, [])

    asyncio.run(main())


def test_inter_token_latency_counts_every_token_of_a_gathered_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """An output carrying several tokens (outputs merged behind one another, or a decode's gathered
    output) adds one inter-token gap per token, each the output's gap over its token count; the first
    output is the time to first token, not a gap."""
    import gateway.dispatch as dispatch
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router

    policy = RoundRobinPolicy()
    dispatcher = dispatch.Dispatcher([], [], Router(policy, policy), combined=True)
    clock = iter([1.0, 1.75, 1.765])
    monkeypatch.setattr(dispatch, "_monotonic", lambda: next(clock))
    run = dispatch._Choice(dispatcher, [1, 2, 3], SamplingParams(max_new_tokens=8))
    run.record(StepOutput(1, [65]))
    run.record(StepOutput(1, [66, 67, 68]))  # 0.75 s for three tokens: three gaps of 0.25 s
    run.record(StepOutput(1, [69]))
    itl, ttft = dispatcher.metrics.itl, dispatcher.metrics.ttft
    assert sum(ttft.counts) == 1
    assert sum(itl.counts) == 4 and itl.sum == pytest.approx(0.765)
    assert itl.counts[itl.bounds.index(0.25)] == 3  # (the bucket le=0.25 holds 0.25 itself)
    assert itl.counts[itl.bounds.index(0.025)] == 1
    assert run.generated == [65, 66, 67, 68, 69]


def test_a_first_output_of_several_tokens_counts_its_others_as_gaps_of_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """A choice's first output may carry several tokens (n > 1, a batch, stop strings: the decode gathers
    them): one is the time to first token, each other one an inter-token gap of 0 (they came with it), so
    the histogram counts every token after each choice's first (it left them out)."""
    import gateway.dispatch as dispatch
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router

    policy = RoundRobinPolicy()
    dispatcher = dispatch.Dispatcher([], [], Router(policy, policy), combined=True)
    clock = iter([1.0, 1.5])
    monkeypatch.setattr(dispatch, "_monotonic", lambda: next(clock))
    run = dispatch._Choice(dispatcher, [1, 2, 3], SamplingParams(max_new_tokens=8))
    run.record(StepOutput(1, [65, 66, 67]))
    run.record(StepOutput(1, [68, 69]))  # 0.5 s for two tokens: two gaps of 0.25 s
    itl, ttft = dispatcher.metrics.itl, dispatcher.metrics.ttft
    assert sum(ttft.counts) == 1
    assert sum(itl.counts) == 4 == len(run.generated) - 1 and itl.sum == pytest.approx(0.5)
    assert itl.counts[0] == 2 and itl.counts[itl.bounds.index(0.25)] == 2


def test_legacy_top_logprobs_always_hold_the_token_itself() -> None:
    """OpenAI's legacy completions: "up to logprobs + 1" tokens, the chosen one always among them; with
    ``logprobs: 0`` it alone (a sampled token outside the most likely ones was missing, and 0 gave {})."""
    from gateway.shapes import legacy_logprobs

    entries = [{"token": " a", "logprob": -0.1, "top_logprobs": []},
               {"token": " b", "logprob": -3.0, "top_logprobs": [{"token": " c", "logprob": -0.2}]},
               {"token": " c", "logprob": -0.2, "top_logprobs": [{"token": " c", "logprob": -0.2}]},
               {"token": "x", "logprob": None, "top_logprobs": None}]  # (an echoed prompt's first token)
    out = legacy_logprobs(entries, 5)
    assert out["top_logprobs"] == [{" a": -0.1}, {" c": -0.2, " b": -3.0}, {" c": -0.2}, None]
    assert out["text_offset"] == [5, 7, 9, 11] and out["tokens"] == [" a", " b", " c", "x"]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_stream_whose_client_stops_reading_is_stopped_for_any_n(n: int) -> None:
    """A consumer that stops reading leaves the workers' outputs unread; past ``max_unread_events`` its
    choices are aborted on their workers. With n > 1 every choice's outputs were moved into one unbounded
    queue as they came, so the limit was never reached: each choice ran to its budget, its outputs kept."""
    from gateway.api import Frontend
    from gateway.dispatch import DispatchConfig, Dispatcher
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router
    from gateway.tokenizer import ByteTokenizer
    from workers.protocol import Abort, Submit

    async def main() -> None:
        workers, transports = _connected_workers(asyncio.get_running_loop(), "both", 3)
        policy = RoundRobinPolicy()
        dispatcher = Dispatcher([], workers, Router(policy, policy), DispatchConfig(max_unread_events=8),
                                combined=True)
        frontend = Frontend(dispatcher, ByteTokenizer(), "m", 4096)
        choices = frontend.run_choices(Prepared([1, 2, 3], SamplingParams(max_new_tokens=4_000), n, [], True,
                                                False, False))
        first = asyncio.ensure_future(choices.__anext__())
        for _ in range(200):
            if sum(len(_sent(t, Submit)) for t in transports) == n:
                break
            await asyncio.sleep(0.005)
        submits = [(w, s) for w, t in zip(workers, transports, strict=True) for s in _sent(t, Submit)]
        assert len(submits) == n
        for worker, submit in submits:
            worker._dispatch(Outputs([StepOutput(submit.rid, [65])]))
        await asyncio.wait_for(first, 5)  # the consumer had one output; it reads no more
        for i in range(200):
            for worker, submit in submits:
                if submit.rid in worker._open:
                    worker._dispatch(Outputs([StepOutput(submit.rid, [66 + i % 20])]))
            await asyncio.sleep(0)
        aborted = sum(len(_sent(t, Abort)) for t in transports)
        still_open = sum(w.num_active for w in workers)
        await choices.aclose()
        assert (aborted, still_open) == (n, 0), f"n={n}: {aborted} aborted, {still_open} still generating"

    asyncio.run(main())


def test_several_choices_still_stream_every_output_in_order() -> None:
    """The choices' outputs, taken one at a time per choice: each choice's text whole and in order."""
    from gateway.api import Frontend
    from gateway.dispatch import Dispatcher
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router
    from gateway.tokenizer import ByteTokenizer
    from workers.protocol import Submit

    async def main() -> None:
        workers, transports = _connected_workers(asyncio.get_running_loop(), "both", 2)
        policy = RoundRobinPolicy()
        dispatcher = Dispatcher([], workers, Router(policy, policy), combined=True)
        frontend = Frontend(dispatcher, ByteTokenizer(), "m", 4096)
        texts = ["", ""]

        async def consume() -> None:
            async for state, text, _ in frontend.run_choices(Prepared([1, 2], SamplingParams(max_new_tokens=9), 2,
                                                                      [], True, False, False)):
                texts[state.index] += text

        task = asyncio.create_task(consume())
        for _ in range(200):
            if sum(len(_sent(t, Submit)) for t in transports) == 2:
                break
            await asyncio.sleep(0.005)
        submits = [(w, s) for w, t in zip(workers, transports, strict=True) for s in _sent(t, Submit)]
        for step in range(9):  # several outputs at once per choice, before the consumer runs
            for worker, submit in submits:
                worker._dispatch(Outputs([StepOutput(submit.rid, [97 + step], "length" if step == 8 else None)]))
            if step % 3 == 0:
                await asyncio.sleep(0)
        await asyncio.wait_for(task, 5)
        assert texts == ["abcdefghi", "abcdefghi"]
        assert sum(w.num_active for w in workers) == 0

    asyncio.run(main())


def test_a_failed_request_of_several_choices_does_not_count_as_served() -> None:
    """One choice fails (the client gets the error): the others, stopped for it, are not served either; their
    prompt and end-to-end figures were counted as if the request had been (tokens generated still count)."""
    from gateway.api import Frontend
    from gateway.dispatch import DispatchConfig, Dispatcher
    from gateway.errors import APIError
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router
    from gateway.tokenizer import ByteTokenizer
    from workers.protocol import Submit

    async def main() -> None:
        workers, transports = _connected_workers(asyncio.get_running_loop(), "both", 2)
        policy = RoundRobinPolicy()
        dispatcher = Dispatcher([], workers, Router(policy, policy), DispatchConfig(max_retries=0), combined=True)
        frontend = Frontend(dispatcher, ByteTokenizer(), "m", 4096)
        choices = frontend.run_choices(Prepared([1, 2, 3], SamplingParams(max_new_tokens=8), 2, [], True, False,
                                                False))
        first = asyncio.ensure_future(choices.__anext__())
        for _ in range(200):
            if sum(len(_sent(t, Submit)) for t in transports) == 2:
                break
            await asyncio.sleep(0.005)
        (w0, s0), (w1, s1) = [(w, s) for w, t in zip(workers, transports, strict=True) for s in _sent(t, Submit)]
        w0._dispatch(Outputs([StepOutput(s0.rid, [65])]))
        await asyncio.wait_for(first, 5)
        w1._dispatch(Error(s1.rid, "internal", "the engine broke"))
        with pytest.raises(APIError):
            await asyncio.wait_for(choices.__anext__(), 5)
        await choices.aclose()
        metrics = dispatcher.metrics
        assert metrics.prompt_tokens._value.value == 0 and sum(metrics.e2e.counts) == 0
        assert metrics.generation_tokens._value.value == 1

    asyncio.run(main())


def test_a_decode_is_credited_once_per_request() -> None:
    """A decode's final output held for the prefill's prompt logprobs is its success; the client leaving
    before the hand-over credited it again, so a half-open breaker closed on half the trials it asks for."""
    from gateway.dispatch import Dispatcher
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router
    from workers.protocol import Submit

    async def main() -> None:
        loop = asyncio.get_running_loop()
        prefills, _ = _connected_workers(loop, "prefill", 1)
        decodes, d_transports = _connected_workers(loop, "decode", 1)
        breaker = decodes[0].health.breaker
        breaker.failures_to_open, breaker.cooldown_s, breaker.successes_to_close = 1, 0.0, 2
        breaker.record_failure()  # open; with no cooldown, half-open at once
        assert breaker.allows and not breaker.closed
        policy = RoundRobinPolicy()
        dispatcher = Dispatcher(prefills, decodes, Router(policy, policy))

        async def consume() -> None:
            async for _ in dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=2, prompt_logprobs=True)):
                pass

        task = asyncio.create_task(consume())
        for _ in range(200):
            if _sent(d_transports[0], Submit):
                break
            await asyncio.sleep(0.005)
        (submit,) = _sent(d_transports[0], Submit)
        decodes[0]._dispatch(Outputs([StepOutput(submit.rid, [65, 66], "length")]))  # held: no hand-over yet
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done()
        task.cancel()  # the client leaves
        await asyncio.gather(task, return_exceptions=True)
        assert not breaker.closed, "one request counted as two of the two successes a half-open breaker asks"

    asyncio.run(main())


@pytest.mark.parametrize("chunked", [True, False], ids=["http1.1", "http1.0"])
def test_the_hot_cycles_text_lane_writes_what_write_now_would(chunked: bool) -> None:
    """``HotCycle.text_lane`` (a stream's middle chunks, one call per output) writes byte for byte what
    ``is_writable`` + ``write_now`` would, nothing for no text; and refuses, accepting nothing, whenever
    ``is_writable`` is False (the client's socket full, the client gone, the response ended, the
    transport closing)."""
    from types import SimpleNamespace

    import msgspec

    from gateway.hot_cycle import HotCycle
    from workers.protocol import StepOutput

    class Transport:
        def __init__(self) -> None:
            self.writes: list[bytes] = []
            self.closing = False

        def write(self, data: bytes) -> None:
            self.writes.append(data)

        def is_closing(self) -> bool:
            return self.closing

    def cycle() -> tuple[HotCycle, Transport]:
        transport = Transport()
        protocol = SimpleNamespace(transport=transport, loop=None, flow=SimpleNamespace(write_paused=False),
                                   server_state=SimpleNamespace(default_headers=[]), on_response_complete=None)
        hot = HotCycle(protocol, None, None, "/v1/chat/completions", [], True, False, chunked)  # type: ignore[arg-type]
        hot.response_started = True
        return hot, transport

    texts = ["Hel", "", "l\u00f6 \"w\"\n", "\U0001F600" * 40]
    encode = msgspec.json.encode
    before, after = b'data: {"choices":[{"delta":{"content":', b'}}]}\n\n'
    lane_cycle, lane_transport = cycle()
    plain_cycle, plain_transport = cycle()
    accepted: list[int] = []

    def accept(output: StepOutput) -> str:
        accepted.append(output.rid)
        return texts[output.rid]

    lane = lane_cycle.text_lane(accept, encode, before, after)
    for i, text in enumerate(texts):
        assert lane(StepOutput(i, [1])) is True
        assert plain_cycle.is_writable()
        if text:
            plain_cycle.write_now(before + encode(text) + after)
    assert accepted == list(range(len(texts)))
    assert lane_transport.writes == plain_transport.writes and len(lane_transport.writes) == 3

    from gateway import write_batch  # inside a worker frame's batch, written when it ends, in order
    assert write_batch.begin()
    try:
        assert lane(StepOutput(0, [1])) is True and lane(StepOutput(2, [1])) is True
        plain_cycle.write_now(before + encode(texts[0]) + after)
        plain_cycle.write_now(before + encode(texts[2]) + after)
        assert len(lane_transport.writes) == 3
    finally:
        write_batch.end()
    assert lane_transport.writes == plain_transport.writes and len(lane_transport.writes) == 5

    refusals = [lambda c, t: setattr(c.flow, "write_paused", True), lambda c, t: setattr(c, "disconnected", True),
                lambda c, t: setattr(c, "response_complete", True), lambda c, t: setattr(t, "closing", True)]
    for refuse in refusals:
        hot, transport = cycle()
        lane = hot.text_lane(accept, encode, before, after)
        refuse(hot, transport)
        accepted.clear()
        assert not hot.is_writable()
        assert lane(StepOutput(0, [1])) is False and not accepted and not transport.writes


def test_a_half_open_breaker_closes_on_its_trials_not_on_an_old_stream() -> None:
    """A long stream that started before its decode's breaker opened ends well while the breaker is half-open:
    its success says nothing about the decode now, and it closed the breaker without any trial. A request sent
    after the opening (a trial) closes it as before."""
    from gateway.dispatch import Dispatcher
    from gateway.health import BreakerState
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router
    from workers.protocol import Submit

    async def main() -> None:
        loop = asyncio.get_running_loop()
        prefills, p_transports = _connected_workers(loop, "prefill", 1)
        decodes, d_transports = _connected_workers(loop, "decode", 1)
        breaker = decodes[0].health.breaker
        breaker.failures_to_open, breaker.successes_to_close, breaker.cooldown_s = 3, 1, 0.0
        policy = RoundRobinPolicy()
        dispatcher = Dispatcher(prefills, decodes, Router(policy, policy))

        async def consume() -> list[int]:
            tokens: list[int] = []
            async for output in dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=2)):
                tokens += output.token_ids
            return tokens

        async def sent(n: int) -> tuple[Any, Any]:
            for _ in range(200):
                if len(_sent(d_transports[0], Submit)) >= n and len(_sent(p_transports[0], Submit)) >= n:
                    break
                await asyncio.sleep(0.005)
            return _sent(d_transports[0], Submit)[n - 1], _sent(p_transports[0], Submit)[n - 1]

        old = asyncio.create_task(consume())
        d_old, p_old = await sent(1)
        decodes[0]._dispatch(Outputs([StepOutput(d_old.rid, [64])]))  # streaming
        for _ in range(breaker.failures_to_open):  # (requests sent since then failed on the decode)
            breaker.record_failure()
        assert breaker.state is BreakerState.HALF_OPEN  # (no cooldown)
        prefills[0]._dispatch(Outputs([StepOutput(p_old.rid, [], "transferred")]))
        decodes[0]._dispatch(Outputs([StepOutput(d_old.rid, [65], "length")]))
        assert await asyncio.wait_for(old, 5) == [64, 65]
        assert breaker.state is BreakerState.HALF_OPEN, "an old stream's end closed the breaker: no trial ran"
        new = asyncio.create_task(consume())  # sent after the opening: a trial, and it counts
        d_new, p_new = await sent(2)
        prefills[0]._dispatch(Outputs([StepOutput(p_new.rid, [], "transferred")]))
        decodes[0]._dispatch(Outputs([StepOutput(d_new.rid, [65, 66], "length")]))
        assert await asyncio.wait_for(new, 5) == [65, 66]
        assert breaker.state is BreakerState.CLOSED and breaker.failures == 0

    asyncio.run(main())


@pytest.mark.parametrize("headers", [
    [(b"content-type", b"text/plain\r\nset-cookie: x=1")], [(b"x-bad header", b"v")], [(b"x-nul", b"a\x00b")],
    [(b"content-type:", b"text/plain")],
])
def test_the_hot_cycles_asgi_send_refuses_a_header_that_would_break_the_head(
        headers: list[tuple[bytes, bytes]]) -> None:
    """``HotCycle.send`` (the SGLang relay's ASGI messages) writes a response head from the caller's headers: one whose
    name or value holds a line break, a control character or (in a name) a separator is refused before anything is
    written, as uvicorn's ``send`` refuses it; the cycle's own 500 then goes out (``run_asgi``)."""
    import asyncio
    from types import SimpleNamespace

    from gateway.hot_cycle import HotCycle

    writes: list[bytes] = []
    transport = SimpleNamespace(write=writes.append, is_closing=lambda: False)
    protocol = SimpleNamespace(transport=transport, loop=None, flow=SimpleNamespace(write_paused=False),
                               server_state=SimpleNamespace(default_headers=[]), on_response_complete=lambda: None)
    hot = HotCycle(protocol, None, None, "/generate", [], True, False)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="forbidden character"):
        asyncio.run(hot.send({"type": "http.response.start", "status": 200, "headers": headers}))
    assert writes == [] and not hot.response_started
    good = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"x-accel-buffering", b"no")]
    asyncio.run(hot.send({"type": "http.response.start", "status": 200, "headers": good}))
    asyncio.run(hot.send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": False}))
    head, _, body = b"".join(writes).partition(b"\r\n\r\n")
    assert b"content-type: text/event-stream; charset=utf-8\r\n" in head and b"transfer-encoding: chunked" in head
    assert body == b"9\r\ndata: 1\n\n\r\n0\r\n\r\n" and hot.response_complete
