"""The generation routes' own request cycle on the HTTP connection: no ASGI, no middleware stack.

``/v1/chat/completions``, ``/v1/completions`` and ``/generate`` carry all the traffic, so their ``POST``s
skip uvicorn's ASGI request cycle, the middleware and (on native workers) ``send``'s message dicts (the
SGLang relay, ``gateway.sglang_relay``, writes ASGI messages: the cycle's ``send`` takes them as
uvicorn's does): the connection's protocol
(``gateway.http_protocol.GuardedHttpProtocol``) gives such a request a ``HotCycle`` in place of
uvicorn's ``RequestResponseCycle``, and the cycle is the route's ``Responder``'s ``Exchange``.
Lifecycle of one request (event loop only):
1. The protocol, at the end of the request head, asks ``HotRoutes.cycle(...)`` for the request
   target and makes the cycle. The body is collected by the protocol's ``on_body``. When the whole body of a
   stream arrives in the read that ends the head, the cycle starts in that callback
   (``gateway.eager``: up to its first wait, normally the workers' first answer, before a task
   exists); otherwise it starts as a task; a cycle behind a response still going out on the
   connection is queued and started after it (pipelining, as uvicorn does).
2. ``run_asgi`` (the name the protocol starts cycles by): the request id (``x-request-id``, checked
   as ``RequestContextMiddleware`` does) and arrival time go into the request's context; the
   gatekeeper's checks (draining: 503; API keys: 401) are the middleware's own
   (``GatekeeperMiddleware.refusal``); then ``Responder.serve(self)``.
3. The responder reads the body (``read_body``: its limits, ``100 Continue``), has the disconnect
   watched (``watch_disconnect``: the protocol's ``connection_lost`` sets ``disconnected`` and
   signals ``message_event``, which cancels the request's task), and writes its answer: whole JSON
   with a content length, or a chunked SSE stream (to an HTTP/1.0 client: unframed, ending with the
   connection). Every write waits while the client's socket is
   full (``flow.drain``; the protocol's write timeout aborts a client that stops reading);
   ``start_now`` and ``write_now`` are the stream's writes from outside the task (``Responder``'s
   direct path; the middle ones gathered per worker frame, ``gateway.write_batch``; the first at
   once), refused while the socket is full so that such chunks queue in order behind the task instead.
4. The response's end calls the protocol's ``on_response_complete`` (keep-alive timer, the next
   pipelined request), or closes the connection when it is not kept alive.
Responses carry uvicorn's default headers (``server``, ``date``) and ``x-request-id``, as the ASGI
path's do, and with ``--cors-allow-origin`` the CORS headers for an allowed origin (``gateway.cors``).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from time import monotonic
from typing import TYPE_CHECKING, Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from gateway import write_batch
from gateway.context import REQUEST_ID, REQUEST_T0, random_hex
from gateway.errors import PayloadTooLarge, RequestTimeout
from gateway.middleware import GatekeeperMiddleware, request_id_from
from gateway.responder import SSE_HEADERS, ClientGone, Responder, check_length

if TYPE_CHECKING:
    from starlette.types import Message

    from gateway.cors import CorsPolicy
    from gateway.http_protocol import GuardedHttpProtocol
    from workers.protocol import StepOutput

log = logging.getLogger(__name__)
Headers = list[tuple[bytes, bytes]]
_JSON_HEAD = b"content-type: application/json\r\n"
_SSE_HEAD_CLOSE = b"".join(b"%s: %s\r\n" % pair for pair in SSE_HEADERS)
_SSE_HEAD = _SSE_HEAD_CLOSE + b"transfer-encoding: chunked\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
# ``_head`` in one formatting step for its most common cases (no header of the caller's, the connection kept
# alive): a whole JSON answer (status line, default headers, CORS headers, content length, request id, body), and
# a chunked stream's start with its first chunk (default headers, CORS headers, request id, first chunk)
_JSON_WHOLE = (b"%b%b%b" + _JSON_HEAD + b"content-length: %d\r\nx-request-id: %b\r\n\r\n%b")
_STREAM_START = (STATUS_LINE[200].replace(b"%", b"%%") + b"%b%b" + _SSE_HEAD.replace(b"%", b"%%")
                 + b"x-request-id: %b\r\n\r\n%x\r\n%b\r\n")
# What a response header given to ``send`` must not hold (it would end the line or the head early): in a name, a
# control character, a separator or a space (RFC 9110's token); in a value, a control character but a tab.
_BAD_NAME = re.compile(rb'[\x00-\x20\x7f()<>@,;:\\"/\[\]?={}]')
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def _noop() -> None:
    pass


_defaults: tuple[Headers | None, bytes] = (None, b"")


def _default_headers(headers: Headers) -> bytes:
    """uvicorn's default headers as bytes (the server renews the list, with its ``date``, once a second)."""
    global _defaults
    if _defaults[0] is not headers:
        _defaults = (headers, b"".join(b"%s: %s\r\n" % pair for pair in headers))
    return _defaults[1]


class HotRoutes:
    """The generation routes that get a ``HotCycle``: path -> responder, behind the gatekeeper's checks."""

    def __init__(self, responders: dict[str, Responder], gatekeeper: GatekeeperMiddleware,
                 cors: CorsPolicy | None = None) -> None:
        self._routes = {path.encode(): (responder, path) for path, responder in responders.items()}
        self.gatekeeper = gatekeeper
        self.cors = cors  # (``--cors-allow-origin``: its headers go on every answer to an allowed origin)

    def cycle(self, url: bytes, protocol: GuardedHttpProtocol, headers: Headers, keep_alive: bool,
              expect_100_continue: bool, chunked: bool) -> HotCycle | None:
        """The cycle of a request to a generation route, None for any other: ``url``, the request target as the
        parser gave it (its path is parsed only when the URL is not itself a route's path: one with a query string,
        an absolute URL; a malformed one raises, as ``httptools.parse_url`` does). ``chunked``: the client reads
        chunked bodies (HTTP/1.1); an HTTP/1.0 client's stream is sent as it is and ends when the connection closes
        (its ``keep_alive`` is False)."""
        route = self._routes.get(url)
        if route is None:
            route = self._routes.get(httptools.parse_url(url).path)
            if route is None:
                return None
        cycle = HotCycle(protocol, route[0], self.gatekeeper, route[1], headers, keep_alive, expect_100_continue,
                         chunked)
        if self.cors is not None:
            cycle.cors_head = self.cors.head(headers)
        return cycle


class _Signal:
    """``message_event`` as the protocol uses it (``set()`` on body, end of body, disconnect) once the cycle is
    finished (``_SETTLED``): nothing is waiting on it any more. Until then a cycle is its own ``message_event``
    (``HotCycle.set``): it refers to itself, and ``run_asgi`` swaps it for ``_SETTLED`` when it returns, so
    that a finished cycle is freed by reference counting, not left to the garbage collector.
    """

    __slots__ = ("cycle",)

    def __init__(self, cycle: HotCycle | None) -> None:
        self.cycle = cycle

    def set(self) -> None:
        if self.cycle is not None:
            self.cycle.signalled()


_SETTLED = _Signal(None)  # a finished cycle's ``message_event``: nothing is waiting on it any more


class HotCycle:
    """One request to a generation route, answered on the connection's transport (see the module doc)."""

    # What every cycle starts with, as class attributes: set on a cycle only when it changes (one request's
    # cycle is made per request: no __slots__, so that these cost nothing to set up)
    cors_head = b""  # (``HotRoutes.cycle``: CORS headers for an allowed origin)
    disconnected = False
    refused = 0  # the status the protocol answered this request with itself (its body unreadable)
    more_body = True
    response_started = False
    response_complete = False
    request_id = b""
    _waiter: asyncio.Future[None] | None = None
    _watch: list[bool] | None = None  # (``watch_disconnect``) set to [True] when the client leaves
    task: asyncio.Task[None] | None = None  # the task answering (``GuardedHttpProtocol`` sets it)
    # (``run_asgi``) the request's headers by name, the first of each (None before it runs)
    fields: dict[bytes, bytes] | None = None
    framed: bool  # (set by ``send``'s head: it declared a content-length, the body goes as it is)
    message_event: HotCycle | _Signal

    def __init__(self, protocol: GuardedHttpProtocol, responder: Responder, gatekeeper: GatekeeperMiddleware,
                 path: str, headers: Headers, keep_alive: bool, expect_100_continue: bool,
                 chunked: bool = True) -> None:
        self.transport = protocol.transport
        self.loop = protocol.loop
        self.flow = protocol.flow
        default_headers = protocol.server_state.default_headers
        self.default_headers = _defaults[1] if _defaults[0] is default_headers else _default_headers(default_headers)
        self.on_response = protocol.on_response_complete
        self.responder = responder
        self.gatekeeper = gatekeeper
        self.path = path
        self.headers = headers
        self.keep_alive = keep_alive
        self.chunked = chunked
        self.waiting_for_100_continue = expect_100_continue
        self.t0 = monotonic()
        self.message_event = self  # (``set``; ``_SETTLED`` once finished)
        self.body = bytearray()

    # -- the protocol's side -----------------------------------------------------------------------
    def signalled(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.disconnected and self._watch is not None and not self.response_complete:
            gone = self._watch
            self._watch = None
            gone[0] = True
            if self.task is not None:  # (None only inside its eager first step, which nothing interrupts)
                self.task.cancel()

    set = signalled  # (``message_event.set()``: the cycle is its own ``message_event`` until it finishes)

    async def run_asgi(self, _app: Any) -> None:
        try:
            headers = self.headers
            # Its headers by name, the first value of each (as ``middleware.header_text``, ``check_length`` read
            # them): one dict made in C, read for the request id here and the declared length next (in this step)
            self.fields = fields = dict(reversed(headers))
            given = fields.get(b"x-request-id")
            request_id = random_hex() if given is None else request_id_from(given)
            self.request_id = request_id.encode()
            REQUEST_ID.set(request_id)
            REQUEST_T0.set(self.t0)
            refusal = self.gatekeeper.refusal(self.path, headers)
            if refusal is not None:
                status, body, headers = refusal
                await self.send_json(body, status, headers)
                return
            await self.responder.serve(self)
        except asyncio.CancelledError:  # the server is shutting down past its drain
            if not self.response_complete:
                self.transport.close()
            raise
        except Exception:
            log.exception("exception answering %s", self.path)
            if not self.response_started:
                await self.send_json(b'{"error": {"message": "internal error in the gateway", "type": '
                                     b'"internal_error", "param": null, "code": null}}', 500, [])
            else:
                self.transport.close()
        else:
            if not self.response_complete and not self.disconnected:
                log.error("%s returned without completing its response", self.path)
                self.transport.close()
        finally:
            self.on_response = _noop
            self._watch = None
            self.task = None  # (it refers to this cycle through its coroutine)
            self.message_event = _SETTLED

    # -- Exchange ----------------------------------------------------------------------------------
    def check_length(self, limit: int) -> None:
        fields = self.fields
        if fields is None:  # (not run: a caller of its own)
            check_length(self.headers, limit)
            return
        value = fields.get(b"content-length")  # (``responder.check_length``'s test, on the first one)
        if value is not None and value.isdigit() and int(value) > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")

    async def read_body(self, limit: int, timeout_s: float) -> bytes:  # (the declared length: ``check_length``)
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if self.more_body and not self.disconnected:
            try:
                async with asyncio.timeout(timeout_s):
                    while self.more_body and not self.disconnected and len(self.body) <= limit:
                        self.flow.resume_reading()
                        self._waiter = self.loop.create_future()
                        try:
                            await self._waiter
                        finally:
                            self._waiter = None
            except TimeoutError:
                raise RequestTimeout(f"the request body did not arrive within {timeout_s:g}s") from None
        if self.flow.read_paused and not self.more_body and not self.transport.is_closing():
            # The last piece paused reading (past uvicorn's high-water mark, 64 KiB): read on, or the client's
            # leaving would go unseen (its generation run to the end, counted a 200)
            self.flow.resume_reading()
        if self.disconnected:
            raise ClientGone(self.refused or 499)
        if len(self.body) > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        return bytes(self.body)

    def watch_disconnect(self, gone: list[bool]) -> None:
        self._watch = gone
        if self.disconnected:
            self.signalled()

    def stop_watching(self) -> None:
        self._watch = None

    async def send_json(self, body: bytes, status: int, headers: Headers) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected or self.response_started or self.transport.is_closing():
            return
        self.response_started = True
        if headers or not self.keep_alive or self.waiting_for_100_continue:
            self.transport.write(self._head(status, headers, _JSON_HEAD + b"content-length: %d\r\n" % len(body))
                                 + body)
            self._complete()
            return
        # (``_head``'s common case, the connection kept: in one step, and ``_complete`` with it)
        self.transport.write(_JSON_WHOLE % (STATUS_LINE[status], self.default_headers, self.cors_head, len(body),
                                            self.request_id, body))
        self.response_complete = True
        self.on_response()

    async def start_stream(self, first: bytes) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected or self.response_started or self.transport.is_closing():
            return
        self.response_started = True
        self.transport.write(self._stream_head(first))

    async def send_chunk(self, chunk: bytes) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if not (self.disconnected or self.response_complete or self.transport.is_closing()) and chunk:
            self.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if self.chunked else chunk)

    async def end_stream(self, last: bytes) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected or self.response_complete or self.transport.is_closing():
            return
        if not self.chunked:
            self.transport.write(last)  # (b"" is no write in asyncio's transports)
        else:
            self.transport.write(b"%x\r\n%b\r\n%b" % (len(last), last, _LAST_CHUNK) if last else _LAST_CHUNK)
        self._complete()

    async def send(self, message: Message) -> None:
        """ASGI's ``send`` on this cycle, for a responder written against ASGI messages (the SGLang relay,
        ``gateway.sglang_relay``), as uvicorn's: the head goes out at ``http.response.start``; without a
        ``content-length`` in it the body is chunked (to an HTTP/1.0 client: unframed, ending with the
        connection); the body message without ``more_body`` completes the response. Writes wait while the
        client's socket is full; after the client left, or once the response is complete, nothing is written."""
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected or self.response_complete or self.transport.is_closing():
            return
        if message["type"] == "http.response.start":
            if self.response_started:
                raise RuntimeError("the response has already started")
            headers = [(name.lower(), value) for name, value in message.get("headers", ())]
            if _BAD_NAME.search(b"".join(name for name, _ in headers)) \
                    or _BAD_VALUE.search(b"".join(value for _, value in headers)):
                raise RuntimeError(f"a response header name or value holds a forbidden character: {headers!r}")
            framed = any(name == b"content-length" for name, _ in headers)
            if not framed:  # (the framing is ours: an application's transfer-encoding is not passed on)
                headers = [pair for pair in headers if pair[0] != b"transfer-encoding"]
            self.response_started = True
            self.framed = framed
            self.transport.write(self._head(message["status"], headers, b"" if framed or not self.chunked
                                            else b"transfer-encoding: chunked\r\n"))
            return
        if not self.response_started:
            raise RuntimeError("the response body was sent before its head")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.framed or not self.chunked:
            if body:
                self.transport.write(body)
        elif body:
            self.transport.write(b"%x\r\n%b\r\n%b" % (len(body), body, b"" if more else _LAST_CHUNK))
        elif not more:
            self.transport.write(_LAST_CHUNK)
        if not more:
            self._complete()

    def is_writable(self) -> bool:
        return self.response_started and not (self.flow.write_paused or self.disconnected or self.response_complete
                                              or self.transport.is_closing())

    def write_now(self, chunk: bytes) -> None:
        write_batch.write(self.transport, b"%x\r\n%b\r\n" % (len(chunk), chunk) if self.chunked else chunk)

    def text_lane(self, accept: Callable[[StepOutput], str], encode: Callable[[str], bytes], before: bytes,
                  after: bytes) -> Callable[[StepOutput], bool]:
        """``is_writable`` and ``write_now`` of ``before + encode(accept(output)) + after`` in one call, the
        chunk framed in one step (no write for no text); False, nothing accepted, when not writable.
        Run once per streamed token (``gateway.responder``'s direct path, once the stream started)."""
        transport, flow, batch = self.transport, self.flow, write_batch.local
        fixed = len(before) + len(after)
        # (from here on attributes of this cycle, not the class's defaults: read per token, and CPython 3.11 reads a
        # class attribute through an instance the slow way)
        self.disconnected, self.response_complete = self.disconnected, self.response_complete
        if not self.chunked:  # (HTTP/1.0: the body as it is)
            def plain_lane(output: StepOutput) -> bool:
                if flow.write_paused or self.disconnected or self.response_complete or transport.is_closing():
                    return False
                text = accept(output)
                if text:
                    pending = batch.pending  # (``write_batch.write``, in place)
                    if pending is None:
                        transport.write(before + encode(text) + after)
                    else:
                        pending.append((transport, before + encode(text) + after))
                return True
            return plain_lane

        # (the chunk's frame with ``before`` and ``after`` in it: its length and the text are all that change)
        chunk = b"%%x\r\n%s%%b%s\r\n" % (before.replace(b"%", b"%%"), after.replace(b"%", b"%%"))

        def lane(output: StepOutput) -> bool:
            if flow.write_paused or self.disconnected or self.response_complete or transport.is_closing():
                return False
            text = accept(output)
            if text:
                data = encode(text)
                pending = batch.pending  # (``write_batch.write``, in place)
                if pending is None:
                    transport.write(chunk % (fixed + len(data), data))
                else:
                    pending.append((transport, chunk % (fixed + len(data), data)))
            return True
        return lane

    def can_start(self) -> bool:
        return not (self.response_started or self.flow.write_paused or self.disconnected
                    or self.transport.is_closing())

    def start_now(self, first: bytes) -> None:
        self.response_started = True
        # At once, not with the frame's other writes (``write_batch``): the first token is the one
        # the client waits on (TTFT), and this is one write of the stream's many.
        self.transport.write(self._stream_head(first))

    # -- helpers -----------------------------------------------------------------------------------
    def _stream_head(self, first: bytes) -> bytes:
        """A stream's response head and its first chunk (when there is one), as one write."""
        if first and self.chunked and self.keep_alive and not self.waiting_for_100_continue:
            # (``_head``'s common case, the connection kept: in one step)
            return _STREAM_START % (self.default_headers, self.cors_head, self.request_id, len(first), first)
        if not self.chunked:  # (HTTP/1.0: the body ends when the connection closes)
            return self._head(200, [], _SSE_HEAD_CLOSE) + first
        return self._head(200, [], _SSE_HEAD) + (b"%x\r\n%b\r\n" % (len(first), first) if first else b"")

    def _head(self, status: int, headers: Headers, content: bytes) -> bytes:
        parts = [STATUS_LINE[status], self.default_headers, self.cors_head, content]
        close = False
        for name, value in headers:
            if name == b"connection" and b"close" in value.lower():
                close = True
            parts.append(b"%s: %s\r\n" % (name, value))
        if close:
            self.keep_alive = False
        elif not self.keep_alive or self.waiting_for_100_continue:
            # (a client told nothing yet may still send its body: it would be read as the next request)
            self.keep_alive = False
            parts.append(b"connection: close\r\n")
        parts.append(b"x-request-id: %s\r\n\r\n" % self.request_id)
        return b"".join(parts)

    def _complete(self) -> None:
        self.response_complete = True
        if not self.keep_alive:
            self.transport.close()
        self.on_response()
