"""A prefill that refuses a streamed request answers as SGLang's server does: 200, ``text/event-stream``,
``data: {"error": ...}``, ``data: [DONE]`` (our workers' ``refusals_as_events``). The relay took that 200 for a
prefill that had handed its KV over: the decode then waited for KV that never came (SGLang's decode: until the
relay's first-byte timeout, a 504 charged to the decode), or failed its room (ours: a 502, retried and charged
to the decode's breaker: a few over-long streamed prompts opened a healthy decode's circuit for everyone)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from relay_harness import Exchange, call, jbody, relay

from gateway.health import HealthConfig
from gateway.sglang_fleet import RelayConfig

REFUSAL = b'data: {"error": {"message": "request needs 25 KV pages; the pool has 16"}}\n\ndata: [DONE]\n\n'


async def prefill_refuses(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    await response.write(REFUSAL)
    await response.write_eof()
    return response


@pytest.mark.parametrize("decode_kind", ["waits_for_kv", "fails_its_room"])
def test_a_prefills_streamed_refusal_is_the_clients_answer(decode_kind: str) -> None:
    decode_calls: list[int] = []
    decode_ended = asyncio.Event()

    async def decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        decode_calls.append(1)
        if decode_kind == "fails_its_room":  # our decode: the prefill ended the room, a 502 soon after
            await asyncio.sleep(0.05)
            return web.json_response({"error": {"message": "the prefill ended it", "code": "transfer_failed"}},
                                     status=502)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})  # SGLang's: head at once
        await response.prepare(request)
        for _ in range(600):  # waiting for the KV, until the relay closes the connection (aborting it)
            if request.transport is None or request.transport.is_closing():
                decode_ended.set()
                break
            await asyncio.sleep(0.05)
        return response

    async def main() -> None:
        config = RelayConfig(retry_backoff_s=0.01, first_byte_timeout_s=5.0, max_retries=2)
        health = HealthConfig(probe_interval_s=0.1, breaker_failures=2)
        async with relay(prefill_refuses, decode, config=config, health_config=health) as (responder, fleet):
            for _ in range(3):
                exchange = Exchange(jbody({"text": "x" * 100, "stream": True}))
                await asyncio.wait_for(call(responder, exchange), 4.0)
                assert exchange.status == 200, (exchange.status, exchange.content)
                events = [line for line in exchange.content.split(b"\n") if line.startswith(b"data:")]
                assert json.loads(events[0][5:])["error"]["message"].startswith("request needs"), exchange.content
                assert events[-1] == b"data: [DONE]"
            assert len(decode_calls) == 3, "a request's fault is not retried"
            breaker = fleet.decodes[0].health.breaker
            assert breaker.closed and breaker.failures == 0, "the prefill's refusal is no fault of the decode's"
            if decode_kind == "waits_for_kv":
                await asyncio.wait_for(decode_ended.wait(), 2.0)  # its request was closed: aborted on the worker

    asyncio.run(main())
