"""``WorkerClient``'s reconnecting, against a real asyncio server speaking the native handshake."""

from __future__ import annotations

import asyncio
import itertools
import time

from gateway.worker_client import STAYED_UP_S, WorkerClient
from workers.protocol import PROTOCOL_VERSION, HelloAck, read_frame, worker_codec


def test_a_connection_that_served_a_while_is_retried_soon_after_old_failures() -> None:
    """A worker restarting refuses connections (the backoff grows to its cap), then serves for a while
    and drops the connection: the next try comes after the first backoff step, not the cap (it stayed at
    the cap for the life of the client)."""
    async def main() -> None:
        codec = worker_codec()
        connects: list[float] = []
        closed_at: list[float] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connects.append(time.monotonic())
            if len(connects) <= 6:  # (restarting: refused at once)
                writer.close()
                return
            await read_frame(reader)
            writer.write(codec.encode(HelloAck(PROTOCOL_VERSION, "w", "decode", "sim", "m", "byte", 16, 4096, 64)))
            if len(connects) == 7:
                await asyncio.sleep(STAYED_UP_S + 0.2)
                closed_at.append(time.monotonic())
                writer.close()
            else:
                await asyncio.sleep(30)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = WorkerClient(f"pd://127.0.0.1:{server.sockets[0].getsockname()[1]}", "decode", max_backoff_s=1.0)
        client.start()
        try:
            for _ in range(200):
                if len(connects) >= 8:
                    break
                await asyncio.sleep(0.05)
            assert len(connects) >= 8 and closed_at
            gaps = [b - a for a, b in itertools.pairwise(connects[:6])]
            assert gaps[-1] >= 0.7, f"the refusals did not back off to the cap: {gaps}"
            assert connects[7] - closed_at[0] < 0.5, "the backoff of the refusals before it was kept"
        finally:
            await client.aclose()
            server.close()

    asyncio.run(main())


def test_a_worker_shutting_down_is_not_chosen_and_its_going_is_not_held_against_it() -> None:
    """A SIGTERMed worker fails its open requests with ``shutting_down`` and goes: its retries and migrations
    went back to it while it was the only healthy one of its role (its connection still up), and its going
    counted as a ``worker_gone`` failure against its breaker (found by review). Now it is not selectable
    from its first ``shutting_down`` until it connects again, and losing its connection blames no one."""
    from workers.protocol import Error, SamplingParams, Submit

    async def main() -> None:
        codec = worker_codec()
        connects: list[int] = []
        stop = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connects.append(1)
            await read_frame(reader)
            writer.write(codec.encode(HelloAck(PROTOCOL_VERSION, "w", "decode", "sim", "m", "byte", 16, 4096, 64)))
            if len(connects) == 1:
                submit = codec.decode(await read_frame(reader))
                writer.write(codec.encode(Error(submit.rid, "shutting_down", "worker stopped")))
                await stop.wait()
                writer.close()
            else:
                await asyncio.sleep(30)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = WorkerClient(f"pd://127.0.0.1:{server.sockets[0].getsockname()[1]}", "decode", max_backoff_s=0.1)
        client.start()
        events: list[object] = []

        class Sink:
            def put_nowait(self, item: tuple[object, object]) -> None:
                events.append(item[1])

        try:
            assert await client.wait_ready(5) and client.healthy
            client.submit(Submit(0, [1, 2, 3], SamplingParams(max_new_tokens=4)), Sink(), "decode", urgent=True)
            open_rid = client.submit(Submit(0, [4, 5], SamplingParams(max_new_tokens=4)), Sink(), "decode",
                                     urgent=True)
            for _ in range(100):
                if events:
                    break
                await asyncio.sleep(0.02)
            assert isinstance(events[0], Error) and events[0].code == "shutting_down"
            assert client.is_stopping and not client.healthy and not client.available
            stop.set()  # its connection goes: the request still open there gets WorkerGone, counted already
            for _ in range(100):
                if len(events) > 1:
                    break
                await asyncio.sleep(0.02)
            gone = events[1]
            assert type(gone).__name__ == "WorkerGone" and gone.counted, (gone, open_rid)  # type: ignore[attr-defined]
            for _ in range(200):
                if len(connects) >= 2 and client.healthy:
                    break
                await asyncio.sleep(0.02)
            assert client.healthy and not client.is_stopping  # (connected again: a restart)
        finally:
            await client.aclose()
            server.close()

    asyncio.run(main())
