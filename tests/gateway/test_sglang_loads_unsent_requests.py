"""A load report polled from an SGLang worker (``GET /v1/loads``) counts only the requests that had reached the
worker; the gateway's requests still waiting to go out (for a free connection to the worker, under
``max_connections_per_worker``; a prefill's, until its decode's request went out) must stay counted on top of it.
The fleet took every request opened before the poll as counted in its answer: a worker with requests queued for
it in the gateway looked less loaded than it was, until the poll after they went out, and was given more."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from relay_harness import Exchange, call, jbody, serve_app

from gateway.admission import Admission
from gateway.health import HealthConfig
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from gateway.sglang_fleet import RelayConfig, SGLangFleet
from gateway.sglang_relay import SGLangResponder


def test_requests_waiting_to_go_out_stay_counted_on_top_of_a_report() -> None:
    async def main() -> None:
        release = asyncio.Event()
        arrived: list[int] = []  # the decode's /generate requests that reached it
        open_now = [0]
        polls = [0]

        async def health(_: web.Request) -> web.Response:
            return web.json_response({})

        async def decode_generate(request: web.Request) -> web.StreamResponse:
            await request.read()
            arrived.append(1)
            open_now[0] += 1
            try:
                reply = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await reply.prepare(request)
                await release.wait()
                await reply.write(b'data: {"text": "x"}\n\ndata: [DONE]\n\n')
                await reply.write_eof()
                return reply
            finally:
                open_now[0] -= 1

        async def decode_loads(_: web.Request) -> web.Response:
            polls[0] += 1
            return web.json_response({"loads": [{
                "num_running_reqs": open_now[0], "num_waiting_reqs": 0, "max_total_num_tokens": 16_000,
                "num_used_tokens": 0, "num_total_tokens": 0, "max_running_requests": 32}]})

        async def prefill_generate(request: web.Request) -> web.Response:
            await request.read()
            await release.wait()  # (its KV handed over: SGLang's prefill answers after it)
            return web.json_response({"text": "x"})

        decode_app, prefill_app = web.Application(), web.Application()
        decode_app.router.add_get("/health", health)
        decode_app.router.add_get("/v1/loads", decode_loads)
        decode_app.router.add_post("/generate", decode_generate)
        prefill_app.router.add_get("/health", health)
        prefill_app.router.add_post("/generate", prefill_generate)
        d_runner, d_url = await serve_app(decode_app)
        p_runner, p_url = await serve_app(prefill_app)
        metrics = GatewayMetrics()
        fleet = SGLangFleet([(p_url, 8998)], [d_url], Router.build("random", "random"),
                            HealthConfig(probe_interval_s=0.05, breaker_failures=1000),
                            RelayConfig(retry_backoff_s=0.01, max_connections_per_worker=1), load_stale_s=5.0)
        fleet.start()
        tasks: list[asyncio.Task[None]] = []
        try:
            assert await fleet.wait_ready(5)
            responder = SGLangResponder(fleet, "generate", "generate", Admission(0, 0, 1.0, metrics), metrics,
                                        1 << 24, 10.0)
            decode = fleet.decodes[0]
            body = jbody({"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 1}})
            exchanges = [Exchange(body), Exchange(body)]
            tasks.append(asyncio.create_task(call(responder, exchanges[0])))
            async with asyncio.timeout(5):
                while not arrived:
                    await asyncio.sleep(0.01)
            # The second request waits for the decode's one connection (the first stream holds it).
            tasks.append(asyncio.create_task(call(responder, exchanges[1])))
            async with asyncio.timeout(5):
                while decode.state.num_active < 2:
                    await asyncio.sleep(0.01)
            seen = polls[0]
            async with asyncio.timeout(5):
                while polls[0] < seen + 3:  # (reports taken while it waits)
                    await asyncio.sleep(0.01)
            assert len(arrived) == 1
            # the prefill's side as well: the first request's went out, the second's waits for its decode's
            assert fleet.prefills[0].last_rid == 1
            state = decode.state
            assert state.is_load_fresh and state.report is not None and state.report.num_running == 1
            # the worker's one plus the gateway's one it has not been sent yet
            assert state.num_running_seqs + state.num_waiting_seqs == 2, (state.num_running_seqs,
                                                                          state.num_waiting_seqs)
            release.set()
            async with asyncio.timeout(10):
                await asyncio.gather(*tasks)
            for exchange in exchanges:
                assert exchange.status == 200 and b"[DONE]" in exchange.content, exchange.sent
                assert json.loads(exchange.content.split(b"\n\n")[0][6:]) == {"text": "x"}
            assert decode.state.num_active == 0
        finally:
            release.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await fleet.aclose()
            await d_runner.cleanup()
            await p_runner.cleanup()

    asyncio.run(main())
