"""The worker's native server: gateway connections speaking ``workers.protocol`` frames.

Lifecycle:
1. ``NativeServer.start()`` listens on TCP.
2. Each connection gets an id; the first frame must be ``Hello`` with our protocol version (else
   ``Rejected`` and close). Then ``Submit``/``Abort`` frames go to the scheduler's inbox; ``Ping`` and
   ``GetTokenizer`` (the tokenizer directory's files, read in a thread) are answered here.
3. The scheduler thread hands each step's messages to ``deliver`` (thread-safe), which groups them per
   connection and writes each connection's frames straight to its socket (one ``send``, no event-loop
   wake-up) while nothing of that connection waits in the event loop. What a socket does not take at
   once is queued, and so is all that follows it, for the event loop to write (one
   ``call_soon_threadsafe`` per batch of steps), until a write of the loop's leaves the transport's
   buffer empty again. A connection that leaves more than ``max_unread_bytes`` unread (a gateway that
   stopped reading) is dropped, never waited on: the scheduler goes on for everyone else. One whose
   peer host stops answering (it died, or the network was cut: nothing closes the socket) is closed by
   the kernel after about ``peer_timeout_s``.
4. A closed connection drops its requests (pages freed); ``aclose()`` stops listening and closes
   every connection. If the scheduler thread has died, handshakes are rejected and a submit gets an
   ``Error`` and its connection is closed, so the gateway marks this worker down instead of waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from transfer.netaddr import listener, watch_peer
from workers.protocol import (
    MAX_HELLO_BYTES,
    MAX_UNREAD_BYTES,
    PEER_TIMEOUT_S,
    PROTOCOL_VERSION,
    Abort,
    GetTokenizer,
    Hello,
    HelloAck,
    Ping,
    Pong,
    Rejected,
    Submit,
    TokenizerFiles,
    read_frame,
    worker_codec,
)
from workers.scheduler import BROADCAST, BUSY_REPORT_S, Message, Scheduler

log = logging.getLogger(__name__)


class _Link:
    """One gateway connection's way out (``NativeServer``'s write lock guards all but ``writer``)."""

    __slots__ = ("conn_id", "direct", "queued", "sock", "writer")

    def __init__(self, conn_id: int, writer: asyncio.StreamWriter) -> None:
        self.conn_id = conn_id
        self.writer = writer
        # The scheduler thread's socket: a duplicate of the transport's descriptor, so that a send never reaches a
        # descriptor number the event loop closed and gave to another connection (closed with the connection).
        # Without one (no descriptors left) the event loop writes everything, as it would after a partial send.
        self.sock: socket.socket | None = None
        with contextlib.suppress(OSError):
            if (sock := writer.get_extra_info("socket")) is not None:
                self.sock = socket.fromfd(sock.fileno(), sock.family, sock.type)
        self.queued: list[bytes] = []  # for the event loop to write, in order
        self.direct = self.sock is not None  # the scheduler thread may send: nothing of this connection is queued

    def put(self, data: bytes) -> bool:
        """Scheduler thread: ``data`` sent now, or queued behind what waits (True: for the event loop to write)."""
        if self.direct:
            assert self.sock is not None
            try:
                sent = self.sock.send(data)
            except OSError:  # (full; or broken: the loop's write meets the same error and ends the connection)
                sent = 0
            if sent == len(data):
                return False
            data = data[sent:]
            self.direct = False
        self.queued.append(data)
        return True

    def close(self) -> None:
        self.queued.clear()
        self.direct = False
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class NativeServer:
    def __init__(self, scheduler: Scheduler, hello_ack: Callable[[], HelloAck], host: str, port: int, *,
                 max_unread_bytes: int = MAX_UNREAD_BYTES,
                 tokenizer_files: Callable[[], TokenizerFiles] | None = None, api_key: str | None = None,
                 peer_timeout_s: float = PEER_TIMEOUT_S) -> None:
        """``api_key``: a peer's ``Hello`` must carry it (else ``Rejected``). ``peer_timeout_s``: a gateway whose
        host stops answering (gone, or the network cut) for about this long is dropped, its requests ended."""
        self._scheduler = scheduler
        self._peer_timeout_s = peer_timeout_s
        self._api_key = api_key.encode() if api_key else None
        self._max_unread = max_unread_bytes
        self._hello_ack = hello_ack
        self._tokenizer_files = tokenizer_files  # answers GetTokenizer (read in a thread: files may be MBs)
        self._host = host
        self._port = port
        self._codec = worker_codec()
        self._scheduler_codec = worker_codec()  # (``deliver``'s: it runs in the scheduler thread)
        self._links: dict[int, _Link] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._write_lock = threading.Lock()  # every write to a connection's socket, from either thread
        self._loop_due = False  # ``_write_queued`` is scheduled (guarded by the lock)
        self._repeater: asyncio.Task[None] | None = None
        # connections the kernel closed for a silent peer (``peer_timeout_s``: ETIMEDOUT on a read or a write)
        self.num_peer_timeouts = 0

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def num_connections(self) -> int:
        return len(self._links)

    async def start(self, serve: bool = True) -> None:
        """Bind the port; ``serve``: accept connections now (else from ``start_serving``: until then a
        connection is refused, as with nothing listening)."""
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._on_connect, sock=listener(self._host, self._port, listen=False),
                                                  start_serving=serve)
        self._repeater = asyncio.create_task(self._repeat_reports(), name="load-report-repeater")

    async def _repeat_reports(self) -> None:
        """While the scheduler is in a long step its load reports go out again, so that no gateway takes them
        as stale (``Scheduler.reports_to_repeat``)."""
        while True:
            await asyncio.sleep(BUSY_REPORT_S)
            if self._links:
                try:
                    reports = self._scheduler.reports_to_repeat(time.monotonic())
                except Exception:  # (read while the scheduler thread changes them: the next tick tries again)
                    log.debug("repeating load reports failed", exc_info=True)
                    continue
                if reports:
                    self._write_batch(reports)

    async def start_serving(self) -> None:
        assert self._server is not None
        await self._server.start_serving()

    def deliver(self, messages: list[tuple[int, Message]]) -> None:
        """Called from the scheduler thread: each connection's frames are sent now, unless something of that
        connection waits for the event loop (then they queue behind it; the loop is woken once per batch)."""
        encode = self._scheduler_codec.encode
        frames = [(conn_id, encode(msg)) for conn_id, msg in messages]
        wake = False
        with self._write_lock:
            for conn_id, data in self._per_connection(frames):
                link = self._links.get(conn_id)
                if link is not None and link.put(data):
                    wake = True
            if wake:
                wake, self._loop_due = not self._loop_due, True
        if wake and self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closing during shutdown
                self._loop.call_soon_threadsafe(self._write_queued)

    def _per_connection(self, frames: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Each connection's frames as one write (a broadcast's to every connection; the write lock held)."""
        if len(frames) == 1 and frames[0][0] != BROADCAST:
            return frames
        grouped: dict[int, list[bytes]] = {}
        broadcast: list[bytes] = []
        for conn_id, frame in frames:
            if conn_id == BROADCAST:
                broadcast.append(frame)
            else:
                grouped.setdefault(conn_id, []).append(frame)
        if broadcast:
            for conn_id in self._links:
                grouped.setdefault(conn_id, []).extend(broadcast)
        return [(conn_id, b"".join(chunks)) for conn_id, chunks in grouped.items()]

    def _write_queued(self) -> None:
        with self._write_lock:
            self._loop_due = False
            for link in self._links.values():
                if link.queued:
                    self._write(link, b"")

    def _write_batch(self, messages: Sequence[tuple[int, msgspec.Struct]]) -> None:
        """Event loop: ``messages`` written behind whatever of their connections is queued."""
        frames = [(conn_id, self._codec.encode(msg)) for conn_id, msg in messages]
        with self._write_lock:
            for conn_id, data in self._per_connection(frames):
                if (link := self._links.get(conn_id)) is not None:
                    self._write(link, data)

    def _send(self, conn_id: int, msg: msgspec.Struct) -> None:
        """Event loop: one message to a connection, behind whatever of it is queued."""
        self._write_batch([(conn_id, msg)])

    def _write(self, link: _Link, data: bytes) -> None:
        """Event loop, the write lock held: what is queued, then ``data``, to the transport. The scheduler thread
        sends for itself again once the transport's buffer is empty after it."""
        if link.queued:
            data = b"".join((*link.queued, data))
            link.queued.clear()
        writer = link.writer
        if writer.is_closing():
            return
        writer.write(data)
        unread = writer.transport.get_write_buffer_size()
        if unread > self._max_unread:
            log.warning("dropping gateway connection %d: %d bytes of output unread (limit %d); its requests end",
                        link.conn_id, unread, self._max_unread)
            link.close()
            writer.transport.abort()
            return
        link.direct = link.sock is not None and not unread

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn_id = next(self._ids)
        try:
            # (without it, the requests of a gateway whose host died held their KV pages and running places until
            # their own timeouts, ~15 minutes for a stream's unacknowledged sends: nothing else notices)
            watch_peer(writer.get_extra_info("socket"), self._peer_timeout_s)
            async with asyncio.timeout(10.0):  # (not ``wait_for``: on Python 3.11 it can lose a cancellation)
                frame = await read_frame(reader, MAX_HELLO_BYTES)
            hello = self._codec.decode(frame)
            if not isinstance(hello, Hello) or hello.version != PROTOCOL_VERSION:
                got = hello.version if isinstance(hello, Hello) else type(hello).__name__
                writer.write(self._codec.encode(Rejected(f"protocol version {PROTOCOL_VERSION} required, got {got}")))
                await writer.drain()
                return
            if self._api_key is not None and not hmac.compare_digest(hello.key.encode(), self._api_key):
                log.warning("refused a connection (%r) from %s: %s API key", hello.client[:64],
                            writer.get_extra_info("peername"), "a wrong" if hello.key else "no")
                why = "no API key" if not hello.key else "a wrong API key"
                writer.write(self._codec.encode(Rejected(
                    f"{why}: this worker takes peers with its --api-key (the gateway's --worker-api-key)")))
                await writer.drain()
                return
            if not self._scheduler.is_alive:
                writer.write(self._codec.encode(Rejected("the worker's scheduler is not running")))
                await writer.drain()
                return
            writer.write(self._codec.encode(self._hello_ack()))
            with self._write_lock:
                self._links[conn_id] = _Link(conn_id, writer)
            self._scheduler.connect(conn_id)
            while True:
                body = await read_frame(reader)
                match self._codec.decode(body):
                    case Submit() as msg:
                        if not self._scheduler.is_alive:  # (shutting down, or its loop crashed)
                            self._send(conn_id, self._scheduler.stopped(msg.rid))
                            await writer.drain()
                            return
                        self._scheduler.submit(conn_id, msg)
                    case Abort(rid=rid, reason=reason):
                        self._scheduler.abort(conn_id, rid, reason)
                    case GetTokenizer():
                        if self._tokenizer_files is None:
                            raise ValueError("GetTokenizer: this worker serves no tokenizer files")
                        files = await asyncio.to_thread(self._tokenizer_files)
                        self._send(conn_id, files)
                    case Ping(nonce=nonce):
                        sched = self._scheduler
                        self._send(conn_id, Pong(nonce, sched.num_steps, sched.stalled_s))
                    case other:
                        raise ValueError(f"unexpected message {type(other).__name__}")
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            # (the kernel's verdict on a silent peer comes as ETIMEDOUT; the Hello's own timeout has no errno)
            if isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT:
                self.num_peer_timeouts += 1
                log.info("gateway connection %d closed: its peer %s stopped answering (--gateway-timeout-s %g); "
                         "its requests end", conn_id, writer.get_extra_info("peername"), self._peer_timeout_s)
        except asyncio.CancelledError:
            pass  # aclose(): end quietly (asyncio's stream callback would log a cancelled handler)
        except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # (RecursionError: nested too deeply)
            log.warning("closing connection %d: protocol error: %s", conn_id, exc)
        finally:
            with self._write_lock:
                if (link := self._links.pop(conn_id, None)) is not None:
                    link.close()
            self._scheduler.drop_connection(conn_id)
            writer.close()
            self._tasks.discard(task)

    async def aclose(self) -> None:
        if self._repeater is not None:
            self._repeater.cancel()
        if self._server is not None:
            self._server.close()
        for link in list(self._links.values()):
            link.writer.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
