"""State shared by a KV manager and its prefill/decode side: config, the backend, one lock, an outbox."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from transfer.base import TransferBackend
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
    # One re-entrant lock guards every room and connection of the manager; the condition wakes the
    # monitor thread when writes were posted.
    lock: threading.RLock = field(default_factory=threading.RLock)
    wake: threading.Condition = field(init=False)
    closed: bool = False
    # Counters for metrics, changed under ``lock`` and read without it (``KVManager.counters``).
    num_bytes_sent: int = 0  # prefill: bytes of KV pages and aux records posted to decodes
    num_rooms_completed: int = 0  # rooms that reached Success
    num_rooms_failed: int = 0  # rooms that reached Failed (aborts included)

    def __post_init__(self) -> None:
        self.wake = threading.Condition(self.lock)


def flush(outbox: Outbox) -> None:
    """Send queued control messages; call it without holding the lock (a send may wait on the peer)."""
    for channel, msg in outbox:
        channel.send(msg)
    outbox.clear()


def room_error(room: int, error: TransferError) -> TransferError:
    """``error`` re-worded to name the room (a connection-level error failing several rooms)."""
    return TransferError(error.kind, f"room {room}: {error.message}")
