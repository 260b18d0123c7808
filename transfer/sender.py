"""Prefill-side rooms: ``KVSender`` and the table of senders, page-list requests and in-flight writes.

Lifecycle of one room (the connections themselves live in ``transfer.prefill``):
1. The decode's ``RoomRequest`` (page ids + aux slot) is kept until the scheduler calls
   ``create_sender(room)`` (TTL = the bootstrap timeout), or attached at once if the sender exists ->
   WaitingForInput. A room the decode aborted before any sender existed leaves a tombstone (same TTL).
2. ``KVSender.send`` (scheduler thread, non-blocking) maps the chunk's source pages onto the decode's
   next reserved pages, merges runs, and posts one backend batch (K and V of every layer, plus the aux
   block with the last chunk, copied into a registered staging slot first).
3. ``tick`` (monitor thread) polls the batches; once the last chunk and aux are DONE it sends
   ``RoomStatus(ok)`` and the room is Success. A failed batch, the transfer timeout, an abort or the
   decode's disappearance make it Failed (``RoomStatus(ok=False)`` or ``Abort`` tells the decode).
4. Writes of a failed room go to a graveyard that ``tick`` drains; once none of the room's writes is in
   flight any more the decode gets ``Quiesced(room)``: its pages are safe to reuse.
5. ``release()`` forgets the room (aborting it first if it was still live).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from transfer.base import UNFENCED, Fence, PeerId, WriteHandle, WriteState
from transfer.blocks import check_pages, kv_blocks, merge_runs
from transfer.channel import ControlChannel
from transfer.context import Context, Outbox, flush, room_error
from transfer.errors import TransferError, TransferErrorKind
from transfer.messages import Abort, Quiesced, Register, RoomRequest, RoomStatus
from transfer.types import KVPoll

NUM_STAGING_SLOTS = 1024  # aux payloads waiting to be written (one per room between last send and DONE)
_TERMINAL = (KVPoll.Failed, KVPoll.Success)


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


@dataclass
class _Request:
    link: Link
    page_ids: list[int]
    aux_index: int
    arrived: float
    generation: int


@dataclass
class _Write:
    room: int
    handle: WriteHandle
    posted: float
    staging_slot: int | None


class KVSender:
    """One room on the prefill side. It owns its state: the scheduler calls its public methods (each
    non-blocking); ``SenderRooms`` moves it only through the transitions below, with the manager's lock
    held (the room table, connections, graveyard and outbox stay with ``SenderRooms``)."""

    def __init__(self, side: SenderRooms, room: int, now: float) -> None:
        self.room = room
        self.num_dst_pages: int | None = None
        self.latency_s: float | None = None  # first chunk posted -> every write DONE (at Success)
        self.created = now
        self._side = side
        self._state = KVPoll.Bootstrapping
        self._error: TransferError | None = None
        self._request: _Request | None = None
        self._offset = 0
        self._last_sent = False
        self._writes: list[_Write] = []
        self._aux_len = 0
        self._released = False
        self._fence = UNFENCED  # (room, the decode's generation for its page list, our liveness)
        self._first_send = 0.0  # monotonic time the first chunk was posted

    # -- the scheduler's API ---------------------------------------------------------------------
    def poll(self) -> KVPoll:
        return self._state

    def send(self, page_ids: Sequence[int], *, last: bool, aux: bytes | None = None) -> None:
        """Write this chunk's source pages into the decode's next reserved pages (and ``aux`` with the
        last chunk). Ignored once Failed; ValueError for more pages than reserved or bad ids."""
        self._side.send(self, list(page_ids), last, aux)

    def failure(self) -> TransferError | None:
        return self._error

    def abort(self, reason: str) -> None:
        self._side.abort(self, reason)

    def release(self) -> None:
        self._side.release(self)

    # -- what SenderRooms reads (lock held) ------------------------------------------------------
    @property
    def request(self) -> _Request | None:
        """The decode's page list, once it arrived."""
        return self._request

    @property
    def is_terminal(self) -> bool:
        return self._state in _TERMINAL

    @property
    def is_released(self) -> bool:
        return self._released

    @property
    def fence(self) -> Fence:
        return self._fence

    @property
    def aux_len(self) -> int:
        return self._aux_len

    def belongs_to(self, link: Link) -> bool:
        return self._request is not None and self._request.link is link

    # -- transitions (SenderRooms, lock held) ----------------------------------------------------
    def attach(self, request: _Request) -> bool:
        """The decode's page list arrived: WaitingForInput. True if ``poll()`` changed."""
        self._request = request
        self._fence = Fence(self.room, request.generation, self._live)
        self.num_dst_pages = len(request.page_ids)
        if self._state != KVPoll.Bootstrapping:
            return False
        self._state = KVPoll.WaitingForInput
        return True

    def fail(self, error: TransferError) -> list[_Write] | None:
        """-> Failed. Answers the writes still in flight (for the graveyard), or None if already ended."""
        if self._state in _TERMINAL:
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

    def chunk_posted(self, num_pages: int, last: bool, aux_len: int | None, write: _Write | None, now: float) -> None:
        """A chunk validated by ``next_chunk`` went out (``write``: its batch, None when it had no block)."""
        if aux_len is not None:
            self._aux_len = aux_len
        self._first_send = self._first_send or now
        self._offset += num_pages
        self._last_sent = last
        self._state = KVPoll.Transferring
        if write is not None:
            self._writes.append(write)

    def settle(self, poll: Callable[[WriteHandle], WriteState], now: float,
               transfer_s: float) -> tuple[list[_Write], _Write | None, bool]:
        """Progress of the posted writes, oldest first: (writes DONE and done with, the first FAILED one
        or None, whether one is still PENDING past ``transfer_s``). Stops at the first PENDING or FAILED."""
        done: list[_Write] = []
        while self._writes:
            write = self._writes[0]
            state = poll(write.handle)
            if state == WriteState.PENDING:
                return done, None, now - write.posted > transfer_s
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

    def mark_released(self) -> None:
        self._released = True

    def take_writes(self) -> list[_Write]:
        """Every write still listed (the manager is closing)."""
        writes, self._writes = self._writes, []
        return writes

    def _live(self) -> bool:
        """The fence's view of this room (any thread, no lock): no byte is worth sending once Failed."""
        return self._state != KVPoll.Failed

    def __repr__(self) -> str:
        return f"KVSender(room={self.room}, state={self._state.name})"


class SenderRooms:
    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._senders: dict[int, KVSender] = {}
        self._requests: dict[int, _Request] = {}
        self._tombstones: dict[int, tuple[str, float]] = {}  # rooms the decode aborted before a sender
        self._graveyard: list[_Write] = []
        self._unquiet: dict[int, Link] = {}  # failed rooms whose decode awaits Quiesced
        slot_bytes = max(ctx.args.aux_slot_bytes, 1)
        self.staging = np.zeros((NUM_STAGING_SLOTS, slot_bytes), dtype=np.uint8)
        self._free_slots = list(range(NUM_STAGING_SLOTS - 1, -1, -1))

    def staging_region(self) -> tuple[int, int]:
        return int(self.staging.ctypes.data), int(self.staging.nbytes)

    # -- control messages (reader threads) -------------------------------------------------------
    def on_room_request(self, link: Link, msg: RoomRequest) -> None:
        outbox: Outbox = []
        channel, room = link.channel, msg.room
        with self._ctx.lock:
            sender = self._senders.get(room)
            problem: TransferError | None = None
            bad = [p for p in msg.page_ids if not 0 <= p < link.num_pages]
            if bad:
                problem = TransferError(
                    TransferErrorKind.RANGE_REJECTED,
                    f"room {room}: page ids {bad[:4]} outside the decode's {link.num_pages} pages",
                )
            elif link.num_aux_slots and not 0 <= msg.aux_index < link.num_aux_slots:
                problem = TransferError(
                    TransferErrorKind.RANGE_REJECTED,
                    f"room {room}: aux slot {msg.aux_index} outside the decode's {link.num_aux_slots} slots",
                )
            elif room in self._requests or (sender is not None and sender.request is not None):
                problem = TransferError(TransferErrorKind.PROTOCOL, f"room {room}: page list sent twice")
            elif room in self._tombstones:
                problem = TransferError(TransferErrorKind.ABORTED, f"room {room}: already aborted")
            elif sender is not None and sender.poll() == KVPoll.Failed:
                problem = sender.failure()
            if problem is not None:
                outbox.append((channel, RoomStatus(room, False, problem.kind.value, problem.message)))
                outbox.append((channel, Quiesced(room)))
                if sender is not None and sender.request is None:
                    self._fail(sender, problem, outbox, notify=False)
            else:
                request = _Request(link, list(msg.page_ids), msg.aux_index, time.monotonic(), msg.generation)
                if sender is None:
                    self._requests[room] = request
                else:
                    self._attach(sender, request)
        flush(outbox)

    def on_abort(self, link: Link, room: int, reason: str) -> None:
        error = TransferError(TransferErrorKind.ABORTED, f"room {room}: aborted by the decode: {reason}")
        with self._ctx.lock:
            self._requests.pop(room, None)
            sender = self._senders.get(room)
            if sender is None:
                self._tombstones[room] = (reason, time.monotonic() + self._ctx.timeouts.bootstrap_s)
            elif sender.request is None or sender.belongs_to(link):
                self._fail(sender, error, [], notify=False)
            # answered by tick() once no write of the room is in flight (at once if none ever was)
            if sender is None or sender.request is None or sender.belongs_to(link):
                self._unquiet[room] = link
                self._ctx.kick()

    def on_link_closed(self, link: Link, error: TransferError) -> None:
        """The decode behind ``link`` is gone: fail its rooms, forget its pending requests (lock held)."""
        for sender in self._senders.values():
            if sender.belongs_to(link):
                self._fail(sender, room_error(sender.room, error), [], notify=False)
        for room in [r for r, req in self._requests.items() if req.link is link]:
            del self._requests[room]

    def fail_link(self, link: Link, error: TransferError, outbox: Outbox) -> None:
        """Fail every room of ``link`` (a silent decode); lock held."""
        for sender in self._senders.values():
            if sender.belongs_to(link):
                self._fail(sender, room_error(sender.room, error), outbox, notify=False)

    # -- rooms (scheduler thread) ----------------------------------------------------------------
    # -- rooms -----------------------------------------------------------------------------------
    def create_sender(self, room: int) -> KVSender:
        with self._ctx.lock:
            if self._ctx.closed:
                raise RuntimeError("KVManager is closed")
            if room in self._senders:
                raise ValueError(f"room {room} already has a sender")
            sender = KVSender(self, room, time.monotonic())
            self._senders[room] = sender
            tomb = self._tombstones.pop(room, None)
            request = self._requests.pop(room, None)
            if tomb is not None:
                error = TransferError(TransferErrorKind.ABORTED, f"room {room}: aborted by the decode: {tomb[0]}")
                self._fail(sender, error, [], notify=False)
            elif request is not None:
                self._attach(sender, request)
            return sender

    def _attach(self, sender: KVSender, request: _Request) -> None:
        changed = sender.attach(request)
        if request.link.closed:
            error = TransferError(TransferErrorKind.PEER_GONE, f"room {sender.room}: the decode disconnected")
            self._fail(sender, error, [], notify=False)
        elif changed:
            self._ctx.changed()

    def send(self, sender: KVSender, page_ids: list[int], last: bool, aux: bytes | None) -> None:
        ctx, room = self._ctx, sender.room
        outbox: Outbox = []
        with ctx.lock:
            request = sender.request
            link = request.link if request is not None else None
            aux_limit = min(link.aux_slot_bytes, ctx.args.aux_slot_bytes) if link and link.num_aux_slots else 0
            dst_pages = sender.next_chunk(page_ids, last, aux, aux_limit)  # raises for a bad chunk
            if dst_pages is None:  # Failed: ignored
                return
            assert link is not None and request is not None and link.reg is not None and link.peer is not None
            check_pages(page_ids, ctx.args.num_pages, f"room {room}: source pages")
            blocks = kv_blocks(ctx.args.kv_ptrs, link.reg.kv_ptrs, ctx.args.kv_item_lens,
                               merge_runs(page_ids, dst_pages))
            slot: int | None = None
            if aux:
                if not self._free_slots:
                    raise RuntimeError(f"room {room}: all {NUM_STAGING_SLOTS} aux staging slots are busy")
                slot = self._free_slots.pop()
                self.staging[slot, : len(aux)] = np.frombuffer(aux, dtype=np.uint8)
                dst_aux = link.reg.aux_ptrs[0] + request.aux_index * link.reg.aux_item_lens[0]
                blocks.append((int(self.staging[slot].ctypes.data), dst_aux, len(aux)))
            write: _Write | None = None
            error: TransferError | None = None
            if blocks:
                try:
                    handle = ctx.backend.write(link.peer, blocks, sender.fence)
                except TransferError as exc:
                    if slot is not None:
                        self._free_slots.append(slot)
                    error = exc
                else:
                    write = _Write(room, handle, time.monotonic(), slot)
                    ctx.num_bytes_sent += sum(length for _, _, length in blocks)
            sender.chunk_posted(len(page_ids), last, len(aux) if aux else None, write, time.monotonic())
            if error is not None:
                self._fail(sender, room_error(room, error), outbox)
            ctx.kick()
        flush(outbox)

    def _fail(self, sender: KVSender, error: TransferError, outbox: Outbox, *, notify: bool = True) -> None:
        in_flight = sender.fail(error)
        if in_flight is None:  # already ended
            return
        self._ctx.num_rooms_failed += 1
        self._ctx.changed()
        self._graveyard.extend(in_flight)
        request = sender.request
        if request is not None and not request.link.closed:
            self._unquiet[sender.room] = request.link
            self._ctx.kick()  # the next tick tells the decode once none of the room's writes is in flight
        if notify and request is not None and not request.link.closed:
            outbox.append((request.link.channel, RoomStatus(sender.room, False, error.kind.value, error.message)))

    def abort(self, sender: KVSender, reason: str) -> None:
        outbox: Outbox = []
        with self._ctx.lock:
            if sender.is_terminal:
                return
            request = sender.request
            error = TransferError(TransferErrorKind.ABORTED, f"room {sender.room}: aborted by the prefill: {reason}")
            self._fail(sender, error, outbox, notify=False)
            if request is not None and not request.link.closed:
                outbox.append((request.link.channel, Abort(sender.room, reason)))
        flush(outbox)

    def release(self, sender: KVSender) -> None:
        if sender.is_released:
            return
        if not sender.is_terminal:
            self.abort(sender, "released before completion")
        with self._ctx.lock:
            sender.mark_released()
            if self._senders.get(sender.room) is sender:
                del self._senders[sender.room]

    def num_rooms(self) -> int:
        with self._ctx.lock:
            return len(self._senders)

    # -- monitor thread --------------------------------------------------------------------------
    def tick(self, now: float, outbox: Outbox) -> bool:
        """Poll writes, complete or fail rooms, expire requests. Lock held. True if writes are pending."""
        ctx, timeouts, busy = self._ctx, self._ctx.timeouts, False
        for sender in list(self._senders.values()):
            if sender.poll() == KVPoll.Transferring:
                self._progress(sender, now, outbox)
                busy = busy or sender.has_writes
            elif sender.poll() == KVPoll.Bootstrapping and now - sender.created > timeouts.bootstrap_s:
                error = TransferError(
                    TransferErrorKind.TIMEOUT,
                    f"room {sender.room}: no page list from a decode within {timeouts.bootstrap_s:g}s",
                )
                self._fail(sender, error, outbox)
        for room, request in list(self._requests.items()):
            if now - request.arrived > timeouts.bootstrap_s:
                del self._requests[room]
                reason = f"room {room}: the prefill created no sender within {timeouts.bootstrap_s:g}s"
                outbox.append((request.link.channel, RoomStatus(room, False, TransferErrorKind.TIMEOUT.value, reason)))
                outbox.append((request.link.channel, Quiesced(room)))
        for room, (_, expiry) in list(self._tombstones.items()):
            if now > expiry:
                del self._tombstones[room]
        still: list[_Write] = []
        for write in self._graveyard:
            if ctx.backend.poll(write.handle) == WriteState.PENDING:
                still.append(write)
            else:
                self._retire(write)
        self._graveyard = still
        if self._unquiet:
            in_flight = {write.room for write in self._graveyard}
            for room, link in list(self._unquiet.items()):
                if room not in in_flight:
                    del self._unquiet[room]
                    if not link.closed:
                        outbox.append((link.channel, Quiesced(room)))
        return busy

    def _retire(self, write: _Write) -> None:
        self._ctx.backend.release(write.handle)
        if write.staging_slot is not None:
            self._free_slots.append(write.staging_slot)

    def _progress(self, sender: KVSender, now: float, outbox: Outbox) -> None:
        backend, room = self._ctx.backend, sender.room
        request = sender.request
        assert request is not None
        done, failed, overdue = sender.settle(backend.poll, now, self._ctx.timeouts.transfer_s)
        for write in done:
            self._retire(write)
        if overdue:
            error = TransferError(
                TransferErrorKind.TIMEOUT,
                f"room {room}: a chunk to {request.link.channel.name} still pending after "
                f"{self._ctx.timeouts.transfer_s:g}s",
            )
            self._fail(sender, error, outbox)
        elif failed is not None:
            cause = backend.error(failed.handle)
            self._retire(failed)
            kind = cause.kind if cause else TransferErrorKind.PEER_GONE
            detail = cause.message if cause else "write failed"
            self._fail(sender, TransferError(kind, f"room {room}: {detail}"), outbox)
        elif sender.is_complete:
            sender.succeed(now)
            self._ctx.changed()
            self._ctx.num_rooms_completed += 1
            outbox.append((request.link.channel, RoomStatus(room, True, aux_len=sender.aux_len)))

    def fail_all(self, outbox: Outbox) -> None:
        for sender in self._senders.values():
            if not sender.is_terminal:
                request = sender.request
                self._fail(sender, TransferError(
                    TransferErrorKind.ABORTED, f"room {sender.room}: the prefill's KV manager closed"
                ), outbox, notify=False)
                if request is not None and not request.link.closed:
                    outbox.append((request.link.channel, Abort(sender.room, "prefill KV manager closed")))

    def drain_graveyard(self, deadline_s: float) -> None:
        """Release every leftover handle (waiting up to ``deadline_s`` for pending ones)."""
        end = time.monotonic() + deadline_s
        with self._ctx.lock:
            writes = self._graveyard + [w for s in self._senders.values() for w in s.take_writes()]
            self._graveyard = []
        for write in writes:
            while self._ctx.backend.poll(write.handle) == WriteState.PENDING and time.monotonic() < end:
                time.sleep(0.005)
            self._retire(write)
