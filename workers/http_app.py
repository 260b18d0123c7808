"""The worker's HTTP side (its own port): health, load, stats (counters), Prometheus metrics, info and
debug views, and SGLang's PD HTTP protocol (``workers/sglang_api.py``: generation, model and server
info, cache flush), so SGLang's router can drive the worker."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from gateway.errors import APIError, api_error, http_error
from gateway.middleware import BRIEF_STATUS, KeyGuardMiddleware
from workers.metrics import CONTENT_TYPE, create_registry

if TYPE_CHECKING:
    from workers.worker import Worker

_json = msgspec.json.Encoder()


def _reply(body: object, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


# Answered without the worker's --api-key: the health probes (SGLang asks no key of /health* either) and the
# Prometheus metrics (as the gateway's own: figures, no requests)
OPEN_PATHS = frozenset(("/health", "/liveness", "/health_generate", "/metrics"))


def shows_details(request: Request) -> bool:
    """Whether an open probe may tell ``request`` why it fails (a registry's or a tokenizer's error): not when the
    worker's ``KeyGuardMiddleware`` marked it ``BRIEF_STATUS`` (a worker with ``--api-key``, a request without it),
    as the gateway's open probes."""
    return not request.scope.get(BRIEF_STATUS)


async def server_error(_: Request, exc: Exception) -> Response:
    """JSON of the OpenAI shape for an unexpected error, as every other error of the worker (Starlette's own is
    plain text, which SGLang's router and OpenAI clients cannot read); Starlette re-raises it: uvicorn logs it."""
    return APIError("internal error in the worker").to_response()


def create_http_app(worker: Worker) -> ASGIApp:
    registry = create_registry(worker)

    def status() -> str:
        if getattr(worker, "stopping", False):  # (SIGTERM: routers probing /health stop sending here at once; its
            return "stopping"  # scheduler stops on the way out, which is no death for a liveness probe to act on)
        scheduler = worker.scheduler  # (started before this app serves: not alive means dead)
        if scheduler is not None and not scheduler.is_alive:
            return "unhealthy"
        if not (worker.started and scheduler is not None):
            return "starting"
        return "unregistered" if worker.registration_error is not None else "ok"

    async def health(request: Request) -> Response:
        """Readiness: 200 only once every server is up (a prefill: registered) and the scheduler runs, and
        while a prefill's registry entry has not lapsed."""
        state = status()
        body: dict[str, str | None] = {"status": state, "role": worker.config.role}
        if state == "unregistered" and shows_details(request):  # (open: no key needed)
            body["error"] = worker.registration_error
        return _reply(body, 200 if state == "ok" else 503)

    async def liveness(_: Request) -> Response:
        """Liveness: 200 while starting too (a prefill may retry its registration for a while: a probe
        with a short threshold must not kill it for that); 503 only once its scheduler has died, or has held
        requests without finishing a step for ``--watchdog-timeout-s`` (a forward that hangs)."""
        state = status()
        body: dict[str, object] = {"status": state, "role": worker.config.role}
        scheduler = worker.scheduler
        stalled_s = scheduler.stalled_s if scheduler is not None and state != "unhealthy" else 0.0
        if stalled_s > worker.config.watchdog_timeout_s:
            state = body["status"] = "stalled"
            body["error"] = f"the scheduler has not finished a step for {stalled_s:.0f}s (a hung forward?)"
        return _reply(body, 503 if state in ("unhealthy", "stalled") else 200)

    async def info(_: Request) -> Response:
        return _reply(worker.info())

    async def load(_: Request) -> Response:
        assert worker.scheduler is not None
        return _reply(worker.scheduler.load_report())

    async def stats(_: Request) -> Response:
        assert worker.scheduler is not None
        return _reply(worker.scheduler.stats())

    async def rooms(_: Request) -> Response:
        assert worker.scheduler is not None
        return _reply(list(worker.scheduler.rooms))

    async def metrics(_: Request) -> Response:
        # Collected on the event loop: plain reads of the scheduler's counters, no lock, no thread hop.
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    sglang = worker.sglang.routes() if worker.sglang is not None else []
    app = Starlette(
        # (JSON for a wrong path or method, and for an APIError out of a plain route: /v1/models before
        # the worker's frontend is up)
        exception_handlers={HTTPException: http_error, APIError: api_error, Exception: server_error},
        routes=[
            *sglang,  # SGLang's PD HTTP protocol (workers/sglang_api.py)
            Route("/health", health),
            Route("/liveness", liveness),
            Route("/info", info),
            Route("/load", load),
            Route("/stats", stats),
            Route("/metrics", metrics),
            Route("/debug/rooms", rooms),
        ]
    )
    key = worker.config.api_key
    return KeyGuardMiddleware(app, key, OPEN_PATHS) if key else app
