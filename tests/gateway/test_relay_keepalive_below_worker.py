"""The relay's idle connections to SGLang-protocol workers are dropped before the workers' own keep-alive ends
(uvicorn's: SGLang's server and our workers' HTTP side). They were kept 30 s against uvicorn's 5 s: the worker
closed an idle one, and a request sent on it as that close crossed it on the wire failed with
a disconnect (aiohttp's ServerDisconnectedError then), a retry and a failure held against a healthy worker."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn

from gateway import sglang_fleet
from gateway.health import HealthConfig
from gateway.router import Router
from gateway.sglang_fleet import SGLangFleet
from gateway.worker_http import Disconnected

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def test_the_relays_keep_alive_ends_before_uvicorns() -> None:
    assert uvicorn.Config(app=None).timeout_keep_alive > sglang_fleet.WORKER_KEEPALIVE_S


def test_a_connection_idle_past_the_keep_alive_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose keep-alive timer fires as a request arrives on an idle connection (emulated: a request after
    0.5 s idle is met with a close, no answer): the relay, keeping idle connections 0.3 s here, never sends one."""
    monkeypatch.setattr(sglang_fleet, "WORKER_KEEPALIVE_S", 0.3)

    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            loop = asyncio.get_running_loop()
            last = loop.time()
            try:
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    if loop.time() - last >= 0.5:  # (the keep-alive expired as it came: closed, not answered)
                        return
                    writer.write(OK)
                    await writer.drain()
                    last = loop.time()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        fleet = SGLangFleet([(url, 8998)], [url], Router.build("random", "random"), HealthConfig(probe_interval_s=60))
        fleet.start()
        try:
            assert fleet.pool is not None
            for _ in range(2):
                async with await fleet.pool.post(f"{url}/generate", b"{}") as reply:
                    assert reply.status == 200 and await reply.read() == b"{}"
                await asyncio.sleep(0.6)
        except Disconnected:
            pytest.fail("an idle connection the worker had closed was reused")
        finally:
            await fleet.aclose()
            server.close()

    asyncio.run(main())
