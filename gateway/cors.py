"""Cross-origin requests from browser pages (CORS): off unless ``--cors-allow-origin`` names origins.

A page served from another origin (a browser chat UI on ``https://chat.example.com`` calling the gateway
directly) is allowed to read the gateway's answers only when they carry ``Access-Control-Allow-Origin``
for it; a request with an ``Authorization`` or JSON ``Content-Type`` header is first asked about in a
preflight ``OPTIONS`` (with ``Origin`` and ``Access-Control-Request-Method``), which browsers send without
credentials. So, with origins configured:

1. A preflight from an allowed origin is answered here, before the drain and API-key checks (it carries
   no key): 204 with the methods, the headers the page asked for, and how long the answer may be cached.
   From another origin: a 403 (the browser then refuses the call). An ``OPTIONS`` that is not a preflight
   goes on to the routes (a 405, as without CORS).
2. Every other response to a request whose ``Origin`` is allowed carries ``Access-Control-Allow-Origin``
   (the origin itself, with ``Vary: Origin``; or ``*`` when every origin is allowed) and exposes
   ``x-request-id``, ``retry-after`` and ``x-should-retry``: error answers included, so a page can read why
   it was refused.
   Requests from other origins are served as before, without the header (a browser hides the answer
   from the page; a non-browser client never sends ``Origin`` or ignores it). Every answer (with origins
   configured) carries ``Vary: Origin``, since it depends on the request's ``Origin``: a shared cache must not
   give the answer to one origin (or to a request without one) to another.

No credentials mode (``Access-Control-Allow-Credentials``): the gateway uses no cookies; a page sends its
key in ``Authorization`` itself. The generation routes' own cycle (``gateway/hot_cycle.py``) adds the same
headers (``CorsPolicy.head``); everything else goes through ``CorsMiddleware``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.middleware import header_text

Headers = list[tuple[bytes, bytes]]
ALLOW_METHODS = b"GET, POST, DELETE, OPTIONS"
EXPOSE_HEADERS = b"x-request-id, retry-after, x-should-retry"  # (the last: OpenAI's SDKs read it)
MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer
# A scheme, a host and an optional port, nothing else: what a browser sends as ``Origin``.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(?:\[[0-9a-f:.]+\]|[^\s/?#@:\[\]]+)(:\d{1,5})?")
# ``Access-Control-Request-Headers``: header names separated by commas (echoed only when it is that).
_HEADER_LIST = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+(\s*,\s*[!#$%&'*+.^_`|~0-9A-Za-z-]+)*")
MAX_REQUEST_HEADERS_LEN = 1024
_VARY_ORIGIN = (b"vary", b"Origin")
_json = msgspec.json.Encoder()


def check_origins(origins: Sequence[str]) -> None:
    """``ValueError`` unless each is ``*`` or an origin (``https://host[:port]``: no path, no trailing slash)."""
    for origin in origins:
        match = _ORIGIN.fullmatch(origin.lower()) if origin != "*" else None
        if origin != "*" and (match is None or (match[1] is not None and int(match[1][1:]) > 65535)):
            raise ValueError(f"cors_allow_origin: {origin!r} is not an origin (scheme://host[:port], no path) nor '*'")


class CorsPolicy:
    """Which origins may read the gateway's answers, and the headers that say so."""

    def __init__(self, origins: Sequence[str]) -> None:
        check_origins(origins)
        self.any_origin = "*" in origins
        self.origins = frozenset(o.lower().encode("latin-1") for o in origins if o != "*")

    def allows(self, origin: bytes) -> bool:
        return bool(origin) and (self.any_origin or origin.lower() in self.origins)

    def response_headers(self, headers: Headers) -> Headers:
        """The CORS headers an answer to a request with these headers gets (none: not a cross-origin request
        from an allowed origin)."""
        origin = _value(headers, b"origin")
        if not self.allows(origin):
            return []
        if self.any_origin:
            return [(b"access-control-allow-origin", b"*"), (b"access-control-expose-headers", EXPOSE_HEADERS)]
        return [(b"access-control-allow-origin", origin), (b"access-control-expose-headers", EXPOSE_HEADERS),
                _VARY_ORIGIN]

    def answer_headers(self, headers: Headers) -> Headers:
        """``response_headers`` and ``Vary: Origin`` in any case: every answer depends on the request's ``Origin``
        (allowed, another, none), so a shared cache must not give one's answer to another (the Fetch standard,
        "CORS protocol and HTTP caches": ``Vary: Origin`` on non-CORS answers as well)."""
        extra = self.response_headers(headers)
        return extra if _VARY_ORIGIN in extra else [*extra, _VARY_ORIGIN]

    def head(self, headers: Headers) -> bytes:
        """``answer_headers`` as header lines of a response head."""
        return b"".join(b"%s: %s\r\n" % pair for pair in self.answer_headers(headers))

    def preflight(self, headers: Headers) -> tuple[int, bytes, Headers] | None:
        """(status, body, headers) answering a preflight ``OPTIONS``; None: not a preflight."""
        origin = _value(headers, b"origin")
        if not origin or not header_text(headers, b"access-control-request-method"):
            return None
        if not self.allows(origin):
            body = _json.encode({"error": {"message": f"the origin {origin.decode('latin-1')!r} is not allowed "
                                                      "(--cors-allow-origin)", "type": "permission_error",
                                           "param": None, "code": "cors_origin_not_allowed"}})
            return 403, body, [(b"content-type", b"application/json"), _VARY_ORIGIN]
        answer = [*self.answer_headers(headers), (b"access-control-allow-methods", ALLOW_METHODS),
                  (b"access-control-max-age", b"%d" % MAX_AGE_S)]
        asked = _value(headers, b"access-control-request-headers").strip()
        if asked and len(asked) <= MAX_REQUEST_HEADERS_LEN and _HEADER_LIST.fullmatch(asked):
            answer += [(b"access-control-allow-headers", asked), (b"vary", b"Access-Control-Request-Headers")]
        return 204, b"", answer


class CorsMiddleware:
    """Outermost ASGI middleware applying a ``CorsPolicy`` (see the module doc)."""

    def __init__(self, app: ASGIApp, policy: CorsPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if scope["method"] == "OPTIONS":
            answer = self.policy.preflight(headers)
            if answer is not None:
                status, body, extra = answer
                await send({"type": "http.response.start", "status": status,
                            "headers": [*extra, (b"content-length", b"%d" % len(body))]})
                await send({"type": "http.response.body", "body": body})
                return
        extra = self.policy.answer_headers(headers)

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _value(headers: Headers, name: bytes) -> bytes:
    return header_text(headers, name).encode("latin-1")  # (latin-1: the bytes as sent)
