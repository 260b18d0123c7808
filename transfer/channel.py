"""One framed control connection between a decode and a prefill (either end).

Lifecycle:
1. Wrap a connected socket: ``ControlChannel(sock, name, on_message, on_close)``.
2. ``start()`` runs a reader thread that calls ``on_message(channel, msg)`` per frame (in that thread,
   so handlers must not block for long) and ``on_close(channel, error)`` exactly once at the end.
3. ``send(msg)`` from any thread; it returns False (and closes the channel) if the socket is broken
   or the peer stopped reading for longer than the send timeout.
4. ``close(reason)`` from any thread; the reader then ends and reports ``on_close``. ``join()`` waits.
``last_rx`` (monotonic seconds) is refreshed by every received frame: the heartbeat check reads it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from transfer.errors import TransferError, TransferErrorKind
from transfer.messages import FrameReader, Message, encode_frame

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5.0
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
        self._closed = threading.Event()
        self._close_error: TransferError | None = None
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

    def send(self, msg: Message) -> bool:
        if self._closed.is_set():
            return False
        frame = encode_frame(msg)
        with self._send_lock:
            deadline = time.monotonic() + SEND_TIMEOUT_S
            view = memoryview(frame)
            try:
                while view:
                    try:
                        n = self.sock.send(view)
                    except TimeoutError:
                        if time.monotonic() > deadline or self._closed.is_set():
                            raise
                        continue
                    view = view[n:]
            except OSError as exc:
                self.close(TransferError(TransferErrorKind.PEER_GONE, f"{self.name}: send failed: {exc}"))
                return False
            self.last_tx = time.monotonic()
        return True

    def close(self, error: TransferError | None = None) -> None:
        if self._closed.is_set():
            return
        self._close_error = error or TransferError(TransferErrorKind.ABORTED, f"{self.name}: closed locally")
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

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
        try:
            self.sock.close()
        except OSError:
            pass
        self._on_close(self, error)
