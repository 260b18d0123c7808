"""An SGLang worker's load reports (``GET /v1/loads``, polled after each passed ``/health`` probe) as the fleet keeps
them, against real HTTP servers (aiohttp stand-ins).

- A report stays fresh between two polls when the worker's ``/health`` is slow but passing. SGLang's ``/health`` is
  a one-token generation: on a busy worker it takes seconds, which the fleet allows (``SGLANG_MIN_HEALTH_TIMEOUT_S``,
  whatever ``--probe-timeout-s`` says), so the next report comes a probe interval + a (slow) health check + a
  loads poll later. A stale view falls back to the gateway's own counts (no waiting sequences, the whole pool free
  but the gateway's own pages): a busy decode read as nearly idle for part of every probe cycle.
- A worker that answered ``/v1/loads`` with a 404 (an older server) is not asked again while it stays up; once it
  has gone down and come back (restarted, upgraded behind the same URL) it is: the fleet asked it never again, and
  the policies saw only the gateway's own counts of it for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.health import HealthConfig
from gateway.router import Router
from gateway.sglang_fleet import RelayConfig, SGLangFleet

Handler = Callable[[web.Request], Awaitable[web.Response]]
HEALTH_S = 1.2  # a busy worker's /health: past --probe-timeout-s, well within the fleet's floor for it


def _loads(running: int, waiting: int, used: int) -> web.Response:
    return web.json_response({"loads": [{
        "num_running_reqs": running, "num_waiting_reqs": waiting, "max_total_num_tokens": 16_000,
        "num_used_tokens": used, "num_total_tokens": used, "max_running_requests": 32}]})


async def _serve(health: Handler, loads: Handler) -> tuple[web.AppRunner, str]:
    """A stand-in SGLang worker: ``/health``, ``/v1/loads`` and ``/get_model_info``; (its runner, its URL)."""
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
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


def test_a_busy_workers_loads_stay_fresh_between_polls() -> None:
    async def main() -> None:
        polls: list[float] = []
        loop = asyncio.get_running_loop()

        async def health(_: web.Request) -> web.Response:
            await asyncio.sleep(HEALTH_S)
            return web.json_response({})

        async def loads(_: web.Request) -> web.Response:
            polls.append(loop.time())
            return _loads(30, 12, 15_000)

        runner, url = await _serve(health, loads)
        checks = HealthConfig(probe_interval_s=0.2, probe_timeout_s=0.3, unhealthy_after=2)
        fleet = SGLangFleet([], [url], Router.build("power_of_two", "power_of_two"), checks, RelayConfig(),
                            load_stale_s=0.5)
        fleet.start()
        decode = fleet.decodes[0]
        try:
            async with asyncio.timeout(10):
                while decode.state.report is None:
                    await asyncio.sleep(0.02)
            stale_at: list[float] = []
            end = loop.time() + 3 * (HEALTH_S + checks.probe_interval_s)
            while loop.time() < end:
                decode.state.refresh()  # (as the gateway's refresher does every 100 ms)
                if not decode.state.is_load_fresh:
                    stale_at.append(loop.time())
                await asyncio.sleep(0.05)
            assert decode.healthy and decode.last_error is None, decode.last_error
            assert len(polls) >= 3, polls  # polled on schedule all along
            assert not stale_at, (f"a healthy worker polled every {polls[-1] - polls[-2]:.2f}s read as stale "
                                  f"{len(stale_at)} times (after {decode.state.stale_after_s}s)")
            assert decode.state.num_waiting_seqs == 12 and decode.state.num_free_pages == 1_000 // 16
        finally:
            await fleet.aclose()
            await runner.cleanup()

    asyncio.run(main())


def test_a_worker_back_from_down_is_asked_for_its_loads_again() -> None:
    async def main() -> None:
        state = {"up": True, "loads": False, "asked": 0}

        async def health(_: web.Request) -> web.Response:
            return web.json_response({}) if state["up"] else web.Response(status=503)

        async def loads(_: web.Request) -> web.Response:
            state["asked"] += 1
            return _loads(3, 7, 1_000) if state["loads"] else web.Response(status=404)

        runner, url = await _serve(health, loads)
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
