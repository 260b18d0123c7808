"""In-process harness for ``gateway.sglang_relay``: aiohttp servers as the workers, ``SGLangResponder`` over a
fake ASGI cycle (what it sent, and a client that leaves or stops reading)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.admission import Admission
from gateway.health import HealthConfig
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from gateway.sglang_fleet import RelayConfig, SGLangFleet
from gateway.sglang_relay import SGLangResponder

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def health(_: web.Request) -> web.Response:
    return web.json_response({})


async def serve(handler: Handler, path: str = "/generate") -> tuple[web.AppRunner, str]:
    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/health", health)
    app.router.add_post(path, handler)
    return await serve_app(app)


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """``app`` served on a free loopback port: its runner (to clean up) and its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@dataclass
class Exchange:
    """One fake ASGI cycle: what the responder sent, and a way to make the client leave."""

    body: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    sent: list[dict[str, Any]] = field(default_factory=list)
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    block_send_after: int | None = None  # the client stops reading: send() never returns after this many messages

    async def receive(self) -> dict[str, Any]:
        if self.body is not None:
            body, self.body = self.body, None  # type: ignore[assignment]
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if self.block_send_after is not None and len(self.sent) >= self.block_send_after:
            await asyncio.Event().wait()  # (uvicorn's flow.drain() for a client that reads no more)
        self.sent.append(dict(message))

    @property
    def status(self) -> int | None:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return starts[0]["status"] if starts else None

    @property
    def response_headers(self) -> dict[bytes, bytes]:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return dict(starts[0]["headers"]) if starts else {}

    @property
    def content(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


@contextlib.asynccontextmanager
async def relay(prefill: Handler, decode: Handler, route: str = "generate", path: str = "generate",
                config: RelayConfig | None = None, health_config: HealthConfig | None = None,
                ) -> AsyncIterator[tuple[SGLangResponder, SGLangFleet]]:
    p_runner, p_url = await serve(prefill, f"/{path}")
    d_runner, d_url = await serve(decode, f"/{path}")
    metrics = GatewayMetrics()
    fleet = SGLangFleet([(p_url, 8998)], [d_url], Router.build("random", "random"),
                        health_config or HealthConfig(probe_interval_s=0.1, breaker_failures=1000),
                        config or RelayConfig(retry_backoff_s=0.01))
    fleet.start()
    try:
        assert await fleet.wait_ready(5)
        responder = SGLangResponder(fleet, route, path, Admission(0, 0, 1.0, metrics), metrics, 1 << 24, 10.0)
        yield responder, fleet
    finally:
        await fleet.aclose()
        await p_runner.cleanup()
        await d_runner.cleanup()


async def call(responder: SGLangResponder, exchange: Exchange, path: str = "/generate") -> None:
    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-type", b"application/json"), *exchange.headers]}
    await responder(scope, exchange.receive, exchange.send)


def jbody(obj: Any) -> bytes:
    return json.dumps(obj).encode()
