"""A connect cut short by the SGLang relay's shared request deadline (``ends_at``, ``HttpPool.post(deadline=)``).

1. A connect cut short by the request's own deadline (what is left of ``request_timeout_s`` is less than
   ``connect_timeout_s``: a retry late in the request, or a short request timeout) raised ``ConnectFailed``, as if
   the worker could not be reached within ``connect_timeout_s``: the relay held it against the decode
   (``worker_gone``, its breaker) and the client got a 502 ``worker_failed``, where the pool's own contract (its
   module doc: "past [the deadline] ... the waiting call raises ``TimeoutError``") and the relay's (a wait cut short
   by the request's deadline is a 504 ``request_timeout`` that blames no worker) say otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from relay_harness import Exchange, call, health, jbody, serve

from gateway.admission import Admission
from gateway.health import HealthConfig
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from gateway.sglang_fleet import RelayConfig, SGLangFleet
from gateway.sglang_relay import SGLangResponder
from gateway.worker_http import HttpPool


async def prefill(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"text": "", "meta_info": {}})


async def decode(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"text": "ok", "meta_info": {}})


class _Gated:
    """An aiohttp app on a listening socket of our own whose accepting can stop: once ``stall()``ed its accept queue
    is full, and a new connection to it hangs (its SYNs dropped) while the connections it accepted before (the
    health probes') go on."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.fillers: list[socket.socket] = []
        self.runner: web.AppRunner | None = None
        self.conns: set[asyncio.Task[object]] = set()

    async def start(self, app: web.Application) -> str:
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        loop = asyncio.get_running_loop()
        server = self.runner.server
        assert server is not None

        def accept() -> None:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return
            conn.setblocking(False)
            task = asyncio.ensure_future(loop.connect_accepted_socket(server, conn))
            self.conns.add(task)
            task.add_done_callback(self.conns.discard)

        loop.add_reader(self.sock.fileno(), accept)
        return f"http://127.0.0.1:{self.port}"

    async def stall(self) -> None:
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        for _ in range(4):  # (the accept queue of a listen(0) socket holds one; the rest wait for its SYN-ACK)
            filler = socket.socket()
            filler.setblocking(False)
            try:
                filler.connect(("127.0.0.1", self.port))
            except BlockingIOError:
                pass
            self.fillers.append(filler)
        await asyncio.sleep(0.05)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.sock.fileno())
        for filler in self.fillers:
            filler.close()
        self.sock.close()
        if self.runner is not None:
            await self.runner.cleanup()


@contextlib.asynccontextmanager
async def _stalled_decode_relay(config: RelayConfig) -> AsyncIterator[tuple[SGLangResponder, SGLangFleet]]:
    p_runner, p_url = await serve(prefill)
    gated = _Gated()
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/generate", decode)
    d_url = await gated.start(app)
    metrics = GatewayMetrics()
    fleet = SGLangFleet([(p_url, 8998)], [d_url], Router.build("random", "random"),
                        HealthConfig(probe_interval_s=0.1, breaker_failures=1000), config)
    fleet.start()
    try:
        assert await fleet.wait_ready(5)
        await gated.stall()
        yield SGLangResponder(fleet, "generate", "generate", Admission(0, 0, 1.0, metrics), metrics, 1 << 24,
                              10.0), fleet
    finally:
        await fleet.aclose()
        await p_runner.cleanup()
        await gated.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_connect_cut_short_by_the_request_timeout_is_a_504_that_blames_no_worker(stream: bool) -> None:
    """The decode accepts no new connection; the request's own timeout (0.5 s) ends before the connect timeout
    (5 s) would: a 504 ``request_timeout``, no failure of the decode's (it was not given its connect timeout)."""

    async def main() -> tuple[Exchange, int, float]:
        config = RelayConfig(retry_backoff_s=0.01, request_timeout_s=0.5, connect_timeout_s=5.0)
        async with _stalled_decode_relay(config) as (responder, fleet):
            exchange = Exchange(jbody({"text": "hi", "stream": stream}))
            await asyncio.wait_for(call(responder, exchange), 20.0)
            worker = fleet.decodes[0]
            counted = sum(responder.metrics.worker_failures.labels(worker.url, "decode", code).value
                          for code in ("timeout", "worker_gone", "internal"))
            return exchange, worker.health.breaker._failures, counted

    exchange, failures, counted = asyncio.run(main())
    assert exchange.status == 504, exchange.content
    assert json.loads(exchange.content)["error"]["code"] == "request_timeout", exchange.content
    assert (failures, counted) == (0, 0), "a connect cut short by the request's deadline was held against the decode"


def test_the_pools_connect_cut_short_by_the_callers_deadline_raises_timeout_error() -> None:
    """The pool's contract: past the request's deadline the waiting call raises ``TimeoutError``; a connect given
    less than ``connect_timeout_s`` (the caller's deadline nearer) is cut by that deadline, not the worker's failure
    to connect in time (``ConnectFailed``)."""

    async def main() -> None:
        gated = _Gated()
        await gated.start(web.Application())
        await gated.stall()
        pool = HttpPool(limit_per_host=2, timeout_s=10.0, connect_timeout_s=5.0)
        loop = asyncio.get_running_loop()
        try:
            with pytest.raises(TimeoutError):
                await pool.post(f"http://127.0.0.1:{gated.port}/generate", b"{}", deadline=loop.time() + 0.3)
            short = HttpPool(limit_per_host=2, timeout_s=10.0, connect_timeout_s=0.3)  # (its own bound: its failure)
            try:
                with pytest.raises(OSError) as caught:
                    await short.post(f"http://127.0.0.1:{gated.port}/generate", b"{}", deadline=loop.time() + 5.0)
                assert not isinstance(caught.value, TimeoutError)
            finally:
                short.close()
        finally:
            pool.close()
            await gated.close()

    asyncio.run(main())
