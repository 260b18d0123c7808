"""Prefill side of one room: ``KVSender`` (it owns its state) and the records it shares with the room table.

Lifecycle: ``SenderRooms.create_sender`` (``transfer.sender_rooms``) makes it Bootstrapping; ``attach``
(the decode's page list) -> WaitingForInput; ``send`` -> Transferring (``next_chunk`` validates, the
table posts the batch, ``chunk_posted`` records it); ``settle`` reports the writes' progress to the
monitor thread, which calls ``succeed`` once the last chunk's writes are DONE; ``fail`` at any time
(-> Failed, its writes go to the table's graveyard); ``release`` forgets it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transfer.base import UNFENCED, Fence, PeerId, WriteHandle, WriteState
from transfer.channel import ControlChannel
from transfer.errors import TransferError
from transfer.messages import Register
from transfer.room import TERMINAL, RoomHandle
from transfer.types import KVPoll

if TYPE_CHECKING:
    from transfer.sender_rooms import SenderRooms


@dataclass
class Link:
    """One decode's control connection and what it registered."""

    channel: ControlChannel
    peer: PeerId | None = None
    reg: Register | None = None
    num_pages: int = 0
    num_aux_slots: int = 0
    aux_slot_bytes: int = 0
    closed: bool = False
    # the prefill is connecting to its data endpoint (in the reader thread: nothing is read meanwhile, so
    # the decode's pings wait unread: not silence)
    connecting: bool = False
    # (workers with a key) the decode has not proved it yet: only the handshake is read (``PrefillSide``); the
    # nonces (the decode's, ours) once its ``AuthHello`` was answered
    proving: bool = False
    nonces: tuple[bytes, bytes] | None = None
    opened: float = 0.0  # (monotonic) when it connected: one that has not proved the key a heartbeat later is closed


@dataclass
class PageList:
    """A decode's page list for one room (its ``RoomRequest``), kept until a sender takes it."""

    link: Link
    page_ids: list[int]
    aux_index: int
    arrived: float
    generation: int


@dataclass
class PostedWrite:
    """One backend batch of a room, until it is no longer PENDING and released."""

    room: int
    handle: WriteHandle
    posted: float
    staging_slot: int | None
    link: Link | None = None  # the decode it goes to (a failed room's write still in flight is timed too)


class KVSender(RoomHandle):
    """One room on the prefill side. It owns its state: the scheduler calls its public methods (each
    non-blocking; ``poll``, ``failure``, ``abort``, ``release`` from ``RoomHandle``); ``SenderRooms``
    moves it only through the transitions below, with the manager's lock held (the room table,
    connections, graveyard and outbox stay with ``SenderRooms``)."""

    _side: SenderRooms

    def __init__(self, side: SenderRooms, room: int, now: float) -> None:
        super().__init__(side, room, now)
        self.num_dst_pages: int | None = None
        self.latency_s: float | None = None  # first chunk posted -> every write DONE (at Success)
        self._request: PageList | None = None
        self._offset = 0
        self._last_sent = False
        self._writes: list[PostedWrite] = []
        self._aux_len = 0
        self._fence = UNFENCED  # (room, the decode's generation for its page list, our liveness)
        self._first_send = 0.0  # monotonic time the first chunk was posted

    # -- the scheduler's API ---------------------------------------------------------------------
    def send(self, page_ids: Sequence[int], *, last: bool, aux: bytes | None = None) -> None:
        """Write this chunk's source pages into the decode's next reserved pages (and ``aux`` with the
        last chunk). Ignored once Failed; ValueError for more pages than reserved or bad ids."""
        self._side.send(self, list(page_ids), last, aux)

    # -- what SenderRooms reads (lock held) ------------------------------------------------------
    @property
    def request(self) -> PageList | None:
        """The decode's page list, once it arrived."""
        return self._request

    @property
    def fence(self) -> Fence:
        return self._fence

    @property
    def aux_len(self) -> int:
        return self._aux_len

    def belongs_to(self, link: Link) -> bool:
        return self._request is not None and self._request.link is link

    # -- transitions (SenderRooms, lock held) ----------------------------------------------------
    def attach(self, request: PageList) -> bool:
        """The decode's page list arrived: WaitingForInput. True if ``poll()`` changed."""
        self._request = request
        self._fence = Fence(self.room, request.generation, self._live)
        self.num_dst_pages = len(request.page_ids)
        if self._state != KVPoll.Bootstrapping:
            return False
        self._state = KVPoll.WaitingForInput
        return True

    def fail(self, error: TransferError) -> list[PostedWrite] | None:
        """-> Failed. Answers the writes still in flight (for the graveyard), or None if already ended."""
        if self._state in TERMINAL:
            return None
        self._state, self._error = KVPoll.Failed, error
        writes, self._writes = self._writes, []
        return writes

    def next_chunk(self, page_ids: list[int], last: bool, aux: bytes | None, aux_limit: int) -> list[int] | None:
        """Validate a chunk (ValueError, RuntimeError as ``send`` documents) and answer the decode pages it
        goes to; None when the room is Failed (the chunk is ignored). Changes nothing."""
        room = self.room
        if self._released:
            raise RuntimeError(f"room {room}: send() after release()")
        if self._state == KVPoll.Failed:
            return None
        if self._last_sent or self._state == KVPoll.Success:
            raise RuntimeError(f"room {room}: send() after the last chunk")
        request = self._request
        if self._state == KVPoll.Bootstrapping or request is None:
            raise RuntimeError(f"room {room}: send() before the decode's page list arrived (Bootstrapping)")
        end = self._offset + len(page_ids)
        if end > len(request.page_ids):
            raise ValueError(f"room {room}: {end} pages sent in all, the decode reserved {len(request.page_ids)}")
        if aux is not None:
            if not last:
                raise ValueError(f"room {room}: aux goes with the last chunk only")
            if len(aux) > aux_limit:
                raise ValueError(f"room {room}: aux of {len(aux)} bytes, the slots hold {aux_limit}")
        return request.page_ids[self._offset : end]

    def chunk_posted(
        self, num_pages: int, last: bool, aux_len: int | None, write: PostedWrite | None, now: float
    ) -> None:
        """A chunk validated by ``next_chunk`` went out (``write``: its batch, None when it had no block)."""
        if aux_len is not None:
            self._aux_len = aux_len
        self._first_send = self._first_send or now
        self._offset += num_pages
        self._last_sent = last
        self._state = KVPoll.Transferring
        if write is not None:
            self._writes.append(write)

    def settle(self, poll: Callable[[WriteHandle], WriteState], now: float, transfer_s: float,
               started_at: Callable[[WriteHandle, float], float | None] | None = None,
               ) -> tuple[list[PostedWrite], PostedWrite | None, bool]:
        """Progress of the posted writes, oldest first: (writes DONE and done with, the first FAILED one
        or None, whether one is still PENDING past ``transfer_s``). Stops at the first PENDING or FAILED.
        ``started_at(handle, posted)``: when the backend began sending a write (None: still queued behind others
        to the same peer, not timed: the decode's ``waiting_s`` and the heartbeats bound that; ``posted`` where it
        cannot tell); without it, from its post."""
        done: list[PostedWrite] = []
        while self._writes:
            write = self._writes[0]
            state = poll(write.handle)
            if state == WriteState.PENDING:
                since = write.posted if started_at is None else started_at(write.handle, write.posted)
                return done, None, since is not None and now - since > transfer_s
            self._writes.pop(0)
            if state == WriteState.FAILED:
                return done, write, False
            done.append(write)
        return done, None, False

    @property
    def has_writes(self) -> bool:
        return bool(self._writes)

    @property
    def is_complete(self) -> bool:
        """Every chunk sent, the last one included, and every write DONE."""
        return self._state == KVPoll.Transferring and self._last_sent and not self._writes

    def succeed(self, now: float) -> None:
        self._state = KVPoll.Success
        self.latency_s = now - self._first_send

    def take_writes(self) -> list[PostedWrite]:
        """Every write still listed (the manager is closing)."""
        writes, self._writes = self._writes, []
        return writes

    def _live(self) -> bool:
        """The fence's view of this room (any thread, no lock): no byte is worth sending once Failed."""
        return self._state != KVPoll.Failed

    def __repr__(self) -> str:
        return f"KVSender(room={self.room}, state={self._state.name})"
