"""A prefill's stream that handed some KV over and then failed (``n`` > 1: one choice's transfer broke after
another's hand-over started the stream) ends with an error event of the worker's own (``upstream_error``, a
502), not a refusal: it is no request fault. Taken for a refusal (any error event anywhere in a 200 stream),
its events became the client's final answer (counted as a 400) and the request was not retried, where a
transfer failure is retried on another attempt."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from relay_harness import Exchange, call, jbody, relay

from gateway.sglang_fleet import RelayConfig

FIRST = json.dumps({"text": "a", "meta_info": {"id": "x", "finish_reason": None}, "index": 0}).encode()
LATE_ERROR = json.dumps({"error": {"message": "prefill worker: room 7: the data path broke", "type": "upstream_error",
                                   "param": None, "code": "transfer_failed"}}).encode()
ANSWER = json.dumps({"text": "abc", "meta_info": {"id": "x", "finish_reason": {"type": "length"}},
                     "index": 0}).encode()


def test_a_prefills_late_error_event_is_retried_not_relayed_as_a_refusal() -> None:
    calls = {"prefill": 0, "decode": 0}

    async def prefill(request: web.Request) -> web.StreamResponse:
        await request.read()
        calls["prefill"] += 1
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        if calls["prefill"] == 1:  # choice 0 handed over (the head went out), choice 1's transfer failed
            await response.write(b"data: " + FIRST + b"\n\ndata: " + LATE_ERROR + b"\n\ndata: [DONE]\n\n")
        else:
            await response.write(b"data: " + FIRST + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    async def decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        calls["decode"] += 1
        if calls["decode"] == 1:  # its choice 1's KV never came: a 502 before its head, after the prefill's end
            await asyncio.sleep(0.2)
            return web.json_response({"error": {"message": "room 7: transfer failed", "code": "transfer_failed"}},
                                     status=502)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + ANSWER + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    async def main() -> None:
        async with relay(prefill, decode, config=RelayConfig(retry_backoff_s=0.01, max_retries=2)) as (responder, _):
            exchange = Exchange(jbody({"text": "hi", "stream": True, "sampling_params": {"n": 2}}))
            await asyncio.wait_for(call(responder, exchange), 10.0)
            assert exchange.status == 200, exchange.content
            assert b"upstream_error" not in exchange.content, exchange.content
            assert ANSWER in exchange.content, exchange.content
            assert calls["decode"] == 2, "a transfer failure is retried"

    asyncio.run(main())
