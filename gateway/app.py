"""The gateway's ASGI app: OpenAI routes, SGLang ``/generate``, health, metrics and the admin API.

Layout (``create_app(config)``), outermost first:
1. Pure ASGI middleware: with ``--cors-allow-origin``, CORS (``gateway/cors.py``: preflights answered, the
   headers added); then (``gateway/middleware.py``) request id and context, drain refusal, API keys.
2. ``GatewayApp``: the generation routes (``/v1/chat/completions``, ``/v1/completions``,
   ``/generate``) go straight to their raw-ASGI ``Responder`` (``gateway/responder.py``: admission,
   body, validation, dispatch, JSON or SSE); everything else goes to Starlette.
3. Starlette: ``/v1/models``, ``GET``/``DELETE /v1/responses/{id}`` and ``GET .../input_items``
   (``gateway/response_store.py``),
   ``/health`` (the process is alive, with the workers' state),
   ``/readiness`` (200 only with a selectable prefill and decode, or combined, worker and not
   draining), ``/metrics``, ``/openapi.json`` (``gateway/openapi.py``, built here once) and the
   admin API; its lifespan starts the ``Gateway`` runtime
   (``gateway/runtime.py``: connects to every worker, loads the tokenizer) and, after the server's
   drain, closes every worker connection (open requests are aborted worker-side when it drops).
``gateway.cli`` installs ``app.hot_routes`` in the HTTP protocol: the generation routes' ``POST``s are then
answered on the gateway's own cycle (``gateway/hot_cycle.py``: the same request id, gatekeeper checks, CORS
headers and responders, no ASGI; the SGLang relay's too, its ASGI messages written by the cycle's ``send``);
other methods and paths come here as above.
Every error is one ``APIError`` mapped to an OpenAI-shaped body with its status code (an unexpected
exception in a Starlette route too: a 500 of the same shape). Limits on the client below the app
(request heads, slow connections) are in ``gateway/http_protocol.py``, installed by ``gateway.cli``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.admin import admin_routes
from gateway.api import ModelNotFound, now_s
from gateway.cors import CorsMiddleware, CorsPolicy
from gateway.errors import APIError, NoWorkers, http_error
from gateway.hot_cycle import HotCycle, HotRoutes
from gateway.metrics import ResponseStoreCollector
from gateway.middleware import BRIEF_STATUS, GatekeeperMiddleware, RequestContextMiddleware
from gateway.openapi import openapi_document
from gateway.responder import Responder
from gateway.response_store import ResponseStore, StoreRoute, input_items_endpoint, response_endpoint, store_of
from gateway.responses import ResponsesResponder
from gateway.runtime import Gateway, GatewayConfig
from gateway.sglang_relay import SGLangResponder
from gateway.shapes import ChatShape, CompletionShape, GenerateShape
from transfer.netaddr import is_loopback

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
GC_YOUNG_THRESHOLD = 10_000  # net allocations between young-generation collections (CPython's default: 700)

__all__ = ["Gateway", "GatewayApp", "GatewayConfig", "create_app"]


def create_app(config: GatewayConfig) -> Any:
    """The ASGI app (middleware around ``GatewayApp``); ``app.state.gateway`` is the ``Gateway``."""
    gw = Gateway(config)
    # (none behind SGLang workers alone: /v1/responses is not served there)
    store = store_of(config.responses_store_max, config.responses_store_ttl_s, keyed=bool(config.api_keys),
                     max_bytes=config.responses_store_max_mib * 1024 * 1024) if gw.serves_native else None
    if store is not None:
        gw.metrics.add_collector(ResponseStoreCollector(store.stats))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        # The port opens now; the first workers are waited for in the background (``Gateway.launch``).
        first_workers = gw.launch()
        first_workers.add_done_callback(_freeze_start_up)  # (the tokenizer, loaded by then, joins them)
        gc.collect()
        gc.freeze()  # start-up objects (modules, config) leave the collector's generations
        # A young-generation pass walks every object still alive since the last one; at the default
        # threshold (700 net allocations) that is mostly the in-flight requests' state, walked again
        # every few requests (~8 us of CPU per request at 64 concurrent). Requests leave no reference
        # cycles behind (tests/integration/test_gateway_gc.py checks), so a rarer pass costs little memory.
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        try:
            yield
        finally:
            await gw.aclose()

    rest = Starlette(
        routes=[
            Route("/v1/models", _guarded(gw, "models", models), methods=["GET"]),
            Route("/v1/models/{model:path}", _guarded(gw, "models", model), methods=["GET"]),
            # (a route of their own in the metrics; another method's 405 is the endpoint's, counted there)
            StoreRoute("/v1/responses/{response_id}", _guarded(gw, "responses_store", response_endpoint(store)),
                       methods=["GET", "DELETE"]),
            StoreRoute("/v1/responses/{response_id}/input_items",
                       _guarded(gw, "responses_store", input_items_endpoint(store)), methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/readiness", readiness, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            *admin_routes(gw, lambda c: worker_status(gw, c)),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    rest.state.gateway = gw
    rest.state.openapi = openapi_document(config, serves_responses=gw.serves_native)
    app = GatewayApp(gw, rest, store)
    guarded = GatekeeperMiddleware(app, api_keys=config.api_keys, admin_api_keys=config.admin_api_keys,
                                   metrics_require_admin=config.metrics_require_admin,
                                   is_draining=lambda: gw.is_draining,
                                   on_refused=lambda reason: gw.metrics.rejected.labels(reason).inc(),
                                   admin_off=_admin_off(config))
    if guarded.admin_off is not None:
        log.warning("the admin API is off: %s", guarded.admin_off)
    outer: Any = RequestContextMiddleware(guarded)
    cors = CorsPolicy(config.cors_allow_origins) if config.cors_allow_origins else None
    if cors is not None:  # (outermost: a preflight carries no key, and is answered while draining too)
        outer = CorsMiddleware(outer, cors)
    outer.state = rest.state
    # The generation routes' POSTs skip ASGI (gateway/hot_cycle.py; gateway.cli installs it)
    outer.hot_routes = HotRoutes(app.responders, guarded, cors)
    return outer


class GatewayApp:
    """Generation routes straight to their responders, everything else (and the lifespan) to Starlette."""

    def __init__(self, gw: Gateway, rest: Starlette, store: ResponseStore | None = None) -> None:
        self.rest = rest
        self.responders: dict[str, Any] = {
            "/v1/chat/completions": Responder(gw, ChatShape(), gw.config.prepare_thread_bytes),
            "/v1/completions": Responder(gw, CompletionShape(), gw.config.prepare_thread_bytes),
            "/generate": Responder(gw, GenerateShape(), gw.config.prepare_thread_bytes),
            "/v1/responses": ResponsesResponder(gw, store, gw.config.prepare_thread_bytes),
        }
        if gw.fleet is not None:  # SGLang workers: the body goes through as is (gateway/sglang_relay.py)
            relays = {
                f"/{path}": SGLangResponder(gw.fleet, route, path, gw.admission, gw.metrics, gw.max_body_bytes,
                                            gw.body_timeout_s, lambda: _served_model_or_none(gw))
                for route, path in (("chat", "v1/chat/completions"), ("completions", "v1/completions"),
                                    ("generate", "generate"))
            }
            native = self.responders
            self.responders = {path: MixedResponder(gw, native[path], relay) if gw.serves_native
                               else relay for path, relay in relays.items()}
            if gw.serves_native:  # (not relayed: served by the native workers alone)
                self.responders["/v1/responses"] = native["/v1/responses"]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            responder = self.responders.get(scope["path"])
            if responder is not None:
                await responder(scope, receive, send)
                return
        await self.rest(scope, receive, send)


class MixedResponder:
    """Native and SGLang workers under one gateway: each request goes to one kind (a prefill and its decode
    must speak the same KV protocol), chosen at random in proportion to each kind's healthy decodes, then
    to that kind's responder, which picks the pair."""

    def __init__(self, gw: Gateway, native: Responder, relay: SGLangResponder) -> None:
        self.gw, self.native, self.relay = gw, native, relay

    def _pick(self) -> Responder | SGLangResponder:
        gw = self.gw
        assert gw.fleet is not None
        native = sum(1 for c in gw.decodes if c.healthy) if gw.dispatcher.is_ready() else 0
        http = sum(1 for w in gw.fleet.decodes if w.healthy) if gw.fleet.is_ready() else 0
        use_relay = http > 0 and (native == 0 or random.random() * (native + http) < http)
        return self.relay if use_relay else self.native

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._pick()(scope, receive, send)

    async def serve(self, exchange: HotCycle) -> None:
        """The gateway's own cycle (``gateway.hot_cycle``), as ``__call__``."""
        await self._pick().serve(exchange)

    def count(self, status: int) -> None:
        """A request the HTTP protocol answered or closed before it started (counted under the route: both
        responders count under the same name)."""
        self.native.count(status)


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def _guarded(gw: Gateway, route: str, endpoint: Callable[[Request], Awaitable[Response]]) -> Any:
    """A Starlette endpoint whose ``APIError`` becomes its OpenAI-shaped response, counted per route."""
    async def wrapped(request: Request) -> Response:
        try:
            response = await endpoint(request)
        except APIError as exc:
            gw.metrics.requests.labels(route, str(exc.status)).inc()
            return exc.to_response()
        gw.metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    return wrapped


async def models(request: Request) -> Response:
    gw = _gateway(request)
    return _reply({"object": "list", "data": [_model_card(_served_model(gw), _context_length(gw))]})


async def model(request: Request) -> Response:
    """``GET /v1/models/{model}``: the served model's card (also under ``default``), else a 404."""
    name, asked = _served_model(_gateway(request)), request.path_params["model"]
    if asked not in (name, "default"):
        raise ModelNotFound(f"The model {asked!r} does not exist here; use {name!r}", param="model",
                            code="model_not_found")
    return _reply(_model_card(name, _context_length(_gateway(request))))


def _served_model(gw: Gateway) -> str:
    if gw.has_native_workers:
        return gw.require_frontend().model_name
    assert gw.fleet is not None  # SGLang workers only: the name they report (or --model-name)
    name = gw.config.model_name or gw.fleet.model_name
    if name is None:
        raise NoWorkers("no SGLang worker has reported its model yet", retry_after_s=2.0)
    return name


def _admin_off(config: GatewayConfig) -> str | None:
    """Why the admin API is off: the gateway listens beyond loopback and no key guards the admin API."""
    if config.api_keys or config.admin_api_keys or is_loopback(config.host):
        return None
    return (f"the gateway listens on {config.host} and no key guards this API: give --admin-api-key (or "
            "--api-key, or $PD_ADMIN_API_KEY), or bind --host to loopback (127.0.0.1); anyone could add a worker "
            "of theirs")


def _served_model_or_none(gw: Gateway) -> str | None:
    """``_served_model``, None while it is not known yet (the relay then passes the request on)."""
    try:
        return _served_model(gw)
    except APIError:
        return None


def _freeze_start_up(_: object) -> None:
    """What start-up made leaves the collector's generations (collected first: the garbage made while the
    workers were waited for is freed, not frozen)."""
    gc.collect()
    gc.freeze()


def _context_length(gw: Gateway) -> int | None:
    """The served context length, when native workers have told it (None with SGLang workers only): the model's,
    or less where the workers' KV pools hold less (``Frontend.usable_context``: a longer request would be a 400)."""
    return gw.require_frontend().usable_context() if gw.has_native_workers else None


def _model_card(name: str, max_model_len: int | None = None) -> dict[str, Any]:
    """vLLM's and SGLang's card: ``root`` and ``max_model_len`` too (Continue's vllm provider reads the latter as
    the context length)."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": now_s(), "owned_by": "pd-gateway", "root": name}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return card


def status(gw: Gateway) -> dict[str, Any]:
    ready = not gw.is_draining and gw.serves()
    return {
        "status": "draining" if gw.is_draining else "ok" if ready else "unavailable",
        "role": "gateway",  # (as a worker's /health names its role: a gateway given as a worker is refused)
        "ready": ready,
        "policy": gw.router.name,
        "active_requests": gw.admission.num_active,
        "queued_requests": gw.admission.num_queued,
        "workers": [worker_status(gw, c) for c in (*gw.clients, *(gw.fleet.workers if gw.fleet else ()))],
    }


def _status_for(request: Request) -> dict[str, Any]:
    """``status``, or only its first fields for a request without a valid key to a gateway with keys: the probes
    need no key, the workers' addresses, roles and errors do (``GET /workers`` is the admin API's)."""
    body = status(_gateway(request))
    if request.scope.get(BRIEF_STATUS):
        return {"status": body["status"], "role": body["role"], "ready": body["ready"]}
    return body


async def health(request: Request) -> Response:
    return _reply(_status_for(request))  # liveness: this process answers


async def readiness(request: Request) -> Response:
    body = _status_for(request)
    return _reply(body, 200 if body["ready"] else 503)


async def metrics(request: Request) -> Response:
    return Response(generate_latest(_gateway(request).metrics.registry), media_type="text/plain; version=0.0.4")


async def openapi(request: Request) -> Response:
    return Response(request.app.state.openapi, media_type="application/json")


async def server_error(request: Request, exc: Exception) -> Response:
    # (Starlette re-raises the exception after this response: uvicorn logs it)
    return APIError("internal error in the gateway").to_response()


def worker_status(gw: Gateway, client: Any) -> dict[str, Any]:
    """One worker as ``/health`` and ``GET /workers`` show it."""
    return {**client.state.describe(), "healthy": client.healthy, "connected": client.is_connected,
            "draining": client.is_draining, **client.health.describe(), "error": client.last_error,
            "cached_pages": gw.router.index.num_pages(client.url)}


def _reply(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")
