"""What both ends of one room share: ``RoomHandle``, the base of ``KVSender`` and ``KVReceiver``.

Lifecycle: made Bootstrapping by its side's table (``SenderRooms`` / ``DecodeSide``); the subclass moves
``_state`` (and ``_error`` on failure) with the table's lock held; ``mark_released`` once ``release`` ran.
"""

from __future__ import annotations

from typing import Any, Protocol

from transfer.errors import TransferError
from transfer.types import KVPoll

TERMINAL = (KVPoll.Failed, KVPoll.Success)


class RoomTable(Protocol):
    """The side that owns a room's handles (the manager's lock, connections, the room table)."""

    def abort(self, handle: Any, reason: str) -> None: ...

    def release(self, handle: Any) -> None: ...


class RoomHandle:
    """One room on one side. The scheduler calls the public methods (each non-blocking)."""

    def __init__(self, side: RoomTable, room: int, now: float) -> None:
        self.room = room
        self.created = now
        self._side = side
        self._state = KVPoll.Bootstrapping
        self._error: TransferError | None = None
        self._released = False

    # -- the scheduler's API ---------------------------------------------------------------------
    def poll(self) -> KVPoll:
        return self._state

    def failure(self) -> TransferError | None:
        return self._error

    def abort(self, reason: str) -> None:
        self._side.abort(self, reason)

    def release(self) -> None:
        self._side.release(self)

    # -- what the owning side reads and sets (its lock held) --------------------------------------
    @property
    def is_terminal(self) -> bool:
        return self._state in TERMINAL

    @property
    def is_released(self) -> bool:
        return self._released

    def mark_released(self) -> None:
        self._released = True
