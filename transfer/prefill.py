"""Prefill side of the KV manager: the control listener, decode registrations, senders.

Lifecycle:
1. ``PrefillSide`` listens on ``control_address``; every decode connection is a ``_Link`` served by
   its channel's reader thread.
2. A decode sends ``Register`` once: the shape is validated, then the backend connects to the decode's
   data endpoint (blocking, in the reader thread), then ``RegisterAck``.
3. Per room the decode sends ``RoomRequest``; it is kept (TTL = bootstrap timeout) until the scheduler
   calls ``create_sender(room)``, or attached at once if the sender exists -> WaitingForInput.
4. ``KVSender.send`` (scheduler thread) posts one backend batch per chunk; the monitor thread
   (``tick``) polls the handles, enforces timeouts and, once the last chunk and aux are DONE, sends
   ``RoomStatus(ok)`` and marks the room Success. Failures are reported with ``RoomStatus(ok=False)``
   (or ``Abort``), and once a failed room has no write in flight any more, with ``Quiesced``.
5. ``release()`` forgets a room; writes still pending then go to a graveyard that ``tick`` drains.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from transfer.base import PeerId, WriteHandle, WriteState
from transfer.blocks import check_pages, kv_blocks, merge_runs
from transfer.channel import ControlChannel
from transfer.context import Context, Outbox, flush, room_error
from transfer.errors import TransferError, TransferErrorKind
from transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    Message,
    Ping,
    Pong,
    Quiesced,
    Register,
    RegisterAck,
    RoomRequest,
    RoomStatus,
)
from transfer.types import KVArgs, KVPoll

NUM_STAGING_SLOTS = 1024  # aux payloads waiting to be written (one per room between last send and DONE)
_TERMINAL = (KVPoll.Failed, KVPoll.Success)


@dataclass
class _Link:
    channel: ControlChannel
    peer: PeerId | None = None
    reg: Register | None = None
    num_pages: int = 0
    num_aux_slots: int = 0
    aux_slot_bytes: int = 0
    closed: bool = False


@dataclass
class _Request:
    link: _Link
    page_ids: list[int]
    aux_index: int
    arrived: float


@dataclass
class _Write:
    room: int
    handle: WriteHandle
    posted: float
    staging_slot: int | None


class KVSender:
    """One room on the prefill side. Every method is non-blocking (scheduler thread)."""

    def __init__(self, side: PrefillSide, room: int, now: float) -> None:
        self.room = room
        self.num_dst_pages: int | None = None
        self._side = side
        self._state = KVPoll.Bootstrapping
        self._error: TransferError | None = None
        self._request: _Request | None = None
        self._offset = 0
        self._last_sent = False
        self._writes: list[_Write] = []
        self._aux_len = 0
        self._created = now
        self._released = False

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

    def __repr__(self) -> str:
        return f"KVSender(room={self.room}, state={self._state.name})"


class PrefillSide:
    def __init__(self, ctx: Context, host: str, port: int) -> None:
        self._ctx = ctx
        self._links: dict[ControlChannel, _Link] = {}
        self._senders: dict[int, KVSender] = {}
        self._requests: dict[int, _Request] = {}
        self._tombstones: dict[int, tuple[str, float]] = {}  # rooms the decode aborted before a sender
        self._graveyard: list[_Write] = []
        self._unquiet: dict[int, _Link] = {}  # failed rooms whose decode awaits Quiesced
        slot_bytes = max(ctx.args.aux_slot_bytes, 1)
        self.staging = np.zeros((NUM_STAGING_SLOTS, slot_bytes), dtype=np.uint8)
        self._free_slots = list(range(NUM_STAGING_SLOTS - 1, -1, -1))
        self._listener = socket.create_server((host, port))
        self.control_address: tuple[str, int] = self._listener.getsockname()[:2]
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-ctl-accept", daemon=True)

    def staging_region(self) -> tuple[int, int]:
        return int(self.staging.ctypes.data), int(self.staging.nbytes)

    def start(self) -> None:
        self._accept_thread.start()

    # -- connections -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            channel = ControlChannel(sock, f"decode@{addr[0]}:{addr[1]}", self._on_message, self._on_close)
            with self._ctx.lock:
                if self._ctx.closed:
                    sock.close()
                    return
                self._links[channel] = _Link(channel)
            channel.start()

    def _on_message(self, channel: ControlChannel, msg: Message) -> None:
        link = self._links.get(channel)
        if link is None:
            return
        match msg:
            case Ping(seq=seq):
                channel.send(Pong(seq))
            case Pong():
                pass
            case Register():
                self._on_register(link, msg)
            case RoomRequest():
                self._on_room_request(link, msg)
            case Abort(room=room, reason=reason):
                self._on_abort(link, room, reason)
            case _:
                channel.close(
                    TransferError(TransferErrorKind.PROTOCOL, f"{channel.name}: unexpected {type(msg).__name__}")
                )

    def _check_register(self, msg: Register) -> str:
        own: KVArgs = self._ctx.args
        if msg.version != PROTOCOL_VERSION:
            return f"protocol version {msg.version}, this prefill speaks {PROTOCOL_VERSION}"
        if msg.backend != self._ctx.backend.name:
            return f"transfer backend {msg.backend!r}, this prefill uses {self._ctx.backend.name!r}"
        if msg.page_size != own.page_size:
            return f"page_size {msg.page_size}, this prefill uses {own.page_size}"
        if msg.kv_dtype != own.kv_dtype:
            return f"kv_dtype {msg.kv_dtype!r}, this prefill uses {own.kv_dtype!r}"
        if len(msg.kv_ptrs) != len(own.kv_ptrs):
            return (
                f"{len(msg.kv_ptrs) // 2} layers ({len(msg.kv_ptrs)} KV buffers), this prefill has "
                f"{len(own.kv_ptrs) // 2}"
            )
        if list(msg.kv_item_lens) != list(own.kv_item_lens):
            return f"page bytes per buffer {msg.kv_item_lens[:2]}..., this prefill uses {own.kv_item_lens[:2]}..."
        try:
            KVArgs(
                msg.kv_ptrs, msg.kv_data_lens, msg.kv_item_lens, msg.aux_ptrs, msg.aux_data_lens,
                msg.aux_item_lens, msg.page_size, msg.kv_dtype,
            )
        except ValueError as exc:
            return str(exc)
        return ""

    def _on_register(self, link: _Link, msg: Register) -> None:
        channel = link.channel
        if link.reg is not None:
            channel.close(TransferError(TransferErrorKind.PROTOCOL, f"{channel.name}: registered twice"))
            return
        reason = self._check_register(msg)
        if reason:
            channel.send(RegisterAck(False, f"rejected: {reason}", TransferErrorKind.PROTOCOL.value))
            channel.close(TransferError(TransferErrorKind.PROTOCOL, f"{channel.name}: {reason}"))
            return
        try:
            peer = self._ctx.backend.connect(msg.endpoint)
        except TransferError as exc:
            channel.send(RegisterAck(False, f"prefill cannot reach your data endpoint: {exc.message}", exc.kind))
            channel.close(exc)
            return
        args = KVArgs(
            msg.kv_ptrs, msg.kv_data_lens, msg.kv_item_lens, msg.aux_ptrs, msg.aux_data_lens,
            msg.aux_item_lens, msg.page_size, msg.kv_dtype,
        )
        with self._ctx.lock:
            link.peer, link.reg = peer, msg
            link.num_pages, link.num_aux_slots, link.aux_slot_bytes = (
                args.num_pages, args.num_aux_slots, args.aux_slot_bytes,
            )
            closed = link.closed
        if closed:
            self._ctx.backend.disconnect(peer)
            return
        channel.send(RegisterAck(True))

    def _on_room_request(self, link: _Link, msg: RoomRequest) -> None:
        outbox: Outbox = []
        channel, room = link.channel, msg.room
        if link.reg is None:
            channel.close(TransferError(TransferErrorKind.PROTOCOL, f"{channel.name}: room {room} before Register"))
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
            elif room in self._requests or (sender is not None and sender._request is not None):
                problem = TransferError(TransferErrorKind.PROTOCOL, f"room {room}: page list sent twice")
            elif room in self._tombstones:
                problem = TransferError(TransferErrorKind.ABORTED, f"room {room}: already aborted")
            elif sender is not None and sender._state == KVPoll.Failed:
                problem = sender._error
            if problem is not None:
                outbox.append((channel, RoomStatus(room, False, problem.kind.value, problem.message)))
                outbox.append((channel, Quiesced(room)))
                if sender is not None and sender._request is None:
                    self._fail(sender, problem, outbox, notify=False)
            else:
                request = _Request(link, list(msg.page_ids), msg.aux_index, time.monotonic())
                if sender is None:
                    self._requests[room] = request
                else:
                    self._attach(sender, request)
        flush(outbox)

    def _on_abort(self, link: _Link, room: int, reason: str) -> None:
        error = TransferError(TransferErrorKind.ABORTED, f"room {room}: aborted by the decode: {reason}")
        with self._ctx.lock:
            self._requests.pop(room, None)
            sender = self._senders.get(room)
            if sender is None:
                self._tombstones[room] = (reason, time.monotonic() + self._ctx.timeouts.bootstrap_s)
            elif sender._request is None or sender._request.link is link:
                self._fail(sender, error, [], notify=False)
            # answered by tick() once no write of the room is in flight (at once if none ever was)
            if sender is None or sender._request is None or sender._request.link is link:
                self._unquiet[room] = link

    def _on_close(self, channel: ControlChannel, error: TransferError) -> None:
        with self._ctx.lock:
            link = self._links.pop(channel, None)
            if link is None:
                return
            link.closed = True
            for sender in self._senders.values():
                if sender._request is not None and sender._request.link is link:
                    self._fail(sender, room_error(sender.room, error), [], notify=False)
            for room in [r for r, req in self._requests.items() if req.link is link]:
                del self._requests[room]
        if link.peer is not None:
            self._ctx.backend.disconnect(link.peer)

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
        sender._request = request
        sender.num_dst_pages = len(request.page_ids)
        if request.link.closed:
            error = TransferError(TransferErrorKind.PEER_GONE, f"room {sender.room}: the decode disconnected")
            self._fail(sender, error, [], notify=False)
        elif sender._state == KVPoll.Bootstrapping:
            sender._state = KVPoll.WaitingForInput

    def send(self, sender: KVSender, page_ids: list[int], last: bool, aux: bytes | None) -> None:
        ctx, room = self._ctx, sender.room
        outbox: Outbox = []
        with ctx.lock:
            if sender._released:
                raise RuntimeError(f"room {room}: send() after release()")
            if sender._state == KVPoll.Failed:
                return
            if sender._last_sent or sender._state == KVPoll.Success:
                raise RuntimeError(f"room {room}: send() after the last chunk")
            request = sender._request
            if sender._state == KVPoll.Bootstrapping or request is None:
                raise RuntimeError(f"room {room}: send() before the decode's page list arrived (Bootstrapping)")
            link = request.link
            assert link.reg is not None and link.peer is not None
            end = sender._offset + len(page_ids)
            if end > len(request.page_ids):
                raise ValueError(
                    f"room {room}: {end} pages sent in all, the decode reserved {len(request.page_ids)}"
                )
            check_pages(page_ids, ctx.args.num_pages, f"room {room}: source pages")
            if aux is not None:
                if not last:
                    raise ValueError(f"room {room}: aux goes with the last chunk only")
                limit = min(link.aux_slot_bytes, ctx.args.aux_slot_bytes)
                if not link.num_aux_slots or len(aux) > limit:
                    raise ValueError(f"room {room}: aux of {len(aux)} bytes, the slots hold {limit}")
            dst_pages = request.page_ids[sender._offset : end]
            blocks = kv_blocks(ctx.args.kv_ptrs, link.reg.kv_ptrs, ctx.args.kv_item_lens,
                               merge_runs(page_ids, dst_pages))
            slot: int | None = None
            if aux:
                if not self._free_slots:
                    raise RuntimeError(f"room {room}: all {NUM_STAGING_SLOTS} aux staging slots are busy")
                slot = self._free_slots.pop()
                sender._aux_len = len(aux)
                self.staging[slot, : len(aux)] = np.frombuffer(aux, dtype=np.uint8)
                dst_aux = link.reg.aux_ptrs[0] + request.aux_index * link.reg.aux_item_lens[0]
                blocks.append((int(self.staging[slot].ctypes.data), dst_aux, len(aux)))
            sender._offset = end
            sender._last_sent = last
            sender._state = KVPoll.Transferring
            if blocks:
                try:
                    handle = ctx.backend.write(link.peer, blocks)
                except TransferError as exc:
                    if slot is not None:
                        self._free_slots.append(slot)
                    self._fail(sender, room_error(room, exc), outbox)
                else:
                    sender._writes.append(_Write(room, handle, time.monotonic(), slot))
            ctx.wake.notify_all()
        flush(outbox)

    def _fail(self, sender: KVSender, error: TransferError, outbox: Outbox, *, notify: bool = True) -> None:
        if sender._state in _TERMINAL:
            return
        sender._state, sender._error = KVPoll.Failed, error
        self._graveyard.extend(sender._writes)
        sender._writes = []
        request = sender._request
        if request is not None and not request.link.closed:
            self._unquiet[sender.room] = request.link
        if notify and request is not None and not request.link.closed:
            outbox.append((request.link.channel, RoomStatus(sender.room, False, error.kind.value, error.message)))

    def abort(self, sender: KVSender, reason: str) -> None:
        outbox: Outbox = []
        with self._ctx.lock:
            if sender._state in _TERMINAL:
                return
            request = sender._request
            error = TransferError(TransferErrorKind.ABORTED, f"room {sender.room}: aborted by the prefill: {reason}")
            self._fail(sender, error, outbox, notify=False)
            if request is not None and not request.link.closed:
                outbox.append((request.link.channel, Abort(sender.room, reason)))
        flush(outbox)

    def release(self, sender: KVSender) -> None:
        if sender._released:
            return
        if sender._state not in _TERMINAL:
            self.abort(sender, "released before completion")
        with self._ctx.lock:
            sender._released = True
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
            if sender._state == KVPoll.Transferring:
                self._progress(sender, now, outbox)
                busy = busy or bool(sender._writes)
            elif sender._state == KVPoll.Bootstrapping and now - sender._created > timeouts.bootstrap_s:
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
        request = sender._request
        assert request is not None
        while sender._writes:
            write = sender._writes[0]
            state = backend.poll(write.handle)
            if state == WriteState.PENDING:
                if now - write.posted > self._ctx.timeouts.transfer_s:
                    error = TransferError(
                        TransferErrorKind.TIMEOUT,
                        f"room {room}: a chunk to {request.link.channel.name} still pending after "
                        f"{self._ctx.timeouts.transfer_s:g}s",
                    )
                    self._fail(sender, error, outbox)
                return
            sender._writes.pop(0)
            if state == WriteState.FAILED:
                cause = backend.error(write.handle)
                self._retire(write)
                kind = cause.kind if cause else TransferErrorKind.PEER_GONE
                detail = cause.message if cause else "write failed"
                self._fail(sender, TransferError(kind, f"room {room}: {detail}"), outbox)
                return
            self._retire(write)
        if sender._last_sent:
            sender._state = KVPoll.Success
            outbox.append((request.link.channel, RoomStatus(room, True, aux_len=sender._aux_len)))

    def heartbeat(self, now: float, outbox: Outbox) -> list[tuple[ControlChannel, TransferError]]:
        """Ping every decode; return the silent ones (the caller closes them outside the lock)."""
        silent = []
        limit = self._ctx.timeouts.heartbeat_timeout_s
        for channel, link in self._links.items():
            if now - channel.last_rx > limit:
                error = TransferError(
                    TransferErrorKind.TIMEOUT, f"{channel.name}: no heartbeat for {now - channel.last_rx:.1f}s"
                )
                for sender in self._senders.values():
                    if sender._request is not None and sender._request.link is link:
                        self._fail(sender, room_error(sender.room, error), outbox, notify=False)
                silent.append((channel, error))
            else:
                outbox.append((channel, Ping(int(now * 1000))))
        return silent

    # -- shutdown --------------------------------------------------------------------------------
    def fail_all(self, outbox: Outbox) -> None:
        for sender in self._senders.values():
            if sender._state not in _TERMINAL:
                request = sender._request
                self._fail(sender, TransferError(
                    TransferErrorKind.ABORTED, f"room {sender.room}: the prefill's KV manager closed"
                ), outbox, notify=False)
                if request is not None and not request.link.closed:
                    outbox.append((request.link.channel, Abort(sender.room, "prefill KV manager closed")))

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._accept_thread.join(timeout=5.0)
        with self._ctx.lock:
            channels = list(self._links)
        for channel in channels:
            channel.close()
        for channel in channels:
            channel.join(timeout=5.0)

    def drain_graveyard(self, deadline_s: float) -> None:
        """Release every leftover handle (waiting up to ``deadline_s`` for pending ones)."""
        end = time.monotonic() + deadline_s
        with self._ctx.lock:
            writes = self._graveyard + [w for s in self._senders.values() for w in s._writes]
            self._graveyard = []
            for sender in self._senders.values():
                sender._writes = []
        for write in writes:
            while self._ctx.backend.poll(write.handle) == WriteState.PENDING and time.monotonic() < end:
                time.sleep(0.005)
            self._retire(write)
