"""The worker's native server: gateway connections speaking ``workers.protocol`` frames.

Lifecycle:
1. ``NativeServer.start()`` listens on TCP.
2. Each connection gets an id; the first frame must be ``Hello`` with our protocol version (else
   ``Rejected`` and close). Then ``Submit``/``Abort`` frames go to the scheduler's inbox; ``Ping`` and
   ``GetTokenizer`` (the tokenizer directory's files, read in a thread) are answered here.
3. The scheduler thread hands each step's messages to ``deliver`` (thread-safe): they queue up until
   the event loop gets to them (one ``call_soon_threadsafe`` per batch of steps, not per step), then
   are grouped per connection and written with one ``write`` call per connection. A connection that
   leaves more than ``max_unread_bytes`` unread (a gateway that stopped reading) is dropped, never
   waited on: the scheduler goes on for everyone else. One whose peer host stops answering (it died, or the
   network was cut: nothing closes the socket) is closed by the kernel after about ``peer_timeout_s``.
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
import threading
import time
from collections.abc import Callable

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
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: list[tuple[int, Message]] = []  # delivered, not yet written (guarded by the lock)
        self._pending_lock = threading.Lock()
        self._repeater: asyncio.Task[None] | None = None
        # connections the kernel closed for a silent peer (``peer_timeout_s``: ETIMEDOUT on a read or a write)
        self.num_peer_timeouts = 0

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def num_connections(self) -> int:
        return len(self._writers)

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
            if self._writers:
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
        """Called from the scheduler thread: the event loop is woken only if it has nothing queued yet."""
        with self._pending_lock:
            wake = not self._pending
            self._pending += messages
        if wake and self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closing during shutdown
                self._loop.call_soon_threadsafe(self._write_pending)

    def _write_pending(self) -> None:
        with self._pending_lock:
            messages, self._pending = self._pending, []
        self._write_batch(messages)

    def _write_batch(self, messages: list[tuple[int, Message]]) -> None:
        frames: dict[int, list[bytes]] = {}
        broadcast: list[bytes] = []
        for conn_id, msg in messages:
            frame = self._codec.encode(msg)
            if conn_id == BROADCAST:
                broadcast.append(frame)
            else:
                frames.setdefault(conn_id, []).append(frame)
        if broadcast:
            for conn_id in self._writers:
                frames.setdefault(conn_id, []).extend(broadcast)
        for conn_id, chunks in frames.items():
            writer = self._writers.get(conn_id)
            if writer is not None and not writer.is_closing():
                writer.write(b"".join(chunks))
                if (unread := writer.transport.get_write_buffer_size()) > self._max_unread:
                    log.warning("dropping gateway connection %d: %d bytes of output unread (limit %d); "
                                "its requests end", conn_id, unread, self._max_unread)
                    writer.transport.abort()

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
            self._writers[conn_id] = writer
            self._scheduler.connect(conn_id)
            while True:
                body = await read_frame(reader)
                match self._codec.decode(body):
                    case Submit() as msg:
                        if not self._scheduler.is_alive:  # (shutting down, or its loop crashed)
                            writer.write(self._codec.encode(self._scheduler.stopped(msg.rid)))
                            await writer.drain()
                            return
                        self._scheduler.submit(conn_id, msg)
                    case Abort(rid=rid, reason=reason):
                        self._scheduler.abort(conn_id, rid, reason)
                    case GetTokenizer():
                        if self._tokenizer_files is None:
                            raise ValueError("GetTokenizer: this worker serves no tokenizer files")
                        files = await asyncio.to_thread(self._tokenizer_files)
                        writer.write(self._codec.encode(files))
                    case Ping(nonce=nonce):
                        sched = self._scheduler
                        writer.write(self._codec.encode(Pong(nonce, sched.num_steps, sched.stalled_s)))
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
            self._writers.pop(conn_id, None)
            self._scheduler.drop_connection(conn_id)
            writer.close()
            self._tasks.discard(task)

    async def aclose(self) -> None:
        if self._repeater is not None:
            self._repeater.cancel()
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers.values()):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
