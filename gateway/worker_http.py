"""The relay's HTTP/1.1 client to SGLang workers: one POST, its answer whole or piece by piece, a keep-alive pool.

Why not aiohttp (which carried these requests before): every relayed request is two POSTs (prefill and decode), and
aiohttp's own Python was about a third of the gateway's CPU on that path (py-spy, docs/performance.md);
``loadtests/bench_http_client.py`` measures this client beside it and a raw socket. It does only what the relay
needs (the workers' health, load and model checks keep their aiohttp session, ``gateway/sglang_fleet.py``):

1. ``HttpPool(limit_per_host, timeout_s, connect_timeout_s, headers, keepalive_s)``; ``reuse=False`` makes one that
   opens a connection per request and closes it after.
2. ``await pool.post(url, data, headers, asked=future)``: a connection to the URL's origin (the most recently idle
   one, else a new one while fewer than ``limit_per_host`` are open, else the first free one, waited for in
   order), the request written in one write (``Host``, ``Content-Length`` and the pool's headers added; ``asked``
   set once it has gone out), then the response head: a ``Reply`` (``status``, ``headers`` with lower-case names).
   The body: ``await reply.read()`` (whole) or ``await reply.readany(idle_s)`` (what has come, ``b""`` at its end,
   ``ReadIdle`` when nothing came within ``idle_s``; past ``HIGH_WATER`` bytes unread the socket is not read until
   the caller catches up). ``reply.release()`` gives a connection whose answer was read to its end (and may be kept
   alive) back to the pool, else closes it; ``reply.close()`` closes it (how a request is aborted on the worker).
   ``async with reply:`` releases it.
3. Time: one deadline per request, ``timeout_s`` after the call (or the caller's ``deadline``, when nearer), over
   everything up to the body's end (the wait for a free connection included, as aiohttp's ``total`` timeout), and
   the connect within ``connect_timeout_s``;
   past it the connection is closed and the waiting call raises ``TimeoutError``. One timer per request.
4. Failures (all ``HttpClientError``, an ``OSError``): ``ConnectFailed`` (no connection), ``Disconnected`` (the
   connection broke: ``answered`` once any byte of an answer had come, ``reused`` when it went out on a pooled
   connection), ``BadResponse`` (not HTTP). ``crossed_idle_close`` tells a request that met the worker's close
   of the idle connection it went out on: the worker never read it, so the relay sends it again once, on a new
   connection (``post(fresh=True)``).
5. Idle connections are closed after ``keepalive_s`` (one timer per pool, only while some are idle), when the
   worker closes them, or when the worker sends anything unasked on them.
Event loop only. A response may be framed by ``Content-Length``, chunked (httptools undoes the chunks) or end with
its connection; ``https://`` URLs are verified against the system's CAs (``ssl.create_default_context``, or the
pool's ``ssl_context``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import cast
from urllib.parse import quote, urlsplit

import httptools

HIGH_WATER = 64 * 1024  # unread answer bytes past which the socket is not read (``readany`` reads it again)
MAX_HEAD_BYTES = 64 * 1024  # an answer's header lines, at most (httptools sets no bound: BadResponse past it)
_DEFAULT_PORTS = {"http": 80, "https": 443}


class HttpClientError(ConnectionError):
    """A request to a worker that failed on the way (not an HTTP status: those are answers)."""


class ConnectFailed(HttpClientError):
    """No connection to the worker could be opened."""


class Disconnected(HttpClientError):
    """The connection broke before the answer's end. ``answered``: some of an answer had come; ``reused``: the
    request went out on a pooled connection, idle before it."""

    def __init__(self, message: str, *, answered: bool, reused: bool) -> None:
        super().__init__(message)
        self.answered, self.reused = answered, reused


class BadResponse(HttpClientError):
    """What the worker sent is not an HTTP/1.1 answer."""


class ReadIdle(TimeoutError):
    """Nothing of the body came within a read's ``idle_s`` (``Reply.readany``): the request itself goes on."""


def _read_idle(waiter: asyncio.Future[None], idle_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(ReadIdle(f"nothing came for {idle_s:g}s"))


def crossed_idle_close(exc: BaseException) -> bool:
    """Whether a request failed because it crossed the worker's close of the idle pooled connection it went out on:
    the connection ended before any byte of an answer (the worker closes only connections with nothing in flight,
    so it never read the request). A new connection that breaks is none of this (a worker gone, a network cut)."""
    return isinstance(exc, Disconnected) and exc.reused and not exc.answered


class _Origin:
    """One worker's connections in a pool: the idle ones (oldest first) and the callers waiting for one."""

    __slots__ = ("host", "host_header", "idle", "num_open", "port", "ssl", "waiters")

    def __init__(self, host: str, port: int, host_header: bytes, use_ssl: bool) -> None:
        self.host, self.port, self.host_header, self.ssl = host, port, host_header, use_ssl
        self.idle: list[_Connection] = []
        self.num_open = 0  # connecting, busy and idle
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()


class _Connection(asyncio.Protocol):
    """One connection to a worker and the answer being read on it (httptools' callbacks fill ``reply``)."""

    def __init__(self, pool: HttpPool, origin: _Origin) -> None:
        self.pool, self.origin = pool, origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reply: Reply | None = None
        self.reused = False
        self.idle_since = 0.0
        self.is_lost = False
        self.counted = True  # in ``origin.num_open`` (cleared once, by ``HttpPool._gone``)
        self._interim = False  # the message being parsed is a 1xx (Continue, Early Hints): skipped
        self._head_bytes = 0  # of the message being parsed's header lines
        self._head: list[tuple[bytes, bytes]] = []  # its header lines as they came (name, value)

    # -- asyncio's side ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is no ``asyncio.Transport`` subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):  # (a transport that is no TCP socket)
                pass

    def data_received(self, data: bytes) -> None:
        reply = self.reply
        if reply is None or reply.ended:  # (unasked: nothing can be read on this connection any more)
            if reply is not None:
                reply.keep_alive = False
            self.close()
            return
        reply.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # (no upgrade was asked for)
            reply._fail(BadResponse(f"{self.pool.describe(self)} answered with a protocol switch"))
            self.close()
        except Exception as exc:  # (httptools.HttpParserError, or a callback's)
            reply._fail(BadResponse(f"{self.pool.describe(self)} sent no valid HTTP answer: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_lost = True
        reply = self.reply
        if reply is not None and not reply.ended:
            if reply.status and not reply.framed and exc is None:  # (no length: its end is a clean close)
                reply._end()
            else:
                why = f": {exc}" if exc is not None else ""
                what = "its answer broke off" if reply.answered else "closed the connection before answering"
                reply._fail(Disconnected(f"{self.pool.describe(self)} {what}{why}", answered=reply.answered,
                                         reused=self.reused))
        self.pool._gone(self)

    # -- httptools' callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        reply = self.reply
        if reply is not None and reply.ended:  # (a message after the answer, in the same read: nobody asked for it)
            raise BadResponse("an unasked message followed the answer")  # (the parse stops; the connection closes)
        self._interim = False
        self._head_bytes = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        # (kept raw: the head's lines are made into ``Reply.headers`` at once, at its end, ``_headers``)
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise BadResponse(f"an answer's header lines passed {MAX_HEAD_BYTES} bytes")
        self._head.append((name, value))

    def on_headers_complete(self) -> None:
        reply = self.reply
        status = self.parser.get_status_code()
        if status < 200:  # (an interim answer: the real one follows; its header lines are dropped)
            self._interim = True
            self._head.clear()
            return
        if reply is not None:
            reply.status = status
            reply.keep_alive = self.parser.should_keep_alive()
            headers = reply.headers = _headers(self._head)
            self._head.clear()
            reply.framed = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower()
            waiter = reply._waiter  # (``Reply._wake``, inline: once per answer)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        reply = self.reply
        if reply is not None and not self._interim:
            reply._feed(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        reply = self.reply
        if reply is not None:
            if self._head:  # (a chunked answer's trailer fields: added, as header lines not given before)
                for name, value in _headers(self._head).items():
                    reply.headers.setdefault(name, value)
                self._head.clear()
            reply._end()

    # -- ours -----------------------------------------------------------------------------------------
    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self.pool._gone(self)


_LATIN_1 = itertools.repeat("latin-1")


def _headers(lines: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """Header lines as ``Reply.headers``: names in lower case, the first line of each name kept. (Built in C, not a
    line at a time: the names joined and split again, by a line break, which no header name can hold.)"""
    if not lines:
        return {}
    names, values = zip(*lines, strict=True)
    headers = dict(zip(b"\n".join(names).decode("latin-1").lower().split("\n"), map(bytes.decode, values, _LATIN_1),
                       strict=True))
    if len(headers) < len(lines):  # (a name given twice: its first value, not its last)
        headers = {}
        for name, value in lines:
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return headers


class Reply:
    """A worker's answer: ``status`` and ``headers`` (lower-case names, the first of each) as its head came; the body
    through ``read`` or ``readany`` (see the module doc)."""

    __slots__ = ("_buffer", "_conn", "_error", "_paused", "_size", "_timer", "_waiter", "answered", "ended", "framed",
                 "headers", "keep_alive", "status")

    def __init__(self, conn: _Connection, deadline: float) -> None:
        self._conn = conn
        self.status = 0  # (0 until the head has come)
        self.headers: dict[str, str] = {}
        self.keep_alive = False
        self.framed = True  # by a length or chunks (else it ends with the connection)
        self.answered = False  # a byte of the answer came
        self.ended = False  # the whole answer came (or it failed: ``_error``)
        self._buffer: list[bytes] = []
        self._size = 0
        self._paused = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer = conn.pool.loop.call_at(deadline, self._expire)

    # -- the caller's side --------------------------------------------------------------------------
    async def read(self) -> bytes:
        """The rest of the body, whole."""
        while not self.ended:
            if self._paused:
                self._resume()
            await self._wait()
        if self._error is not None:
            raise self._error
        data = b"".join(self._buffer)
        self._buffer.clear()
        self._size = 0
        return data

    async def readany(self, idle_s: float | None = None) -> bytes:
        """What has come of the body since the last read (waiting for some); ``b""`` at its end. ``idle_s``: at most
        that long a wait for it, else ``ReadIdle`` (the request and its connection go on)."""
        while not self._buffer and not self.ended:
            if idle_s is None:
                await self._wait()
            else:
                await self._wait_idle(idle_s)
        if self._buffer:
            data = self._buffer[0] if len(self._buffer) == 1 else b"".join(self._buffer)
            self._buffer.clear()
            self._size = 0
            if self._paused:
                self._resume()
            return data
        if self._error is not None:
            raise self._error
        return b""

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if it was read to its end and may be kept
        alive, else it is closed (the request, if still running, is aborted on the worker)."""
        self._timer.cancel()
        conn = self._conn
        if conn.reply is not self:
            return
        conn.reply = None
        if self.ended and self._error is None and self.keep_alive:
            if self._paused:
                self._resume()
            conn.pool._put_back(conn)
        else:
            self._closed_early()
            conn.close()

    def close(self) -> None:
        """Done with it at once: its connection is closed (the request is aborted on the worker)."""
        self._timer.cancel()
        if self._conn.reply is self:
            self._conn.reply = None
            self._closed_early()
            self._conn.close()

    def _closed_early(self) -> None:
        # (a read still waiting, in another task, ends instead of waiting for a connection that is gone)
        if not self.ended:
            self._fail(Disconnected(f"{self._conn.pool.describe(self._conn)}: the gateway closed the connection",
                                    answered=self.answered, reused=self._conn.reused))

    async def __aenter__(self) -> Reply:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self.release()

    # -- the connection's side ----------------------------------------------------------------------
    async def _wait(self) -> None:
        """Until the connection's side wakes the reader (``_wake``, or its end or failure)."""
        waiter = self._waiter = self._conn.pool.loop.create_future()
        try:
            await waiter
        finally:
            if self._waiter is waiter:  # (not a newer read's, begun as this one was cancelled)
                self._waiter = None

    async def _wait_idle(self, idle_s: float) -> None:
        """``_wait``, at most ``idle_s``: else ``ReadIdle``."""
        loop = self._conn.pool.loop
        waiter = self._waiter = loop.create_future()
        # (a timer per wait, not ``asyncio.timeout``'s context: a relayed stream waits once per event)
        timer = loop.call_later(idle_s, _read_idle, waiter, idle_s)
        try:
            await waiter
        finally:
            timer.cancel()
            if self._waiter is waiter:  # (not a newer read's, begun as this one was cancelled)
                self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._buffer.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER and not self._paused:
            transport = self._conn.transport
            if transport is not None and not transport.is_closing():
                transport.pause_reading()
                self._paused = True
        waiter = self._waiter  # (``_wake``, inline: once per piece of a body)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _resume(self) -> None:
        self._paused = False
        transport = self._conn.transport
        if transport is not None and not transport.is_closing():
            transport.resume_reading()

    def _end(self) -> None:
        self.ended = True
        self._timer.cancel()
        waiter = self._waiter  # (``_wake``, inline: once per answer)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if not self.ended:
            self._error = exc
            self.ended = True
            self._timer.cancel()
        self._wake()

    def _expire(self) -> None:
        pool = self._conn.pool
        self._fail(TimeoutError(f"{pool.describe(self._conn)} had not answered whole by the request's deadline "
                                f"({pool.timeout_s:g}s at most)"))
        if self._conn.reply is self:
            self._conn.reply = None
            self._conn.close()


class HttpPool:
    """Keep-alive connections to the workers, ``limit_per_host`` at most per origin (see the module doc)."""

    def __init__(self, *, limit_per_host: int, timeout_s: float, connect_timeout_s: float, keepalive_s: float = 4.0,
                 headers: dict[str, str] | None = None, reuse: bool = True,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """``ssl_context``: for ``https://`` URLs (default: ``ssl.create_default_context()``, the system's CAs,
        made at the first such connection)."""
        if limit_per_host < 1:
            raise ValueError("limit_per_host must be at least 1")
        self.limit_per_host, self.timeout_s, self.connect_timeout_s = limit_per_host, timeout_s, connect_timeout_s
        self.keepalive_s, self.reuse = keepalive_s, reuse
        self._fixed = header_lines(headers or {})
        self._origins: dict[str, tuple[_Origin, bytes]] = {}  # URL -> (its origin, its path), as asked for
        self._by_key: dict[tuple[str, int, bool], _Origin] = {}
        self._conns: set[_Connection] = set()  # every connection open (or opening)
        self._sweep: asyncio.TimerHandle | None = None
        self._ssl = ssl_context
        self._closed = False
        self.loop = asyncio.get_running_loop()
        # Test seams, awaited when set: a pooled connection is taken (``on_reuse``); the request's bytes are ready,
        # its connection taken, before the write (``before_write``). Both get the connection's transport; the second,
        # whether it was taken from the pool.
        self.on_reuse: Callable[[asyncio.Transport], Awaitable[None]] | None = None
        self.before_write: Callable[[asyncio.Transport, bool], Awaitable[None]] | None = None

    def describe(self, conn: _Connection) -> str:
        return f"{conn.origin.host}:{conn.origin.port}"

    def num_idle(self) -> int:
        return sum(len(origin.idle) for origin in self._by_key.values())

    async def post(self, url: str, data: bytes, headers: Mapping[str, str] | bytes | None = None,
                   asked: asyncio.Future[None] | None = None, deadline: float | None = None, *,
                   fresh: bool = False) -> Reply:
        """POST ``data`` to ``url``: the answer once its head has come (see the module doc). ``headers``: besides the
        pool's, as a mapping or as ``header_lines`` made them (for several requests); ``asked`` is set once the
        request has gone out on a connection; ``deadline`` (loop time), when nearer than ``timeout_s`` from now, is
        the request's (a caller's own deadline over several attempts); ``fresh``: on a new connection, none of the
        idle ones (within ``limit_per_host`` all the same: at the limit, the oldest idle one is closed for it)."""
        latest = self.loop.time() + self.timeout_s
        if deadline is None or deadline > latest:
            deadline = latest
        known = self._origins.get(url)  # (``_origin``'s cache, without its call)
        origin, path = known if known is not None else self._origin(url)
        lines = headers if isinstance(headers, bytes) else header_lines(headers) if headers else b""
        request = b"POST %s HTTP/1.1\r\nhost: %s\r\n%b%bcontent-length: %d\r\n\r\n%b" % (
            path, origin.host_header, self._fixed, lines, len(data), data)
        conn = await self._acquire(origin, deadline, fresh)
        reply = conn.reply = Reply(conn, deadline)
        try:
            transport = conn.transport
            assert transport is not None
            if self.before_write is not None:
                await self.before_write(transport, conn.reused)
            if conn.is_lost or transport.is_closing():  # (the worker's close came in first)
                raise Disconnected(f"{self.describe(conn)} closed the connection before the request went out",
                                   answered=False, reused=conn.reused)
            transport.write(request)
            if asked is not None and not asked.done():
                asked.set_result(None)
            while not reply.status and not reply.ended:
                await reply._wait()
            if not reply.status:
                assert reply._error is not None
                raise reply._error
        except BaseException:
            reply.close()
            raise
        return reply

    def close(self) -> None:
        """Close every connection and fail every waiter (the pool takes no request after)."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for origin in self._by_key.values():
            for waiter in origin.waiters:
                if not waiter.done():
                    waiter.set_exception(ConnectFailed("the gateway is closing its connections to the workers"))
            origin.waiters.clear()
            for conn in origin.idle:
                conn.close()
            origin.idle.clear()
        for conn in list(self._conns):
            if conn.reply is not None:
                conn.reply._fail(Disconnected("the gateway closed the connection", answered=conn.reply.answered,
                                              reused=conn.reused))
            conn.close()

    # -- connections ----------------------------------------------------------------------------------
    def _origin(self, url: str) -> tuple[_Origin, bytes]:
        known = self._origins.get(url)
        if known is not None:
            return known
        parts = urlsplit(url)
        if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise ValueError(f"not an http:// or https:// URL: {url!r}")
        port = parts.port or _DEFAULT_PORTS[parts.scheme]
        key = (parts.hostname, port, parts.scheme == "https")
        origin = self._by_key.get(key)
        if origin is None:
            origin = self._by_key[key] = _Origin(parts.hostname, port, parts.netloc.encode("idna"), key[2])
        path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=~").encode("ascii")  # (check_http_url: no query)
        if len(self._origins) < 4096:  # (the workers' few routes; a bound all the same)
            self._origins[url] = (origin, path)
        return origin, path

    async def _acquire(self, origin: _Origin, deadline: float, fresh: bool = False) -> _Connection:
        loop = self.loop
        woken = False  # (a waiter woken for a connection that another took first keeps its place: the head of the line)
        while True:
            if self._closed:
                raise ConnectFailed("the gateway is closing its connections to the workers")
            idle = origin.idle
            if fresh:
                if idle and origin.num_open >= self.limit_per_host:
                    idle[0].close()  # (the oldest: room for a new one; ``_gone`` takes it off the list)
            else:
                while idle:
                    conn = idle.pop()  # (the freshest: the least likely to meet its keep-alive's end)
                    if conn.is_lost or conn.transport is None or conn.transport.is_closing() \
                            or loop.time() - conn.idle_since >= self.keepalive_s:
                        conn.close()
                        continue
                    conn.reused = True
                    if self.on_reuse is not None:
                        await self.on_reuse(conn.transport)
                    return conn
            if origin.num_open < self.limit_per_host:
                return await self._connect(origin, deadline)
            waiter = loop.create_future()
            if woken:
                origin.waiters.appendleft(waiter)
            else:
                origin.waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException as exc:
                with contextlib.suppress(ValueError):
                    origin.waiters.remove(waiter)
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self._wake_one(origin)  # (it was woken as it gave up: the turn passes on)
                if isinstance(exc, TimeoutError):
                    raise TimeoutError(f"no connection to {origin.host}:{origin.port} came free within "
                                       f"{self.timeout_s:g}s ({self.limit_per_host} open)") from None
                raise
            origin.waiters.remove(waiter)
            woken = True

    async def _connect(self, origin: _Origin, deadline: float) -> _Connection:
        loop = self.loop
        origin.num_open += 1
        conn = _Connection(self, origin)
        self._conns.add(conn)
        context = None
        if origin.ssl:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        start = loop.time()
        until = min(start + self.connect_timeout_s, deadline)  # (or the request's deadline)
        try:
            async with asyncio.timeout_at(until):
                await loop.create_connection(lambda: conn, origin.host, origin.port, ssl=context)
        except TimeoutError:
            self._gone(conn)
            if until >= deadline:  # cut short by the request's deadline: its timeout (3.), not the worker's failure
                raise TimeoutError(f"no connection to {origin.host}:{origin.port} by the request's deadline "
                                   f"({max(0.0, until - start):.3g}s left)") from None
            raise ConnectFailed(f"could not connect to {origin.host}:{origin.port} within "
                                f"{self.connect_timeout_s:.3g}s") from None
        except OSError as exc:
            self._gone(conn)
            raise ConnectFailed(f"could not connect to {origin.host}:{origin.port}: {exc}") from exc
        except BaseException:
            self._gone(conn)
            if conn.transport is not None:
                conn.transport.close()
            raise
        return conn

    def _put_back(self, conn: _Connection) -> None:
        transport = conn.transport
        if not self.reuse or self._closed or conn.is_lost or transport is None or transport.is_closing():
            conn.close()
            return
        conn.idle_since = self.loop.time()
        origin = conn.origin
        origin.idle.append(conn)
        if self._sweep is None:
            self._sweep = self.loop.call_later(self.keepalive_s, self._sweep_idle)
        if origin.waiters:  # (none, mostly: no call to look)
            self._wake_one(origin)

    def _gone(self, conn: _Connection) -> None:
        """``conn`` is closed or closing: it no longer counts, and a waiter may open another."""
        if not conn.counted:
            return
        conn.counted = False
        self._conns.discard(conn)
        origin = conn.origin
        origin.num_open -= 1
        if conn.reply is None:
            with contextlib.suppress(ValueError):
                origin.idle.remove(conn)
        self._wake_one(origin)

    def _wake_one(self, origin: _Origin) -> None:
        for waiter in origin.waiters:
            if not waiter.done():
                waiter.set_result(None)
                return

    def _sweep_idle(self) -> None:
        self._sweep = None
        now = self.loop.time()
        oldest = None
        for origin in self._by_key.values():
            while origin.idle and now - origin.idle[0].idle_since >= self.keepalive_s:
                origin.idle.pop(0).close()
            if origin.idle:
                since = origin.idle[0].idle_since
                oldest = since if oldest is None else min(oldest, since)
        if oldest is not None and not self._closed:
            self._sweep = self.loop.call_at(oldest + self.keepalive_s, self._sweep_idle)


def header_lines(headers: Mapping[str, str]) -> bytes:
    """``headers`` as a request's header lines (``HttpPool.post`` takes them as they are); ``ValueError`` for a name
    or value that would break the request's framing (a line break, NUL, a colon in a name)."""
    lines = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    if lines.count("\r") != len(headers) or lines.count("\n") != len(headers) or "\0" in lines \
            or ":" in "".join(headers):
        bad = next(name for name, value in headers.items()
                   if "\r" in name + value or "\n" in name + value or "\0" in name + value or ":" in name)
        raise ValueError(f"header {bad!r} cannot be sent: it holds a line break, NUL or colon")
    return lines.encode("latin-1")
