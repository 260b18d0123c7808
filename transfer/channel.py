"""One framed control connection between a decode and a prefill (either end).

Lifecycle:
1. Wrap a connected socket: ``ControlChannel(sock, name, on_message, on_close)``.
2. ``start()`` runs a reader thread that calls ``on_message(channel, msg)`` per frame (in that thread,
   so handlers must not block for long) and ``on_close(channel, error)`` exactly once at the end.
3. ``send(msg)`` from any thread, never waiting on the peer (the scheduler's thread sends page lists):
   what the socket takes at once is written there and then; the rest queues in order for a writer
   thread (started the first time a frame does not fit). It returns False (the message is not sent)
   once the channel is closed; the channel closes itself when the socket breaks, when the peer reads
   nothing for ``SEND_TIMEOUT_S`` while frames wait, or when more than ``MAX_BACKLOG_BYTES`` wait.
4. ``close(reason)`` from any thread (``settle`` first waits for frames still queued); the reader then
   ends and reports ``on_close``. ``join()`` waits. ``close_after(reason, settle_s)`` closes once the
   frames already queued are written (at most ``settle_s`` later) without the caller waiting: the writer
   thread closes it; nothing sent after it is taken.
``last_rx`` (monotonic seconds) is refreshed by every received frame: the heartbeat check reads it.
``set_handler(fn)`` (from the reader thread, in a handler) routes the frames after this one to ``fn``: a key's
handshake (``transfer.auth``) hands over to the ordinary handler once the peer proved the key.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from transfer.errors import TransferError, TransferErrorKind
from transfer.messages import FrameReader, Message, encode_frame

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5.0  # frames waiting and the peer reading none of them for this long: the channel closes
MAX_BACKLOG_BYTES = 16 * 1024 * 1024  # frames waiting for the peer past this: the channel closes
_POLL_S = 0.5  # socket timeout: how often a blocked reader rechecks whether it was closed


class ControlChannel:
    def __init__(
        self,
        sock: socket.socket,
        name: str,
        on_message: Callable[[ControlChannel, Message], None],
        on_close: Callable[[ControlChannel, TransferError], None],
    ) -> None:
        self.sock = sock
        self.name = name
        self._on_message = on_message
        self._on_close = on_close
        self._send_lock = threading.Lock()
        self._has_backlog = threading.Condition(self._send_lock)
        self._backlog: deque[memoryview] = deque()  # frames (or their tails) the socket did not take yet, in order
        self._backlog_bytes = 0
        self._writer: threading.Thread | None = None
        self._closed = threading.Event()
        self._close_error: TransferError | None = None
        # (``close_after``) the close waits for the backlog until then, with this error; no send is taken
        self._close_by: float | None = None
        self._close_after_error = TransferError(TransferErrorKind.ABORTED, f"{name}: closed locally")
        self.last_rx = time.monotonic()
        self.last_tx = time.monotonic()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(_POLL_S)
        self._thread = threading.Thread(target=self._read_loop, name=f"kv-ctl-{name}", daemon=True)

    @property
    def is_closed(self) -> bool:
        return self._closed.is_set()

    def start(self) -> None:
        self._thread.start()

    def set_handler(self, on_message: Callable[[ControlChannel, Message], None]) -> None:
        """The handler of every frame read from now on (call it from a handler: the reader thread)."""
        self._on_message = on_message

    def send(self, msg: Message) -> bool:
        """Write ``msg`` now as far as the socket takes it, the rest queued for the writer; never waits on
        the peer. False: the channel is closed (or closed itself now: see the module doc)."""
        if self._closed.is_set():
            return False
        frame = memoryview(encode_frame(msg))
        with self._send_lock:
            if self._close_by is not None:  # (``close_after``: closing once what came before is written)
                return False
            error = self._send_locked(frame)
        if error is None:
            return True
        self.close(error)
        return False

    def _send_locked(self, frame: memoryview) -> TransferError | None:
        if self._closed.is_set():  # (closed meanwhile: its socket may be closed, its descriptor reused)
            return TransferError(TransferErrorKind.ABORTED, f"{self.name}: closed")
        written = 0
        if not self._backlog:  # (behind frames already waiting it waits too: in order)
            try:  # (the socket has a timeout, so its descriptor is non-blocking: this never waits)
                written = os.write(self.sock.fileno(), frame)
            except BlockingIOError:
                pass
            except OSError as exc:
                return TransferError(TransferErrorKind.PEER_GONE, f"{self.name}: send failed: {exc}")
            else:
                self.last_tx = time.monotonic()
                if written == len(frame):
                    return None
        self._backlog.append(frame[written:])
        self._backlog_bytes += len(frame) - written
        if self._backlog_bytes > MAX_BACKLOG_BYTES:
            return TransferError(TransferErrorKind.PEER_GONE, f"{self.name}: send failed: more than "
                                 f"{MAX_BACKLOG_BYTES} bytes wait for a peer that does not read them")
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name=f"kv-ctl-w-{self.name}", daemon=True)
            self._writer.start()
        self._has_backlog.notify_all()  # (the writer; ``settle`` waits on it too)
        return None

    def _write_loop(self) -> None:
        """The writer: the frames the socket did not take at once, written as the peer reads them."""
        fd = self.sock.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        error: TransferError | None = None
        while error is None:
            with self._send_lock:
                while not self._backlog and not self._closed.is_set() and self._close_by is None:
                    self._has_backlog.wait(_POLL_S)  # (``close`` wakes it; the timeout is only a backstop)
                if self._closed.is_set():
                    return
                if self._close_by is not None and (not self._backlog or time.monotonic() >= self._close_by):
                    break  # (``close_after``: what was queued is written, or its time is up)
            waited = 0.0  # (in slices: a closed channel's descriptor may be another file's by now)
            while not poller.poll(_POLL_S * 1000):  # (a shut-down socket polls at once: a failed write below)
                waited += _POLL_S
                if self._closed.is_set():
                    return
                if self._close_by is not None and time.monotonic() >= self._close_by:
                    break  # (``close_after``: the peer did not take what was queued in time)
                if waited >= SEND_TIMEOUT_S:
                    error = TransferError(TransferErrorKind.PEER_GONE, f"{self.name}: send failed: the peer "
                                          f"read nothing for {SEND_TIMEOUT_S:g}s")
                    break
            if error is not None:
                break
            with self._send_lock:
                if self._closed.is_set():  # (the reader closes the socket under this lock: ``fd`` may be reused)
                    return
                error = self._drain(fd)
        self.close(error or self._close_after_error)

    def _drain(self, fd: int) -> TransferError | None:
        """Write waiting frames until the socket is full (under the send lock)."""
        backlog = self._backlog
        try:
            while backlog:
                data = backlog[0]
                written = os.write(fd, data)
                self._backlog_bytes -= written
                self.last_tx = time.monotonic()
                if written < len(data):
                    backlog[0] = data[written:]
                    return None
                backlog.popleft()
            self._has_backlog.notify_all()  # (``settle`` waits for this)
        except BlockingIOError:
            return None
        except OSError as exc:
            return TransferError(TransferErrorKind.PEER_GONE, f"{self.name}: send failed: {exc}")
        return None

    def settle(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until no frame waits for the writer: before a close that must not
        lose what was sent last. True: nothing waits (or the channel closed)."""
        with self._send_lock:
            return self._has_backlog.wait_for(lambda: not self._backlog or self._closed.is_set(), timeout_s)

    def close_after(self, error: TransferError, settle_s: float) -> None:
        """``close(error)`` once every frame already queued is written, or ``settle_s`` from now if the
        peer has not taken them by then, without waiting here (the writer thread closes it); a send from now
        on is refused. What was sent last before a close (a room's status) is then not lost to a backlog."""
        with self._send_lock:
            if not self._closed.is_set() and self._close_by is None and self._backlog:
                self._close_after_error = error
                self._close_by = time.monotonic() + settle_s
                self._has_backlog.notify_all()
                return
        self.close(error)  # (nothing waits: at once)

    def close(self, error: TransferError | None = None) -> None:
        if self._closed.is_set():
            return
        self._close_error = error or TransferError(TransferErrorKind.ABORTED, f"{self.name}: closed locally")
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self._send_lock:  # (the writer and ``settle`` wait for it; nobody holding this lock waits on more)
            self._has_backlog.notify_all()

    @staticmethod
    def close_all(channels: list[ControlChannel], settle_s: float = 1.0) -> None:
        """Close ``channels`` (a side's at its close), each first let settle (``settle_s`` for them all:
        their last messages, Quiesced or Aborts, may wait in a backlog), and wait for their threads."""
        settle_by = time.monotonic() + settle_s
        for channel in channels:
            channel.settle(max(0.0, settle_by - time.monotonic()))
            channel.close()
        for channel in channels:
            channel.join(timeout=5.0)

    def join(self, timeout: float | None = None) -> None:
        for thread in (self._thread, self._writer):
            if thread is not None and thread.is_alive() and threading.current_thread() is not thread:
                thread.join(timeout)

    def _read_loop(self) -> None:
        reader = FrameReader(self.sock, keep_going=lambda: not self._closed.is_set())
        error: TransferError
        try:
            while True:
                msg = reader.read()
                if msg is None:
                    error = TransferError(TransferErrorKind.PEER_GONE, f"{self.name}: peer closed the connection")
                    break
                self.last_rx = time.monotonic()
                self._on_message(self, msg)
        except TransferError as exc:
            error = exc
        except OSError as exc:
            error = TransferError(TransferErrorKind.PEER_GONE, f"{self.name}: connection broke: {exc}")
        except Exception as exc:  # a handler bug must not leave the channel half-alive
            log.exception("control channel %s: handler failed", self.name)
            error = TransferError(TransferErrorKind.PROTOCOL, f"{self.name}: handler failed: {exc!r}")
        if self._closed.is_set() and self._close_error is not None:
            error = self._close_error
        self._closed.set()
        with self._send_lock:  # (no write is under way on the descriptor as it is closed)
            try:
                self.sock.close()
            except OSError:
                pass
            self._has_backlog.notify_all()
        self._on_close(self, error)
