"""KVManager: one per worker rank; owns the backend, the control plane and the monitor thread.

Lifecycle:
1. ``KVManager(role, args, backend, ...)`` registers ``args``' memory with the backend once (the prefill
   also registers a small staging area for aux payloads) and starts its threads: the prefill listens on
   ``host`` (127.0.0.1 by default) and names ``advertise_host`` (default: the bound address) in
   ``control_address``; both run a monitor thread (write progress, timeouts,
   heartbeats).
2. Prefill: ``create_sender(room)`` per request; decode: ``create_receiver(room, host, port, instance_id)``.
   The scheduler thread then polls the room and calls its non-blocking methods (see ``KVSender`` and
   ``KVReceiver``); background threads do every blocking step. ``set_listener(fn)``: ``fn()`` runs
   whenever a room's ``poll()`` or ``quiesced`` changes, so the scheduler waits for that instead of
   polling. The monitor thread ticks when kicked (a write completed or failed, a room to quiesce, a
   write posted to a backend that cannot notify completions) and otherwise every ``_IDLE_POLL_S`` for
   timeouts; it polls every ``_BUSY_POLL_S`` while writes are in flight only on a backend that cannot
   notify completions (``NotifiesCompletion``). On a prefill with few rooms, a completion is handled
   right in the backend thread that reported it (``SenderRooms.settle_here``: the room's
   ``RoomStatus`` leaves and the scheduler is told without waking the monitor); with more rooms the
   monitor's one tick serves a burst of completions.
3. ``release()`` each room when done; ``num_rooms()`` counts rooms not yet released.
4. ``close()`` (idempotent): fails live rooms (ABORTED, telling the peers), closes connections, joins
   threads, closes the backend (which unregisters the memory). The manager owns the backend.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Literal

from transfer.auth import derive
from transfer.base import NotifiesCompletion, PeerId, ProvesKey, TransferBackend
from transfer.channel import ControlChannel
from transfer.context import Context, Outbox, flush
from transfer.decode import DecodeSide, Resolver
from transfer.errors import TransferError, TransferErrorKind
from transfer.prefill import PrefillSide
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.types import KVArgs, KVTimeouts

log = logging.getLogger(__name__)

_BUSY_POLL_S = 0.0005  # monitor tick while writes are in flight on a backend that does not notify
_IDLE_POLL_S = 0.05  # otherwise: timeouts and heartbeats
# A connection closed for a broken data path: the rooms' statuses sent just before it may wait in its backlog;
# it closes once they are written, or this long after (``ControlChannel.close_after``, not waited for here).
_STATUS_SETTLE_S = 1.0


class KVManager:
    def __init__(
        self,
        role: Literal["prefill", "decode"],
        args: KVArgs,
        backend: TransferBackend,
        *,
        host: str = "127.0.0.1",
        control_port: int = 0,
        timeouts: KVTimeouts = KVTimeouts(),
        resolver: Resolver | None = None,
        advertise_host: str | None = None,
        auth_key: str | None = None,
    ) -> None:
        """``auth_key``: the workers' key (``pd-worker --api-key``); with it every control connection, and the
        data connections of a backend that ``ProvesKey`` (tcp), prove it before anything else is taken
        (``transfer.auth``); peers without it are refused. None: no proof asked or given."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"KVManager role must be 'prefill' or 'decode', got {role!r}")
        if not isinstance(backend, TransferBackend):
            raise TypeError(f"backend must be a TransferBackend, got {type(backend).__name__}")
        self.role = role
        self.args = args
        self.backend = backend
        self.timeouts = timeouts
        self._advertise_host = advertise_host  # what control_address names (default: the bound address)
        self._ctx = Context(args, backend, timeouts)
        self.counters = self._ctx  # num_bytes_sent, num_rooms_completed, num_rooms_failed (for metrics)
        self._prefill: PrefillSide | None = None
        self._decode: DecodeSide | None = None
        keys = derive(auth_key)
        if isinstance(backend, ProvesKey):  # (before its memory is registered and its endpoint told anyone)
            backend.set_kv_keys(keys)
        regions = args.regions()
        if role == "prefill":
            self._prefill = PrefillSide(self._ctx, host, control_port, keys)
            regions.append(self._prefill.staging_region())
        else:
            self._decode = DecodeSide(self._ctx, resolver, keys)
        try:
            backend.register(regions)
        except Exception:
            if self._prefill is not None:
                self._prefill.close()
            with contextlib.suppress(Exception):  # (its own error is the one to tell)
                backend.close()
            raise
        self._closed = False
        self._close_lock = threading.Lock()
        self._notified = isinstance(backend, NotifiesCompletion)
        if isinstance(backend, NotifiesCompletion):
            backend.set_completion_listener(self._on_settled if self._prefill is not None else self._ctx.kick)
        if self._prefill is not None:
            self._prefill.start()
        self._monitor = threading.Thread(target=self._monitor_loop, name=f"kv-monitor-{role}", daemon=True)
        self._monitor.start()

    @property
    def num_peers_refused(self) -> int:
        """Connections refused for not proving the workers' key (control channel, and the backend's data port
        where it ``ProvesKey``): the refusals logged (once per address a minute) and not."""
        side = self._prefill or self._decode
        assert side is not None
        return side.refusals.num_refused + int(getattr(self.backend, "num_peers_refused", 0))

    @property
    def num_refused_by_peers(self) -> int:
        """The other way round: our connections a peer refused (``transfer.auth``'s ``RefusalLog.refused_us``: a
        prefill's proof of the key or a decode's registration refused on the control channel, a prefill's proof of
        the key refused by a decode's tcp data port where the backend ``ProvesKey``), logged or not."""
        side = self._prefill or self._decode
        assert side is not None
        return side.refusals.num_refused_by_peers + int(getattr(self.backend, "num_refused_by_peers", 0))

    @property
    def control_address(self) -> tuple[str, int]:
        """Prefill: where decodes connect (goes into the bootstrap registry as rank_ip/rank_port)."""
        if self._prefill is None:
            raise AttributeError("control_address: only a prefill KVManager listens")
        host, port = self._prefill.control_address
        return (self._advertise_host or host, port)

    def create_sender(self, room: int) -> KVSender:
        if self._prefill is None:
            raise RuntimeError("create_sender() on a decode KVManager")
        return self._prefill.create_sender(room)

    def room_requested(self, room: int) -> bool:
        """Prefill: whether the decode's page list for ``room`` (or its abort) arrived before a sender for it was
        created (any thread). Their arrival calls the listener too: one that came after this said no is told."""
        if self._prefill is None:
            raise RuntimeError("room_requested() on a decode KVManager")
        return self._prefill.rooms.has_word(room)

    def end_room(self, room: int, reason: str) -> None:
        """Prefill: a room it will not serve (a refused request); its decode's page list fails at once."""
        if self._prefill is None:
            raise RuntimeError("end_room() on a decode KVManager")
        self._prefill.end_room(room, reason)

    def create_receiver(
        self, room: int, host: str, port: int | None, instance_id: str | None = None
    ) -> KVReceiver:
        if self._decode is None:
            raise RuntimeError("create_receiver() on a prefill KVManager")
        return self._decode.create_receiver(room, host, port, instance_id)

    def decline_room(self, room: int, host: str, port: int | None, instance_id: str | None, reason: str) -> None:
        """Decode: a room whose request it refused (no receiver): the prefill is told, as by an abort."""
        if self._decode is None:
            raise RuntimeError("decline_room() on a prefill KVManager")
        self._decode.decline(room, host, port, instance_id, reason)

    def set_listener(self, on_change: Callable[[], None] | None) -> None:
        """``on_change()`` is called after a room's ``poll()`` or ``quiesced`` changed, and (prefill) when a
        decode's page list or abort arrives for a room no sender holds yet (from whichever thread made the
        change, with the manager's lock held: it must not block or call back in)."""
        self._ctx.on_change = on_change

    def num_rooms(self) -> int:
        side = self._prefill or self._decode
        assert side is not None
        return side.num_rooms()

    def _on_settled(self) -> None:
        """A write settled (a backend thread, holding none of its locks): progress the rooms here when
        ``SenderRooms.settle_here`` can, else kick the monitor."""
        assert self._prefill is not None
        ctx = self._ctx
        outbox: Outbox = []
        with ctx.lock:
            if ctx.closed:
                return
            if not self._prefill.rooms.settle_here(time.monotonic(), outbox):
                ctx.kicked = True
                ctx.wake.notify_all()
        flush(outbox)

    def _monitor_loop(self) -> None:
        ctx = self._ctx
        side = self._prefill or self._decode
        assert side is not None
        next_beat = time.monotonic()
        outbox: Outbox = []
        while True:
            with ctx.lock:
                if ctx.closed:
                    return
                ctx.kicked = False  # kicks from now on are seen by the wait below
                now = time.monotonic()
                stalled: list[PeerId] = []
                silent: list[tuple[ControlChannel, TransferError]] = []
                broken: list[tuple[ControlChannel, TransferError]] = []
                try:
                    busy = side.tick(now, outbox)
                    broken = side.take_broken()
                    if self._prefill is not None:
                        stalled = self._prefill.rooms.take_stalled()
                    if now >= next_beat:
                        silent += side.heartbeat(now, outbox)
                        next_beat = now + self.timeouts.heartbeat_interval_s
                except Exception:
                    log.exception("KV monitor tick failed")
                    busy = False  # (what take_broken took is closed all the same: nothing else would)
            flush(outbox)
            for channel, error in broken:  # (their rooms' statuses, just flushed, go first)
                channel.close_after(error, _STATUS_SETTLE_S)
            for channel, error in silent:
                channel.close(error)
            fail_queued: Callable[[PeerId, TransferError], None] | None = (
                getattr(ctx.backend, "fail_queued", None) if stalled else None)
            if fail_queued is not None:
                for peer in stalled:
                    fail_queued(peer, TransferError(TransferErrorKind.PEER_GONE, "the data path to the decode "
                                                    "stalled behind another room's write"))
            with ctx.lock:
                if ctx.closed:
                    return
                if not ctx.kicked:
                    ctx.wake.wait(_BUSY_POLL_S if busy and not self._notified else _IDLE_POLL_S)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        outbox: Outbox = []
        side = self._prefill or self._decode
        assert side is not None
        with self._ctx.lock:
            side.fail_all(outbox)
        flush(outbox)
        with self._ctx.lock:
            self._ctx.closed = True
            self._ctx.wake.notify_all()
        self._monitor.join(timeout=5.0)
        try:
            if self._prefill is not None:  # (its writes settle, and their decodes hear so, before connections close)
                self._prefill.drain_graveyard(2.0, outbox)
                flush(outbox)
        finally:
            side.close()
            self.backend.close()

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
