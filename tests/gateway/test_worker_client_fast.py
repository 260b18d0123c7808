"""The per-request shortcuts of ``gateway.worker_client`` / ``worker_state`` / ``write_batch``: each gives what
the plain code gave (``healthy``'s flag for draining/stopping, the inline end of a request in ``_dispatch``, the
frame split, the inline ``FrameCodec.encode``, ``write_batch.end``'s resumed loop, the state's inline figures)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway import write_batch
from gateway.health import BreakerState
from gateway.worker_client import WorkerClient, _FrameProtocol
from gateway.worker_state import WorkerState
from workers.protocol import (
    PROTOCOL_VERSION,
    HelloAck,
    LoadReport,
    Outputs,
    SamplingParams,
    StepOutput,
    Submit,
    gateway_codec,
    worker_codec,
)


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        self.closing = True


class _Sink:
    def __init__(self, on_put: Any = None) -> None:
        self.items: list[Any] = []
        self.on_put = on_put

    def put_nowait(self, item: Any) -> None:
        self.items.append(item)
        if self.on_put is not None:
            self.on_put(item)


def _client(role: str = "decode") -> tuple[WorkerClient, _Transport]:
    client = WorkerClient("pd://127.0.0.1:1", role)
    client.loop = asyncio.get_running_loop()
    transport = _Transport()
    client._transport = transport  # type: ignore[assignment]
    client.info = HelloAck(PROTOCOL_VERSION, "w", role, "sim", "m", "byte", 4, 4096, 64)
    client.state.connected(client.info)
    return client, transport


def _plain_healthy(client: WorkerClient) -> bool:
    """``healthy`` as the plain expression it stands for."""
    return (client.is_connected and not client.is_draining and not client.is_stopping
            and client.health.is_selectable)


def test_healthy_follows_every_input_as_the_plain_expression_does() -> None:
    async def main() -> None:
        client, transport = _client()
        assert client.healthy and _plain_healthy(client)
        for draining, stopping in ((True, False), (True, True), (False, True), (False, False)):
            client.is_draining, client.is_stopping = draining, stopping
            assert client.healthy is _plain_healthy(client) is (not draining and not stopping)
        client.is_stopping = True
        client.is_draining = True
        client.is_draining = False  # (still stopping)
        assert client.healthy is False
        client.is_stopping = False
        assert client.healthy is True
        transport.closing = True
        assert client.healthy is _plain_healthy(client) is False
        transport.closing = False
        client.health.is_probe_healthy = False
        assert client.healthy is _plain_healthy(client) is False
        client.health.is_probe_healthy = True
        # an open breaker, then half-open with room for one trial (``allows``), then none
        now = [0.0]
        breaker = client.health.breaker
        breaker._clock = lambda: now[0]
        breaker.successes_to_close = 1
        for _ in range(breaker.failures_to_open):
            breaker.record_failure()
        assert client.healthy is _plain_healthy(client) is False
        now[0] += breaker.cooldown_s
        assert client.healthy is _plain_healthy(client) is True
        assert breaker.state is BreakerState.HALF_OPEN
        client.submit(Submit(0, [1], SamplingParams()), _Sink(), "decode")  # a trial: no room left
        assert client.healthy is _plain_healthy(client) is False
        client.info = None
        assert client.healthy is False

    asyncio.run(main())


def test_a_frames_outputs_reach_their_sinks_and_a_final_one_ends_the_request_once() -> None:
    async def main() -> None:
        client, _ = _client()
        sinks = [_Sink() for _ in range(3)]
        rids = [client.submit(Submit(0, [1, 2], SamplingParams()), sink, i, prefill_tokens=2, pages=1)
                for i, sink in enumerate(sinks)]
        assert client.state.num_active == 3 and client.state.num_reserved_pages == 3
        client._dispatch(Outputs([StepOutput(rids[0], [5]), StepOutput(999, [5], "stop"),  # (unknown: skipped)
                                  StepOutput(rids[1], [6], "stop"), StepOutput(rids[2], [7])]))
        assert [[tag for tag, _ in s.items] for s in sinks] == [[0], [1], [2]]
        assert set(client._open) == {rids[0], rids[2]}
        assert (client.state.num_active, client.state.num_reserved_pages, client.state.num_free_pages) == (2, 2, 62)
        # a consumer that aborts its request when the final output comes: the request ends once, not twice
        sinks[0].on_put = lambda item: client.abort(rids[0])
        client._dispatch(Outputs([StepOutput(rids[0], [8], "length"), StepOutput(rids[0], [9], "length")]))
        assert len(sinks[0].items) == 2 and rids[0] not in client._open
        assert client.state.num_active == 1
        client._dispatch(Outputs([StepOutput(rids[2], [1], "stop")]))
        assert client.state.num_active == 0 and client.state.num_free_pages == 64 and not client._open
        client._flush()

    asyncio.run(main())


def test_a_half_open_trials_place_frees_at_its_end_and_at_its_first_token() -> None:
    async def main() -> None:
        client, _ = _client()
        now = [0.0]
        breaker = client.health.breaker
        breaker._clock = lambda: now[0]
        for _ in range(breaker.failures_to_open):
            breaker.record_failure()
        now[0] += breaker.cooldown_s
        assert breaker.state is BreakerState.HALF_OPEN
        first = client.submit(Submit(0, [1], SamplingParams()), _Sink(), "a")
        second = client.submit(Submit(0, [1], SamplingParams()), _Sink(), "b")
        assert breaker.trials == {first, second}
        client._dispatch(Outputs([StepOutput(first, [], "transferred")]))  # ended, without a token
        assert breaker.trials == {second}
        client._dispatch(Outputs([StepOutput(second, [3])]))  # its first token
        assert breaker.trials == set()
        client._flush()

    asyncio.run(main())


def test_submit_frames_are_the_codecs_and_go_out_in_order() -> None:
    async def main() -> None:
        client, transport = _client()
        messages = [Submit(0, [i, i + 1], SamplingParams(max_new_tokens=i), request_id=f"r{i}") for i in range(3)]
        for message in messages:
            client.submit(message, _Sink(), "decode")
        assert transport.writes == []
        await asyncio.sleep(0)
        codec = gateway_codec()
        assert transport.writes == [b"".join(codec.encode(m) for m in messages)]
        # another connection meanwhile: what was queued for the first goes to it, the rest to the new one
        client.submit(Submit(0, [7], SamplingParams()), _Sink(), "decode")
        other = _Transport()
        client._transport = other  # type: ignore[assignment]
        client.submit(Submit(0, [8], SamplingParams()), _Sink(), "decode")
        await asyncio.sleep(0)
        reads = [worker_codec().decode(w[4:]) for w in transport.writes[1:] + other.writes]
        assert [m.input_ids for m in reads] == [[7], [8]]  # type: ignore[attr-defined]

    asyncio.run(main())


@pytest.mark.parametrize("cuts", [(), (1,), (3, 9), (4,), (5, 6, 7)])
def test_frames_split_anywhere_decode_as_whole(cuts: tuple[int, ...]) -> None:
    async def main() -> None:
        codec = worker_codec()
        frames = [codec.encode(Outputs([StepOutput(i, [i] * i)])) for i in range(1, 4)]
        data = b"".join(frames)
        got: list[object] = []
        proto = _FrameProtocol(gateway_codec().decode)
        proto.on_message = got.append
        at = 0
        for cut in (*cuts, len(data)):
            proto.data_received(data[at:cut])
            at = cut
        assert got == [Outputs([StepOutput(i, [i] * i)]) for i in range(1, 4)]
        assert not proto._buf and not proto.closed.done()

    asyncio.run(main())


def test_an_oversized_frame_drops_the_connection() -> None:
    async def main() -> None:
        proto = _FrameProtocol(gateway_codec().decode)
        proto.on_message = lambda message: None
        proto.data_received((1 << 30).to_bytes(4, "big") + b"x")
        assert proto.closed.done() and "exceeds" in proto.closed.result()

    asyncio.run(main())


def test_write_batch_end_writes_the_rest_after_a_failed_write() -> None:
    class Refusing(_Transport):
        def write(self, data: bytes) -> None:
            raise RuntimeError("Cannot call write() after write_eof()")

    a, refusing, closed, b = _Transport(), Refusing(), _Transport(), _Transport()
    closed.closing = True
    assert write_batch.begin()
    for transport, data in ((a, b"1"), (refusing, b"2"), (closed, b"3"), (b, b"4"), (refusing, b"5"), (a, b"6")):
        write_batch.write(transport, data)
    write_batch.end()
    assert a.writes == [b"1", b"6"] and b.writes == [b"4"] and closed.writes == [] and refusing.closing
    assert write_batch.local.pending is None
    write_batch.end()  # (nothing open: nothing to do)
    assert write_batch.begin()
    write_batch.end()
    assert write_batch.local.pending is None


def test_state_figures_inline_match_the_recomputed_ones() -> None:
    """The figures ``dispatched`` / ``ended`` set inline are those ``_recompute`` gives, fresh or stale."""
    now = [0.0]
    state = WorkerState("pd://w:1", "decode", stale_after_s=1.0, clock=lambda: now[0])
    state.connected(HelloAck(PROTOCOL_VERSION, "w", "decode", "sim", "m", "byte", 16, 4096, 100))
    names = ("num_prefill_tokens", "num_running_seqs", "num_waiting_seqs", "num_reserved_pages", "num_free_pages")

    def check() -> None:
        figures = [getattr(state, name) for name in names]
        state._recompute()
        assert figures == [getattr(state, name) for name in names]

    for rid in range(1, 40):
        state.dispatched(rid, rid * 10, rid % 7)
        check()
        if rid % 3 == 0:
            state.ended(rid - 1)
            check()
        if rid == 20:
            state.reported(LoadReport(num_running=3, num_waiting=2, num_free_pages=60, num_total_pages=100,
                                      num_prefill_tokens=700, last_rid=15, num_queued_pages=4), now[0])
            check()
    state.ended(12345)  # unknown: nothing
    check()
    now[0] += 5
    state.refresh()
    for rid in range(1, 40):
        state.ended(rid)
        check()
    assert state.num_active == 0 and state.num_free_pages == 100
