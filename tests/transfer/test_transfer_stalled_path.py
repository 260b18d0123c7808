"""A data path that stops moving while the decode's heartbeats live (a route or firewall dropping the data
connection's packets, large packets black-holed, a wedged receiver): the write in hand fails at ``transfer_s``,
and the data path is dropped with it, so that the rooms queued behind it fail at once instead of each waiting
for the decode's ``waiting_s``, and the decode's next room goes over a fresh data path.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
from kvunit import StallingTcp, StubPeerBackend, make_args, open_room, wait_for, warm_room

from transfer import KVManager, KVPoll, KVTimeouts, TransferErrorKind
from transfer.base import Block, Fence, WriteState
from transfer.errors import PeerReport, TransferError
from transfer.peer_threads import SenderPeer
from transfer.tcp import TcpBackend
from workers.pd_queues import failure_fault
from workers.protocol import Fault


@pytest.fixture
def pair():
    backend = StallingTcp()
    prefill = KVManager("prefill", make_args(), backend, timeouts=KVTimeouts(
        bootstrap_s=10.0, waiting_s=60.0, transfer_s=0.5, heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0))
    decode = KVManager("decode", make_args(), TcpBackend(), timeouts=KVTimeouts(
        bootstrap_s=10.0, waiting_s=60.0, transfer_s=30.0, heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0))
    try:
        yield backend, prefill, decode
    finally:
        prefill.close()
        decode.close()


def test_a_stalled_data_path_is_dropped_and_the_rooms_behind_it_fail_at_once(pair) -> None:
    backend, prefill, decode = pair
    warm_room(prefill, decode)  # (the data path works)
    backend.stall.set()
    stuck, stuck_rx = open_room(prefill, decode, 2, [1, 2], 0)
    behind, behind_rx = open_room(prefill, decode, 3, [5, 6], 1)
    stuck.send([3, 4], last=True)
    behind.send([5, 6], last=True)
    assert wait_for(lambda: stuck.poll() == KVPoll.Failed, 10)
    assert stuck.failure().kind == TransferErrorKind.TIMEOUT
    # the room queued behind it: failed with the dropped data path, not at the decode's waiting_s (60 s)
    assert wait_for(lambda: behind.poll() == KVPoll.Failed, 10), "a room queued behind a stalled write waited on"
    assert wait_for(lambda: behind_rx.poll() == KVPoll.Failed and stuck_rx.poll() == KVPoll.Failed, 10)
    assert wait_for(lambda: stuck_rx.quiesced and behind_rx.quiesced, 10)  # (no write of theirs can land any more)
    backend.stall.clear()
    _next_room_moves(prefill, decode, backend)


def _next_room_moves(prefill: KVManager, decode: KVManager, backend: StallingTcp) -> None:
    """The decode's next room goes over a fresh data path (it registers again), which moves: the decode learns of
    the stall from the connection's close, not from a status sent before it (then its next room could go over the
    dying connection before it read the close)."""
    for room in range(10, 20):
        sender = prefill.create_sender(room)
        receiver = decode.create_receiver(room, *prefill.control_address)
        assert wait_for(lambda: receiver.poll() != KVPoll.Bootstrapping, 10)  # noqa: B023
        if receiver.poll() == KVPoll.WaitingForInput:
            receiver.send_metadata([7, 8], 2)
            ready = wait_for(lambda: sender.poll() != KVPoll.Bootstrapping, 10)  # noqa: B023
            if ready and sender.poll() == KVPoll.WaitingForInput:
                sender.send([3, 4], last=True)
        assert wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 15)  # noqa: B023
        if receiver.poll() == KVPoll.Success:
            assert room == 10, "the first room after a stall failed"
            assert backend.num_connects == 2
            return
        assert receiver.failure().kind == TransferErrorKind.PEER_GONE, receiver.failure()
    raise AssertionError("no room after the stall moved")


class _SlowCut(StallingTcp):
    """(Review.) The stuck write is cut off a second after the drop, as a sender thread's join may take seconds."""

    def _interrupt(self, peer: SenderPeer) -> None:
        threading.Timer(1.0, super()._interrupt, args=(peer,)).start()


def test_the_decodes_next_room_after_a_stall_does_not_wait_for_the_stuck_write_to_be_cut() -> None:
    backend = _SlowCut()
    timeouts = KVTimeouts(bootstrap_s=10.0, waiting_s=60.0, transfer_s=0.5, heartbeat_interval_s=0.1,
                          heartbeat_timeout_s=5.0)
    prefill = KVManager("prefill", make_args(), backend, timeouts=timeouts)
    decode = KVManager("decode", make_args(), TcpBackend(), timeouts=timeouts)
    try:
        warm_room(prefill, decode)
        backend.stall.set()
        stuck, stuck_rx = open_room(prefill, decode, 2, [1, 2], 0)
        stuck.send([3, 4], last=True)
        assert wait_for(lambda: stuck_rx.poll() == KVPoll.Failed and stuck_rx.quiesced, 10)
        backend.stall.clear()
        _next_room_moves(prefill, decode, backend)
    finally:
        prefill.close()
        decode.close()


class _OneAtATime(StubPeerBackend):
    """Pipelined, one turn in flight (the stuck one): the next write waits queued. Turns end on ``clear``."""

    name = "one-at-a-time"
    pipelined = True
    pipeline_bytes = 1

    def __init__(self) -> None:
        super().__init__()
        self.posted: list[int] = []
        self.clear = threading.Event()

    def _post(self, peer: SenderPeer, blocks: list[Block], fence: Fence) -> tuple[Any, TransferError | None, bool]:
        self.posted.append(fence.room)
        return fence.room, None, False

    def _check(self, peer: SenderPeer, token: Any) -> tuple[WriteState, TransferError | None]:
        return (WriteState.DONE if self.clear.is_set() else WriteState.PENDING), None


def test_a_queued_write_failed_by_fail_queued_and_released_is_never_posted() -> None:
    """(Review.) ``fail_queued`` fails a queued write while its peer stays up; the prefill then releases it and
    fails its room. A peer thread that found its fence still live just before, and takes it after the release,
    posted it untracked: its room was called quiet, and on a decode that does not fence it lands in reused pages."""
    backend = _OneAtATime()
    peer = backend.connect()
    try:
        backend.write(peer, [(0, 0, 8)], Fence(1, 1))  # the stuck write
        deadline = time.monotonic() + 5
        while backend.posted != [1] and time.monotonic() < deadline:
            time.sleep(0.001)
        assert backend.posted == [1]
        room_failed = threading.Event()
        behind = 0

        def live() -> bool:  # room 2's fence, as its KVSender answers it (no lock)
            if room_failed.is_set():
                return False
            # the peer's thread checked it just before the monitor's tick progressed room 2: that tick releases
            # the write fail_queued failed (``_retire``), then fails the room (``_fail``)
            backend.release(behind)
            room_failed.set()
            return True

        behind = backend.write(peer, [(0, 0, 8)], Fence(2, 1, live))
        backend.fail_queued(peer, TransferError(TransferErrorKind.PEER_GONE, "stalled behind another write"))
        assert backend.poll(behind) == WriteState.FAILED  # (what the prefill reads, then acts on)
        backend.clear.set()  # the stuck write ends: the peer's thread takes the next job
        time.sleep(0.3)
        assert backend.posted == [1], "a write reported FAILED (and released) went on the wire"
    finally:
        backend.close()


def _same_culprit(sender: Any, receiver: Any) -> None:
    """Both workers hold the failure against the decode (``workers.pd_queues.failure_fault``): the prefill, and the
    decode told by the prefill's ``RoomStatus`` (a ``PeerReport``). (Review.) Failed without a status and learnt
    from the connection's close, the decode blamed the prefill: whichever report reached the gateway first
    decided whose breaker counted it and which worker the retry avoided."""
    assert wait_for(lambda: sender.poll() == KVPoll.Failed and receiver.poll() == KVPoll.Failed, 10)
    assert failure_fault(sender) is Fault.PEER
    assert isinstance(receiver.failure(), PeerReport), receiver.failure()
    assert failure_fault(receiver) is Fault.OWN, f"the decode blames the prefill: {receiver.failure()}"


def test_a_stalled_data_path_to_a_fencing_decode_is_held_against_the_decode_on_both_sides(pair) -> None:
    backend, prefill, decode = pair
    warm_room(prefill, decode)
    backend.stall.set()
    sender, receiver = open_room(prefill, decode, 2, [1, 2], 1)
    sender.send([3, 4], last=True)
    _same_culprit(sender, receiver)
    assert sender.failure().kind == TransferErrorKind.TIMEOUT


def test_every_room_of_a_link_closed_for_a_broken_data_path_is_held_against_the_decode_on_both_sides() -> None:
    """(Review.) A broken data path to a decode that fences: the room whose write failed, and the other rooms of the
    link the close fails, each told by its own status before the close (told by the close alone, the decode blamed
    the prefill)."""
    timeouts = KVTimeouts(bootstrap_s=10.0, waiting_s=60.0, transfer_s=30.0, heartbeat_interval_s=0.1,
                          heartbeat_timeout_s=5.0)
    prefill = KVManager("prefill", make_args(), TcpBackend(), timeouts=timeouts)
    decode = KVManager("decode", make_args(), TcpBackend(), timeouts=timeouts)
    try:
        warm_room(prefill, decode)
        other, other_rx = open_room(prefill, decode, 3, [5, 6], 0)  # (a second request to the same decode)
        for peer in list(prefill.backend._peers.values()):  # the data connection breaks
            peer.sock.shutdown(socket.SHUT_RDWR)
        sender, receiver = open_room(prefill, decode, 2, [1, 2], 1)
        sender.send([3, 4], last=True)
        _same_culprit(sender, receiver)
        _same_culprit(other, other_rx)
    finally:
        prefill.close()
        decode.close()


def test_a_link_taken_to_close_is_closed_even_if_the_heartbeat_then_raises() -> None:
    """(Review.) The monitor's tick took the link to close, then its heartbeat raised: the close was dropped (the
    link marked closed, its status sent, the decode gone to a new connection: the old one open for ever)."""
    timeouts = KVTimeouts(bootstrap_s=10.0, waiting_s=60.0, transfer_s=30.0, heartbeat_interval_s=0.001,
                          heartbeat_timeout_s=5.0)
    prefill = KVManager("prefill", make_args(), TcpBackend(), timeouts=timeouts)
    decode = KVManager("decode", make_args(), TcpBackend(), timeouts=timeouts)
    side = prefill._prefill
    assert side is not None
    real = side.heartbeat
    failing = [False]

    def heartbeat(now: float, outbox: Any) -> Any:
        if failing[0]:
            raise RuntimeError("a bug in the heartbeat")
        return real(now, outbox)

    try:
        warm_room(prefill, decode)
        for peer in list(prefill.backend._peers.values()):
            peer.sock.shutdown(socket.SHUT_RDWR)
        sender, receiver = open_room(prefill, decode, 2, [1, 2], 1)
        old = receiver.conn
        side.heartbeat = heartbeat  # type: ignore[method-assign]
        failing[0] = True
        sender.send([3, 4], last=True)
        assert wait_for(lambda: receiver.poll() == KVPoll.Failed, 10)
        time.sleep(0.3)
        failing[0] = False
        assert wait_for(lambda: old.channel.is_closed, 3), "the broken link's control connection was never closed"
    finally:
        prefill.close()
        decode.close()
