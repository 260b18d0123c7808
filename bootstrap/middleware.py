"""Pure ASGI middleware in front of the registry app: metrics, bearer token, body size limit.

Per HTTP request, in order:
1. The route label and start time are taken; ``send`` is wrapped to capture the status.
2. The bearer token is checked (``token_scope="all"``: every route but ``/health``;
   ``"writes"``: only the routes that change state). Failure: 401, the app never runs.
3. A declared ``Content-Length`` above the limit is refused (413) before reading; otherwise the
   body is read here, up to the limit (413 past it, also for chunked bodies), and replayed to the
   app as one message, so handlers never see more than ``max_body_bytes``. A client that leaves
   before its body is complete is recorded as 499; the app never runs for it. A body that has not all
   arrived within ``body_timeout_s`` is a 408 and the connection closes (the HTTP protocol bounds only the
   head's time: a client trickling a body would otherwise hold its connection, and a file descriptor of the
   registry, or of the prefill embedding it, for ever).
4. When the response is done, (method, route, status, seconds) goes to ``RequestStats``.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from bootstrap import errors
from bootstrap.metrics import RequestStats

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

KNOWN_ROUTES = frozenset({"/route", "/register_dp_rank", "/query_dp_ranks", "/health", "/instances", "/metrics"})
WRITE_ROUTES = frozenset({("PUT", "/route"), ("DELETE", "/route"), ("POST", "/register_dp_rank")})
OPEN_ROUTES = frozenset({"/health"})
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
_JSON_HEADERS = [(b"content-type", b"application/json"), (b"cache-control", b"no-store")]
CLIENT_GONE = errors.ApiError(499, "invalid_request_error", "client_closed_request",
                              "the client closed the connection while sending its body")


class RegistryMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        stats: RequestStats,
        token: str | None,
        token_scope: str,
        max_body_bytes: int,
        body_timeout_s: float = 60.0,
    ) -> None:
        self.app = app
        self.stats = stats
        self.expected_auth = f"Bearer {token}".encode() if token else None
        self.token_scope = token_scope
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        method: str = scope["method"]
        path: str = scope["path"]
        route = path if path in KNOWN_ROUTES else "other"  # bounded label sets
        method_label = method if method in _METHODS else "OTHER"
        status = 500

        async def send_capturing(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            error = self._check_auth(scope, method, path)
            if error is None:
                receive, error = await self._limit_body(scope, method, receive)
            if error is CLIENT_GONE:
                status = 499  # nobody to answer
            elif error is not None:
                await _send_error(send_capturing, error)
            else:
                await self.app(scope, receive, send_capturing)
        finally:
            self.stats.observe(method_label, route, status, time.perf_counter() - start)

    def _check_auth(self, scope: Scope, method: str, path: str) -> errors.ApiError | None:
        if self.expected_auth is None or path in OPEN_ROUTES:
            return None
        if self.token_scope == "writes" and (method, path) not in WRITE_ROUTES:
            return None
        for name, value in scope["headers"]:
            if name == b"authorization":
                if _auth_matches(value, self.expected_auth):
                    return None
                return errors.unauthorized("invalid bearer token")
        return errors.unauthorized("missing 'Authorization: Bearer <token>' header")

    async def _limit_body(self, scope: Scope, method: str, receive: Receive) -> tuple[Receive, errors.ApiError | None]:
        declared: int | None = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return receive, errors.bad_request("invalid_header", "Content-Length is not an integer")
            elif name == b"transfer-encoding":
                chunked = True
        if declared is None and not chunked:
            return receive, None  # no body (a bodiless GET: nothing to buffer)
        limit = self.max_body_bytes
        if declared is not None and declared > limit:
            return receive, errors.too_large(limit)
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return receive, CLIENT_GONE
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        return receive, errors.too_large(limit)
                    parts.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return receive, errors.body_timeout(self.body_timeout_s)
        return _replay(b"".join(parts), receive), None


def _auth_matches(value: bytes, expected: bytes) -> bool:
    scheme, _, token = value.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(b"Bearer " + token.strip(), expected)


def _replay(body: bytes, original: Receive) -> Receive:
    """A ``receive`` that yields the buffered body once, then defers to the server's."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await original()

    return receive


async def _send_error(send: Send, error: errors.ApiError) -> None:
    body = error.body()
    headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    elif error.status == 408:  # (the rest of the body may still come: not to be read as a next request)
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
