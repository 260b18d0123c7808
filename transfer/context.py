"""State shared by a KV manager and its prefill/decode side: config, the backend, one lock, an outbox."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from transfer.base import NotifiesCompletion, TransferBackend
from transfer.channel import ControlChannel
from transfer.errors import TransferError
from transfer.messages import Message
from transfer.types import KVArgs, KVTimeouts

Outbox = list[tuple[ControlChannel, Message]]


@dataclass
class Context:
    args: KVArgs
    backend: TransferBackend
    timeouts: KVTimeouts
    # One re-entrant lock guards every room and connection of the manager; ``kick()`` wakes the
    # monitor thread (writes posted or completed, a room to quiesce).
    lock: threading.RLock = field(default_factory=threading.RLock)
    wake: threading.Condition = field(init=False)
    kicked: bool = False  # a kick since the monitor's last tick began (read and cleared under ``lock``)
    closed: bool = False
    # Counters for metrics, changed under ``lock`` and read without it (``KVManager.counters``).
    num_bytes_sent: int = 0  # prefill: bytes of KV pages and aux records posted to decodes
    num_rooms_completed: int = 0  # rooms that reached Success
    num_rooms_failed: int = 0  # rooms that reached Failed by a transfer failure (peer gone, timeout, refused...)
    num_rooms_aborted: int = 0  # rooms that reached Failed by an abort (``RoomAborted``: either side's, a release)
    # decode: failed rooms called quiesced without their silent prefill's word, at ``quarantine_s``
    num_rooms_unquiesced_released: int = 0
    # Called (from whichever thread, lock held) after a room's state or ``quiesced`` changed, so the
    # scheduler wakes at once instead of polling: it must not block.
    on_change: Callable[[], None] | None = None
    # The backend tells the monitor when a write settles (``NotifiesCompletion``): posting one needs no
    # kick then; otherwise the monitor polls pending writes, and each post starts that.
    notifies: bool = field(init=False)

    def __post_init__(self) -> None:
        self.wake = threading.Condition(self.lock)
        self.notifies = isinstance(self.backend, NotifiesCompletion)

    def changed(self) -> None:
        """A room's poll() or quiesced answer changed: tell the listener (call it after the whole change)."""
        if self.on_change is not None:
            self.on_change()

    def kick(self) -> None:
        """Wake the monitor thread for a tick now (any thread; takes the lock briefly)."""
        with self.lock:
            self.kicked = True
            self.wake.notify_all()


def flush(outbox: Outbox) -> None:
    """Send queued control messages; call it without holding the lock (a send may wait on the peer)."""
    for channel, msg in outbox:
        channel.send(msg)
    outbox.clear()


def room_error(room: int, error: TransferError) -> TransferError:
    """``error`` re-worded to name the room (a connection-level error failing several rooms)."""
    return TransferError(error.kind, f"room {room}: {error.message}")
