"""Pure ASGI middleware in front of the gateway's routes (outermost first):

1. ``RequestContextMiddleware``: takes ``x-request-id`` from the client (or makes one), echoes it
   on the response, and sets the request's context (``gateway.context``) so the dispatcher passes
   it to the workers and every log line about the request carries it.
2. ``GatekeeperMiddleware``: while the gateway drains, new requests get 503 with
   ``Connection: close``; then API keys: the client API (``/v1/*``, ``/generate``) needs one of
   the client keys, the admin API (``/workers`` and SGLang's aliases) one of the admin keys,
   ``/metrics`` the admin key only if so configured; ``/health`` and ``/readiness`` are open.
   Keys are compared in constant time and never logged. Errors are OpenAI-shaped JSON.
The generation routes' own cycle (``gateway/hot_cycle.py``) applies the same two: ``request_id_of``
and ``GatekeeperMiddleware.refusal``.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Sequence

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.context import REQUEST_ID, REQUEST_T0, random_hex

ADMIN_PATHS = ("/workers", "/add_worker", "/remove_worker", "/list_workers")
OPEN_PATHS = ("/health", "/readiness")
# set in the scope of an open path's request without a valid key on a gateway with keys: its status alone
BRIEF_STATUS = "pd_gateway.brief_status"
_json = msgspec.json.Encoder()
MAX_REQUEST_ID_LEN = 128
# The paths ``GatekeeperMiddleware.refusal`` tells apart; any other is the client API's (the generation routes')
_SPECIAL_PATHS = frozenset((*OPEN_PATHS, *ADMIN_PATHS, "/metrics"))
Headers = list[tuple[bytes, bytes]]


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope["headers"])
        REQUEST_ID.set(request_id)
        REQUEST_T0.set(time.monotonic())
        raw_id = request_id.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", raw_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


class GatekeeperMiddleware:
    def __init__(self, app: ASGIApp, *, api_keys: Sequence[str], admin_api_keys: Sequence[str],
                 metrics_require_admin: bool, is_draining: Callable[[], bool],
                 on_refused: Callable[[str], None] | None = None, admin_off: str | None = None) -> None:
        """``admin_off``: why the admin API answers nothing but 403 (a gateway reachable from other hosts with
        no key to guard it: anyone could add a "worker" of theirs, receive the clients' prompts and the
        workers' key); None: served."""
        self.app = app
        self.admin_off = admin_off
        self.on_refused = on_refused  # told "draining" or "unauthorized" for each refusal (metrics)
        self.api_keys = [k.encode() for k in api_keys]
        # Without admin keys, a gateway with client keys guards its admin API with them: never open by
        # surprise (anyone could otherwise add a "worker" of theirs and receive the clients' prompts).
        self.admin_api_keys = [k.encode() for k in admin_api_keys] or self.api_keys
        # what lets a request see the open probes' whole status (the workers): any key; none: no keys set
        self.status_keys = list(dict.fromkeys(self.api_keys + self.admin_api_keys))
        self.metrics_require_admin = metrics_require_admin
        self.is_draining = is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] in OPEN_PATHS:  # (probes need no key; the fleet's addresses and errors do)
            if self.status_keys and not _key_ok(bearer_key(scope["headers"]), self.status_keys):
                scope[BRIEF_STATUS] = True
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope["path"], scope["headers"])
        if refusal is not None:
            await _send_refusal(send, refusal)
            return
        await self.app(scope, receive, send)

    def refusal(self, path: str, headers: Headers) -> tuple[int, bytes, Headers] | None:
        """(status, JSON body, extra headers) refusing this request, or None to let it through."""
        if path not in _SPECIAL_PATHS:  # the client API (every generation request): the checks below that apply
            if self.is_draining():
                self._refused("draining")
                return _error(503, "the gateway is shutting down", "service_unavailable", None,
                              [(b"connection", b"close"), (b"retry-after", b"1")])
            keys = self.api_keys
            if keys and not _key_ok(bearer_key(headers), keys):
                self._refused("unauthorized")
                return _error(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                              "invalid_request_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return None
        if path in OPEN_PATHS:
            return None
        if self.is_draining() and path != "/metrics":  # (scraped on while open requests finish)
            self._refused("draining")
            return _error(503, "the gateway is shutting down", "service_unavailable", None,
                          [(b"connection", b"close"), (b"retry-after", b"1")])
        if self.admin_off is not None and path in ADMIN_PATHS:
            self._refused("unauthorized")
            return _error(403, f"the admin API is off: {self.admin_off}", "permission_error", "admin_api_off", [])
        if path in ADMIN_PATHS or (path == "/metrics" and self.metrics_require_admin):
            keys, what = self.admin_api_keys, "admin"
        elif path == "/metrics":
            keys, what = [], ""
        else:
            keys, what = self.api_keys, "API"
        if keys and not _key_ok(bearer_key(headers), keys):
            self._refused("unauthorized")
            return _error(401, f"Incorrect or missing {what} key: send 'Authorization: Bearer <key>'",
                          "invalid_request_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        return None

    def _refused(self, reason: str) -> None:
        if self.on_refused is not None:
            self.on_refused(reason)


def request_id_of(headers: Headers) -> str:
    """The client's ``x-request-id`` if it is usable (printable ASCII, at most 128 characters), else a new one."""
    request_id = header_text(headers, b"x-request-id")
    if (not request_id or len(request_id) > MAX_REQUEST_ID_LEN or not request_id.isascii()
            or not request_id.isprintable()):
        request_id = random_hex()
    return request_id


def request_id_from(value: bytes) -> str:
    """``request_id_of`` for the value of the request's first ``x-request-id`` header."""
    request_id = value.decode("latin-1")
    if (not request_id or len(request_id) > MAX_REQUEST_ID_LEN or not request_id.isascii()
            or not request_id.isprintable()):
        request_id = random_hex()
    return request_id


def header_text(headers: Headers, name: bytes) -> str:
    """The first value of header ``name`` (lower case, as the server gives names), or ""."""
    for key, value in headers:
        if key == name:
            return str(value.decode("latin-1"))
    return ""


def bearer_key(headers: Headers) -> bytes:
    """The key of an ``Authorization: Bearer KEY`` header (b"": none)."""
    value = header_text(headers, b"authorization")
    scheme, _, token = value.partition(" ")
    # (only HTTP's white space: ``str.strip`` on the latin-1 text would also take 0x85 and 0xa0, bytes that end UTF-8
    # characters, off a key such as "voilà")
    return token.strip(" \t").encode("latin-1") if scheme.lower() == "bearer" else b""


def _key_ok(given: bytes, keys: Sequence[bytes]) -> bool:
    ok = False
    for key in keys:  # no early exit: the time taken does not say which key came close
        ok |= hmac.compare_digest(given, key)
    return bool(given) and ok


def _error(status: int, message: str, kind: str, code: str | None,
           headers: Headers) -> tuple[int, bytes, Headers]:
    return status, _json.encode({"error": {"message": message, "type": kind, "param": None, "code": code}}), headers


class KeyGuardMiddleware:
    """A worker's HTTP side with ``--api-key``: every request but ``open_paths`` (its health probes) needs
    ``Authorization: Bearer KEY``, else a 401 of the gateway's shape; an open path's request without it is marked
    ``BRIEF_STATUS`` (as the gateway's ``GatekeeperMiddleware`` marks it): told no error details."""

    def __init__(self, app: ASGIApp, key: str, open_paths: frozenset[str]) -> None:
        self.app, self.keys, self.open_paths = app, [key.encode()], open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not _key_ok(bearer_key(scope["headers"]), self.keys):
            if scope["path"] in self.open_paths:
                scope[BRIEF_STATUS] = True
                await self.app(scope, receive, send)
                return
            await _send_refusal(send, _error(401, "Incorrect or missing key: send 'Authorization: Bearer <key>' (the "
                                             "worker's --api-key)", "invalid_request_error", "invalid_api_key",
                                             [(b"www-authenticate", b"Bearer")]))
            return
        await self.app(scope, receive, send)


async def _send_refusal(send: Send, refusal: tuple[int, bytes, Headers]) -> None:
    status, body, headers = refusal
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
