"""Prefill side of the KV manager: the control listener and the decodes registered with it.

Lifecycle:
1. ``PrefillSide`` listens on ``control_address``; every decode connection is a ``Link`` whose channel's
   reader thread delivers its messages here.
   Workers with a key (``transfer.auth``): a connection's reader first reads only the key's handshake
   (``_on_handshake``: ``AuthHello`` -> our ``AuthChallenge`` -> its ``AuthProof``); a decode that proves
   nothing, or wrongly, or not within a heartbeat timeout, is refused (``RegisterAck(ok=False)``) and closed,
   logged once per address a minute and counted. One that closes after our ``AuthChallenge`` without its proof
   refused ours (another key): logged as seldom (``refused_us``). Then the ordinary handler (``_on_message``)
   takes over.
2. A decode sends ``Register`` once: the shape is validated against ours (protocol version, backend,
   page size, dtype, layer count, page bytes), then the backend connects to the decode's data endpoint
   (blocking, in that connection's reader thread: it holds up no other decode's registration, rooms or heartbeats;
   tcp bounds it by one deadline, ``connect_timeout_s``), then ``RegisterAck``. A mismatch is refused with the
   reason, as is a data endpoint that cannot be reached or that refuses our proof of the key (tcp: PROTOCOL, a
   configuration error).
3. Room messages (``RoomRequest``, ``Abort``) go to ``SenderRooms`` (``transfer.sender_rooms``).
4. The monitor thread pings every decode; one silent for the heartbeat timeout has its rooms failed
   (TIMEOUT) and its connection closed (never at the first beat after a stall of our own: the decode's
   frames are then still unread); a closed connection fails its rooms (PEER_GONE) and the backend
   drops the peer. A decode that comes back connects and registers afresh.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from transfer.auth import (
    NONCE_BYTES,
    KVKeys,
    RefusalLog,
    decode_proof,
    is_valid,
    new_nonce,
    prefill_proof,
)
from transfer.base import FencesWrites
from transfer.channel import ControlChannel
from transfer.context import Context, Outbox
from transfer.errors import TransferError, TransferErrorKind
from transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    AuthChallenge,
    AuthHello,
    AuthProof,
    Message,
    Ping,
    Pong,
    Register,
    RegisterAck,
    RoomRequest,
)
from transfer.netaddr import accept_retrying, listener
from transfer.sender import KVSender, Link
from transfer.sender_rooms import SenderRooms
from transfer.types import KVArgs

log = logging.getLogger(__name__)

_KEY_HINT = "(the workers' --api-key / $PD_WORKER_API_KEY)"


class PrefillSide:
    def __init__(self, ctx: Context, host: str, port: int, keys: KVKeys | None = None) -> None:
        self._ctx = ctx
        self._keys = keys  # the worker key's (``transfer.auth``): None, no handshake
        self.refusals = RefusalLog(log, "KV control port")
        self._links: dict[ControlChannel, Link] = {}
        # (as the decode decides: with fences, it refuses a closed room's writes itself; without, it takes the
        # control connection's close as the end of every write of that connection's rooms)
        backend = ctx.backend
        self._fences_writes = isinstance(backend, FencesWrites)
        self.rooms = SenderRooms(ctx, fences_writes=self._fences_writes)
        if isinstance(backend, FencesWrites):
            # Fencing on and no fence ever opened: a prefill takes no writes (before, anyone reaching its data port
            # could write into its pool, prefix-cache pages included)
            backend.set_fence_listener(_receives_nothing)
        self._last_beat = time.monotonic()
        self._listener = listener(host, port)
        self._closing = False
        self.control_address: tuple[str, int] = self._listener.getsockname()[:2]
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-ctl-accept", daemon=True)

    def staging_region(self) -> tuple[int, int]:
        return self.rooms.staging_region()

    def start(self) -> None:
        self._accept_thread.start()

    def create_sender(self, room: int) -> KVSender:
        return self.rooms.create_sender(room)

    def end_room(self, room: int, reason: str) -> None:
        self.rooms.end_room(room, reason)

    def num_rooms(self) -> int:
        return self.rooms.num_rooms()

    def tick(self, now: float, outbox: Outbox) -> bool:
        return self.rooms.tick(now, outbox)

    def take_broken(self) -> list[tuple[ControlChannel, TransferError]]:
        """Connections to close (lock held; the caller closes them outside it): see ``SenderRooms.take_broken``."""
        return self.rooms.take_broken()

    def fail_all(self, outbox: Outbox) -> None:
        self.rooms.fail_all(outbox)

    def drain_graveyard(self, deadline_s: float, outbox: Outbox) -> None:
        self.rooms.drain_graveyard(deadline_s, outbox)

    # -- connections -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            accepted = accept_retrying(self._listener, lambda: self._closing or self._ctx.closed,
                                       "KV control listener")
            if accepted is None:
                return
            sock, addr = accepted
            proving = self._keys is not None
            channel = ControlChannel(sock, f"decode@{addr[0]}:{addr[1]}",
                                     self._on_handshake if proving else self._on_message, self._on_close)
            with self._ctx.lock:
                if self._ctx.closed:
                    sock.close()
                    return
                self._links[channel] = Link(channel, proving=proving, opened=time.monotonic())
            channel.start()

    def _refuse(self, channel: ControlChannel, reason: str) -> None:
        """Refuse a connection's registration (the reason in ``RegisterAck``), then close it."""
        channel.send(RegisterAck(False, f"rejected: {reason}", TransferErrorKind.PROTOCOL.value))
        # (the refusal's reason is not lost in a backlog as the channel closes; nor does this reader wait)
        channel.close_after(TransferError(TransferErrorKind.PROTOCOL, f"{channel.name}: {reason}"), 1.0)

    def _refuse_unproven(self, channel: ControlChannel, reason: str) -> None:
        self.refusals.refused(channel.name, reason)
        link = self._links.get(channel)
        if link is not None:
            link.nonces = None  # (its close is ours, not its refusal of our challenge: ``_on_close``)
        channel.set_handler(_ignore)  # (what it sent behind, read as the channel closes, is not taken either)
        self._refuse(channel, reason)

    def _on_handshake(self, channel: ControlChannel, msg: Message) -> None:
        """A connection's frames until its decode proved the worker key (only with a key)."""
        link = self._links.get(channel)
        keys = self._keys
        if link is None or keys is None:
            return
        version_reason = f"protocol version {{}}, this prefill speaks {PROTOCOL_VERSION}"
        match msg:
            case Ping(seq=seq):  # (its heartbeat may come first)
                channel.send(Pong(seq))
            case Pong():
                pass
            case AuthHello(version=version, nonce=nonce):
                if version != PROTOCOL_VERSION:
                    self._refuse_unproven(channel, version_reason.format(version))
                elif link.nonces is not None or len(nonce) != NONCE_BYTES:
                    self._refuse_unproven(channel, "malformed key handshake")
                else:
                    ours = new_nonce()
                    link.nonces = (nonce, ours)
                    channel.send(AuthChallenge(ours, prefill_proof(keys, nonce, ours)))
            case AuthProof(proof=proof):
                if link.nonces is None:
                    self._refuse_unproven(channel, "key proof before AuthHello")
                elif not is_valid(decode_proof(keys, *link.nonces), proof):
                    self._refuse_unproven(channel, f"the decode's worker key is not this prefill's {_KEY_HINT}")
                else:
                    link.proving = False
                    channel.set_handler(self._on_message)  # (its Register is the next frame)
            case Register(version=version) if version != PROTOCOL_VERSION:
                self._refuse_unproven(channel, version_reason.format(version))
            case Register():
                self._refuse_unproven(channel, f"this prefill requires the worker key {_KEY_HINT} and the decode "
                                      "has none (or is of an earlier release, without KV keys)")
            case _:
                self._refuse_unproven(channel, f"{type(msg).__name__} before proving the worker key")

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
                if link.reg is None:
                    channel.close(TransferError(
                        TransferErrorKind.PROTOCOL, f"{channel.name}: room {msg.room} before Register"
                    ))
                else:
                    self.rooms.on_room_request(link, msg)
            case Abort(room=room, reason=reason):
                self.rooms.on_abort(link, room, reason)
            case AuthHello() if self._keys is None:
                self._refuse(channel, f"the decode has a worker key and this prefill none {_KEY_HINT}")
                self.refusals.refused(channel.name, "the decode has a worker key and this prefill none")
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

    def _on_register(self, link: Link, msg: Register) -> None:
        channel = link.channel
        if link.reg is not None:
            channel.close(TransferError(TransferErrorKind.PROTOCOL, f"{channel.name}: registered twice"))
            return
        reason = self._check_register(msg)
        if reason:
            self._refuse(channel, reason)
            return
        link.connecting = True  # (a first NIXL wire-up, a Mooncake warm-up: seconds, maybe past the heartbeat)
        try:
            peer = self._ctx.backend.connect(msg.endpoint)
        except TransferError as exc:
            # (unreachable, or refused: a tcp data port whose key differs refuses our proof, PROTOCOL)
            failed = "cannot reach" if exc.kind == TransferErrorKind.PEER_UNREACHABLE else "cannot use"
            channel.send(RegisterAck(False, f"prefill {failed} your data endpoint: {exc.message}", exc.kind))
            channel.close_after(exc, 1.0)
            return
        finally:
            channel.last_rx = max(channel.last_rx, time.monotonic())  # (its pings are read next: not silent)
            link.connecting = False  # (after: a heartbeat between the two must not see the old last_rx)
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

    def _on_close(self, channel: ControlChannel, error: TransferError) -> None:
        with self._ctx.lock:
            link = self._links.pop(channel, None)
            if link is None:
                return
            # it closed after our challenge, without its proof: a decode does that to a prefill whose proof of the
            # key it refused (it logs and counts that refusal; this side learns nothing more)
            challenged = link.proving and link.nonces is not None and error.kind == TransferErrorKind.PEER_GONE
            link.closed = True
            self.rooms.on_link_closed(link, error)
        if challenged:
            self.refusals.refused_us(channel.name, "it closed the connection after our key challenge, without its "
                                     f"proof: it refused our proof of the worker key (its key differs {_KEY_HINT}), "
                                     "or it went away")
        if link.peer is not None:
            self._ctx.backend.disconnect(link.peer)

    # -- monitor thread --------------------------------------------------------------------------
    def heartbeat(self, now: float, outbox: Outbox) -> list[tuple[ControlChannel, TransferError]]:
        """Ping every decode; return the silent ones (the caller closes them outside the lock)."""
        silent = []
        limit = self._ctx.timeouts.heartbeat_timeout_s
        # after a stall of our own (SIGSTOP, a starved machine) every decode looks silent, and their
        # frames are waiting unread: judge at the next beat. (Closing now would also lose the chance to
        # tell a decode that this room's writes are over: it holds those pages until it hears that.)
        stalled, self._last_beat = now - self._last_beat > limit, now
        for channel, link in self._links.items():
            if link.proving and now - link.opened > limit and not stalled and not channel.is_closed:
                # (a peer that pings but never proves the key holds no connection for long)
                silent.append((channel, TransferError(
                    TransferErrorKind.PROTOCOL, f"{channel.name}: did not prove the worker key within {limit:g}s")))
                self.refusals.refused(channel.name, f"did not prove the worker key within {limit:g}s")
                continue
            if now - channel.last_rx > limit and not stalled and not link.connecting:
                error = TransferError(
                    TransferErrorKind.TIMEOUT, f"{channel.name}: no heartbeat for {now - channel.last_rx:.1f}s"
                )
                self.rooms.fail_link(link, error, outbox)
                if self._fences_writes:
                    silent.append((channel, error))
                else:  # (the decode takes the close as the end of every write: not while one is on the wire)
                    self.rooms.close_when_quiet(link, error)
            else:
                outbox.append((channel, Ping(int(now * 1000))))
        return silent

    # -- shutdown --------------------------------------------------------------------------------
    def close(self) -> None:
        self._closing = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        if self._accept_thread.ident is not None:  # (not started: the backend refused to register)
            self._accept_thread.join(timeout=5.0)
        with self._ctx.lock:
            channels = list(self._links)
        ControlChannel.close_all(channels)


def _receives_nothing(room: int, generation: int) -> None:
    """A prefill's fence listener: it opens no fence, so no write of its backend's is ever under way to end."""


def _ignore(channel: ControlChannel, msg: Message) -> None:
    """The handler of a refused connection's last frames, read while it closes."""
