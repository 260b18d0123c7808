"""A decode's stream that has sent its ``data: [DONE]`` is complete: what happens to its connection after that
(it breaks before the chunked body's end, or the worker keeps it open) is no failure of the answer. The relay
added an error event and a second ``[DONE]`` after the first (a raw SSE reader saw an error after the end), held
the client for the idle timeout when the connection stayed open, and counted the finished stream as a 502 against
the decode's breaker."""

from __future__ import annotations

import asyncio

from aiohttp import web
from relay_harness import Exchange, call, jbody, relay

from gateway.sglang_fleet import RelayConfig

EVENT = b'data: {"text": "a", "meta_info": {"finish_reason": {"type": "length"}}}\n\n'
DONE = b"data: [DONE]\n\n"


async def prefill(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"text": "", "meta_info": {}})


def _run(after_done: str) -> tuple[Exchange, list[int]]:
    released: list[asyncio.Event] = []  # (made on the test's loop: the worker below runs on it too)

    async def decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(EVENT + DONE)
        if after_done == "break":  # the connection drops before the chunked body's last chunk
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.close()
        else:  # the worker (or a proxy in front of it) keeps the connection open, past the idle timeout
            await released[0].wait()
        return response

    async def main() -> tuple[Exchange, list[int]]:
        released.append(asyncio.Event())
        # (an idle timeout past the test's own limit: an answer that waits for the body's end never comes in time)
        config = RelayConfig(retry_backoff_s=0.01, read_timeout_s=60.0)
        async with relay(prefill, decode, config=config) as (responder, fleet):
            exchange = Exchange(jbody({"text": "hi", "stream": True}))
            try:
                await asyncio.wait_for(call(responder, exchange), 20.0)
            finally:
                released[0].set()
            breaker = fleet.decodes[0].health.breaker
            return exchange, [breaker._failures]

    return asyncio.run(main())


def test_a_stream_broken_after_its_done_ends_as_it_was_sent() -> None:
    exchange, failures = _run("break")
    assert exchange.status == 200
    assert exchange.content == EVENT + DONE, exchange.content
    assert failures == [0], "a finished stream is no failure of the decode's"


def test_a_stream_left_open_after_its_done_ends_without_the_idle_timeout() -> None:
    exchange, failures = _run("open")  # (waiting for the body's end: the test's 20 s limit, then a failure)
    assert exchange.content == EVENT + DONE, exchange.content
    assert failures == [0]
