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
