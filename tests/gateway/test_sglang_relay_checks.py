"""The SGLang relay (``gateway.sglang_relay``) against real HTTP servers standing in for the workers."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from relay_harness import Exchange, call, jbody, relay

from gateway.api_models import MAX_BATCH_CHOICES, MAX_N
from gateway.sglang_fleet import RelayConfig


async def prefill_ok(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"text": "", "meta_info": {"input_token_logprobs": [[-0.5, 1, None]]}})


def test_a_worker_that_would_compress_its_answer_is_asked_not_to() -> None:
    """The relay passes a worker's bytes on as they are: a compressed answer (a worker, or a proxy in front of
    an https:// one, compressing for a client that accepts it) reached the client as unreadable bytes."""
    seen: list[str] = []

    async def decode(request: web.Request) -> web.Response:
        await request.read()
        seen.append(request.headers.get("accept-encoding", ""))
        response = web.json_response({"text": "x" * 2000, "meta_info": {"input_token_logprobs": []}})
        response.enable_compression()  # (compresses when the request accepts gzip or deflate)
        return response

    async def main() -> None:
        async with relay(prefill_ok, decode) as (responder, _):
            exchange = Exchange(jbody({"text": "hi"}))
            await call(responder, exchange)
            assert exchange.status == 200 and seen == ["identity"], seen
            assert json.loads(exchange.content)["text"] == "x" * 2000, exchange.content[:40]

    asyncio.run(main())


@pytest.mark.parametrize(("route", "body", "param"), [
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 2_000_000}, "n"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": "2"}, "n"),
    ("completions", {"prompt": ["a"] * (MAX_BATCH_CHOICES // 2 + 1), "n": 2}, "prompt"),
    ("generate", {"text": ["a", "b"], "sampling_params": {"n": MAX_N}}, "text"),
    ("generate", {"text": "a", "sampling_params": {"n": MAX_N + 1}}, "sampling_params.n"),
    ("generate", {"input_ids": [[1, 2]] * (MAX_BATCH_CHOICES + 1)}, "input_ids"),
    ("generate", {"text": []}, "text"),
])
def test_more_choices_than_the_gateway_takes_are_refused_before_any_worker_is_asked(route, body, param) -> None:
    """The room lists of ``n`` choices are built, encoded and sent to both workers before either could refuse
    them (a 60-byte request with n = 2,000,000 sent each worker 74 MB, built on the event loop)."""
    asked: list[int] = []

    async def worker(request: web.Request) -> web.Response:
        asked.append(len(await request.read()))
        return web.json_response({"text": "", "meta_info": {}})

    path = {"chat": "v1/chat/completions", "completions": "v1/completions", "generate": "generate"}[route]

    async def main() -> None:
        async with relay(worker, worker, route=route, path=path) as (responder, _):
            exchange = Exchange(jbody(body))
            await call(responder, exchange, f"/{path}")
            assert exchange.status == 400, (exchange.status, exchange.content[:200])
            assert json.loads(exchange.content)["error"]["param"] == param
            assert asked == []

    asyncio.run(main())


def test_a_worker_refusing_the_gateways_key_is_not_the_clients_401() -> None:
    """SGLang asks no key of ``/health``: a gateway without the workers' key (``--worker-api-key``) is ready,
    and each request got the worker's 401 as if the client's own key were wrong (counted as the worker's
    success). It is the gateway's misconfiguration: a 502 that names the flag, and the worker's failure."""
    async def guarded(request: web.Request) -> web.Response:
        await request.read()
        if request.headers.get("authorization") != "Bearer right":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response({"text": "ok", "meta_info": {}})

    async def main() -> None:
        async with relay(guarded, guarded, config=RelayConfig(retry_backoff_s=0.01, max_retries=1)) as (responder,
                                                                                                         fleet):
            failures = fleet.decodes[0].health.breaker.failures
            exchange = Exchange(jbody({"text": "hi"}))
            await call(responder, exchange)
            assert exchange.status == 502, (exchange.status, exchange.content)
            error = json.loads(exchange.content)["error"]
            assert error["code"] == "worker_failed" and "--worker-api-key" in error["message"], error
            assert fleet.decodes[0].health.breaker.failures > failures

        async with relay(guarded, guarded, config=RelayConfig(worker_api_key="right")) as (responder, _):
            exchange = Exchange(jbody({"text": "hi"}))
            await call(responder, exchange)
            assert exchange.status == 200 and json.loads(exchange.content)["text"] == "ok"

    asyncio.run(main())


def test_the_prefill_is_asked_only_once_its_decode_is() -> None:
    """The decode's connections (``max_connections_per_worker``) all busy: the new request's prefill POST went
    out at once while its decode's waited for a free connection, and the prefill held the prompt's KV for a
    decode that was not asked (SGLang: up to its bootstrap timeout)."""
    release = asyncio.Event()
    prefill_got: list[str] = []
    decode_got: list[str] = []

    async def prefill(request: web.Request) -> web.Response:
        prefill_got.append((await request.json())["text"])
        return web.json_response({"text": "", "meta_info": {}})

    async def decode(request: web.Request) -> web.Response:
        text = (await request.json())["text"]
        decode_got.append(text)
        if text == "hold":
            await release.wait()
        return web.json_response({"text": text, "meta_info": {}})

    async def main() -> None:
        async with relay(prefill, decode, config=RelayConfig(retry_backoff_s=0.01, max_connections_per_worker=1)) \
                as (responder, _):
            first, second = Exchange(jbody({"text": "hold"})), Exchange(jbody({"text": "second"}))
            held = asyncio.create_task(call(responder, first))
            while "hold" not in decode_got:
                await asyncio.sleep(0.01)
            waiting = asyncio.create_task(call(responder, second))
            await asyncio.sleep(0.5)
            assert prefill_got == ["hold"] and decode_got == ["hold"], (prefill_got, decode_got)
            release.set()
            await asyncio.gather(held, waiting)
            assert prefill_got == ["hold", "second"] and decode_got == ["hold", "second"]
            assert (first.status, second.status) == (200, 200)
            assert json.loads(second.content)["text"] == "second"

    asyncio.run(main())


def test_a_whole_answer_that_breaks_off_is_retried() -> None:
    """The decode's body broke off before the client got anything: retried on a new pair (it was a 502 at
    once, and no failure of the decode's), as a stream that breaks before its first event is."""
    calls: list[int] = []

    async def decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        calls.append(1)
        if len(calls) == 1:  # a head promising more than comes, then the connection closes
            response = web.StreamResponse(headers={"content-type": "application/json", "content-length": "100"})
            await response.prepare(request)
            await response.write(b'{"text": "cut')
            request.transport.close()  # type: ignore[union-attr]
            return response
        return web.json_response({"text": "whole", "meta_info": {}})

    async def main() -> None:
        async with relay(prefill_ok, decode) as (responder, _):
            exchange = Exchange(jbody({"text": "hi"}))
            await call(responder, exchange)
            assert exchange.status == 200 and json.loads(exchange.content)["text"] == "whole", exchange.content
            assert len(calls) == 2

    asyncio.run(main())


def test_a_whole_answer_past_the_request_timeout_is_a_504_not_rerun() -> None:
    """The decode's head came at once, its body past ``request_timeout_s``: a 504, and the generation is not
    run again on another pair (each run would take as long) nor held against the decode."""
    calls: list[int] = []

    async def decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        calls.append(1)
        response = web.StreamResponse(headers={"content-type": "application/json"})
        await response.prepare(request)
        await asyncio.sleep(5)
        await response.write(b'{"text": "late"}')
        return response

    async def main() -> None:
        config = RelayConfig(retry_backoff_s=0.01, request_timeout_s=0.5, max_retries=2)
        async with relay(prefill_ok, decode, config=config) as (responder, fleet):
            exchange = Exchange(jbody({"text": "hi"}))
            await call(responder, exchange)
            assert exchange.status == 504, (exchange.status, exchange.content)
            assert len(calls) == 1 and fleet.decodes[0].health.breaker.failures == 0

    asyncio.run(main())
