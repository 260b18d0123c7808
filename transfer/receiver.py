"""Decode side of one room: ``KVReceiver`` (it owns its state) and the record of a prefill connection.

Lifecycle: ``DecodeSide.create_receiver`` (``transfer.decode``) makes it Bootstrapping; ``join`` (the
connection to its prefill) / ``connection_ready`` -> WaitingForInput; ``metadata_leaving`` as its page
list goes out; ``succeed`` on the prefill's ok ``RoomStatus``; ``fail`` at any time; ``quiet`` once no
write of the room can land any more (``quiesced``); ``release`` forgets it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transfer.channel import ControlChannel
from transfer.errors import TransferError
from transfer.room import TERMINAL, RoomHandle
from transfer.types import KVPoll

if TYPE_CHECKING:
    from transfer.decode import DecodeSide


@dataclass(eq=False)
class PrefillConn:
    """One control connection to a prefill and the rooms that use it."""

    address: tuple[str, int]
    channel: ControlChannel | None = None
    ready: bool = False
    error: TransferError | None = None
    receivers: set[KVReceiver] = field(default_factory=set)  # live, or failed and not yet quiesced
    draining: bool = False  # silent prefill, no fencing: kept open only to hear its Quiesced
    draining_since: float = 0.0  # (draining) the decode's run clock when it began: ``quarantine_s`` counts from it
    left: bool = False  # told its data path broke or stalled: no new room; closed by us once none uses it
    targets: set[tuple[str, int | None, str | None]] = field(default_factory=set)  # resolved to this address
    # (room, reason): sent once registered; if it cannot be opened, they go where the registry names next
    pending_aborts: list[tuple[KVReceiver, str]] = field(default_factory=list)
    nonce: bytes = b""  # (workers with a key) ours in ``AuthHello``: the prefill's proof must cover it


class KVReceiver(RoomHandle):
    """One room on the decode side. It owns its state: the scheduler calls its public methods (each
    non-blocking; ``poll``, ``failure``, ``abort``, ``release`` from ``RoomHandle``); ``DecodeSide``
    moves it only through the transitions below, with the manager's lock held (connections, fences and
    the room table stay with ``DecodeSide``)."""

    _side: DecodeSide

    def __init__(self, side: DecodeSide, room: int, now: float) -> None:
        super().__init__(side, room, now)
        self.metadata_sent = False
        self.aux_len: int | None = None  # bytes the prefill wrote into the aux slot (known at Success)
        self.metadata_at = 0.0  # when the page list left
        self.generation = 0  # of our page list (the fence of the prefill's writes)
        self.fence_open = False  # (DecodeSide's bookkeeping of our fence in the backend)
        self._conn: PrefillConn | None = None
        self._quiet = False
        self.target: tuple[str, int | None, str | None] | None = None  # (host, port, instance_id) to resolve
        self.resolved_again = False  # asked the registry again after its address could not be reached
        # Aborted before it had a connection to its prefill (its address still being looked up): the
        # prefill is told once one exists (``DecodeSide._attach``), so that it does not wait for a page list.
        self.abort_reason: str | None = None

    # -- the scheduler's API ---------------------------------------------------------------------
    @property
    def quiesced(self) -> bool:
        """True once no write of this room can land in our pages any more (Success; or Failed and the
        prefill confirmed, or the connection to it closed: at once when our backend fences writes, else once
        we ran a heartbeat timeout since; or it never got our page list). Pages of a
        Failed room should go back to the pool only when this is True."""
        return self._state == KVPoll.Success or not self.metadata_sent or self._quiet

    def send_metadata(self, page_ids: Sequence[int], aux_index: int) -> None:
        """Tell the prefill where to write. Only in WaitingForInput before metadata was sent; ignored
        once Failed; ValueError for page ids or an aux slot outside our pool."""
        self._side.send_metadata(self, list(page_ids), aux_index)

    # -- what DecodeSide reads (lock held) -------------------------------------------------------
    @property
    def conn(self) -> PrefillConn | None:
        return self._conn

    @property
    def is_quiet(self) -> bool:
        """Told (or known) that no write of ours can land any more."""
        return self._quiet

    # -- transitions (DecodeSide, lock held); each answers whether poll() or quiesced changed -----
    def join(self, conn: PrefillConn) -> bool:
        """Attach to the prefill connection; WaitingForInput when it is registered already."""
        self._conn = conn
        return self.connection_ready() if conn.ready else False

    def connection_ready(self) -> bool:
        if self._state != KVPoll.Bootstrapping:
            return False
        self._state = KVPoll.WaitingForInput
        return True

    def metadata_leaving(self, generation: int, now: float) -> None:
        self.metadata_sent = True
        self.metadata_at = now
        self.generation = generation

    def fail(self, error: TransferError) -> bool:
        if self._state in TERMINAL:
            return False
        self._state, self._error = KVPoll.Failed, error
        return True

    def succeed(self, aux_len: int) -> None:
        self.aux_len = aux_len
        self._state = KVPoll.Success

    def quiet(self) -> bool:
        """No byte of ours can land any more. True if ``quiesced`` changed."""
        was = self.quiesced
        self._quiet = True
        return self.quiesced != was

    def __repr__(self) -> str:
        return f"KVReceiver(room={self.room}, state={self._state.name}, metadata_sent={self.metadata_sent})"
