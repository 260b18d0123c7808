"""The registry's HTTP app: SGLang's bootstrap routes plus our operator routes.

Lifecycle:
1. ``create_app(config)`` builds the state (``Registry``, ``RoomTable``, ``Metrics``) and a Starlette
   app wrapped in ``RegistryMiddleware`` (token, body limit, request metrics).
2. On lifespan startup a named sweeper task drops expired rank leases and room entries every
   ``sweep_interval_s``; reads also expire leases lazily, so correctness never waits for it.
3. Handlers run on the server's one event loop and never await while mutating state, so no lock is
   needed; a refused request (4xx/5xx) leaves the state unchanged.
4. On lifespan shutdown the sweeper is cancelled and awaited.

Routes (SGLang's, same shapes and status codes): ``PUT /route``, ``GET /route``,
``POST /register_dp_rank``, ``POST /query_dp_ranks``, ``GET /health``. Ours: ``DELETE /route``
(graceful deregistration), ``GET /instances`` (operator listing, draining ranks flagged), ``GET /metrics``
(Prometheus). A ``PUT /route`` with ``"draining": true`` (ours) is answered ``{"draining": true}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bootstrap import errors
from bootstrap.config import BootstrapConfig
from bootstrap.messages import RANK_PUT_FIELDS, QueryDpRanks, RankPut, RegisterDpRank
from bootstrap.metrics import Metrics
from bootstrap.middleware import RegistryMiddleware
from bootstrap.registry import Instance, Registry, key_of
from bootstrap.rooms import RoomTable

logger = logging.getLogger("bootstrap")

_ENCODER = msgspec.json.Encoder()
_ANY_DECODER = msgspec.json.Decoder()
_REGISTER_DP_DECODER = msgspec.json.Decoder(RegisterDpRank)
_QUERY_DP_DECODER = msgspec.json.Decoder(QueryDpRanks)
_ROUTE_QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
_TEXT = "text/plain; charset=utf-8"
MAX_EXTRA_BYTES = 4096  # unknown PUT fields are kept for operators, within this bound
_JSON = "application/json"

Handler = Callable[[Request], Awaitable[Response]]


class RegistryState:
    """What one app owns; reachable as ``app.state.registry_state`` (tests, embedded handle)."""

    def __init__(self, config: BootstrapConfig) -> None:
        self.config = config
        self.registry = Registry(ttl_s=config.ttl_s, max_ranks=config.max_ranks, body_timeout_s=config.body_timeout_s)
        self.rooms = RoomTable(ttl_s=config.room_ttl_s, max_rooms=config.max_rooms)
        self.metrics = Metrics(self.registry, self.rooms)

    def sweep(self) -> None:
        now = time.monotonic()
        self.registry.sweep(now)
        self.rooms.sweep(now)


def _ok() -> Response:
    # SGLang answers its writes and /health with the plain text "OK"; clients check the status only.
    return Response(b"OK", 200, media_type=_TEXT)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_ENCODER.encode(obj), status, media_type=_JSON)


def _error(error: errors.ApiError) -> Response:
    return Response(error.body(), error.status, media_type=_JSON, headers=error.headers())


def _api(handler: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except errors.ApiError as error:
            return _error(error)

    wrapped.__name__ = handler.__name__
    return wrapped


def _decode(body: bytes, decoder: msgspec.json.Decoder[Any]) -> Any:
    if not body:
        raise errors.bad_request("invalid_json", "request body is empty; expected a JSON object")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise errors.bad_request("invalid_field", f"invalid request body: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise errors.bad_request("invalid_json", f"request body is not valid JSON: {exc}") from None


def _decode_put(body: bytes) -> tuple[RankPut, dict[str, Any]]:
    raw = _decode(body, _ANY_DECODER)
    if not isinstance(raw, dict):
        raise errors.bad_request("invalid_json", "request body must be a JSON object")
    try:
        put = msgspec.convert(raw, RankPut, strict=True)
    except msgspec.ValidationError as exc:
        raise errors.bad_request("invalid_field", f"invalid registration: {exc}") from None
    extra = {k: v for k, v in raw.items() if k not in RANK_PUT_FIELDS}
    if extra and len(_ENCODER.encode(extra)) > MAX_EXTRA_BYTES:
        raise errors.bad_request(
            "extra_fields_too_large", f"unknown fields {sorted(extra)[:8]} exceed {MAX_EXTRA_BYTES} bytes in all"
        )
    return put, extra


def _parse_rank(name: str, value: str | None) -> int:
    if not value:
        raise errors.bad_request(
            "missing_parameter",
            f"missing query parameter {name!r}; GET /route needs prefill_dp_rank, prefill_cp_rank, "
            "target_tp_rank and target_pp_rank (all -1 for the topology)",
        )
    digits = value[1:] if value.startswith("-") else value
    # (not int()'s spaces, underscores and other scripts' digits; nor more digits than a rank has)
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 9):
        raise errors.bad_request("invalid_parameter", f"query parameter {name}={value!r} is not an integer")
    return int(value)


def build_routes(state: RegistryState) -> list[Route]:
    registry, rooms = state.registry, state.rooms

    @_api
    async def put_route(request: Request) -> Response:
        put, extra = _decode_put(await request.body())
        replacements = registry.num_replacements
        instance, is_new = registry.register(put, extra, time.monotonic())
        if registry.num_replacements != replacements:
            logger.warning("rank %s of %r moved to %s:%s (a restart elsewhere, or two prefills sharing one "
                           "instance id)", key_of(put), instance.instance_id, put.rank_ip, put.rank_port)
        if is_new:
            logger.info(
                "registered rank dp=%s cp=%s tp=%s pp=%s of %r at %s:%s (%d/%d)",
                put.attn_dp_rank if put.system_dp_size == 1 else put.system_dp_rank,
                put.attn_cp_rank,
                put.attn_tp_rank,
                put.pp_rank,
                instance.instance_id,
                put.rank_ip,
                put.rank_port,
                len(instance.entries),
                instance.topology.num_ranks,
            )
        if put.draining:  # (the confirmation a draining registrar looks for: a registry that ignores it says OK)
            return _json({"draining": True})
        return _ok()

    @_api
    async def delete_route(request: Request) -> Response:
        put, extra = _decode_put(await request.body())
        return _json({"deregistered": registry.deregister(put, time.monotonic(), extra)})

    @_api
    async def get_route(request: Request) -> Response:
        query = request.query_params
        dp, cp, tp, pp = (_parse_rank(name, query.get(name)) for name in _ROUTE_QUERY)
        instance = registry.find_instance(query.get("instance_id"), time.monotonic())
        if dp == cp == tp == pp == -1:
            return _json(registry.topology(instance))
        if min(dp, cp, tp, pp) < 0:
            raise errors.bad_request(
                "invalid_parameter",
                f"ranks must all be -1 (topology) or all >= 0, got prefill_dp_rank={dp} "
                f"prefill_cp_rank={cp} target_tp_rank={tp} target_pp_rank={pp}",
            )
        return _json(registry.lookup(instance, (dp, cp, tp, pp)))

    @_api
    async def register_dp_rank(request: Request) -> Response:
        msg: RegisterDpRank = _decode(await request.body(), _REGISTER_DP_DECODER)
        rooms.register(msg.bootstrap_room, msg.dp_rank, time.monotonic())
        return _ok()

    @_api
    async def query_dp_ranks(request: Request) -> Response:
        msg: QueryDpRanks = _decode(await request.body(), _QUERY_DP_DECODER)
        return _json(rooms.query(msg.bootstrap_rooms, time.monotonic()))

    async def health(request: Request) -> Response:
        return _ok()

    async def instances(request: Request) -> Response:
        now = time.monotonic()
        registry.sweep(now)
        return _json(
            {
                "instances": [_describe(inst, now) for _, inst in sorted(registry.instances.items())],
                "num_rooms": len(rooms),
                "ttl_s": state.config.ttl_s,
            }
        )

    async def metrics(request: Request) -> Response:
        state.sweep()
        return Response(state.metrics.render(), 200, media_type=CONTENT_TYPE_LATEST)

    return [
        Route("/route", put_route, methods=["PUT"]),
        Route("/route", get_route, methods=["GET"]),
        Route("/route", delete_route, methods=["DELETE"]),
        Route("/register_dp_rank", register_dp_rank, methods=["POST"]),
        Route("/query_dp_ranks", query_dp_ranks, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/instances", instances, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def _describe(instance: Instance, now: float) -> dict[str, Any]:
    ranks = []
    for (dp, cp, tp, pp), entry in sorted(instance.entries.items()):
        ranks.append(
            {
                "prefill_dp_rank": dp,
                "prefill_cp_rank": cp,
                "target_tp_rank": tp,
                "target_pp_rank": pp,
                "rank_ip": entry.address.rank_ip,
                "rank_port": entry.address.rank_port,
                "registered_unix": entry.registered_unix,
                "age_s": round(now - entry.first_seen, 3),
                "last_seen_s_ago": round(now - entry.last_seen, 3),
                "expires_in_s": None if math.isinf(entry.expires_at) else round(entry.expires_at - now, 3),
                "num_puts": entry.num_puts,
                "draining": entry.draining,
                "extra": entry.extra,
            }
        )
    return {
        "instance_id": instance.instance_id,
        "ready": instance.is_ready,
        "draining": instance.is_draining,  # leaving: still looked up for the rooms it holds, route nothing new to it
        "num_ranks": len(instance.entries),
        "num_expected_ranks": instance.topology.num_ranks,
        "topology": instance.topology,
        "ranks": ranks,
    }


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    code = {404: "unknown_route", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return Response(
        errors.ApiError(exc.status_code, kind, code, message).body(),
        exc.status_code,
        media_type=_JSON,
        headers=exc.headers,
    )


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(errors.ApiError(500, "server_error", "internal_error", "internal error in the bootstrap registry"))


def create_app(config: BootstrapConfig | None = None) -> Starlette:
    """Build the registry app for ``config`` (defaults when None); serve it with uvicorn."""
    config = config or BootstrapConfig()
    state = RegistryState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(_sweep_forever(state), name="bootstrap-sweeper")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = Starlette(
        routes=build_routes(state),
        middleware=[
            Middleware(
                RegistryMiddleware,
                stats=state.metrics.stats,
                token=config.token,
                token_scope=config.token_scope,
                max_body_bytes=config.max_body_bytes,
                body_timeout_s=config.body_timeout_s,
            )
        ],
        exception_handlers={HTTPException: _http_exception, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.registry_state = state
    return app


async def _sweep_forever(state: RegistryState) -> None:
    while True:
        await asyncio.sleep(state.config.sweep_interval_s)
        try:
            state.sweep()
        except Exception:  # a sweep bug must not kill the registry; log and keep serving
            logger.exception("sweep failed")


def guarded_http() -> type:
    """uvicorn's httptools protocol with the gateway's limits on a client's request head (size, time) and on
    a body left unread: the registry checks its token only once a request is read, so an unauthenticated
    peer must not make it buffer a head of any size or hold a connection open for ever."""
    from gateway.http_protocol import ClientLimits, protocol_class

    return protocol_class(ClientLimits())
