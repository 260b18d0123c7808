"""uvicorn's httptools protocol with the limits on the client that uvicorn lacks.

uvicorn bounds neither the size of a request head (request line + headers: httptools buffers a
header of any size) nor the time a client may take to send it, and once a response is sent it
reads and discards whatever is left of the request body for as long as the client sends it. So,
per connection (``GuardedHttpProtocol``, event loop only):
1. ``connection_made`` and the first byte of every request start the head timer; the end of the
   headers stops it. A head larger than ``max_head_bytes`` is answered 431 and one that has not
   arrived within ``head_timeout_s`` 408 (a connection that sends nothing is closed that way too).
2. A response that completes before its request body has arrived starts a timer of ``body_timeout_s``
   for the rest of the body (read and discarded); past it the connection is closed. Otherwise (and
   once such a body is in) it starts the keep-alive wait (uvicorn's ``timeout_keep_alive``, the
   gateway's ``--keep-alive-timeout-s``) for the next request's first byte; past it the connection
   is closed too. All of these share one timer per connection, moved lazily.
3. A request whose body is in a transfer coding other than ``chunked`` (``Transfer-Encoding: gzip, chunked``:
   httptools undoes only the chunked framing) is answered 501 (RFC 9112 6.1), as a refusal below.
   Every refusal, and uvicorn's own 400 for a request it cannot parse, is OpenAI-shaped JSON with
   ``Connection: close``; the connection then half-closes and drops what the client still sends for
   ``LINGER_S`` before closing, so a client still writing reads the answer instead of a reset. While a
   response is going out on the connection (a request pipelined behind it was refused), the refusal
   cannot go in its middle: every unanswered request on it sees a disconnect and it is closed. A request a
   refusal ends is counted (``pd_gateway_requests_total``) with the refusal's status when it is the one
   answered, else with ``CLOSED_BY_GATEWAY`` (444), not as a client's 499, started or not.
4. Writes: once the transport's buffer passes its high-water mark (the client stopped reading),
   uvicorn makes the app's ``send`` wait; if the client has read nothing more within
   ``write_timeout_s`` the connection is aborted, which the app sees as a disconnect (its requests are
   aborted on the workers), so a stuck client holds neither memory nor an admission slot for ever.
5. A request asking to upgrade to a protocol the server does not speak (``Upgrade: h2c``) is served as the
   HTTP/1.1 request it also is (RFC 9110 7.8; ``_feed``); an HTTP/1.0 client's ``Expect: 100-continue`` is
   ignored (no interim response). A disconnect reaches every unanswered cycle of the connection, ASGI ones
   included (uvicorn tells only the newest: a pipelined request's elder would not know).
The body of a request being read by the app is bounded by the app (``gateway.responder.read_body``:
``--max-body-bytes``, ``--body-timeout-s``).
6. ``hot_routes`` (the gateway's): a ``POST`` to a generation route gets the
   gateway's own cycle (``gateway.hot_cycle.HotCycle``) in place of uvicorn's ASGI cycle, queued
   behind a response still going out exactly as uvicorn's cycles are; every limit above holds. Not
   queued, a stream (``"stream": true`` in the body) starts in the callback that completes its body,
   up to its first wait (``gateway.eager``: it is dispatched to its workers in the same pass of the
   event loop); any other request starts as a task then, as does one whose body is still to come at
   the end of the read that ended its head.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httptools
import msgspec
from uvicorn.protocols.http.httptools_impl import HIGH_WATER_LIMIT, STATUS_LINE, HttpToolsProtocol

from gateway import eager
from gateway.errors import APIError, BadRequest, HeadersTooLarge, RequestTimeout
from gateway.hot_cycle import HotCycle
from gateway.responder import CLOSED_BY_GATEWAY, REFUSED_KEY

if TYPE_CHECKING:
    from gateway.hot_cycle import HotRoutes

LINGER_S = 2.0
# Answered during a drain on a connection kept open (not closed after their answer, unlike any other route's):
# a scraper or a probe reads the open requests falling to zero on one connection until the last response ends.
DRAIN_PROBES = frozenset(("/health", "/readiness", "/metrics"))
log = logging.getLogger(__name__)

# A body that asks for a stream: such a request starts in the read's callback (``gateway.eager``),
# since its first token waits on it; a whole response starts as a task, which measured 7-16% less
# gateway CPU per request at 64 concurrent (bench_ab.py, both slot orders). Only the start differs,
# so a miss either way (a "stream" key nested in some object, an escaped key) costs time, not meaning.
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')


_stream_search = _STREAM_TRUE.search


def _asks_to_stream(body: bytes | bytearray) -> bool:
    return _stream_search(body) is not None


_UPGRADE_HEADERS = (b"upgrade", b"http2-settings")
_NEVER = float("inf")
_json = msgspec.json.Encoder()


class CodingNotImplemented(APIError):
    """A request body in a transfer coding other than ``chunked`` (RFC 9112 6.1: 501). httptools reads only the
    chunked framing: the body under it (gzip-compressed, say) would reach the app as if it were plain."""

    status = 501
    type = "invalid_request_error"


def _expects_100(headers: list[tuple[bytes, bytes]]) -> bool:
    """Does the request expect ``100 Continue`` (uvicorn's test of each header in its ``on_header``)?"""
    return any(name == b"expect" and value.lower() == b"100-continue" for name, value in headers)


def _unknown_transfer_coding(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The first transfer coding of the request other than ``chunked`` (None: none; the parser itself refuses a
    ``Transfer-Encoding`` whose last coding is not ``chunked``, and one with ``Content-Length``, 400)."""
    for name, value in headers:
        if name == b"transfer-encoding":
            for coding in value.split(b","):
                coding = coding.partition(b";")[0].strip().lower()
                if coding and coding != b"chunked":
                    return coding
    return None


@dataclass(frozen=True)
class ClientLimits:
    max_head_bytes: int = 64 * 1024
    head_timeout_s: float = 20.0
    body_timeout_s: float = 60.0
    write_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_head_bytes < 1024 or not min(self.head_timeout_s, self.body_timeout_s, self.write_timeout_s) > 0:
            raise ValueError("max_header_bytes must be at least 1024; header, body and write timeouts positive")


class GuardedHttpProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` enforcing ``limits`` (see the module doc); make one with ``protocol_class``."""

    limits = ClientLimits()
    hot_routes: HotRoutes | None = None  # routes answered by the gateway's own cycle instead of the ASGI app

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # waiting for, or reading, a request head
        self._head_bytes = 0
        self._ended_in_read = False  # a request ended in the read being parsed (its bytes are not all a head's)
        self._big_read = False  # the read being parsed could hold a whole head over the limit
        self._reads = 0  # reads so far; ``_head_read``: the one the current head began in
        self._head_read = 0
        self._head_too_large = False
        self._head_refusal: APIError | None = None  # (``on_chunk_header``) why the head just read is refused
        self._codings_read = False  # this message's transfer codings were looked at (``on_chunk_header``)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = _NEVER  # when ``_timer`` fires (``_NEVER``: no timer)
        self._waiting_for = ""  # what the timer waits for: "head", "body" or "idle" ("": nothing)
        self._deadline = 0.0  # loop time by which it must have arrived
        self._refused = False
        self._write_timer: asyncio.TimerHandle | None = None
        self._write_mark = 0  # the transport's unsent bytes when the write timer was (re-)armed
        # This connection's cycles, answered or not (uvicorn keeps only the newest; a disconnect must reach
        # every unanswered one, a pipelined request's elder included)
        self._cycles: list[Any] = []
        self._ignored_upgrade = False  # (``_feed``) the head just parsed asked for an upgrade we do not speak
        self._unstarted: HotCycle | None = None  # a cycle whose head was read in this read, not started yet
        self._shutting_down = False  # (``shutdown``) the server drains: the next answer closes the connection

    # -- connection ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("head")

    def connection_lost(self, exc: Exception | None) -> None:
        for cycle in self._cycles:  # uvicorn tells only the newest cycle; a pipelined one's elder must know too
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        if not self._refused:  # (``_refuse`` counted its own, 444): queued ones never start, counted as the 499
            for queued, _ in self.pipeline:  # the client's close left them
                if isinstance(queued, HotCycle):
                    queued.responder.count(499)
        self._disarm()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_at = _NEVER
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)
        if self._shutting_down and not _responding(self.server_state.connections):
            # (the drain's last response ended with its client gone: the idle connections close now, not
            # when their keep-alive wait ends)
            _close_idle(self.server_state.connections)

    def shutdown(self) -> None:
        """The server's graceful shutdown (SIGTERM: the gateway drains). A response going out finishes and
        the connection closes after it (uvicorn's). An idle kept-alive connection stays open while any
        connection still has a response going out, so that a request arriving on it is answered rather
        than cut (a generation route: 503 ``draining``, with ``Connection: close``; ``/health``, ``/readiness``,
        ``/metrics``: served, the connection kept, so that a scraper reads on); the idle ones close once no
        response is left (the server waits for every connection to close before it exits)."""
        self._shutting_down = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False
        elif not _responding(self.server_state.connections):
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_mark = self.transport.get_write_buffer_size()
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def _write_stalled(self) -> None:
        self._write_timer = None
        left = self.transport.get_write_buffer_size()
        if left < self._write_mark:  # the client read some (a large answer, still above the low-water mark)
            self._write_mark = left
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_stalled)
            return
        log.warning("client %s read nothing for %gs: disconnecting it", self.client, self.limits.write_timeout_s)
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering: what the client still sends is dropped
        self._ended_in_read = False
        self._big_read = len(data) > self.limits.max_head_bytes
        self._reads += 1
        if self.timeout_keep_alive_task is not None:  # (uvicorn's; never set here: its keep-alive wait is ``_arm``'s)
            self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._feed(data, exc)
        unstarted = self._unstarted
        if unstarted is not None:  # its body is still to come: read_body waits for it in a task
            self._unstarted = None
            if not self._refused:
                self._start_hot(unstarted, eagerly=False)
            else:  # refused in this read (``_refuse``): never started, counted with what it was answered
                unstarted.responder.count(unstarted.refused or CLOSED_BY_GATEWAY)
        # A read that ends inside a head, with no request ended in it, is all that head's (a read that ended a
        # request and began the next head holds the former's body too: not counted, at most one read over)
        if self._in_head and not self._ended_in_read and not self._refused:
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse_big_head()

    def _feed(self, data: bytes, exc: Exception) -> None:
        """The rest of uvicorn's ``data_received`` (``data_received`` feeds the parser ``data``; this handles
        what that raised, ``exc``), except that a request asking to upgrade to a protocol the server does
        not speak (``Upgrade: h2c``, which ``curl --http2`` and several Java clients send by default) is
        served as the HTTP/1.1 request it also is (RFC 9110 7.8): httptools stops at the end of such a head
        (its body unread), so the head is parsed again without the upgrade, followed by the rest of the read."""
        while True:
            if isinstance(exc, httptools.HttpParserUpgrade):
                if self._ignored_upgrade and not self._refused:
                    self._ignored_upgrade = False
                    data = self._head_without_upgrade() + data[exc.args[0]:]
                    self._renew_parser()
                    try:
                        self.parser.feed_data(data)
                    except (httptools.HttpParserError, httptools.HttpParserUpgrade) as again:
                        exc = again
                        continue
                    return
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
            else:
                self.send_400_response("Invalid HTTP request received.")
            return

    def _renew_parser(self) -> None:
        """A new parser for the connection (httptools binds the protocol's callbacks when it makes one)."""
        self.parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # (as uvicorn's own parser: bytes after a close request)
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)

    def _head_without_upgrade(self) -> bytes:
        """The request head just parsed, without its upgrade (``Upgrade``, ``HTTP2-Settings`` and their
        ``Connection`` tokens)."""
        parser = self.parser
        head = [b"%s %s HTTP/%s\r\n" % (parser.get_method(), self.url, parser.get_http_version().encode())]
        for name, value in self.headers:
            if name in _UPGRADE_HEADERS:
                continue
            if name == b"connection":
                tokens = [t.strip() for t in value.split(b",")]
                value = b", ".join(t for t in tokens if t and t.lower() not in _UPGRADE_HEADERS)
                if not value:
                    continue
            head.append(b"%s: %s\r\n" % (name, value))
        head.append(b"\r\n")
        return b"".join(head)

    def _refuse_big_head(self) -> None:
        self._refuse(HeadersTooLarge(f"the request head exceeds {self.limits.max_head_bytes} bytes",
                                     code="request_head_too_large"))

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            self._refuse_big_head()
        elif self._head_refusal is not None:
            self._refuse(self._head_refusal)
        else:
            self._refuse(BadRequest(f"{msg} (not parsable as HTTP/1.1)", code="invalid_http"))

    # -- parser callbacks --------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.hot_routes is None:
            super().on_message_begin()
        else:  # the ASGI scope is made only for a request that goes to the app (on_headers_complete)
            self.url, self.headers, self.expect_100_continue = b"", [], False
        self._in_head, self._head_bytes, self._head_read, self._codings_read = True, 0, self._reads, False
        self._waiting_for = "head"  # (``_arm("head")``, inline: once per request)
        self._deadline = deadline = self.loop.time() + self.limits.head_timeout_s
        if deadline < self._timer_at:
            self._set_timer(deadline)

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's, but ``Expect: 100-continue`` is looked for once per head, at its end (``_expects_100``)
        self.headers.append((name.lower(), value))

    def on_chunk_header(self) -> None:
        """httptools calls it for each chunk of a chunked body, and only then: the transfer codings are read once,
        at a body's first chunk (a coding other than ``chunked`` is a 501), not in every request's head."""
        if self._codings_read:
            return
        self._codings_read = True
        coding = _unknown_transfer_coding(self.headers)
        if coding is not None:
            self._head_refusal = CodingNotImplemented(
                f"the transfer coding {coding.decode('latin-1')!r} is not supported: send the body as it is, with "
                "Content-Length or Transfer-Encoding: chunked alone", code="transfer_coding_not_supported")
            raise self._head_refusal  # (the parser stops: send_400_response answers)

    def on_headers_complete(self) -> None:
        # Measured exactly when the head could be over the limit: it came in a read that long, or over
        # several reads (those ending inside it are counted as they come, but not the one ending it)
        if (self._big_read or self._head_read != self._reads) and \
                len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers) > self.limits.max_head_bytes:
            self._head_too_large = True
            raise HeadersTooLarge("request head too large")  # (the parser stops: send_400_response answers)
        if b"expect" in dict(self.headers):  # (``on_header``: rare, so looked for in C first)
            self.expect_100_continue = _expects_100(self.headers)
        self._in_head = False
        self._waiting_for = ""  # (``_disarm``)
        parser = self.parser
        upgrade = parser.should_upgrade()
        if upgrade and parser.get_method() != b"CONNECT" and not self._should_upgrade():
            self._ignored_upgrade = True  # (no cycle: ``_feed`` parses the head again without the upgrade)
            return
        hot = self.hot_routes
        if hot is not None and not upgrade and parser.get_method() == b"POST":
            http10 = parser.get_http_version() == "1.0"
            if http10 and self.expect_100_continue:
                self.expect_100_continue = False  # (an HTTP/1.0 client's expectation is ignored: RFC 9110 10.1.1)
            cycle = hot.cycle(self.url, self, self.headers,
                                 not (http10 or self._shutting_down) and parser.should_keep_alive(),
                                 self.expect_100_continue, not http10)
            if cycle is not None:  # a generation route: the gateway's own cycle (gateway/hot_cycle.py)
                cycles = self._cycles
                if len(cycles) == 1 and cycles[0].response_complete:  # (the common case: the one before answered)
                    cycles[0] = cycle
                else:
                    self._cycles = [c for c in cycles if not c.response_complete] + [cycle]
                existing = self.cycle
                self.cycle = cycle  # type: ignore[assignment]
                if existing is None or existing.response_complete:
                    self._unstarted = cycle  # started when its body is complete, or at the end of this read
                else:  # pipelined behind a response still going out: as uvicorn queues its own cycles
                    if self.pipeline:  # (from the second on: with one queued, reading on sees the client leave)
                        self.flow.pause_reading()
                    self.pipeline.appendleft((cycle, self.app))  # type: ignore[arg-type]
                return
        elif self.expect_100_continue and parser.get_http_version() == "1.0":
            self.expect_100_continue = False  # (as above)
        if hot is not None:  # uvicorn's start of a message (its scope) with what was parsed since
            url, headers, expect_100_continue = self.url, self.headers, self.expect_100_continue
            super().on_message_begin()
            self.url, self.headers, self.expect_100_continue = url, headers, expect_100_continue
            self.scope["headers"] = headers
        before = self.cycle
        super().on_headers_complete()
        made = self.cycle
        if made is not None and made is not before:
            self._cycles = [c for c in self._cycles if not c.response_complete] + [made]
            if len(self.pipeline) == 1 and isinstance(before, HotCycle) and not before.response_complete:
                # Queued behind the gateway's own cycle, which reads nothing more (uvicorn's cycle ahead would
                # resume reading in the app's ``receive``): read on, as with one hot cycle queued, so that the
                # client leaving is seen (the next one queued pauses reading)
                self.flow.resume_reading()
            if self._shutting_down and made.scope["path"] not in DRAIN_PROBES:  # (its answer closes the connection)
                made.keep_alive = False

    def on_body(self, body: bytes) -> None:
        # uvicorn's, with the cycle read once
        if self.parser.should_upgrade() and self._should_upgrade():
            return
        cycle = self.cycle
        if cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        if cycle is not self._unstarted:  # (a hot cycle not started yet: nothing waits on it)
            cycle.message_event.set()

    def on_message_complete(self) -> None:
        if self._ignored_upgrade:
            return  # (the head is parsed again, its body with it: ``_feed``)
        self._ended_in_read = True
        cycle = self.cycle
        unstarted = self._unstarted
        if not ((self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete):
            cycle.more_body = False  # (uvicorn's ``on_message_complete``, inline)
            if cycle is not unstarted:  # (a hot cycle not started yet: nothing waits on it)
                cycle.message_event.set()
        if self._waiting_for == "body":  # the rest of a body that came after its response: now idle
            if cycle is not None and cycle.response_complete and not self.pipeline and cycle.keep_alive:
                self._arm("idle")
            else:
                self._disarm()
        if unstarted is not None and unstarted is cycle:  # (a refusal in between would have made it disconnected)
            self._unstarted = None
            if not unstarted.disconnected:
                self._start_hot(unstarted, eagerly=_stream_search(unstarted.body) is not None)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if isinstance(cycle, HotCycle):  # (also uvicorn's start of a pipelined cycle)
            self._start_hot(cycle, eagerly=False)
        else:
            super()._start_asgi_task(cycle, app)

    def _start_hot(self, cycle: HotCycle, *, eagerly: bool) -> None:
        """Start ``cycle``: up to its first wait now (``eagerly``), or as a task; its task is kept in
        ``tasks`` (the server waits for them at shutdown) and told to the cycle (it cancels it when the
        client leaves)."""
        # (None: a copy of the current context, made by ``eager.start`` or the task itself)
        context = contextvars.Context() if self.config.reset_contextvars else None
        if eagerly:
            task = eager.start(cycle.run_asgi(self.app), self.loop, context)
            if task is None:  # answered at once (a refusal, a bad request)
                return
        else:
            task = self.loop.create_task(cycle.run_asgi(self.app), context=context)
        cycle.task = task
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def on_response_complete(self) -> None:
        # uvicorn's, except that the keep-alive wait is on this connection's one timer (``_arm``), not
        # a loop timer made and cancelled per request
        self.server_state.total_requests += 1
        transport = self.transport
        if self._shutting_down and not _responding(self.server_state.connections):
            _close_idle(self.server_state.connections)  # (the last response of a drain: the server may exit)
        if transport.is_closing():
            return
        flow = self.flow
        if flow.read_paused:
            flow.resume_reading()
        if self.pipeline:  # the next pipelined request
            pipelined, app = self.pipeline.pop()
            self._start_asgi_task(pipelined, app)
        elif self._waiting_for != "head":  # (a next request's head under way keeps its own timeout)
            self._waiting_for = "idle"  # (``_arm("idle")``, inline: once per request)
            self._deadline = deadline = self.loop.time() + self.timeout_keep_alive
            if deadline < self._timer_at:
                self._set_timer(deadline)
        cycle = self.cycle  # (the newest: a pipelined one just started reads its own body, on its own timeout)
        if cycle is not None and cycle.response_complete and cycle.more_body and not transport.is_closing():
            self._arm("body")  # the rest of the body is being discarded: not for ever

    # -- timer and refusals --------------------------------------------------------------------------
    def _arm(self, what: str) -> None:
        """Wait for ``what`` (its timeout from now). One timer per connection, moved lazily: arming and
        disarming per request only set numbers; the timer re-arms itself when it fires early."""
        self._waiting_for = what
        limits = self.limits
        timeout_s = (limits.head_timeout_s if what == "head" else limits.body_timeout_s if what == "body"
                     else self.timeout_keep_alive)
        self._deadline = deadline = self.loop.time() + timeout_s
        if deadline < self._timer_at:  # (a head's timeout may be shorter than a body's)
            self._set_timer(deadline)

    def _set_timer(self, deadline: float) -> None:
        """The connection's timer, moved to fire at ``deadline`` (earlier than it would)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = timer = self.loop.call_at(deadline, self._expired)
        self._timer_at = timer.when()

    def _disarm(self) -> None:
        self._waiting_for = ""

    def _expired(self) -> None:
        self._timer = None
        self._timer_at = _NEVER
        if self.transport.is_closing() or self._refused or not self._waiting_for:
            return
        if self.loop.time() < self._deadline:  # re-armed since: wait for the new deadline
            self._set_timer(self._deadline)
            return
        if self._waiting_for != "head":  # the rest of a body, or the next request on a kept-alive connection
            self.transport.close()
        elif self.cycle is not None and not self.cycle.response_complete:
            self._arm("head")  # a pipelined request's head behind a response still going out
        else:
            self._refuse(RequestTimeout(f"the request head did not arrive within {self.limits.head_timeout_s:g}s",
                                        code="request_head_timeout"))

    def _refuse(self, error: APIError) -> None:
        """Answer ``error`` (unless a response is going out: then just close), linger and close."""
        self._refused = True
        self._disarm()
        transport = self.transport
        # Every unanswered request on the connection sees a disconnect (its sends go nowhere). The refusal
        # answers the newest one when it is that request's own (its body could not be read) and nothing
        # was sent for it; otherwise, with any request unanswered, it would be read as the answer to an
        # earlier one, or land in the middle of one: the connection is closed instead.
        newest: Any = self.cycle
        cycles: list[Any] = [newest, *self._cycles, *(c for c, _ in self.pipeline)]
        unanswered = [c for c in cycles if c is not None and not c.response_complete]
        answers_newest = newest is not None and newest.more_body and not newest.response_started and all(
            c is newest for c in unanswered)
        # Each one counts the status it was ended with (pd_gateway_requests_total), not the client's 499: this
        # refusal, or CLOSED_BY_GATEWAY for those the connection's close leaves unanswered
        status = error.status if answers_newest else CLOSED_BY_GATEWAY
        for cycle in unanswered:
            if isinstance(cycle, HotCycle):
                cycle.refused = status
            else:  # (uvicorn's ASGI cycle: the responder reads it from the request's scope)
                cycle.scope[REFUSED_KEY] = status
            cycle.disconnected = True
            cycle.message_event.set()
        if unanswered and not answers_newest:
            for queued, _ in self.pipeline:  # (never started: counted here; uvicorn's own have no route to count)
                if isinstance(queued, HotCycle):
                    queued.responder.count(CLOSED_BY_GATEWAY)
            transport.close()
        if transport.is_closing():
            return
        body = _json.encode(error.body())
        head = [STATUS_LINE[error.status]]
        head += [b"%s: %s\r\n" % (name, value) for name, value in self.server_state.default_headers]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        transport.write(b"".join(head) + body)
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(LINGER_S, transport.close)


def protocol_class(limits: ClientLimits, hot_routes: HotRoutes | None = None) -> type[GuardedHttpProtocol]:
    """A ``GuardedHttpProtocol`` bound to ``limits`` (and ``hot_routes``), for ``uvicorn.Config(http=...)``."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"limits": limits, "hot_routes": hot_routes})


def _responding(connections: Any) -> bool:
    """Has any of ``connections`` a response going out (or a request being answered)?"""
    return any(c.cycle is not None and not c.cycle.response_complete for c in connections)


def _close_idle(connections: Any) -> None:
    """Close the connections the server's shutdown kept open while others answered (idle, kept alive)."""
    for c in list(connections):
        if getattr(c, "_shutting_down", False) and (c.cycle is None or c.cycle.response_complete) \
                and not c.transport.is_closing():
            c.transport.close()
