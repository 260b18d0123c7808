"""SGLang workers as SGLang serves them: the model name clients use, and a `/health` that takes its usual time."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.admission import Admission
from gateway.health import HealthConfig
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from gateway.sglang_fleet import RelayConfig, SGLangFleet
from gateway.sglang_relay import SGLangResponder
from tests.gateway.relay_harness import Exchange, call, jbody, serve_app


async def _sglang_worker(role: str) -> tuple[web.AppRunner, str]:
    """An SGLang worker as ``python -m sglang.launch_server --model-path /models/llama-3-8b
    --served-model-name llama-3-8b``: ``/get_model_info`` names the path only (SGLang's has no
    ``served_model_name``), ``/v1/models`` and ``/get_server_info`` the served name."""
    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"model_path": "/models/llama-3-8b", "tokenizer_path": "/models/llama-3-8b",
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": "default"})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "llama-3-8b", "object": "model", "created": 0, "owned_by": "sglang", "root": "llama-3-8b",
             "max_model_len": 8192}]})

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response({"model_path": "/models/llama-3-8b", "served_model_name": "llama-3-8b",
                                  "disaggregation_mode": role, "internal_states": [{}], "version": "0.5.0"})

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"text": "ok", "meta_info": {"id": "x"}, "model": body.get("model")})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_post("/generate", generate)
    return await serve_app(app)


def test_the_served_model_name_is_sglangs_served_model_name_not_its_model_path() -> None:
    """SGLang's ``/get_model_info`` has no ``served_model_name``: its ``model_path`` is a directory when the
    worker was started with ``--served-model-name``. Clients use the served name (SGLang's ``/v1/models``):
    the gateway 404'd every one of their requests and listed the directory as its model."""
    async def main() -> None:
        p_runner, p_url = await _sglang_worker("prefill")
        d_runner, d_url = await _sglang_worker("decode")
        metrics = GatewayMetrics()
        fleet = SGLangFleet([(p_url, 8998)], [d_url], Router.build("random", "random"),
                            HealthConfig(probe_interval_s=0.1, breaker_failures=1000),
                            RelayConfig(retry_backoff_s=0.01))
        fleet.start()
        try:
            assert await fleet.wait_ready(5)
            for _ in range(50):
                if fleet.model_name is not None:
                    break
                await asyncio.sleep(0.05)
            assert fleet.model_name == "llama-3-8b"
            responder = SGLangResponder(fleet, "generate", "generate", Admission(0, 0, 1.0, metrics), metrics,
                                        1 << 24, 10.0, lambda: fleet.model_name)
            exchange = Exchange(jbody({"text": "hi", "model": "llama-3-8b"}))
            await call(responder, exchange)
            assert exchange.status == 200, exchange.content
        finally:
            await fleet.aclose()
            await p_runner.cleanup()
            await d_runner.cleanup()

    asyncio.run(main())


def test_an_sglang_worker_whose_health_check_takes_its_usual_time_stays_up() -> None:
    """SGLang's ``GET /health`` is its ``health_generate``: it runs a one-token generation, sleeps a second,
    and answers 200 once any output came since (one more second at a time, up to its 20 s
    HEALTH_CHECK_TIMEOUT): 1 s idle, 2 s and more on a busy worker whose step outputs come less than once a
    second. SGLang's router waits 5 s; the gateway's default 2 s probe timeout (2 misses: unhealthy) took
    busy SGLang workers out of rotation, under load, when they were fine."""
    async def slow_health(_: web.Request) -> web.Response:
        await asyncio.sleep(2.3)  # (sleep 1 s, no output yet, sleep 1 s more, output seen: 200)
        return web.Response(status=200)

    async def main() -> None:
        runners, urls = [], []
        for _ in range(2):
            app = web.Application()
            app.router.add_get("/health", slow_health)
            runner, url = await serve_app(app)
            runners.append(runner)
            urls.append(url)
        fleet = SGLangFleet([(urls[0], 8998)], [urls[1]], Router.build("random", "random"),
                            HealthConfig(), RelayConfig())  # (the gateway's defaults: --health-timeout-s 2)
        fleet.start()
        try:
            assert await fleet.wait_ready(8), [w.last_error for w in fleet.workers]
        finally:
            await fleet.aclose()
            for runner in runners:
                await runner.cleanup()

    asyncio.run(main())
