"""Decode side of the KV manager: connections to prefills, registration, receivers.

Lifecycle:
1. ``create_receiver(room, host, port, instance_id)`` (scheduler thread) makes a Bootstrapping receiver
   and hands the bootstrap to a small thread pool: ``resolver(host, port, instance_id)`` (may block on
   HTTP) -> the prefill's control address -> the one connection kept per address (opened on first use:
   TCP connect, ``Register`` with our data endpoint and memory, wait for ``RegisterAck``). Workers with a
   key (``transfer.auth``): ``AuthHello`` first; only a prefill whose ``AuthChallenge`` proves the key gets
   our ``AuthProof`` and ``Register`` (``_on_handshake``); one that does not is closed, its rooms failed
   (PROTOCOL), our memory's layout never sent to it (logged once per address a minute, counted). One that
   closes on our ``AuthHello`` without an answer does not know it (a prefill of an earlier release: one of this
   release without a key answers with a refusal), or went away: its rooms fail saying so, PEER_GONE (held against
   the prefill, which cannot serve us in either case, not against this decode). A refused registration
   (the reason is the prefill's) is logged as seldom.
   Fast path: when the address is known without blocking (no resolver and a port given, or a
   ``CachingResolver`` with the answer cached) and its connection is registered, the receiver is
   WaitingForInput before ``create_receiver`` returns, with no hand-off.
2. Once the connection is registered the receiver is WaitingForInput with ``metadata_sent`` False: the
   scheduler calls ``send_metadata(page_ids, aux_index)`` -> ``RoomRequest``; ``metadata_sent`` True.
3. The prefill writes the KV straight into our registered memory and then sends ``RoomStatus``:
   ok -> Success (every byte landed), else Failed with the prefill's reason.
   After a failure (either side's abort, a timeout) a write already in flight may still land in the
   room's pages: ``quiesced`` turns True once no byte can land any more. With a backend that
   ``FencesWrites`` (tcp) the decode knows it itself: every page list opens a fence (room, generation),
   every failure closes it, and the backend refuses the fence's writes from then on (quiesced at once,
   or once a write being received is out). Otherwise: once the prefill confirmed it (``Quiesced``), the
   decode ran ``heartbeat_timeout_s`` since the connection to it closed (a killed prefill's last bytes still
   wait in socket buffers: ``_settle``), or it never had our page list; or, for a silent prefill that never
   answers, once its connection has been draining for ``quarantine_s`` of the decode's running (unconfirmed and
   unfenced: ``_give_up_draining``). Free the pages only then.
4. Connection loss fails the connection's rooms (PEER_GONE), a silent prefill fails them (TIMEOUT); the
   connection is dropped for new rooms, so the next receiver for that address connects afresh (a
   recovered peer). A connection that breaks or cannot be opened also makes an ``InvalidatingResolver``
   forget the address it answered: a restarted prefill listens on a new port, and the next room asks
   the registry instead of the dead one for the rest of the cache's lifetime. The rooms of a connection
   that could not be opened ask the registry once more themselves (``_resolve_again``): told another
   address, they go there instead of failing; told the same one, they fail. A silent prefill may be
   frozen mid-write, not dead: without fencing its connection stays open, draining, until it answers
   ``Quiesced`` for every room it might still write (after it resumes) or closes, or at most ``quarantine_s``
   of the decode's running (``KVTimeouts``: then its rooms are called quiesced and the connection closes);
   its rooms' pages wait for that.
5. ``release()`` forgets the room (aborting it first if it was still live).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

from transfer.auth import KVKeys, RefusalLog, decode_proof, is_valid, new_nonce, prefill_proof
from transfer.base import FencesWrites
from transfer.blocks import check_pages
from transfer.channel import ControlChannel
from transfer.context import Context, Outbox, room_error
from transfer.errors import PeerReport, RoomAborted, TransferError, TransferErrorKind
from transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    AuthChallenge,
    AuthHello,
    AuthProof,
    Message,
    Ping,
    Pong,
    Quiesced,
    Register,
    RegisterAck,
    RoomRequest,
    RoomStatus,
)
from transfer.receiver import KVReceiver, PrefillConn
from transfer.types import KVPoll

log = logging.getLogger(__name__)

Resolver = Callable[[str, int | None, str | None], tuple[str, int]]


@runtime_checkable
class CachingResolver(Protocol):
    """Optional resolver ability: answer from what it already knows, without blocking."""

    def __call__(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int]: ...

    def cached(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int] | None:
        """What ``__call__`` would answer now if that needs no I/O; None when it would have to ask.
        Never blocks; may raise (the receiver then takes the ordinary path, which reports the error)."""
        ...


@runtime_checkable
class InvalidatingResolver(Protocol):
    """Optional resolver ability: forget what it cached of one prefill. The KV manager calls it when the
    connection to the address it answered fails or breaks (a restarted prefill listens elsewhere)."""

    def __call__(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int]: ...

    def invalidate(self, host: str, port: int | None, instance_id: str | None) -> None: ...


_TERMINAL = (KVPoll.Failed, KVPoll.Success)
_MAX_CONNECT_S = 10.0
# the most of one gap between the monitor's ticks (50 ms apart) that counts as time this decode ran (``_settle``)
_TICK_GAP_CAP_S = 0.5
# a prefill's failed RoomStatus of these kinds: its data path to this decode broke or stalled (transfer.sender_rooms)
_DATA_PATH_FAILURES = (TransferErrorKind.PEER_GONE, TransferErrorKind.PEER_UNREACHABLE, TransferErrorKind.TIMEOUT)


class DecodeSide:
    def __init__(self, ctx: Context, resolver: Resolver | None, keys: KVKeys | None = None) -> None:
        self._ctx = ctx
        self._keys = keys  # the worker key's (``transfer.auth``): None, no handshake
        self.refusals = RefusalLog(log, "KV control")
        self._resolver = resolver
        self._invalidate = resolver.invalidate if isinstance(resolver, InvalidatingResolver) else None
        # (checked once: a runtime Protocol check costs tens of µs, too much for every room)
        self._cached = resolver.cached if isinstance(resolver, CachingResolver) else None
        self._receivers: dict[int, KVReceiver] = {}
        self._conns: dict[tuple[str, int], PrefillConn] = {}
        self._by_channel: dict[ControlChannel, PrefillConn] = {}
        self._unanswered: set[ControlChannel] = set()  # (with a key) AuthHello sent, no answer read yet
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-bootstrap")
        # target -> the rooms waiting for its look-up, under way on one pool thread (a registry that hangs holds
        # one thread, not one per room: rooms of other prefills are not queued behind its rooms)
        self._resolving: dict[tuple[str, int | None, str | None], list[KVReceiver]] = {}
        self._generations = itertools.count(1)
        self._last_beat = time.monotonic()
        # Without fences: rooms whose prefill's control connection closed while a write of theirs could be on
        # the wire -> when they count as quiesced (``_settle``), on a clock of the time this decode ran: the
        # monitor's ticks, each gap counted up to ``_TICK_GAP_CAP_S`` (a decode stopped meanwhile read nothing)
        self._settling: dict[KVReceiver, float] = {}
        self._run_clock = 0.0
        self._last_tick = time.monotonic()
        backend = ctx.backend
        self._fences: FencesWrites | None = backend if isinstance(backend, FencesWrites) else None
        if self._fences is not None:
            self._fences.set_fence_listener(self._on_fence_quiet)

    # -- rooms -----------------------------------------------------------------------------------
    def create_receiver(self, room: int, host: str, port: int | None, instance_id: str | None) -> KVReceiver:
        with self._ctx.lock:
            if self._ctx.closed:
                raise RuntimeError("KVManager is closed")
            if room in self._receivers:
                raise ValueError(f"room {room} already has a receiver")
            receiver = KVReceiver(self, room, time.monotonic())
            target = receiver.target = (host, port, instance_id)
            self._receivers[room] = receiver
            # With the registry's answer not cached (any more), a registered, heartbeating connection serving this
            # prefill already is where it still is (asking a registry that hangs cost each room seconds); a cached
            # answer naming another address wins (the prefill may have moved)
            known = self._known_address(host, port, instance_id)
            conn = self._conns.get(known) if known is not None else self._live_conn(target)
            if conn is not None and conn.ready:  # fast path: nothing to resolve, connect or register
                receiver.join(conn)
                conn.targets.add(target)
                conn.receivers.add(receiver)
                self._ctx.changed()
                return receiver
            waiting = self._resolving.get(target)
            if waiting is not None:  # its look-up is under way: its answer serves this room too
                waiting.append(receiver)
                return receiver
            self._resolving[target] = [receiver]
        self._pool.submit(self._bootstrap, target)
        return receiver

    def _known_address(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int] | None:
        """The prefill's control address if known without blocking (see ``_bootstrap`` for the slow path)."""
        if self._resolver is None:
            return (host, port) if port is not None else None
        if self._cached is None:
            return None
        try:
            address = self._cached(host, port, instance_id)
        except Exception:
            return None
        return (str(address[0]), int(address[1])) if address is not None else None

    def _bootstrap(self, target: tuple[str, int | None, str | None]) -> None:
        """On a pool thread: look ``target`` up once (may block on the registry), then join every room that
        waited for it (those created meanwhile too) to its connection, opening it if new."""
        host, port, instance_id = target
        address, failure = self._resolve(target)
        with self._ctx.lock:
            receivers = self._resolving.pop(target, [])
        opened: list[PrefillConn] = []
        for receiver in receivers:
            if address is None:
                if isinstance(failure, TransferError):
                    error = room_error(receiver.room, failure)
                else:
                    error = TransferError(TransferErrorKind.BOOTSTRAP, f"room {receiver.room}: resolving bootstrap "
                                          f"target {host}:{port} ({instance_id}) failed: {failure!r}")
                self._fail_one(receiver, error)
                continue
            try:
                conn = self._attach(receiver, address)
            except Exception as exc:  # (on the pool's thread: raised, it would be lost and the rooms left waiting)
                self._fail_one(receiver, TransferError(
                    TransferErrorKind.BOOTSTRAP,
                    f"room {receiver.room}: connecting to the prefill {host}:{port} failed: {exc!r}"))
                continue
            if conn is not None:
                opened.append(conn)
        for conn in opened:
            try:
                self._open(conn)
            except Exception as exc:
                self._conn_failed(conn, TransferError(
                    TransferErrorKind.BOOTSTRAP, f"connecting to the prefill {host}:{port} failed: {exc!r}"))

    def _resolve(self, target: tuple[str, int | None, str | None]) -> tuple[tuple[str, int] | None, Exception | None]:
        """The prefill's control address (may block on the registry), or None and why not."""
        try:
            return self._address(*target), None
        except TransferError as exc:
            return None, exc
        except Exception as exc:
            # The registry failed the look-up (down past its replies' stale window, say), but a registered,
            # heartbeating connection may serve that very prefill: it still is where it was.
            live = self._live_address(target)
            return (live, None) if live is not None else (None, exc)

    def _live_address(self, target: tuple[str, int | None, str | None]) -> tuple[str, int] | None:
        """The address of a ready connection that a room for ``target`` was served over, if there is one."""
        with self._ctx.lock:
            conn = self._live_conn(target)
            return conn.address if conn is not None else None

    def _live_conn(self, target: tuple[str, int | None, str | None]) -> PrefillConn | None:
        """Lock held: a ready connection that a room for ``target`` was served over, if there is one."""
        for conn in self._conns.values():
            if conn.ready and conn.error is None and target in conn.targets:
                return conn
        return None

    def _address(self, host: str, port: int | None, instance_id: str | None) -> tuple[str, int]:
        if self._resolver is not None:
            address = self._resolver(host, port, instance_id)
        elif port is None:
            raise TransferError(TransferErrorKind.BOOTSTRAP, f"no port for {host} and no resolver")
        else:
            address = (host, port)
        return (str(address[0]), int(address[1]))

    def _attach(self, receiver: KVReceiver, address: tuple[str, int]) -> PrefillConn | None:
        """Join ``receiver`` to the connection for ``address``; returns the connection if it is new (to
        be opened by the caller), else None. A receiver aborted meanwhile joins nothing, but its abort goes
        to the prefill over that connection (now, or once it is registered)."""
        channel, reason = None, ""
        with self._ctx.lock:
            if self._ctx.closed or (receiver.is_terminal and receiver.abort_reason is None):
                return None
            conn = self._conns.get(address)
            created = conn is None or conn.error is not None
            if created:
                conn = PrefillConn(address)
                self._conns[address] = conn
            assert conn is not None
            if receiver.target is not None:
                conn.targets.add(receiver.target)
            if receiver.is_terminal:
                reason, receiver.abort_reason = receiver.abort_reason or "", None
                if conn.ready and conn.channel is not None:
                    channel = conn.channel
                else:
                    conn.pending_aborts.append((receiver, reason))
            else:
                conn.receivers.add(receiver)
                if receiver.join(conn):
                    self._ctx.changed()
        if channel is not None:
            channel.send(Abort(receiver.room, reason))
        return conn if created else None

    def _open(self, conn: PrefillConn) -> None:
        host, port = conn.address
        timeout = min(self._ctx.timeouts.bootstrap_s, _MAX_CONNECT_S)
        try:
            sock = socket.create_connection(conn.address, timeout=timeout)
        except (OSError, ValueError) as exc:  # (ValueError: a host name that does not encode, e.g. a label > 63)
            error = TransferError(TransferErrorKind.PEER_UNREACHABLE,
                                  f"cannot connect to the prefill's control port {host}:{port}: {exc}")
            spared = self._conn_failed(conn, error, spare_unresolved=True)
            if spared:
                self._resolve_again(conn.address, spared, error)
            return
        proving = self._keys is not None
        channel = ControlChannel(sock, f"prefill@{host}:{port}", self._on_handshake if proving else self._on_message,
                                 self._on_close)
        with self._ctx.lock:
            conn.channel = channel
            self._by_channel[channel] = conn
            if proving:
                conn.nonce = new_nonce()
                self._unanswered.add(channel)
        channel.start()
        if proving:
            channel.send(AuthHello(PROTOCOL_VERSION, conn.nonce))
        else:
            self._register(channel)

    def _register(self, channel: ControlChannel) -> None:
        args = self._ctx.args
        channel.send(Register(
            PROTOCOL_VERSION, self._ctx.backend.name, self._ctx.backend.endpoint(),
            args.kv_ptrs, args.kv_data_lens, args.kv_item_lens,
            args.aux_ptrs, args.aux_data_lens, args.aux_item_lens, args.page_size, args.kv_dtype,
        ))

    def _on_handshake(self, channel: ControlChannel, msg: Message) -> None:
        """A connection's frames until its prefill proved the worker key (only with a key)."""
        conn = self._by_channel.get(channel)
        keys = self._keys
        if conn is None or keys is None:
            return
        if isinstance(msg, (AuthChallenge, RegisterAck)):  # (it knows the key's handshake: ``_on_close``)
            with self._ctx.lock:
                self._unanswered.discard(channel)
        match msg:
            case Ping(seq=seq):
                channel.send(Pong(seq))
            case Pong():
                pass
            case RegisterAck(ok=False):  # the prefill refused us (no key there, a version, ...): its reason
                self._on_message(channel, msg)
            case AuthChallenge(nonce=nonce, proof=proof) if is_valid(prefill_proof(keys, conn.nonce, nonce), proof):
                channel.set_handler(self._on_message)
                channel.send(AuthProof(decode_proof(keys, conn.nonce, nonce)))
                self._register(channel)
            case AuthChallenge():
                self._refuse(channel, conn, f"{channel.name} did not prove the worker key (not this decode's "
                             "--api-key / $PD_WORKER_API_KEY, or not one of our prefills)")
            case _:
                self._refuse(channel, conn, f"{channel.name}: {type(msg).__name__} before proving the worker key")

    def _refuse(self, channel: ControlChannel, conn: PrefillConn, reason: str) -> None:
        self.refusals.refused(channel.name, reason)
        error = TransferError(TransferErrorKind.PROTOCOL, reason)
        self._conn_failed(conn, error)
        channel.close(error)

    def _fail(self, receiver: KVReceiver, error: TransferError, *, gone: bool = False, cut: bool = False) -> None:
        """Lock held. ``gone``: the control connection to the prefill closed; ``cut``: the prefill may be
        frozen mid-write (silent, or its connection gone), so a write of it being received is cut off."""
        was_quiet = receiver.quiesced
        if receiver.fail(error):  # (an abort ended it on purpose: not a transfer failure, for the metrics)
            # (the prefill's refusal of a room it had aborted, before our page list came, says so in its kind)
            if isinstance(error, RoomAborted) or (isinstance(error, PeerReport)
                                                  and error.kind == TransferErrorKind.ABORTED):
                self._ctx.num_rooms_aborted += 1
            else:
                self._ctx.num_rooms_failed += 1
        if self._fences is not None:
            self._close_fence(receiver, cut=cut or gone)
        elif gone:
            self._settle(receiver)
        if receiver.poll() == KVPoll.Failed and receiver.is_quiet and receiver.conn is not None:
            receiver.conn.receivers.discard(receiver)  # (e.g. its Quiesced came first): nothing to wait for
        if receiver.poll() == KVPoll.Failed or receiver.quiesced != was_quiet:
            self._ctx.changed()

    def _settle(self, receiver: KVReceiver) -> None:
        """Lock held, no fences: the control connection to the room's prefill closed, so no ``Quiesced`` will
        come, but what the prefill wrote before it closed or died may still be on its way into our pages: a
        killed process's bytes wait in its socket's and our kernel's buffers, and our engine (NIXL's UCX) lands
        them when it reads them, after the close was seen (a decode frozen meanwhile: megabytes, as it resumes).
        The room counts as quiesced once this decode has run ``heartbeat_timeout_s`` since (``tick``'s clock)."""
        if not receiver.quiesced and receiver not in self._settling:
            # (from now: the gap since the last tick, which the next one counts, went by before the close)
            pending = min(max(0.0, time.monotonic() - self._last_tick), _TICK_GAP_CAP_S)
            self._settling[receiver] = self._run_clock + pending + self._ctx.timeouts.heartbeat_timeout_s

    def _close_fence(self, receiver: KVReceiver, *, cut: bool) -> None:
        """Refuse the room's writes from now on (lock held); quiesced once none can land."""
        if self._fences is None or not receiver.metadata_sent or receiver.is_quiet:
            return
        if receiver.fence_open or cut:
            receiver.fence_open = False
            if self._fences.close_fence(receiver.room, receiver.generation, cut=cut):
                receiver.quiet()

    def _on_fence_quiet(self, room: int, generation: int) -> None:
        """Backend thread: a closed fence's last write being received is out."""
        with self._ctx.lock:
            receiver = self._receivers.get(room)
            if receiver is not None and receiver.generation == generation and not receiver.is_quiet:
                receiver.quiet()
                if receiver.conn is not None:
                    receiver.conn.receivers.discard(receiver)
                self._ctx.changed()

    def _fail_one(self, receiver: KVReceiver, error: TransferError) -> None:
        with self._ctx.lock:
            self._fail(receiver, error)

    def _resolve_again(self, dead: tuple[str, int], receivers: list[KVReceiver], error: TransferError) -> None:
        """Rooms whose connection to ``dead`` could not be opened: that may be a restarted prefill's old
        address (a new control port under the same instance id, which an address cached before the
        restart, or a registry that had not yet heard of it, still named). They ask the registry once
        more (once per target; ``_conn_failed`` has made it forget the address): told a different
        address they move to it; told the same one, or nothing, they fail with ``error`` (the prefill
        is what cannot be reached) without another attempt."""
        by_target: dict[tuple[str, int | None, str | None], list[KVReceiver]] = {}
        for receiver in receivers:
            receiver.resolved_again = True
            assert receiver.target is not None
            by_target.setdefault(receiver.target, []).append(receiver)
        opened: list[PrefillConn] = []
        for target, group in by_target.items():  # one look-up per target, not per room
            with self._ctx.lock:  # (timed out or aborted meanwhile: only an abort still goes, to the new address)
                group = [r for r in group if not r.is_terminal or r.abort_reason is not None]
            if not group:
                continue
            try:
                address = self._address(*target)
            except Exception:  # (the registry does not know it either: the prefill is what is unreachable)
                address = dead
            for receiver in group:
                if address == dead:
                    self._fail_one(receiver, room_error(receiver.room, error))
                elif (new := self._attach(receiver, address)) is not None:
                    opened.append(new)
        for new in opened:
            self._open(new)

    def _conn_failed(self, conn: PrefillConn, error: TransferError, *,
                     spare_unresolved: bool = False) -> list[KVReceiver]:
        """Drop the connection and fail its rooms. ``spare_unresolved`` (it could not be opened): rooms
        that may still ask the registry again (``_resolve_again``) are detached instead and returned."""
        spared: list[KVReceiver] = []
        with self._ctx.lock:
            conn.error = conn.error or error
            conn.ready = False
            if self._conns.get(conn.address) is conn:
                del self._conns[conn.address]
            for receiver in list(conn.receivers):
                if (spare_unresolved and self._invalidate is not None and not receiver.resolved_again
                        and receiver.target is not None and not receiver.is_terminal):
                    spared.append(receiver)
                else:
                    self._fail(receiver, room_error(receiver.room, error), gone=True)
            conn.receivers.clear()
            for receiver, reason in conn.pending_aborts:  # (aborted while it was being opened)
                if (spare_unresolved and self._invalidate is not None and not receiver.resolved_again
                        and receiver.target is not None):
                    receiver.abort_reason = reason  # (told at the address the registry names: ``_resolve_again``)
                    spared.append(receiver)
            conn.pending_aborts.clear()
            targets = list(conn.targets)
        if self._invalidate is not None:  # the next room asks the registry again instead of a dead address
            for target in targets:
                with contextlib.suppress(Exception):
                    self._invalidate(*target)
        return spared

    def send_metadata(self, receiver: KVReceiver, page_ids: list[int], aux_index: int) -> None:
        args, room = self._ctx.args, receiver.room
        with self._ctx.lock:
            if receiver.is_released:
                raise RuntimeError(f"room {room}: send_metadata() after release()")
            if receiver.poll() == KVPoll.Failed:
                return
            if receiver.metadata_sent:
                raise RuntimeError(f"room {room}: send_metadata() called twice")
            conn = receiver.conn
            if receiver.poll() != KVPoll.WaitingForInput or conn is None or conn.channel is None:
                raise RuntimeError(f"room {room}: send_metadata() before the prefill connection is ready")
            check_pages(page_ids, args.num_pages, f"room {room}: destination pages")
            if args.num_aux_slots and not 0 <= aux_index < args.num_aux_slots:
                raise ValueError(f"room {room}: aux slot {aux_index} outside [0, {args.num_aux_slots})")
            receiver.metadata_leaving(next(self._generations), time.monotonic())
            if self._fences is not None:
                self._fences.open_fence(room, receiver.generation)
                receiver.fence_open = True
            channel = conn.channel
        channel.send(RoomRequest(room, page_ids, aux_index, receiver.generation))

    def abort(self, receiver: KVReceiver, reason: str) -> None:
        """Fail the room and tell its prefill (at once, or once the connection to it is registered: a
        prefill told nothing would hold the request until its bootstrap timeout)."""
        with self._ctx.lock:
            if receiver.is_terminal:
                return
            conn = receiver.conn
            self._fail(receiver, RoomAborted(f"room {receiver.room}: aborted by the decode: {reason}"))
            channel = conn.channel if conn is not None and conn.ready else None
            if conn is None or conn.error is not None:  # (its address is being looked up, maybe again)
                receiver.abort_reason = reason  # (``_attach`` tells the prefill)
            elif channel is None:
                conn.pending_aborts.append((receiver, reason))
        if channel is not None:
            channel.send(Abort(receiver.room, reason))

    def decline(self, room: int, host: str, port: int | None, instance_id: str | None, reason: str) -> None:
        """A room whose request this decode refused before it had a receiver: its prefill is told (an
        ``Abort``), so that it does not wait for a page list until its bootstrap timeout. Nothing when the
        room is in use here (another request's: not this one's to end)."""
        with self._ctx.lock:
            if room in self._receivers:
                return
        try:
            receiver = self.create_receiver(room, host, port, instance_id)
        except (ValueError, RuntimeError):  # (taken meanwhile, or closing)
            return
        self.abort(receiver, reason)
        self.release(receiver)

    def release(self, receiver: KVReceiver) -> None:
        if receiver.is_released:
            return
        if not receiver.is_terminal:
            self.abort(receiver, "released before completion")
        with self._ctx.lock:
            receiver.mark_released()
            self._settling.pop(receiver, None)
            if self._receivers.get(receiver.room) is receiver:
                del self._receivers[receiver.room]
            if receiver.conn is not None:
                receiver.conn.receivers.discard(receiver)

    def num_rooms(self) -> int:
        with self._ctx.lock:
            return len(self._receivers)

    # -- control messages (reader threads) -------------------------------------------------------
    def _on_message(self, channel: ControlChannel, msg: Message) -> None:
        conn = self._by_channel.get(channel)
        if conn is None:
            return
        match msg:
            case Ping(seq=seq):
                channel.send(Pong(seq))
            case Pong():
                pass
            case RegisterAck(ok=True):
                with self._ctx.lock:
                    conn.ready = True
                    for receiver in conn.receivers:
                        receiver.connection_ready()
                    aborts, conn.pending_aborts = conn.pending_aborts, []
                    self._ctx.changed()
                for aborted, reason in aborts:  # (rooms aborted while the connection was being registered)
                    channel.send(Abort(aborted.room, reason))
            case RegisterAck(ok=False, reason=reason, kind=kind):
                self.refusals.refused_us(channel.name, f"it refused our registration: {reason}")
                error = TransferError(TransferErrorKind.parse(kind), f"{channel.name} refused registration: {reason}")
                self._conn_failed(conn, error)
                channel.close(error)
            case RoomStatus(room=room, ok=ok, kind=kind, reason=reason, aux_len=aux_len):
                with self._ctx.lock:
                    found = self._receivers.get(room)
                    if found is None or found.conn is not conn or found.is_terminal:
                        return
                    receiver = found
                    if ok and receiver.metadata_sent:
                        receiver.succeed(aux_len)
                        self._ctx.num_rooms_completed += 1
                        self._close_fence(receiver, cut=False)  # every write was acknowledged
                        self._ctx.changed()
                        conn.receivers.discard(receiver)
                    elif ok:
                        self._fail(receiver, TransferError(
                            TransferErrorKind.PROTOCOL,
                            f"room {room}: {channel.name} reported success before our page list",
                        ))
                    else:
                        failure = TransferErrorKind.parse(kind)
                        self._fail(receiver, PeerReport(failure, f"room {room}: {channel.name} reported: {reason}"))
                        if failure in _DATA_PATH_FAILURES and self._conns.get(conn.address) is conn:
                            # its data path to us broke or stalled: the prefill closes this connection (at once,
                            # or once none of its writes is in flight); new rooms go over a new one (one that came
                            # between this status and the close went over the dying connection and failed)
                            del self._conns[conn.address]
                            conn.left = True
            case Quiesced(room=room):
                # The prefill sends it once it has failed the room and none of its writes is in flight.
                # Its own Abort or failed RoomStatus leaves from another of its threads and may come
                # after it: without fences (which decide this for themselves) a live room remembers it.
                with self._ctx.lock:
                    target = self._receivers.get(room)
                    if target is None or target.conn is not conn or not target.metadata_sent:
                        return
                    failed = target.poll() == KVPoll.Failed
                    if failed or self._fences is None:
                        target.quiet()
                    if failed:
                        conn.receivers.discard(target)
                        self._ctx.changed()
            case Abort(room=room, reason=reason):
                with self._ctx.lock:
                    target = self._receivers.get(room)
                    if target is not None and target.conn is conn:
                        self._fail(target, RoomAborted(f"room {room}: aborted by the prefill: {reason}"))
            case _:
                channel.close(TransferError(
                    TransferErrorKind.PROTOCOL, f"{channel.name}: unexpected {type(msg).__name__}"
                ))

    def _on_close(self, channel: ControlChannel, error: TransferError) -> None:
        with self._ctx.lock:
            conn = self._by_channel.pop(channel, None)
            unanswered = channel in self._unanswered
            self._unanswered.discard(channel)
        if conn is None:
            return
        if unanswered and error.kind == TransferErrorKind.PEER_GONE:
            # (a prefill of this release answers AuthHello, a refusal included: one that closes on it does not know
            # it, an earlier release's decoder fails on the unknown message; or it went away, killed or stopping,
            # which looks the same from here. Still PEER_GONE, said so: held against the prefill, not against this
            # decode as a PROTOCOL failure of its own would be, in either case)
            error = TransferError(TransferErrorKind.PEER_GONE, f"{channel.name} closed the connection on our key "
                                  "handshake (AuthHello) without an answer: it does not support the workers' KV keys "
                                  f"(a prefill of an earlier release), or it went away ({error.message})")
            self.refusals.refused_us(channel.name, error.message)
        self._conn_failed(conn, error)

    # -- monitor thread --------------------------------------------------------------------------
    def take_broken(self) -> list[tuple[ControlChannel, TransferError]]:
        """(The prefill side's; a decode's connections end through ``heartbeat`` and their readers.)"""
        return []

    def tick(self, now: float, outbox: Outbox) -> bool:
        """Enforce bootstrap and waiting timeouts, quiesce settled rooms (lock held). Never busy."""
        timeouts = self._ctx.timeouts
        self._run_clock += min(max(0.0, now - self._last_tick), _TICK_GAP_CAP_S)
        self._last_tick = now
        if self._settling:
            for receiver, deadline in list(self._settling.items()):
                if self._run_clock >= deadline:
                    del self._settling[receiver]
                    if receiver.quiet():
                        if receiver.conn is not None:
                            receiver.conn.receivers.discard(receiver)
                        self._ctx.changed()
        for receiver in list(self._receivers.values()):
            if receiver.poll() == KVPoll.Bootstrapping and now - receiver.created > timeouts.bootstrap_s:
                self._fail(receiver, TransferError(
                    TransferErrorKind.TIMEOUT,
                    f"room {receiver.room}: not connected to a prefill within {timeouts.bootstrap_s:g}s",
                ))
            elif (
                receiver.poll() == KVPoll.WaitingForInput
                and receiver.metadata_sent
                and now - receiver.metadata_at > timeouts.waiting_s
            ):
                conn = receiver.conn
                # (BOOTSTRAP: no worker's fault, as a prefill's wait for a busy decode's page list: the room
                # waits here while the prefill's queue holds its request, and overload must not open the
                # breaker of a prefill that is only busy. A prefill that is gone or frozen is told apart by its
                # connection and heartbeats, a stalled write by ``transfer_s``.)
                self._fail(receiver, TransferError(
                    TransferErrorKind.BOOTSTRAP,
                    f"room {receiver.room}: no KV from the prefill within {timeouts.waiting_s:g}s (its queue may "
                    "be long)",
                ))
                if conn is not None and conn.channel is not None:
                    outbox.append((conn.channel, Abort(receiver.room, "decode timed out waiting for the KV")))
        return False

    def heartbeat(self, now: float, outbox: Outbox) -> list[tuple[ControlChannel, TransferError]]:
        """Ping every prefill; fail the rooms of silent ones. Returns the connections to close now: silent
        ones whose rooms are all quiesced, and draining ones once they are (the caller closes them)."""
        to_close = []
        limit = self._ctx.timeouts.heartbeat_timeout_s
        # after a stall of our own (SIGSTOP, a starved machine) every peer looks silent: judge next beat
        stalled, self._last_beat = now - self._last_beat > limit, now
        for channel, conn in list(self._by_channel.items()):
            if conn.left and not conn.draining and not conn.receivers and not conn.pending_aborts:
                # (a prefill that does not close it itself: e.g. a TIMEOUT of a backend without started_at)
                to_close.append((channel, TransferError(TransferErrorKind.ABORTED, f"{channel.name}: left")))
                continue
            if conn.draining:
                if not any(not r.quiesced for r in conn.receivers):
                    to_close.append((channel, conn.error or TransferError(TransferErrorKind.TIMEOUT, "drained")))
                    continue
                if self._run_clock - conn.draining_since >= self._ctx.timeouts.quarantine_s:
                    to_close.append((channel, self._give_up_draining(channel, conn)))
                    continue
            elif now - channel.last_rx > limit and not stalled:
                error = TransferError(
                    TransferErrorKind.TIMEOUT, f"{channel.name}: no heartbeat for {now - channel.last_rx:.1f}s"
                )
                conn.error = conn.error or error
                conn.ready = False
                if self._conns.get(conn.address) is conn:
                    del self._conns[conn.address]
                for receiver in list(conn.receivers):
                    self._fail(receiver, room_error(receiver.room, error), cut=True)
                    if receiver.metadata_sent and not receiver.quiesced:
                        outbox.append((channel, Abort(receiver.room, "the prefill went silent")))
                if self._fences is not None or all(r.quiesced for r in conn.receivers):
                    to_close.append((channel, error))  # fenced: nothing it still sends can land
                    continue
                conn.draining = True  # it may be frozen mid-write: wait for its Quiesced or its end
                conn.draining_since = self._run_clock  # (... or ``quarantine_s`` of our running)
            outbox.append((channel, Ping(int(now * 1000))))
        return to_close

    def _give_up_draining(self, channel: ControlChannel, conn: PrefillConn) -> TransferError:
        """Lock held: a silent prefill did not answer ``Quiesced`` within ``quarantine_s`` of our running (frozen
        for good, its host cut off). Its rooms are called quiesced now, so their pages go back to the pool, and
        the connection closes (a prefill that resumes reads the close and fails whatever it still had queued for
        us). Not fenced: what it had already handed its engine before it froze lands if it ever resumes, maybe in
        pages given out again meanwhile (docs/transfer.md)."""
        rooms = sorted(r.room for r in conn.receivers if not r.quiesced)
        quarantine_s = self._ctx.timeouts.quarantine_s
        log.warning("%s: silent and no Quiesced within quarantine_s (%gs) for rooms %s: their pages are given back "
                    "now; a write it had posted before it went silent is not fenced and lands if it ever resumes",
                    channel.name, quarantine_s, rooms[:16])
        for receiver in list(conn.receivers):
            if receiver.quiet():
                self._ctx.num_rooms_unquiesced_released += 1
            self._settling.pop(receiver, None)
            conn.receivers.discard(receiver)
        self._ctx.changed()
        return TransferError(TransferErrorKind.TIMEOUT, f"{channel.name}: no Quiesced within quarantine_s "
                             f"({quarantine_s:g}s) of going silent; its rooms were released")

    # -- shutdown --------------------------------------------------------------------------------
    def fail_all(self, outbox: Outbox) -> None:
        for receiver in self._receivers.values():
            if receiver.is_terminal:
                continue
            conn = receiver.conn
            self._fail(receiver, RoomAborted(f"room {receiver.room}: the decode's KV manager closed"))
            if conn is not None and conn.channel is not None and conn.ready:
                outbox.append((conn.channel, Abort(receiver.room, "decode KV manager closed")))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._ctx.lock:
            channels = list(self._by_channel)
        ControlChannel.close_all(channels)
