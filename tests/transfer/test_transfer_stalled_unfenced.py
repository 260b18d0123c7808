"""A stalled write to a decode whose backend does not fence writes (Mooncake here; NIXL alike): the decode takes
the end of a room's writes (``Quiesced``, or its control connection's close) as the end of every byte, so the
prefill must neither fail the stuck write early nor close the connection while it may still land. What it does
at once: fail the writes queued behind it (nothing of them is on the wire) and take no more rooms on that link.

(Review of a first version that dropped the data path: Mooncake's and NIXL's drop fails an in-flight write at once
while its engine call goes on; the prefill then sent ``Quiesced``, and the call, once the path cleared, landed the
room's bytes in pages the decode had given out again.) Needs a private network namespace (Mooncake binds 0.0.0.0).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from kvunit import _POOLS, make_args, open_room, wait_for, warm_room

from transfer import KVManager, KVPoll, KVTimeouts, TransferErrorKind
from transfer.mooncake import MooncakeBackend

pytestmark = pytest.mark.skipif(MooncakeBackend.unavailable_reason() is not None,
                                reason=str(MooncakeBackend.unavailable_reason()))


class _StuckEngine:
    """Mooncake's engine whose batch calls, once ``stall`` is set, hang (a black-holed path) until ``go``, then
    move their bytes, as an engine call does once the path clears."""

    def __init__(self, engine: object) -> None:
        self._engine = engine
        self.stall, self.go, self.inside, self.returned = (threading.Event() for _ in range(4))

    def batch_transfer_sync_write(self, *args: object) -> int:
        if not self.stall.is_set():
            return self._engine.batch_transfer_sync_write(*args)  # type: ignore[attr-defined]
        self.inside.set()
        self.go.wait(60)
        try:
            return self._engine.batch_transfer_sync_write(*args)  # type: ignore[attr-defined]
        finally:
            self.returned.set()

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)


def test_a_stalled_unfenced_write_lands_nothing_in_reused_pages_and_the_rooms_behind_it_fail_at_once() -> None:
    backend = MooncakeBackend()
    engine = _StuckEngine(backend._engine)
    backend._engine = engine
    timeouts = KVTimeouts(bootstrap_s=10.0, waiting_s=60.0, transfer_s=0.5, heartbeat_interval_s=0.1,
                          heartbeat_timeout_s=5.0)
    prefill = KVManager("prefill", make_args(), backend, timeouts=timeouts)
    src_pool = _POOLS[-1]
    decode = KVManager("decode", make_args(), MooncakeBackend(), timeouts=timeouts)
    dst_pool = _POOLS[-1]
    for buf in src_pool.kv_buffers():
        buf.view(np.uint8)[...] = 0x5A
    try:
        warm_room(prefill, decode)
        engine.stall.set()
        stuck, stuck_rx = open_room(prefill, decode, 2, [1, 2], 1)
        behind, behind_rx = open_room(prefill, decode, 3, [5, 6], 2)
        stuck.send([3, 4], last=True)
        assert engine.inside.wait(10)
        behind.send([3, 4], last=True)  # (queued behind the stuck write)
        assert wait_for(lambda: stuck.poll() == KVPoll.Failed, 10)
        assert stuck.failure().kind == TransferErrorKind.TIMEOUT
        # the room behind it: failed at once, not at the decode's waiting_s (60 s)
        assert wait_for(lambda: behind_rx.poll() == KVPoll.Failed and behind.poll() == KVPoll.Failed, 10)
        assert wait_for(lambda: behind_rx.quiesced, 5)  # (nothing of it was ever on the wire)
        # no new room on that connection while the stuck write may still land: the decode's next room goes over a
        # new one (told by the failed statuses), and the prefill refuses any that still came over the old one
        next_rx = decode.create_receiver(4, *prefill.control_address)
        assert wait_for(lambda: next_rx.poll() == KVPoll.WaitingForInput, 10), next_rx.poll()
        assert next_rx.conn is not None and next_rx.conn is not stuck_rx.conn
        early = wait_for(lambda: stuck_rx.quiesced, 2)  # (the engine call is still running)
        if early:  # the decode's scheduler gives the pages to another request, which fills them
            for i in range(len(dst_pool.kv_buffers())):
                for page in (1, 2):
                    dst_pool.page_view(i, page)[:] = 0
        engine.go.set()  # the path clears: the engine call goes on
        assert engine.returned.wait(30)
        assert wait_for(lambda: stuck_rx.quiesced, 10)
        landed = [(i, p) for i in range(len(dst_pool.kv_buffers())) for p in (1, 2)
                  if early and dst_pool.page_view(i, p).any()]
        assert not landed, (f"the decode called room 2 quiesced while its write's engine call was still running; "
                            f"the call then landed in pages {landed} (buffer, page) it had given out again")
    finally:
        engine.go.set()
        prefill.close()
        decode.close()


class _BlackHoled:
    """Mooncake's engine on a black-holed path, once ``stall`` is set: each batch call hangs for the engine's
    transfer timeout, then fails (-1), as the engine does; once ``stall`` is cleared (the path cleared), calls go
    through again. ``batches``: the destination lists of the calls made while stalled."""

    def __init__(self, engine: object, timeout_s: float) -> None:
        self._engine, self._timeout_s = engine, timeout_s
        self.stall = threading.Event()
        self.calls = 0
        self.batches: list[tuple[int, ...]] = []

    def batch_transfer_sync_write(self, *args: object) -> int:
        if not self.stall.is_set():
            return self._engine.batch_transfer_sync_write(*args)  # type: ignore[attr-defined]
        self.calls += 1
        self.batches.append(tuple(args[2]))  # type: ignore[arg-type]
        time.sleep(self._timeout_s)
        return -1

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)


def test_a_batch_the_engine_timed_out_fails_the_rooms_queued_behind_it_at_once(monkeypatch) -> None:
    """(Review.) Mooncake ends a stuck batch's call itself at ``MC_TRANSFER_TIMEOUT`` (30 s by default, below the
    default ``transfer_s``): that verdict counts as a stall too, and what was queued behind it fails at once instead
    of going into the engine in turn, each waiting out a timeout of its own. The timed-out batch itself stays in
    flight (the engine goes on moving it once the path clears: tests/contracts/
    test_mooncake_timed_out_batch_still_lands.py): its room fails at ``transfer_s`` and is quiesced once the path
    cleared and the batch is over."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")  # (the least it takes; 30 s by default)
    # (this engine's timed-out calls leave nothing in flight: no wait for their backed-off retransmissions)
    monkeypatch.setattr("transfer.mooncake._TCP_RTO_MAX_S", 0.0)
    backend = MooncakeBackend()
    engine = _BlackHoled(backend._engine, 5.0)
    backend._engine = engine
    timeouts = KVTimeouts(bootstrap_s=30.0, waiting_s=60.0, transfer_s=8.0, heartbeat_interval_s=0.1,
                          heartbeat_timeout_s=5.0)  # (transfer_s above the engine's timeout, as by default)
    prefill = KVManager("prefill", make_args(), backend, timeouts=timeouts)
    decode = KVManager("decode", make_args(), MooncakeBackend(), timeouts=timeouts)
    try:
        warm_room(prefill, decode)
        engine.stall.set()
        stuck, stuck_rx = open_room(prefill, decode, 2, [1, 2], 1)
        behind, behind_rx = open_room(prefill, decode, 3, [5, 6], 2)
        stuck.send([3, 4], last=True)
        assert wait_for(lambda: engine.calls == 1, 10)
        behind.send([3, 4], last=True)  # (queued behind the stuck batch)
        # the room behind it: failed at once (nothing of it on the wire), not after an engine timeout of its own
        assert wait_for(lambda: behind.poll() == KVPoll.Failed and behind_rx.poll() == KVPoll.Failed, 7), (
            "the room queued behind a batch the engine timed out went into the engine in its turn")
        assert wait_for(lambda: stuck.poll() == KVPoll.Failed, 10)
        assert stuck.failure().kind == TransferErrorKind.TIMEOUT
        assert set(engine.batches) == {engine.batches[0]}, "a batch of the room behind went into the engine"
        time.sleep(0.5)
        assert not stuck_rx.quiesced, "the timed-out batch may still land, yet the decode was told it is over"
        engine.stall.clear()  # the path clears: the batch is over once a call gets through
        assert wait_for(lambda: stuck_rx.quiesced, 15)
    finally:
        engine.stall.clear()
        prefill.close()
        decode.close()
