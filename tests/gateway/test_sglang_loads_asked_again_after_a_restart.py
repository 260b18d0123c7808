"""An SGLang worker that answered ``/v1/loads`` with a 404 (an older server) is not asked again while it stays up;
once it has gone down and come back (restarted, upgraded behind the same URL) it is: the fleet asked it never
again, and the policies saw only the gateway's own counts of it for good."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.health import HealthConfig
from gateway.router import Router
from gateway.sglang_fleet import RelayConfig, SGLangFleet


def test_a_worker_back_from_down_is_asked_for_its_loads_again() -> None:
    async def main() -> None:
        state = {"up": True, "loads": False, "asked": 0}

        async def health(_: web.Request) -> web.Response:
            return web.json_response({}) if state["up"] else web.Response(status=503)

        async def loads(_: web.Request) -> web.Response:
            state["asked"] += 1
            if not state["loads"]:
                return web.Response(status=404)
            return web.json_response({"loads": [{
                "num_running_reqs": 3, "num_waiting_reqs": 7, "max_total_num_tokens": 16_000,
                "num_used_tokens": 1_000, "num_total_tokens": 1_000, "max_running_requests": 32}]})

        async def model(_: web.Request) -> web.Response:
            return web.json_response({"served_model_name": "m"})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/loads", loads)
        app.router.add_get("/get_model_info", model)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        checks = HealthConfig(probe_interval_s=0.05, probe_timeout_s=0.5, unhealthy_after=2, healthy_after=1)
        fleet = SGLangFleet([], [url], Router.build("power_of_two", "power_of_two"), checks, RelayConfig())
        fleet.start()
        decode = fleet.decodes[0]
        try:
            async with asyncio.timeout(10):
                while decode.has_loads is not False:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # (several probes: not asked again while it stays up)
            assert state["asked"] == 1
            state["up"] = False
            async with asyncio.timeout(10):
                while decode.is_up:
                    await asyncio.sleep(0.02)
            state["up"], state["loads"] = True, True  # back, now serving /v1/loads
            async with asyncio.timeout(10):
                while decode.state.report is None:
                    await asyncio.sleep(0.02)
            assert decode.has_loads and decode.state.num_waiting_seqs == 7
        finally:
            await fleet.aclose()
            await runner.cleanup()

    asyncio.run(main())
