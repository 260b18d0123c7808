"""The worker admin API (behind ``--admin-api-key`` when one is set).

- ``GET /workers``: every worker with role, health, breaker and load.
- ``POST /workers`` with ``{"url": "pd://HOST:PORT", "role": "prefill|decode|both"}``: start routing
  to it (201; it is selectable once connected and passing probes). An SGLang worker: ``{"url":
  "http://HOST:PORT", "role": "prefill|decode", "bootstrap_port": N}`` (a prefill's, absent for none),
  on a gateway started with SGLang workers (it relays their routes).
- ``DELETE /workers?url=...``: drain it (202): no new requests, open ones finish (up to
  ``--drain-timeout-s``), then the connection closes and it disappears from the list.
- SGLang router's names as aliases: ``GET /list_workers`` (its ``{"urls": [...]}``, ``workers`` too),
  ``POST /add_worker?url=...&role=...`` (or its ``worker_type=regular|prefill|decode``; ``bootstrap_port=N``
  for an SGLang prefill),
  ``POST /remove_worker?url=...``.
Errors are OpenAI-shaped JSON: 400 for a bad URL or role, 404 for an unknown worker, 409 when the
worker is already there, 413 for a body over ``MAX_BODY_BYTES`` (it is never buffered whole).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api import decode_body
from gateway.errors import APIError, BadRequest, NotFound
from gateway.responder import ClientGone, read_body
from gateway.runtime import ROLES
from gateway.sglang_fleet import AlreadyThere, check_http_url, is_http_url

if TYPE_CHECKING:
    from gateway.runtime import Gateway

_json = msgspec.json.Encoder()


class Conflict(APIError):
    status = 409
    type = "invalid_request_error"


MAX_BODY_BYTES = 16 * 1024
MAX_URL_CHARS = 2048


class NewWorker(msgspec.Struct, forbid_unknown_fields=True):
    url: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_URL_CHARS,
                                     description="pd://HOST:PORT, or http://HOST:PORT for an SGLang worker")]
    role: Annotated[str, msgspec.Meta(extra_json_schema={"enum": ["prefill", "decode", "both"]})]  # checked by add
    bootstrap_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None  # an SGLang prefill's


def admin_routes(gw: Gateway, describe: Callable[[Any], dict[str, Any]]) -> list[Route]:
    def reply(body: Any, status: int = 200) -> Response:
        return Response(_json.encode(body), status_code=status, media_type="application/json")

    def guarded(fn: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            try:
                return await fn(request)
            except APIError as exc:
                return exc.to_response()
            except ClientGone:
                return Response(status_code=499)  # nobody reads it: the client left while sending its body

        return endpoint

    def add(url: str | None, role: str | None, bootstrap_port: int | None = None) -> Response:
        if not url or not role:
            raise BadRequest("give the worker's url and role", param="url" if not url else "role")
        if is_http_url(url):
            return reply(describe(add_sglang(url, role, bootstrap_port)), 201)
        if bootstrap_port is not None:
            raise BadRequest("bootstrap_port is for SGLang (http://) prefills; ours tell theirs themselves",
                             param="bootstrap_port")
        if role not in ROLES:
            raise BadRequest(f"role must be one of {', '.join(ROLES)}, got {role!r}", param="role")
        existing = gw.find(url)
        if existing is not None:
            why = "is being removed; add it again once it is gone" if existing.is_draining else "is already configured"
            raise Conflict(f"worker {url} {why}", param="url")
        try:
            client = gw.add_worker(url, role)
        except ValueError as exc:
            message = str(exc)  # (a bad URL, one of a kind this gateway does not serve, or a role that does not fit)
            raise BadRequest(message, param="role" if message.startswith(("role ", "this gateway runs ")) else "url") \
                from None
        return reply(describe(client), 201)

    def add_sglang(url: str, role: str, bootstrap_port: int | None) -> Any:
        try:
            check_http_url(url)  # (first: a URL of no worker is the answer on a gateway of either kind)
        except ValueError as exc:
            raise BadRequest(str(exc), param="url") from None
        fleet = gw.fleet
        if fleet is None:
            raise BadRequest("this gateway serves native (pd://) workers; it takes SGLang (http://) workers when "
                             "started with one", param="url")
        try:
            return fleet.add(url, role, bootstrap_port)
        except AlreadyThere as exc:
            raise Conflict(str(exc), param="url") from None
        except ValueError as exc:
            message = str(exc)
            raise BadRequest(message, param="role" if "role" in message else
                             "bootstrap_port" if "bootstrap_port" in message else "url") from None

    def remove(url: str | None) -> Response:
        if not url:
            raise BadRequest("give the worker's url as ?url=...", param="url")
        if gw.fleet is not None and gw.fleet.find(url) is not None:
            return reply(describe(gw.fleet.remove(url, gw.config.drain_timeout_s)), 202)
        try:
            client = gw.remove_worker(url)
        except KeyError:
            raise NotFound(f"no worker {url}", param="url") from None
        return reply(describe(client), 202)

    def listed() -> list[Any]:
        return [*gw.clients, *(gw.fleet.workers if gw.fleet else ())]

    async def list_workers(_: Request) -> Response:
        return reply({"workers": [describe(c) for c in listed()]})

    async def list_alias(_: Request) -> Response:
        # SGLang's router answers {"urls": [...]}: tools written against it read that key
        workers = listed()
        return reply({"urls": [c.url for c in workers], "workers": [describe(c) for c in workers]})

    async def post_worker(request: Request) -> Response:
        raw = await read_body(request.scope, request.receive, MAX_BODY_BYTES, gw.body_timeout_s)
        body: NewWorker = decode_body(raw, NewWorker)
        return add(body.url, body.role, body.bootstrap_port)

    async def delete_worker(request: Request) -> Response:
        return remove(request.query_params.get("url"))

    async def add_alias(request: Request) -> Response:
        query = request.query_params
        worker_type = query.get("worker_type")  # (SGLang's router's name for the role: regular|prefill|decode)
        role = query.get("role") or ("both" if worker_type == "regular" else worker_type) or \
            ("both" if gw.is_combined else None)
        port = query.get("bootstrap_port")
        number = port is not None and port.isascii() and port.isdigit() and len(port) <= 5
        if port is not None and port.lower() != "none" and not (number and 1 <= int(port) <= 65535):
            raise BadRequest(f"bootstrap_port must be a port number, got {port!r}", param="bootstrap_port")
        return add(query.get("url"), role, int(port) if port is not None and number else None)

    async def remove_alias(request: Request) -> Response:
        return remove(request.query_params.get("url"))

    by_method = {"GET": list_workers, "POST": post_worker, "DELETE": delete_worker}

    async def workers(request: Request) -> Response:  # one route, so that a 405 lists every method in Allow
        return await by_method[request.method if request.method != "HEAD" else "GET"](request)

    return [
        Route("/workers", guarded(workers), methods=list(by_method)),
        Route("/list_workers", guarded(list_alias), methods=["GET"]),
        Route("/add_worker", guarded(add_alias), methods=["POST"]),
        Route("/remove_worker", guarded(remove_alias), methods=["POST"]),
    ]
