"""The gateway's checks of SGLang workers (``gateway.sglang_fleet``) against real HTTP servers (aiohttp)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.health import HealthConfig
from gateway.router import Router
from gateway.sglang_fleet import RelayConfig, SGLangFleet


def test_a_worker_whose_pool_is_full_of_requests_still_passes_its_checks() -> None:
    """Relayed requests fill a decode's connection pool (long streams): its /health checks, answered at
    once, must not wait behind them for a connection and time out (the fleet then marked a healthy
    worker down and every new request got a 503 until the streams ended)."""
    async def main() -> None:
        release = asyncio.Event()

        async def health(_: web.Request) -> web.Response:
            return web.json_response({})

        async def hold(_: web.Request) -> web.Response:
            await release.wait()
            return web.json_response({})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/hold", hold)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        checks = HealthConfig(probe_interval_s=0.1, probe_timeout_s=0.3, unhealthy_after=2)
        fleet = SGLangFleet([(url, 8998)], [url.replace("127.0.0.1", "localhost")], Router.build("random", "random"),
                            checks, RelayConfig(max_connections_per_worker=2))
        fleet.start()
        try:
            assert await fleet.wait_ready(5)
            assert fleet.pool is not None
            held = [asyncio.create_task(fleet.pool.post(f"{url}/hold", b"{}")) for _ in range(2)]  # (the pool, full)
            await asyncio.sleep(1.5)  # some fifteen checks
            prefill = fleet.prefills[0]
            assert prefill.healthy and prefill.last_error is None, prefill.last_error
            release.set()
            for response in await asyncio.gather(*held):
                response.release()
        finally:
            await fleet.aclose()
            await runner.cleanup()

    asyncio.run(main())


def test_relayed_token_figures_count_each_prompt_once() -> None:
    """``/generate`` with ``sampling_params.n`` answers a list of n items, each with its prompt's figures:
    the prompt counts once (as the native path counts it), the generated tokens of every item."""
    import json

    from gateway.metrics import GatewayMetrics
    from gateway.sglang_relay import _Figures

    def counted(figures: _Figures) -> tuple[float, float, float]:
        m = figures.metrics
        return (m.prompt_tokens._value.value, m.cached_tokens._value.value, m.generation_tokens._value.value)

    item = {"text": "x", "meta_info": {"prompt_tokens": 10, "cached_tokens": 8, "completion_tokens": 5}}
    figures = _Figures(GatewayMetrics(), False, per_prompt=3)
    figures.answered(json.dumps([item, item, item]).encode())
    assert counted(figures) == (10, 8, 15)
    streamed = _Figures(GatewayMetrics(), False, per_prompt=3)  # (a stream's last event is one item's)
    streamed.answered(json.dumps(item).encode(), streamed=True)
    assert counted(streamed) == (0, 0, 0)
    one = _Figures(GatewayMetrics(), False)
    one.answered(json.dumps({"usage": {"prompt_tokens": 7, "completion_tokens": 2,
                                       "prompt_tokens_details": {"cached_tokens": 4}}}).encode())
    assert counted(one) == (7, 4, 2)


def test_closing_the_fleet_tells_the_policies_each_worker_that_was_up_is_removed() -> None:
    """The policy hook ``on_worker_removed`` runs when a worker is lost or the gateway closes (docs/policies.md):
    native workers' did at close, SGLang workers' did not (found by review)."""
    removed: list[str] = []

    class Recording:
        name = "recording"

        def select(self, prefills, decodes, request):  # type: ignore[no-untyped-def]
            from gateway.policies.base import Pair
            return Pair(prefills[0] if prefills else None, decodes[0])

        def on_worker_removed(self, worker) -> None:  # type: ignore[no-untyped-def]
            removed.append(f"{worker.role} {worker.url}")

    async def main() -> None:
        async def health(_: web.Request) -> web.Response:
            return web.json_response({})

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        policy = Recording()
        fleet = SGLangFleet([(url, 8998)], [url.replace("127.0.0.1", "localhost")], Router(policy, policy),
                            HealthConfig(probe_interval_s=0.1, probe_timeout_s=0.3))
        fleet.start()
        try:
            assert await fleet.wait_ready(5)
        finally:
            await fleet.aclose()
            await runner.cleanup()
        assert sorted(removed) == sorted([f"prefill {url}", f"decode {url.replace('127.0.0.1', 'localhost')}"])

    asyncio.run(main())
