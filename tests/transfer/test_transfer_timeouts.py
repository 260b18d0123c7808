"""Every deadline of the control plane fires, with the right kind and a message naming the room."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from kvunit import make_args, open_room, wait_for

from transfer import UNFENCED, KVManager, KVPoll, KVTimeouts, TransferErrorKind, WriteState
from transfer.fake import FakeBackend
from workers.pd_queues import failure_fault
from workers.protocol import Fault


class StuckBackend(FakeBackend):
    """Writes stay PENDING until ``unstick()`` (a peer that stopped draining)."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck = True
        self.pending: set[int] = set()

    def write(self, peer, blocks, fence=UNFENCED):
        handle = super().write(peer, blocks, fence)
        self.pending.add(handle)
        return handle

    def poll(self, handle):
        return WriteState.PENDING if self.stuck and handle in self.pending else super().poll(handle)

    def unstick(self) -> None:
        self.stuck = False


@pytest.fixture
def managers():
    made = []

    def make(role, timeouts, backend=None):
        manager = KVManager(role, make_args(), backend or FakeBackend(), timeouts=timeouts)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.close()


def _t(**kw):
    base = dict(bootstrap_s=5.0, waiting_s=5.0, transfer_s=5.0, heartbeat_interval_s=0.1, heartbeat_timeout_s=3.0)
    return KVTimeouts(**{**base, **kw})


def test_sender_bootstrap_timeout(managers):
    prefill = managers("prefill", _t(bootstrap_s=0.3))
    sender = prefill.create_sender(1)
    assert wait_for(lambda: sender.poll() == KVPoll.Failed, 5)
    error = sender.failure()
    assert error.kind == TransferErrorKind.BOOTSTRAP and "room 1" in str(error) and "page list" in str(error)
    # (no worker's fault: a decode with every page in use holds its requests; overload must not open its breaker)
    assert failure_fault(sender) == Fault.NONE


def test_room_request_ttl_without_sender(managers):
    prefill = managers("prefill", _t(bootstrap_s=0.4))
    decode = managers("decode", _t())
    receiver = decode.create_receiver(2, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
    receiver.send_metadata([1], 0)
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed, 5)
    assert receiver.failure().kind == TransferErrorKind.BOOTSTRAP and "no sender" in str(receiver.failure())
    assert failure_fault(receiver) == Fault.NONE  # (the decode did nothing wrong: not its breaker's count)
    assert wait_for(lambda: receiver.quiesced)


def test_receiver_waiting_timeout_aborts_the_prefill(managers):
    prefill = managers("prefill", _t())
    decode = managers("decode", _t(waiting_s=0.3))
    sender = prefill.create_sender(3)
    receiver = decode.create_receiver(3, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
    receiver.send_metadata([1, 2], 0)
    assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    # the prefill never sends: the decode gives up and tells the prefill
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed, 5)
    assert receiver.failure().kind == TransferErrorKind.BOOTSTRAP and "no KV" in str(receiver.failure())
    assert failure_fault(receiver) == Fault.NONE  # (a prefill with a long queue: only busy)
    assert wait_for(lambda: sender.poll() == KVPoll.Failed, 5)
    assert sender.failure().kind == TransferErrorKind.ABORTED and "timed out" in str(sender.failure())
    assert wait_for(lambda: receiver.quiesced)


def test_receiver_bootstrap_timeout_on_a_mute_listener(managers):
    mute = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        decode = managers("decode", _t(bootstrap_s=0.4, heartbeat_timeout_s=30.0, heartbeat_interval_s=1.0))
        receiver = decode.create_receiver(4, *mute.getsockname()[:2])
        assert wait_for(lambda: receiver.poll() == KVPoll.Failed, 5)
        error = receiver.failure()
        assert error.kind == TransferErrorKind.TIMEOUT and "not connected to a prefill" in str(error)
    finally:
        mute.close()


def test_silent_prefill_fails_rooms_by_heartbeat(managers):
    """A 'prefill' that accepts the registration and then says nothing more."""
    from transfer.messages import FrameReader, RegisterAck, encode_frame

    server = socket.create_server(("127.0.0.1", 0))
    conns = []

    def serve():
        sock, _ = server.accept()
        conns.append(sock)
        FrameReader(sock).read()  # Register
        sock.sendall(encode_frame(RegisterAck(True)))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        decode = managers("decode", _t(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6))
        receiver = decode.create_receiver(5, *server.getsockname()[:2])
        assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
        receiver.send_metadata([1], 0)
        started = time.monotonic()
        assert wait_for(lambda: receiver.poll() == KVPoll.Failed, 5)
        assert time.monotonic() - started >= 0.3
        error = receiver.failure()
        assert error.kind == TransferErrorKind.TIMEOUT and "heartbeat" in str(error) and "room 5" in str(error)
    finally:
        thread.join(5)
        for sock in conns:
            sock.close()
        server.close()


def test_transfer_timeout_and_late_quiesce(managers):
    stuck = StuckBackend()
    prefill = managers("prefill", _t(transfer_s=0.3), backend=stuck)
    decode = managers("decode", _t())
    sender, receiver = open_room(prefill, decode, 6, [1, 2], 0)
    sender.send([3, 4], last=True)
    assert sender.poll() == KVPoll.Transferring
    assert wait_for(lambda: sender.poll() == KVPoll.Failed, 5)
    assert sender.failure().kind == TransferErrorKind.TIMEOUT and "still pending" in str(sender.failure())
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed, 5)
    assert receiver.failure().kind == TransferErrorKind.TIMEOUT
    # Both sides hold the decode (the one that stopped draining) to blame: the prefill's view, which the
    # decode relays (held against the prefill, a recovered prefill's breaker reopened in a chaos run).
    assert failure_fault(sender) is Fault.PEER
    assert "reported" in str(receiver.failure()) and failure_fault(receiver) is Fault.OWN
    time.sleep(0.3)
    assert not receiver.quiesced  # the stuck write might still land
    stuck.unstick()
    assert wait_for(lambda: receiver.quiesced, 5)


def test_timeouts_validation():
    with pytest.raises(ValueError, match="bootstrap_s"):
        KVTimeouts(bootstrap_s=0)
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        KVTimeouts(heartbeat_interval_s=2.0, heartbeat_timeout_s=1.0)
    assert KVTimeouts().bootstrap_s == 300.0


def test_a_decodes_abort_before_the_prefill_has_the_room_is_remembered_for_bootstrap_s(managers):
    """The tombstone of a room the decode aborted before the prefill created its sender fails that sender at
    once, and goes after ``bootstrap_s`` (dropped oldest first, without a scan of every one each tick)."""
    prefill = managers("prefill", _t(bootstrap_s=0.5))
    decode = managers("decode", _t())
    rooms = prefill._prefill.rooms
    for room in (7, 8):
        receiver = decode.create_receiver(room, *prefill.control_address)
        assert wait_for(lambda r=receiver: r.poll() == KVPoll.WaitingForInput)
        receiver.abort("client left")
    assert wait_for(lambda: set(rooms._tombstones) == {7, 8}, 5)
    early = prefill.create_sender(7)
    assert early.poll() == KVPoll.Failed and early.failure().kind == TransferErrorKind.ABORTED
    assert wait_for(lambda: not rooms._tombstones and not rooms._tombstone_order, 5)
    late = prefill.create_sender(8)  # (past bootstrap_s: a new room of that id)
    assert late.poll() == KVPoll.Bootstrapping


def test_a_data_path_connect_longer_than_the_heartbeat_timeout_is_not_silence(managers):
    """The prefill connects to a decode's data endpoint in that decode's reader thread (a first NIXL wire-up,
    a Mooncake warm-up: seconds). Its heartbeat took the unread pings for a silent decode and closed the link
    it was registering, on every retry: a decode could never register."""
    class SlowConnect(FakeBackend):
        def connect(self, endpoint):  # type: ignore[no-untyped-def]
            time.sleep(1.2)
            return super().connect(endpoint)

    timeouts = _t(heartbeat_interval_s=0.2, heartbeat_timeout_s=0.6)
    prefill = managers("prefill", timeouts, SlowConnect())
    decode = managers("decode", timeouts)
    receiver = decode.create_receiver(1, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() != KVPoll.Bootstrapping, 10)
    assert receiver.poll() == KVPoll.WaitingForInput, receiver.failure()


def test_a_connection_the_decode_leaves_on_a_timeout_status_is_closed_once_its_rooms_are_done(managers):
    """(Review.) A backend that cannot tell when a write began to move (no ``started_at``): its overdue write fails
    TIMEOUT and the decode is told, but the prefill does not take the link as stalled and never closes it. The
    decode leaves it all the same (new rooms go over a new connection): it closes it itself once none of its
    rooms uses it (it stayed open, pinged, for ever: one more per such timeout)."""
    stuck = StuckBackend()
    prefill = managers("prefill", _t(transfer_s=0.3), backend=stuck)
    decode = managers("decode", _t(waiting_s=30.0))
    sender, receiver = open_room(prefill, decode, 1, [1, 2], 0)
    sender.send([3, 4], last=True)
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed, 5)
    assert receiver.failure().kind == TransferErrorKind.TIMEOUT
    stuck.unstick()
    assert wait_for(lambda: receiver.quiesced, 5)
    receiver.release()
    sender.release()
    after, after_rx = open_room(prefill, decode, 2, [1, 2], 0)  # (over a new connection)
    after.send([3, 4], last=True)
    assert wait_for(lambda: after_rx.poll() == KVPoll.Success, 5)
    assert wait_for(lambda: len(decode._decode._by_channel) == 1, 3), \
        f"{len(decode._decode._by_channel)} connections to one prefill"
