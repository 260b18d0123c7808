"""How soon the gateway finds a restarted worker: its reconnect pauses (``ReconnectBackoff``). They doubled up to
2 s, so a prefill back after ~5 s (a restart on a new control address waits out its predecessor's lease in the
registry) was connected at fixed times 5.15 s / 7.15 s after the loss, up to 2 s after it listened. Now they are
capped at 0.5 s for the first ``RECONNECT_FAST_FOR_S`` of an outage (2 s after that: a dead address costs what it
did), each jittered so that gateways do not reconnect in lockstep."""

from __future__ import annotations

import asyncio

from gateway.worker_client import (
    LONG_OUTAGE_BACKOFF_S,
    RECONNECT_FAST_FOR_S,
    RECONNECT_FIRST_S,
    RECONNECT_JITTER,
    ReconnectBackoff,
    WorkerClient,
)
from workers.protocol import PROTOCOL_VERSION, HelloAck, read_frame, worker_codec


def _pauses(backoff: ReconnectBackoff, outage_s: float, n: int) -> list[float]:
    return [backoff.next_pause_s(outage_s) for _ in range(n)]


def test_the_pauses_double_to_half_a_second_early_in_an_outage_and_to_two_seconds_late() -> None:
    backoff = ReconnectBackoff()
    early = _pauses(backoff, 0.0, 12)
    nominal = [RECONNECT_FIRST_S * 2 ** i for i in range(4)] + [0.5] * 8  # 0.05, 0.1, 0.2, 0.4, then 0.5 each
    for got, want in zip(early, nominal, strict=True):
        assert want * (1 - RECONNECT_JITTER) <= got <= want * (1 + RECONNECT_JITTER), (early, nominal)
    late = _pauses(backoff, RECONNECT_FAST_FOR_S, 4)  # (a worker gone a minute: as before, 2 s apart at most)
    assert late[0] <= 1.0 * (1 + RECONNECT_JITTER) and late[-1] >= LONG_OUTAGE_BACKOFF_S * (1 - RECONNECT_JITTER)
    assert max(late) <= LONG_OUTAGE_BACKOFF_S * (1 + RECONNECT_JITTER)
    backoff.reset()
    assert backoff.next_pause_s(0.0) <= RECONNECT_FIRST_S * (1 + RECONNECT_JITTER)


def test_gateways_that_lost_a_worker_together_do_not_retry_in_lockstep() -> None:
    schedules = {tuple(_pauses(ReconnectBackoff(), 0.0, 8)) for _ in range(8)}
    assert len(schedules) == 8


def test_a_client_keeps_trying_at_the_short_cadence_until_the_worker_is_back() -> None:
    """Against a real socket: a worker restarting (its port closes each connection at once) for a dozen tries, then
    back. Every pause the client took was within the 0.5 s cap (it used to reach 2 s by the seventh try), and the
    try after the worker came back connected."""

    class Recording(ReconnectBackoff):
        def __init__(self) -> None:
            super().__init__()
            self.taken: list[float] = []

        def next_pause_s(self, outage_s: float) -> float:
            pause = super().next_pause_s(outage_s)
            self.taken.append(pause)
            return pause

    async def main() -> None:
        codec = worker_codec()
        tries: list[int] = []
        back = asyncio.Event()
        refused = 12

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            tries.append(1)
            if len(tries) <= refused:  # (restarting: closed at once)
                writer.close()
                return
            back.set()
            await read_frame(reader)
            writer.write(codec.encode(HelloAck(PROTOCOL_VERSION, "w", "prefill", "sim", "m", "byte", 16, 4096, 64)))
            await asyncio.sleep(30)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = WorkerClient(f"pd://127.0.0.1:{server.sockets[0].getsockname()[1]}", "prefill")
        recording = client.reconnect = Recording()
        client.start()
        try:
            async with asyncio.timeout(60):  # (a hang guard only)
                while not client.healthy:
                    await asyncio.sleep(0.02)
            assert len(tries) == refused + 1 and back.is_set()
            assert len(recording.taken) == refused  # one pause after each refused try, none after the good one
            assert max(recording.taken) <= client.reconnect.max_backoff_s * (1 + RECONNECT_JITTER), recording.taken
            assert client.reconnect.max_backoff_s == 0.5
        finally:
            await client.aclose()
            server.close()

    asyncio.run(main())
