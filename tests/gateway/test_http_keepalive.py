"""The keep-alive wait on ``GuardedHttpProtocol``'s one timer, in-process under uvicorn: an idle
connection closes after ``timeout_keep_alive``, also one whose request body finished arriving after
its response (read and discarded), and a connection whose requests keep coming does not."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import uvicorn

from gateway.http_protocol import ClientLimits, protocol_class

KEEP_ALIVE_S = 0.3


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})  # (at once: a body may still be coming)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> float | None:
    start = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(100), seconds)
    except TimeoutError:
        return None
    assert data == b"", data
    return time.monotonic() - start


def test_idle_connections_close_busy_ones_stay() -> None:
    async def main() -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, http=protocol_class(ClientLimits()),
                                timeout_keep_alive=KEEP_ALIVE_S, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(5):  # a request every 0.2 s for a second: never idle for the timeout
                writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                await reader.readuntil(b"ok")
                await asyncio.sleep(0.2)
            idle = await closed_within(reader, 5.0)
            assert idle is not None and idle >= KEEP_ALIVE_S - 0.25, idle
            writer.close()

            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n12345")
            await reader.readuntil(b"ok")
            await asyncio.sleep(0.05)
            writer.write(b"67890")  # the rest of the body, after the response
            assert await closed_within(reader, 5.0) is not None, "a connection idle after its body was kept"
            writer.close()
        finally:
            server.should_exit = True
            await task

    asyncio.run(main())
