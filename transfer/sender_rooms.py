"""Prefill-side room table (``SenderRooms``): senders, page-list requests, aux staging, in-flight writes.

Lifecycle of one room (``KVSender`` in ``transfer.sender`` holds its own state; the connections live in
``transfer.prefill``):
1. The decode's ``RoomRequest`` (page ids + aux slot) is kept until the scheduler calls
   ``create_sender(room)`` (TTL = the bootstrap timeout), or attached at once if the sender exists ->
   WaitingForInput. A room the decode aborted before any sender existed leaves a tombstone (same TTL).
2. ``send`` (scheduler thread, non-blocking) maps the chunk's source pages onto the decode's next
   reserved pages, merges runs, and posts one backend batch (K and V of every layer, plus the aux block
   with the last chunk, copied into a registered staging slot first).
3. ``tick`` (monitor thread, woken by the backend's completion listener) polls the batches; once the
   last chunk and aux are DONE it sends ``RoomStatus(ok)`` and the room is Success. With few rooms the
   listener does it itself in the backend thread (``settle_here``), and ``send`` does it at once when
   the backend completed the batch before ``write`` returned (a small same-host copy): the room is
   then Success when ``send`` returns, with no hand-off to the monitor. A failed
   batch, the transfer timeout, an abort or the decode's disappearance make it Failed
   (``RoomStatus(ok=False)`` or ``Abort`` tells the decode).
4. Writes of a failed room go to a graveyard that ``tick`` drains; once none of the room's writes is in
   flight any more the decode gets ``Quiesced(room)``: its pages are safe to reuse.
5. ``release`` forgets the room (aborting it first if it was still live).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import deque

import numpy as np

from transfer.base import PeerId, WriteState
from transfer.blocks import check_pages, kv_blocks, merge_runs
from transfer.channel import ControlChannel
from transfer.context import Context, Outbox, flush, room_error
from transfer.errors import RoomAborted, TransferError, TransferErrorKind
from transfer.messages import Abort, Quiesced, RoomRequest, RoomStatus
from transfer.sender import KVSender, Link, PageList, PostedWrite
from transfer.types import KVPoll

log = logging.getLogger(__name__)

NUM_STAGING_SLOTS = 1024  # aux payloads waiting to be written (one per room between last send and DONE)
SETTLE_HERE_MAX_ROOMS = 8  # settle_here progresses rooms itself up to this many (else the monitor ticks)


class SenderRooms:
    def __init__(self, ctx: Context, *, fences_writes: bool = False) -> None:
        self._ctx = ctx
        self._fences_writes = fences_writes  # the decodes' backend refuses a closed room's writes itself
        self._senders: dict[int, KVSender] = {}
        self._requests: dict[int, PageList] = {}
        # rooms the decode ended (aborted, or its connection closed) before a sender: (why, expiry, that decode's
        # link; another decode's page list for the room is not refused for it: ``on_room_request``)
        self._tombstones: dict[int, tuple[TransferError, float, Link]] = {}
        # (room, expiry), oldest first (each lives bootstrap_s): the tick drops expired ones without a scan of
        # them all under the lock (many aborted rooms left a scan of hundreds of thousands per 50 ms tick)
        self._tombstone_order: deque[tuple[int, float]] = deque()
        # rooms this prefill ended before their decode's page list came: that list fails at once
        self._ended: dict[int, tuple[str, float]] = {}
        self._ended_order: deque[tuple[int, float]] = deque()  # (room, expiry), oldest first: one bootstrap_s each
        self._graveyard: list[PostedWrite] = []
        self._unquiet: dict[int, Link] = {}  # failed rooms whose decode awaits Quiesced
        # links to close once none of their writes is in flight (``take_broken``): their data path died under
        # an open control connection, or their decode fell silent; id(link) -> (link, why, that is the close's)
        self._broken: dict[int, tuple[Link, TransferError, bool]] = {}
        # links closed already, their channels to close (``take_broken``), each after the failed room's status
        self._closing: list[tuple[ControlChannel, TransferError, list[RoomStatus]]] = []
        self._stalled: list[PeerId] = []  # data paths whose queued writes fail now (``take_stalled``)
        slot_bytes = max(ctx.args.aux_slot_bytes, 1)
        self.staging = np.zeros((NUM_STAGING_SLOTS, slot_bytes), dtype=np.uint8)
        self._free_slots = list(range(NUM_STAGING_SLOTS - 1, -1, -1))
        # each slot's address, once (numpy's ``.ctypes`` costs microseconds per use)
        base = int(self.staging.ctypes.data)
        self._slot_bytes = slot_bytes
        self._slot_addrs = [base + slot * slot_bytes for slot in range(NUM_STAGING_SLOTS)]

    def staging_region(self) -> tuple[int, int]:
        return int(self.staging.ctypes.data), int(self.staging.nbytes)

    # -- control messages (reader threads) -------------------------------------------------------
    def on_room_request(self, link: Link, msg: RoomRequest) -> None:
        outbox: Outbox = []
        channel, room = link.channel, msg.room
        if len(msg.page_ids) > link.num_pages:  # (before any per-id work: no real list is longer than the decode's
            # pool, and a forged one of millions held the lock for a second, id by id, and was kept)
            too_long = TransferError(
                TransferErrorKind.RANGE_REJECTED,
                f"room {room}: a page list of {len(msg.page_ids)} ids for a decode of {link.num_pages} pages")
            with self._ctx.lock:
                _refuse(outbox, channel, room, too_long)
                waiting = self._senders.get(room)
                if waiting is not None and waiting.request is None:  # (as any other list it cannot take)
                    self._fail(waiting, too_long, outbox, notify=False)
            flush(outbox)
            return
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
            elif room in self._tombstones and self._tombstones[room][2] is link:
                problem = RoomAborted(f"room {room}: already aborted")
            elif sender is None and room in self._ended:
                problem = _ended_error(room, self._ended.pop(room)[0])
            elif sender is not None and sender.poll() == KVPoll.Failed:
                problem = sender.failure()
            elif id(link) in self._broken:
                problem = _resetting(room, link)
            if problem is not None:
                _refuse(outbox, channel, room, problem)
                if sender is not None and sender.request is None:
                    self._fail(sender, problem, outbox, notify=False)
            else:
                request = PageList(link, list(msg.page_ids), msg.aux_index, time.monotonic(), msg.generation)
                if sender is None:
                    # (another decode's abort of this room, if any, was that decode's end of it, not this one's:
                    # a room two requests share, as in ``on_abort``)
                    self._tombstones.pop(room, None)
                    self._requests[room] = request
                    self._ctx.changed()  # (a submit waiting for its page list wakes the scheduler with it)
                else:
                    self._attach(sender, request)
        flush(outbox)

    def on_abort(self, link: Link, room: int, reason: str) -> None:
        error = RoomAborted(f"room {room}: aborted by the decode: {reason}")
        with self._ctx.lock:
            waiting = self._requests.get(room)
            if waiting is not None and waiting.link is not link:
                # Another decode's page list for this room (a room two requests share: clients of the workers'
                # SGLang API choose rooms themselves): this decode's abort is not that room's end, as for a sender
                # attached to another decode below. (This decode's own list for it, if any, was refused.)
                return
            self._requests.pop(room, None)
            sender = self._senders.get(room)
            if sender is None:
                self._bury(room, error, time.monotonic() + self._ctx.timeouts.bootstrap_s, link)
                self._ctx.changed()  # (as a page list for it: a submit waiting for one learns it is not coming)
            elif sender.request is None or sender.belongs_to(link):
                self._fail(sender, error, [], notify=False)
            # answered by tick() once no write of the room is in flight (at once if none ever was)
            if sender is None or sender.request is None or sender.belongs_to(link):
                self._unquiet[room] = link
                self._ctx.kick()

    def _bury(self, room: int, error: TransferError, expiry: float, link: Link) -> None:
        """``room``'s sender, if one is created before ``expiry``, fails at once with ``error``, unless another
        decode than ``link``'s sends its page list for it first (lock held)."""
        self._tombstones[room] = (error, expiry, link)
        self._tombstone_order.append((room, expiry))

    def on_link_closed(self, link: Link, error: TransferError) -> None:
        """The decode behind ``link`` is gone: fail its rooms, forget its pending requests (lock held)."""
        for sender in self._senders.values():
            if sender.belongs_to(link):
                self._fail(sender, room_error(sender.room, error), [], notify=False)
        expiry = time.monotonic() + self._ctx.timeouts.bootstrap_s
        for room in [r for r, req in self._requests.items() if req.link is link]:
            del self._requests[room]  # (its sender, created later, fails at once: not at its bootstrap timeout)
            self._bury(room, room_error(room, error), expiry, link)

    def fail_link(self, link: Link, error: TransferError, outbox: Outbox) -> None:
        """Fail every room of ``link`` (a silent decode); lock held."""
        for sender in self._senders.values():
            if sender.belongs_to(link):
                self._fail(sender, room_error(sender.room, error), outbox, notify=False)

    def has_word(self, room: int) -> bool:
        """Whether the decode's page list for ``room``, or its abort, came before a sender for it (any thread; a
        read without the lock: a hint, which ``on_room_request``'s and ``on_abort``'s ``changed()`` back up)."""
        return room in self._requests or room in self._tombstones

    # -- rooms (scheduler thread) ----------------------------------------------------------------
    def create_sender(self, room: int) -> KVSender:
        with self._ctx.lock:
            if self._ctx.closed:
                raise RuntimeError("KVManager is closed")
            if room in self._senders:
                raise ValueError(f"room {room} already has a sender")
            sender = KVSender(self, room, time.monotonic())
            self._senders[room] = sender
            self._ended.pop(room, None)
            tomb = self._tombstones.pop(room, None)
            request = self._requests.pop(room, None)
            if tomb is not None:
                self._fail(sender, tomb[0], [], notify=False)
            elif request is not None:
                self._attach(sender, request)
            return sender

    def _attach(self, sender: KVSender, request: PageList) -> None:
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
                if len(aux) > self._slot_bytes:  # (``next_chunk`` holds it to the slot's size already)
                    raise ValueError(f"room {room}: aux of {len(aux)} bytes, a staging slot holds {self._slot_bytes}")
                slot = self._free_slots.pop()
                ctypes.memmove(self._slot_addrs[slot], aux if type(aux) is bytes else bytes(aux), len(aux))
                dst_aux = link.reg.aux_ptrs[0] + request.aux_index * link.reg.aux_item_lens[0]
                blocks.append((self._slot_addrs[slot], dst_aux, len(aux)))
            write: PostedWrite | None = None
            error: TransferError | None = None
            posted = time.monotonic()  # (before write(): a batch it completes inline is timed too)
            if blocks and id(link) in self._broken:  # (queued behind a stalled write, or to a dead peer)
                if slot is not None:
                    self._free_slots.append(slot)
                error = _resetting(room, link)
            elif blocks:
                try:
                    handle = ctx.backend.write(link.peer, blocks, sender.fence)
                except TransferError as exc:  # (refused before it was posted: the slot is free again)
                    if slot is not None:
                        self._free_slots.append(slot)
                    error = exc
                except BaseException:  # a backend's bug: its write may be under way, reading the slot: not reused
                    log.error("room %s: the transfer backend's write raised; aux staging slot %s is not reused", room,
                              slot)
                    raise
                else:
                    write = PostedWrite(room, handle, posted, slot, link)
                    ctx.num_bytes_sent += sum(length for _, _, length in blocks)
            sender.chunk_posted(len(page_ids), last, len(aux) if aux else None, write, posted)
            if error is not None:
                breaks = error.kind in _BROKEN
                self._fail_room(sender, room_error(room, error), outbox, link if breaks else None)
            elif write is None or ctx.backend.poll(write.handle) != WriteState.PENDING:
                # settled already (a small same-host copy, or nothing to write): no hand-off to the monitor
                self._progress(sender, time.monotonic(), outbox)
            if not ctx.notifies:
                ctx.kick()  # the monitor polls this write until it settles
        flush(outbox)

    def _fail(self, sender: KVSender, error: TransferError, outbox: Outbox, *, notify: bool = True) -> None:
        in_flight = sender.fail(error)
        if in_flight is None:  # already ended
            return
        if isinstance(error, RoomAborted):  # (ended on purpose: not a transfer failure, for the metrics)
            self._ctx.num_rooms_aborted += 1
        else:
            self._ctx.num_rooms_failed += 1
        self._ctx.changed()
        self._graveyard.extend(in_flight)
        request = sender.request
        if request is not None and not request.link.closed:
            self._unquiet[sender.room] = request.link
            self._ctx.kick()  # the next tick tells the decode once none of the room's writes is in flight
        if notify and request is not None and not request.link.closed:
            outbox.append((request.link.channel, _failed(sender.room, error)))

    def _fail_room(self, sender: KVSender, error: TransferError, outbox: Outbox, broke: Link | None,
                   stalled: bool = False) -> None:
        """Fail ``sender``'s room with ``error`` (lock held) and, with ``broke``, take that link's data path as
        broken (``_data_path_broke``). The decode hears the room's status before the connection's close, when
        that comes at once: sent by the monitor that closes it, not by whichever thread flushes ``outbox``
        (its verdict is the decode's own fault: told only by the close, the decode blamed the prefill)."""
        closes_now = broke is not None and self._fences_writes and self._breakable(broke)
        self._fail(sender, error, outbox, notify=not closes_now)
        if broke is not None:
            status = _failed(sender.room, error) if closes_now else None
            self._data_path_broke(broke, error, stalled=stalled, status=status)

    def _breakable(self, link: Link) -> bool:
        """Whether ``_data_path_broke`` acts on ``link`` (lock held): open, registered, not already broken."""
        return not link.closed and link.peer is not None and id(link) not in self._broken

    def _data_path_broke(self, link: Link, error: TransferError, *, stalled: bool = False,
                         status: RoomStatus | None = None) -> None:
        """A write to ``link``'s decode failed because its data path broke (PEER_GONE, PEER_UNREACHABLE), or moved
        nothing for ``transfer_s`` while the decode's heartbeats live (``stalled``: a route or a firewall dropping
        the data connection's packets, large packets black-holed, a wedged receiver); lock held. The tcp backend
        keeps a broken peer's mark (every later write fails with it); a stalled path holds every room queued to
        that decode behind it until the decode's ``waiting_s``, and a stuck tcp connection, once the path clears,
        resumes at TCP's backed-off retransmission. So the control connection is closed, and the decode registers
        again, with a fresh data path, for its next room: at once when the decode fences writes (its fences keep
        a stuck write's bytes out of its pages; the close drops the data path, which cuts that write off and
        fails those queued behind it); else once none of the link's writes is in flight (the decode takes the
        close as the end of every write, and a stuck one may still land), the writes queued behind a stalled one
        failed at once meanwhile (``take_stalled``: nothing of them is on the wire), and no new room or write
        taken on the link."""
        if not self._breakable(link):
            return
        if self._fences_writes:
            closing = _closing_error(link, error)
            others = [s for s in self._senders.values() if s.belongs_to(link) and not s.is_terminal]
            link.closed = True
            self.on_link_closed(link, closing)
            statuses = [status] if status is not None else []
            statuses += [_failed(s.room, room_error(s.room, closing)) for s in others]
            self._closing.append((link.channel, closing, statuses))
        else:
            self._broken[id(link)] = (link, error, False)
            if stalled:
                assert link.peer is not None  # (``_breakable``)
                self._stalled.append(link.peer)
        self._ctx.kick()

    def take_stalled(self) -> list[PeerId]:
        """Data paths whose queued writes (none of whose bytes are on the wire) are to fail now (lock held; the
        caller fails them outside it, ``fail_queued`` of a thread-per-peer backend)."""
        stalled, self._stalled = self._stalled, []
        return stalled

    def close_when_quiet(self, link: Link, error: TransferError) -> None:
        """Close ``link`` (with ``error``) once none of its writes is in flight (lock held): a silent decode
        of a backend that does not fence writes takes the close as the end of every write of its rooms, and
        one frozen mid-write would, when it wakes, give out pages that a write still on the wire lands in."""
        if not link.closed and id(link) not in self._broken:
            self._broken[id(link)] = (link, error, True)
            self._ctx.kick()

    def take_broken(self) -> list[tuple[ControlChannel, TransferError]]:
        """The control connections to close for a broken data path (lock held; closed outside it, after the
        statuses ``tick`` queued for them: the monitor calls the two in one hold of the lock). To a decode that
        fences, at once; else once no write to its decode is in flight: such a decode takes the close as the end
        of every write of the connection's rooms (docs/transfer.md), so a write still on its way (of a room the
        backend has not failed yet) could land in pages it gave out again."""
        in_flight = {write.room for write in self._graveyard}
        broken = [(channel, error) for channel, error, _ in self._closing]
        self._closing = []
        for key, (link, error, as_is) in list(self._broken.items()):
            if not link.closed:
                if any(room in in_flight and waiting is link for room, waiting in self._unquiet.items()) or any(
                        sender.has_writes and sender.belongs_to(link) for sender in self._senders.values()):
                    continue  # (the next tick looks again: it runs while writes are pending)
                closing = error if as_is else _closing_error(link, error)
                # Closed here, under the lock, not only when the caller closes the channel outside it: in
                # between, the scheduler's ``send`` for a room of this link would post a write (its room
                # not failed yet), and a reader thread could attach a new room to it.
                link.closed = True
                self.on_link_closed(link, closing)
                broken.append((link.channel, closing))
            del self._broken[key]
        return broken

    def abort(self, sender: KVSender, reason: str) -> None:
        outbox: Outbox = []
        with self._ctx.lock:
            if sender.is_terminal:
                return
            request = sender.request
            error = RoomAborted(f"room {sender.room}: aborted by the prefill: {reason}")
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
                if sender.request is None:  # its decode's page list, if it comes now, must not wait bootstrap_s
                    failure = sender.failure()
                    self._end(sender.room, failure.message if failure is not None else "released")

    def end_room(self, room: int, reason: str) -> None:
        """A room this prefill will never serve (it refused the request): the decode's page list for it
        fails at once, whether it is here already or comes later. Nothing for a room that has a sender
        here (another request's)."""
        outbox: Outbox = []
        with self._ctx.lock:
            if room in self._senders:
                return
            request = self._requests.pop(room, None)
            if request is None:
                self._end(room, reason)
            else:
                _refuse(outbox, request.link.channel, room, _ended_error(room, reason))
        flush(outbox)

    def _end(self, room: int, reason: str) -> None:
        expiry = time.monotonic() + self._ctx.timeouts.bootstrap_s
        self._ended[room] = (reason, expiry)
        self._ended_order.append((room, expiry))

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
                # (BOOTSTRAP: the room never got going, no worker's fault: a decode whose pages are all in use
                # holds its requests until pages free up, and overload must not open its breaker. A decode
                # that is gone or frozen is told apart by its connection and heartbeats, and the gateway's
                # probes.)
                error = TransferError(
                    TransferErrorKind.BOOTSTRAP,
                    f"room {sender.room}: no page list from a decode within {timeouts.bootstrap_s:g}s (its KV "
                    "pages may all be in use)",
                )
                self._fail(sender, error, outbox)
        for room, request in list(self._requests.items()):
            if now - request.arrived > timeouts.bootstrap_s:
                del self._requests[room]
                reason = f"room {room}: the prefill created no sender within {timeouts.bootstrap_s:g}s"
                # (BOOTSTRAP: the room never got going, no worker's fault; the prefill was never given its
                # request, as far as it knows. A TIMEOUT the decode takes as its own: its breaker's count.)
                _refuse(outbox, request.link.channel, room, TransferError(TransferErrorKind.BOOTSTRAP, reason))
        tombs = self._tombstone_order
        while tombs and tombs[0][1] < now:
            room, expiry = tombs.popleft()
            tomb = self._tombstones.get(room)
            if tomb is not None and tomb[1] == expiry:
                del self._tombstones[room]
        order = self._ended_order
        while order and order[0][1] < now:
            room, expiry = order.popleft()
            if self._ended.get(room, ("", 0.0))[1] == expiry:
                del self._ended[room]
        still: list[PostedWrite] = []
        started_at = getattr(ctx.backend, "started_at", None)
        for write in self._graveyard:
            if ctx.backend.poll(write.handle) == WriteState.PENDING:
                still.append(write)
                # A failed room's write still in the peer's hands is timed as a live room's is: stuck (a stalled
                # data path), it holds every room queued behind it to that decode, none of which is timed (never
                # started), until the decode's waiting_s, and its room (aborted: a client that gave up) never
                # times out to drop the path.
                since = started_at(write.handle, write.posted) if started_at is not None else None
                if write.link is not None and since is not None and now - since > timeouts.transfer_s:
                    self._data_path_broke(write.link, TransferError(
                        TransferErrorKind.TIMEOUT,
                        f"room {write.room}: a chunk of this failed room to {write.link.channel.name} still pending "
                        f"{timeouts.transfer_s:g}s after it began to be sent"), stalled=True)
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
        for channel, _, statuses in self._closing:  # (sent by the monitor before it closes the channel)
            outbox.extend((channel, status) for status in statuses)
        return busy

    def settle_here(self, now: float, outbox: Outbox) -> bool:
        """A write settled (the backend thread that reported it; lock held): with at most
        ``SETTLE_HERE_MAX_ROOMS`` rooms and no failed room's write in the graveyard, progress every
        transferring room now, as ``tick`` would (one hand-off fewer at low load), and answer True;
        False: leave it to the monitor's tick (one scan for a burst of completions at high load)."""
        if self._graveyard or len(self._senders) > SETTLE_HERE_MAX_ROOMS:
            return False
        for sender in list(self._senders.values()):
            if sender.poll() == KVPoll.Transferring:
                self._progress(sender, now, outbox)
        return True

    def _retire(self, write: PostedWrite) -> None:
        self._ctx.backend.release(write.handle)
        if write.staging_slot is not None:
            self._free_slots.append(write.staging_slot)

    def _progress(self, sender: KVSender, now: float, outbox: Outbox) -> None:
        backend, room = self._ctx.backend, sender.room
        request = sender.request
        assert request is not None
        started_at = getattr(backend, "started_at", None)
        done, failed, overdue = sender.settle(backend.poll, now, self._ctx.timeouts.transfer_s, started_at)
        for write in done:
            self._retire(write)
        if overdue:
            error = TransferError(
                TransferErrorKind.TIMEOUT,
                f"room {room}: a chunk to {request.link.channel.name} still pending "
                f"{self._ctx.timeouts.transfer_s:g}s after it began to be sent",
            )
            stalled = started_at is not None  # (else timed from its post: it may only have queued behind others)
            self._fail_room(sender, error, outbox, request.link if stalled else None, stalled=True)
        elif failed is not None:
            cause = backend.error(failed.handle)
            self._retire(failed)
            kind = cause.kind if cause else TransferErrorKind.PEER_GONE
            detail = cause.message if cause else "write failed"
            error = TransferError(kind, f"room {room}: {detail}")
            # (a TIMEOUT: the backend's own verdict on a stalled path, Mooncake's MC_TRANSFER_TIMEOUT)
            stalled = kind == TransferErrorKind.TIMEOUT and started_at is not None
            breaks = stalled or kind in _BROKEN
            self._fail_room(sender, error, outbox, request.link if breaks else None, stalled=stalled)
        elif sender.is_complete:
            sender.succeed(now)
            self._ctx.changed()
            self._ctx.num_rooms_completed += 1
            outbox.append((request.link.channel, RoomStatus(room, True, aux_len=sender.aux_len)))

    def fail_all(self, outbox: Outbox) -> None:
        for sender in self._senders.values():
            if not sender.is_terminal:
                request = sender.request
                self._fail(sender, RoomAborted(f"room {sender.room}: the prefill's KV manager closed"), outbox,
                           notify=False)
                if request is not None and not request.link.closed:
                    outbox.append((request.link.channel, Abort(sender.room, "prefill KV manager closed")))

    def drain_graveyard(self, deadline_s: float, outbox: Outbox) -> None:
        """At close: release every leftover handle (waiting up to ``deadline_s`` for pending ones), and tell
        the decodes ``Quiesced`` for each failed room none of whose writes is still pending (before the
        control connections close: a decode without fences takes the close itself as the end of every
        write, and one still on the wire could then land in pages it has given back)."""
        end = time.monotonic() + deadline_s
        with self._ctx.lock:
            writes = self._graveyard + [w for s in self._senders.values() for w in s.take_writes()]
            self._graveyard = []
        pending: set[int] = set()
        for write in writes:
            while self._ctx.backend.poll(write.handle) == WriteState.PENDING and time.monotonic() < end:
                time.sleep(0.005)
            if self._ctx.backend.poll(write.handle) == WriteState.PENDING:
                pending.add(write.room)
            self._retire(write)
        with self._ctx.lock:
            for room, link in list(self._unquiet.items()):
                if room not in pending:
                    del self._unquiet[room]
                    if not link.closed:
                        outbox.append((link.channel, Quiesced(room)))


def _ended_error(room: int, reason: str) -> TransferError:
    return RoomAborted(f"room {room}: the prefill ended it: {reason}")


_BROKEN = (TransferErrorKind.PEER_GONE, TransferErrorKind.PEER_UNREACHABLE)  # a write failing so: its data path broke


def _closing_error(link: Link, error: TransferError) -> TransferError:
    return TransferError(TransferErrorKind.PEER_GONE, f"{link.channel.name}: the data path broke ({error.message}); "
                         "closing the connection so that the decode registers again")


def _resetting(room: int, link: Link) -> TransferError:
    return TransferError(TransferErrorKind.PEER_GONE, f"room {room}: the data path to {link.channel.name} broke or "
                         "stalled; its connection closes once none of its writes is on the wire, and the decode "
                         "registers again")


def _refuse(outbox: Outbox, channel: ControlChannel, room: int, error: TransferError) -> None:
    """A decode's page list that no sender will take: the failure, and at once ``Quiesced`` (nothing was
    ever written into its pages)."""
    outbox.append((channel, _failed(room, error)))
    outbox.append((channel, Quiesced(room)))


def _failed(room: int, error: TransferError) -> RoomStatus:
    """The status that tells a decode its room failed, and why."""
    return RoomStatus(room, False, error.kind.value, error.message)
