"""The SGLang relay's request timeout (``request_timeout_s``): a stream it cuts is no failure of its decode's, and
a request's attempts share it.

A stream still flowing when the request's own ``request_timeout_s`` ran out (the pool's per-request deadline, over
the whole request as aiohttp's ``total`` was) was ended with an error event saying the decode "sent nothing for
<read_timeout_s>s" (it had sent an event every 0.1 s) and counted as the decode's ``timeout`` failure: its breaker
heard one, ``pd_gateway_worker_failures_total{code="timeout"}`` went up, so long generations cut by the request
timeout could open a healthy decode's breaker. The native path ends such a stream with its ``request_timeout``
error, "final, and no worker's fault"; a decode that really goes silent is still the decode's failure.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from relay_harness import Exchange, call, jbody, relay

from gateway.sglang_fleet import RelayConfig

EVENT = b'data: {"text": "a", "meta_info": {}}\n\n'


async def prefill(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"text": "", "meta_info": {}})


def _events(content: bytes) -> list[str]:
    return [event.removeprefix("data: ") for event in content.decode().split("\n\n") if event]


def _run(decode_gaps_s: list[float], config: RelayConfig) -> tuple[Exchange, int, float, int]:
    async def decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for gap_s in decode_gaps_s:
            await response.write(EVENT)
            await asyncio.sleep(gap_s)
        await response.write(b"data: [DONE]\n\n")
        return response

    async def main() -> tuple[Exchange, int, float, int]:
        async with relay(prefill, decode, config=config) as (responder, fleet):
            exchange = Exchange(jbody({"text": "hi", "stream": True}))
            await asyncio.wait_for(call(responder, exchange), 20.0)
            worker = fleet.decodes[0]
            counted = responder.metrics.worker_failures.labels(worker.url, "decode", "timeout").value
            assert fleet.pool is not None
            busy = sum(origin.num_open - len(origin.idle) for origin in fleet.pool._by_key.values())
            return exchange, worker.health.breaker._failures, counted, busy

    return asyncio.run(main())


def test_a_flowing_stream_cut_by_the_request_timeout_is_no_failure_of_the_decodes() -> None:
    # events every 0.1 s for ~3 s, well within the idle timeout; the request's own timeout is 1 s
    config = RelayConfig(retry_backoff_s=0.01, request_timeout_s=1.0, read_timeout_s=5.0)
    exchange, failures, counted, busy = _run([0.1] * 30, config)
    assert exchange.status == 200
    events = _events(exchange.content)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "sent nothing" not in error["message"], error  # (it sent an event every 0.1 s)
    assert error["code"] == "request_timeout", error
    assert failures == 0, "the request's own deadline is no failure of the decode's"
    assert counted == 0
    assert busy == 0


def test_a_decode_silent_past_the_idle_timeout_is_still_its_failure() -> None:
    config = RelayConfig(retry_backoff_s=0.01, read_timeout_s=0.5)
    exchange, failures, counted, busy = _run([3.0], config)
    events = _events(exchange.content)
    error = json.loads(events[-2])["error"]
    assert "sent nothing for 0.5s" in error["message"], error
    assert failures == 1 and counted == 1
    assert busy == 0


def test_the_attempts_of_a_request_share_its_timeout() -> None:
    """``request_timeout_s`` bounds the whole request, retries included (as on the native path): a decode that
    fails after 0.7 s is tried twice within a 1 s timeout, not once per attempt's own full timeout (three tries)."""
    tries = [0]

    async def failing_decode(request: web.Request) -> web.Response:
        await request.read()
        tries[0] += 1
        await asyncio.sleep(0.7)
        return web.json_response({"error": {"message": "boom"}}, status=500)

    async def main() -> Exchange:
        config = RelayConfig(retry_backoff_s=0.01, request_timeout_s=1.0, max_retries=2)
        async with relay(prefill, failing_decode, config=config) as (responder, _fleet):
            exchange = Exchange(jbody({"text": "hi"}))
            await asyncio.wait_for(call(responder, exchange), 20.0)
            return exchange

    exchange = asyncio.run(main())
    assert exchange.status in (502, 504), exchange.content
    assert tries[0] == 2, f"{tries[0]} tries: the attempts did not share the request's timeout"


def test_a_stream_whose_first_event_comes_past_the_request_timeout_is_no_failure_of_the_decodes() -> None:
    """The decode's head comes at once, its first event only after the request's own timeout (shorter here than the
    first-token timeout): a 504 ``request_timeout``, not the decode's broken stream (retried, and held against it)."""

    async def late_decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(2.0)
        await response.write(EVENT + b"data: [DONE]\n\n")
        return response

    async def main() -> tuple[Exchange, int, float]:
        config = RelayConfig(retry_backoff_s=0.01, request_timeout_s=0.5, first_byte_timeout_s=5.0)
        async with relay(prefill, late_decode, config=config) as (responder, fleet):
            exchange = Exchange(jbody({"text": "hi", "stream": True}))
            await asyncio.wait_for(call(responder, exchange), 20.0)
            worker = fleet.decodes[0]
            gone = responder.metrics.worker_failures.labels(worker.url, "decode", "worker_gone").value
            return exchange, worker.health.breaker._failures, gone

    exchange, failures, gone = asyncio.run(main())
    assert exchange.status == 504, exchange.content
    assert json.loads(exchange.content)["error"]["code"] == "request_timeout", exchange.content
    assert (failures, gone) == (0, 0), "the request's own deadline was held against the decode"


def test_a_whole_answer_past_the_request_timeout_is_no_failure_of_the_decodes() -> None:
    """A non-streamed answer (its head comes with its end) not come by the request's own timeout: a 504
    ``request_timeout`` (final), not the decode's silence held against it once its prefill had answered."""

    async def slow_decode(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(2.0)
        return web.json_response({"text": "late", "meta_info": {}})

    async def main() -> tuple[Exchange, int, float]:
        config = RelayConfig(retry_backoff_s=0.01, request_timeout_s=0.5)
        async with relay(prefill, slow_decode, config=config) as (responder, fleet):
            exchange = Exchange(jbody({"text": "hi"}))
            await asyncio.wait_for(call(responder, exchange), 20.0)
            worker = fleet.decodes[0]
            counted = sum(responder.metrics.worker_failures.labels(worker.url, "decode", code).value
                          for code in ("timeout", "worker_gone"))
            return exchange, worker.health.breaker._failures, counted

    exchange, failures, counted = asyncio.run(main())
    assert exchange.status == 504, exchange.content
    assert json.loads(exchange.content)["error"]["code"] == "request_timeout", exchange.content
    assert (failures, counted) == (0, 0), "the request's own deadline was held against the decode"
