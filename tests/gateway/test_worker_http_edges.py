"""Edge cases of the relay's HTTP client (``gateway/worker_http.py``) and of its use in ``gateway/sglang_relay.py``.

1. An answer followed, in the same read, by bytes that parse as another HTTP message (a worker or proxy that
   sends more than it was asked for: a wrong ``Content-Length``, a stray second answer) must not rewrite the
   answer already parsed (its status, its body), nor may that connection go back to the pool.
2. A client that leaves just as the decode worker's response head arrives (the relay's task cancelled in the
   same turn of the loop that finished the decode's request task) must not leave that response unreleased: with
   aiohttp the unreferenced response closed its connection when collected; ours is held by its connection and
   its timer, so the decode's request ran on, and held a pool slot, for the whole ``request_timeout_s``.
3. A waiter woken for a free connection that a newcomer took first waits again at the head of the line, not
   behind requests that came after it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from relay_harness import Exchange, call, jbody, relay

from gateway.worker_http import HttpPool


async def _one_shot_server(answer: bytes) -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
            await reader.read()  # (until the client closes)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_unasked_message_after_an_answer_does_not_rewrite_it(loop_kind: str) -> None:
    async def main() -> None:
        server, port = await _one_shot_server(
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
            b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 3\r\n\r\nbad")
        pool = HttpPool(limit_per_host=1, timeout_s=5, connect_timeout_s=1)
        try:
            reply = await pool.post(f"http://127.0.0.1:{port}/generate", b"{}")
            assert reply.status == 200
            assert await reply.read() == b"ok"
            reply.release()
            assert pool.num_idle() == 0  # (the connection carried bytes nobody asked for: not reused)
        finally:
            pool.close()
            server.close()

    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(main())
    else:
        asyncio.run(main())


def test_client_leaving_as_the_decode_head_arrives_aborts_the_decode() -> None:
    asyncio.run(_client_leaving_as_the_decode_head_arrives())


async def _client_leaving_as_the_decode_head_arrives() -> None:
    aborted = asyncio.Event()

    async def prefill(request: web.Request) -> web.StreamResponse:
        await request.read()
        await asyncio.sleep(0.5)
        return web.json_response({"text": ""})

    async def decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        try:
            for _ in range(200):  # (10 s of events, unless the relay closes the connection: the request aborted)
                await asyncio.sleep(0.05)
                await response.write(b'data: {"text": "x"}\n\n')
        except (OSError, asyncio.CancelledError):
            aborted.set()
            raise
        return response

    async with relay(prefill, decode) as (responder, fleet):
        assert fleet.pool is not None
        exchange = Exchange(jbody({"text": "hi", "stream": True}))
        real_post = fleet.pool.post
        decode_url = fleet.decodes[0].url

        async def post(url: str, data: bytes, headers: Any = None, asked: Any = None, deadline: Any = None) -> Any:
            reply = await real_post(url, data, headers, asked, deadline)
            if url.startswith(decode_url):
                exchange.gone.set()  # (the client's disconnect is read in the turn the decode's head came in)
            return reply

        fleet.pool.post = post  # type: ignore[method-assign]
        await asyncio.wait_for(call(responder, exchange), 10)
        assert exchange.status is None  # (the client left before anything was sent)
        await asyncio.wait_for(aborted.wait(), 3)  # the decode's request is aborted, not left to run on
        assert not [conn for conn in fleet.pool._conns if conn.reply is not None]


async def _keepalive_server() -> tuple[asyncio.Server, int]:
    """Answers every request on a connection at once, ``ok`` (keeps it alive)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_waiter_passed_over_keeps_its_place_in_line(loop_kind: str) -> None:
    """The module's promise, "waited for in order": a waiter woken for a connection that a newcomer took first (a
    task that ran before it in that turn of the loop, as under load) waits again at the head of the line, not
    behind everyone who came after it (as aiohttp's connector does: else a request can be passed over until its
    timeout while later ones are served)."""
    async def main() -> None:
        server, port = await _keepalive_server()
        url = f"http://127.0.0.1:{port}/generate"
        pool = HttpPool(limit_per_host=1, timeout_s=5, connect_timeout_s=1)
        served: list[str] = []

        async def client(name: str) -> None:
            async with await pool.post(url, name.encode()) as reply:
                assert await reply.read() == b"ok"
            served.append(name)

        try:
            first = await pool.post(url, b"first")
            assert await first.read() == b"ok"  # (the one connection, held)
            origin = next(iter(pool._by_key.values()))
            early = asyncio.create_task(client("early"))
            await asyncio.sleep(0)
            late = asyncio.create_task(client("late"))
            await asyncio.sleep(0)
            assert len(origin.waiters) == 2  # early, then late
            newcomer = asyncio.create_task(client("newcomer"))  # (runs before the woken waiter: takes the connection)
            first.release()
            await asyncio.wait_for(asyncio.gather(early, late, newcomer), 5)
            assert served == ["newcomer", "early", "late"]
        finally:
            pool.close()
            server.close()

    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(main())
    else:
        asyncio.run(main())
