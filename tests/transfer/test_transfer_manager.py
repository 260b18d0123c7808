"""KVManager state machine and API contract, in one process over real loopback sockets.

The fake backend (moves no bytes) keeps these fast; byte movement is the contract suite's job.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from kvunit import Waker, make_args, open_room, wait_for

from transfer import (
    KVArgs,
    KVManager,
    KVPoll,
    KVTimeouts,
    TransferErrorKind,
    WriteState,
    create_backend,
)
from transfer.base import UNFENCED
from transfer.errors import TransferError
from transfer.fake import FakeBackend

QUICK = KVTimeouts(bootstrap_s=5.0, waiting_s=5.0, transfer_s=5.0, heartbeat_interval_s=0.1,
                   heartbeat_timeout_s=2.0)


@pytest.fixture
def managers():
    made = []

    def make(role, *, timeouts=QUICK, backend=None, args=None, backend_name=None, **kw):
        if backend_name is not None:
            backend = create_backend(backend_name)
        manager = KVManager(role, args or make_args(), backend or FakeBackend(), timeouts=timeouts, **kw)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.close()


def open_pair(managers, room=1, pages=(3, 4, 5), **kw):
    prefill, decode = managers("prefill", **kw), managers("decode", **kw)
    sender = prefill.create_sender(room)
    receiver = decode.create_receiver(room, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
    receiver.send_metadata(list(pages), 1)
    assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    return prefill, decode, sender, receiver


def test_happy_path_state_machine(managers):
    prefill, decode = managers("prefill"), managers("decode")
    sender = prefill.create_sender(7)
    assert sender.poll() == KVPoll.Bootstrapping and sender.num_dst_pages is None and sender.failure() is None
    receiver = decode.create_receiver(7, *prefill.control_address)
    assert receiver.room == 7 and sender.room == 7
    assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
    assert not receiver.metadata_sent and receiver.quiesced  # nothing sent yet: nothing can land
    assert sender.poll() == KVPoll.Bootstrapping  # no page list yet
    receiver.send_metadata([2, 3, 9], 0)
    assert receiver.metadata_sent and receiver.poll() == KVPoll.WaitingForInput and not receiver.quiesced
    assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput) and sender.num_dst_pages == 3
    sender.send([0, 1], last=False)
    assert sender.poll() in (KVPoll.Transferring, KVPoll.Success)
    sender.send([5], last=True, aux=b"xy")
    assert wait_for(lambda: receiver.poll() == KVPoll.Success)
    assert sender.poll() == KVPoll.Success and receiver.aux_len == 2 and receiver.quiesced
    assert prefill.num_rooms() == 1 and decode.num_rooms() == 1
    sender.release()
    receiver.release()
    receiver.release()
    assert prefill.num_rooms() == 0 and decode.num_rooms() == 0
    # one run per chunk ([0, 1] -> [2, 3], then [5] -> [9]) x 4 buffers, plus the aux block
    assert prefill.backend.blocks_written == 4 + 4 + 1


def test_every_change_the_scheduler_waits_for_is_notified(managers):
    """The scheduler sleeps until the manager's listener fires: each transition it waits for must fire it."""
    prefill, decode = managers("prefill"), managers("decode")
    p_wake, d_wake = Waker(), Waker()
    prefill.set_listener(p_wake)
    decode.set_listener(d_wake)
    address = prefill.control_address
    sender = prefill.create_sender(1)
    receiver = decode.create_receiver(1, *address)
    assert d_wake.until(lambda: receiver.poll() == KVPoll.WaitingForInput)  # connected and registered
    receiver.send_metadata([3, 4], 0)
    assert p_wake.until(lambda: sender.poll() == KVPoll.WaitingForInput)  # the page list arrived
    sender.send([1, 2], last=True, aux=b"a")
    assert p_wake.until(lambda: sender.poll() == KVPoll.Success)  # the monitor saw every write done
    assert d_wake.until(lambda: receiver.poll() == KVPoll.Success)
    # a room on the ready connection; the prefill aborts it after the page list: Failed, then quiesced
    receiver2 = decode.create_receiver(2, *address)
    assert d_wake.until(lambda: receiver2.poll() == KVPoll.WaitingForInput)
    receiver2.send_metadata([5], 1)
    sender2 = prefill.create_sender(2)
    assert p_wake.until(lambda: sender2.poll() == KVPoll.WaitingForInput)
    sender2.abort("test")
    assert d_wake.until(lambda: receiver2.poll() == KVPoll.Failed)
    assert d_wake.until(lambda: receiver2.quiesced)
    # the decode aborts a room whose page list the prefill holds: the prefill's sender fails
    sender3 = prefill.create_sender(3)
    receiver3 = decode.create_receiver(3, *address)
    assert d_wake.until(lambda: receiver3.poll() == KVPoll.WaitingForInput)
    receiver3.send_metadata([6], 2)
    assert p_wake.until(lambda: sender3.poll() == KVPoll.WaitingForInput)
    receiver3.abort("test")
    assert p_wake.until(lambda: sender3.poll() == KVPoll.Failed)
    assert d_wake.until(lambda: receiver3.quiesced)
    # the prefill goes away: its rooms fail and quiesce on the decode
    receiver4 = decode.create_receiver(4, *address)
    assert d_wake.until(lambda: receiver4.poll() == KVPoll.WaitingForInput)
    receiver4.send_metadata([7], 3)
    prefill.close()
    assert d_wake.until(lambda: receiver4.poll() == KVPoll.Failed and receiver4.quiesced)
    for room in (sender, sender2, sender3, receiver, receiver2, receiver3, receiver4):
        room.release()


def test_blocks_per_chunk_merge_runs(managers):
    backend = FakeBackend()
    prefill = managers("prefill", backend=backend)
    decode = managers("decode")
    sender = prefill.create_sender(2)
    receiver = decode.create_receiver(2, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
    receiver.send_metadata([3, 4, 5, 10], 0)
    assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    sender.send([7, 8, 9, 11], last=True)  # runs: (7->3, 3 pages), (11->10, 1 page)
    assert wait_for(lambda: receiver.poll() == KVPoll.Success)
    n_buffers = 4  # 2 layers x (K, V)
    assert backend.blocks_written == 2 * n_buffers
    assert backend.bytes_written == 4 * n_buffers * prefill.args.kv_item_lens[0]


def test_api_misuse_is_a_clear_error(managers):
    prefill, decode, sender, receiver = open_pair(managers)
    with pytest.raises(ValueError, match="already has a sender"):
        prefill.create_sender(1)
    with pytest.raises(ValueError, match="already has a receiver"):
        decode.create_receiver(1, "127.0.0.1", 1)
    with pytest.raises(RuntimeError, match="decode KVManager"):
        decode.create_sender(5)
    with pytest.raises(RuntimeError, match="prefill KVManager"):
        prefill.create_receiver(5, "127.0.0.1", 1)
    with pytest.raises(AttributeError, match="only a prefill"):
        _ = decode.control_address
    with pytest.raises(ValueError, match="role"):
        KVManager("both", make_args(), FakeBackend())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="called twice"):
        receiver.send_metadata([1], 0)
    with pytest.raises(ValueError, match="aux goes with the last chunk"):
        sender.send([1], last=False, aux=b"x")
    with pytest.raises(ValueError, match="aux of 33 bytes"):
        sender.send([1], last=True, aux=bytes(33))
    with pytest.raises(ValueError, match="reserved 3"):
        sender.send([1, 2, 3, 4], last=True)
    with pytest.raises(ValueError, match="source pages"):
        sender.send([16], last=False)
    sender.send([1, 2, 3], last=True)
    with pytest.raises(RuntimeError, match="after the last chunk"):
        sender.send([], last=True)
    early = prefill.create_sender(9)
    with pytest.raises(RuntimeError, match="before the decode's page list"):
        early.send([1], last=True)
    r2 = decode.create_receiver(10, *prefill.control_address)
    with pytest.raises(ValueError, match="destination pages"):
        assert wait_for(lambda: r2.poll() == KVPoll.WaitingForInput)
        r2.send_metadata([0, 16], 0)
    with pytest.raises(ValueError, match="aux slot 4"):
        r2.send_metadata([0], 4)
    assert not r2.metadata_sent  # rejected calls change nothing
    r2.release()
    with pytest.raises(RuntimeError, match="after release"):
        r2.send_metadata([0], 0)


def test_abort_before_metadata_and_tombstone(managers):
    prefill, decode = managers("prefill"), managers("decode")
    receiver = decode.create_receiver(3, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
    receiver.abort("gateway gave up")
    assert receiver.poll() == KVPoll.Failed and receiver.quiesced
    assert receiver.failure().kind == TransferErrorKind.ABORTED and "gateway gave up" in str(receiver.failure())
    # the prefill's sender for that room, created later, fails at once instead of waiting 300 s
    time.sleep(0.2)
    sender = prefill.create_sender(3)
    assert sender.poll() == KVPoll.Failed and sender.failure().kind == TransferErrorKind.ABORTED
    receiver.abort("again")  # no effect on a finished room
    assert "gateway gave up" in str(receiver.failure())


def test_an_abort_before_the_prefill_connection_exists_still_reaches_the_prefill(managers):
    """Aborted (and released) while its prefill's address was still being looked up: the prefill hears
    of it once the connection stands, so its sender fails at once instead of waiting for a page list
    until bootstrap_s; ``decline_room`` (a request the decode refused: no receiver) does the same."""
    prefill = managers("prefill")
    looked_up = threading.Event()

    def resolver(host, port, instance_id):
        looked_up.wait(5)
        return prefill.control_address

    decode = managers("decode", resolver=resolver)
    sender = prefill.create_sender(5)
    receiver = decode.create_receiver(5, "prefill-0.local", None, "inst-1")
    receiver.abort("refused by the decode")
    receiver.release()
    looked_up.set()
    assert wait_for(lambda: sender.poll() == KVPoll.Failed, timeout_s=3.0), "the prefill was not told"
    assert sender.failure().kind == TransferErrorKind.ABORTED and "refused by the decode" in str(sender.failure())
    decode.decline_room(6, "prefill-0.local", None, "inst-1", "request needs 78 KV pages")
    time.sleep(0.2)
    late = prefill.create_sender(6)  # (the request reaches the prefill after the decode refused it)
    assert wait_for(lambda: late.poll() == KVPoll.Failed, timeout_s=3.0)
    assert "78 KV pages" in str(late.failure())


def test_a_room_the_prefill_ended_before_its_page_list_fails_at_once(managers):
    """The mirror of the tombstone above: the prefill aborts and releases its sender before the
    decode's page list arrives; that list then fails at once, not after bootstrap_s (the decode would
    hold its pages and aux slot that long)."""
    prefill, decode = managers("prefill"), managers("decode")
    sender = prefill.create_sender(9)
    sender.abort("refused at admission")
    sender.release()
    receiver = decode.create_receiver(9, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() in (KVPoll.WaitingForInput, KVPoll.Failed))
    if receiver.poll() == KVPoll.WaitingForInput:
        receiver.send_metadata([3, 4], 1)
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed, timeout_s=2.0)
    assert receiver.failure().kind == TransferErrorKind.ABORTED and "refused at admission" in str(receiver.failure())
    assert wait_for(lambda: receiver.quiesced, timeout_s=2.0)


@pytest.mark.parametrize("page_list_first", [False, True])
def test_a_room_refused_at_admission_fails_its_page_list_at_once(managers, page_list_first):
    """``end_room``: the prefill refused the request (no sender ever); the decode's page list fails at
    once, whether it arrived before the refusal or comes after; a room with a sender is not touched."""
    prefill, decode = managers("prefill"), managers("decode")
    busy = prefill.create_sender(11)
    prefill.end_room(11, "not this one")  # another request's room: nothing happens to it
    assert busy.poll() == KVPoll.Bootstrapping
    receiver = decode.create_receiver(12, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
    if page_list_first:
        receiver.send_metadata([3, 4], 1)
        time.sleep(0.2)  # (parked on the prefill, waiting for a sender)
        prefill.end_room(12, "queue is full")
    else:
        prefill.end_room(12, "queue is full")
        receiver.send_metadata([3, 4], 1)
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed, timeout_s=2.0)
    assert receiver.failure().kind == TransferErrorKind.ABORTED and "queue is full" in str(receiver.failure())
    assert wait_for(lambda: receiver.quiesced, timeout_s=2.0)


def test_release_of_a_live_room_aborts_it(managers):
    prefill, _decode, sender, receiver = open_pair(managers)
    sender.release()
    assert sender.poll() == KVPoll.Failed and prefill.num_rooms() == 0
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert receiver.failure().kind == TransferErrorKind.ABORTED and "released" in str(receiver.failure())
    assert wait_for(lambda: receiver.quiesced)
    with pytest.raises(RuntimeError, match="after release"):
        sender.send([1], last=True)


def test_close_fails_live_rooms_and_tells_the_peer(managers):
    prefill, decode, sender, receiver = open_pair(managers)
    other = decode.create_receiver(2, *prefill.control_address)
    prefill.close()
    prefill.close()  # idempotent
    assert sender.poll() == KVPoll.Failed and sender.failure().kind == TransferErrorKind.ABORTED
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed and other.poll() == KVPoll.Failed)
    assert receiver.failure().kind in (TransferErrorKind.ABORTED, TransferErrorKind.PEER_GONE)
    assert receiver.quiesced
    with pytest.raises(RuntimeError, match="closed"):
        prefill.create_sender(99)
    decode.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-") and t.is_alive()
                and "mc" not in t.name]


def test_resolver_runs_in_the_background(managers):
    prefill = managers("prefill")
    calls = []
    caller = threading.get_ident()

    def resolver(host, port, instance_id):
        calls.append((host, port, instance_id, threading.get_ident() != caller))
        return prefill.control_address

    decode = managers("decode", resolver=resolver)
    receiver = decode.create_receiver(4, "prefill-0.local", None, "inst-7")
    assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
    assert calls == [("prefill-0.local", None, "inst-7", True)]


def test_a_known_address_skips_the_bootstrap_thread(managers):
    prefill = managers("prefill")
    address = prefill.control_address

    class Caching:
        """A CachingResolver: it knows the answer once asked."""

        def __init__(self):
            self.calls = 0

        def __call__(self, host, port, instance_id):
            self.calls += 1
            return address

        def cached(self, host, port, instance_id):
            return address if self.calls else None

    resolver = Caching()
    decode = managers("decode", resolver=resolver)
    first = decode.create_receiver(1, "prefill-0.local", None, "inst")
    assert wait_for(lambda: first.poll() == KVPoll.WaitingForInput)
    second = decode.create_receiver(2, "prefill-0.local", None, "inst")
    assert second.poll() == KVPoll.WaitingForInput, "ready before create_receiver returned"
    assert resolver.calls == 1
    second.send_metadata([1], 0)
    sender = prefill.create_sender(2)
    assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    sender.send([2], last=True)
    assert wait_for(lambda: second.poll() == KVPoll.Success)
    # no resolver: host and port are the address, known at once
    plain = managers("decode")
    third = plain.create_receiver(3, *address)
    assert wait_for(lambda: third.poll() == KVPoll.WaitingForInput)
    assert plain.create_receiver(4, *address).poll() == KVPoll.WaitingForInput


def test_a_settled_write_completes_its_room_without_the_monitor(managers, monkeypatch):
    """tcp notifies completions: with few rooms the backend thread that got the ack completes the room
    itself (RoomStatus sent, Success), with no hand-off to the monitor, whose tick does nothing here."""
    from transfer.prefill import PrefillSide

    monkeypatch.setattr(PrefillSide, "tick", lambda self, now, outbox: False)
    prefill = managers("prefill", backend=create_backend("tcp"))
    decode = managers("decode", backend=create_backend("tcp"))
    sender = prefill.create_sender(5)
    receiver = decode.create_receiver(5, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
    receiver.send_metadata([3, 4], 1)
    assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    sender.send([1, 2], last=True, aux=b"ok")
    assert wait_for(lambda: receiver.poll() == KVPoll.Success), receiver.failure()
    assert sender.poll() == KVPoll.Success and receiver.aux_len == 2
    receiver.release()
    sender.release()
    assert prefill.num_rooms() == decode.num_rooms() == 0


def test_bootstrap_failures(managers):
    def broken(host, port, instance_id):
        raise LookupError("no such prefill instance")

    decode = managers("decode", resolver=broken)
    receiver = decode.create_receiver(5, "h", 1, "x")
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed)
    error = receiver.failure()
    assert error.kind == TransferErrorKind.BOOTSTRAP
    assert "no such prefill instance" in str(error) and "room 5" in str(error)
    plain = managers("decode")
    nowhere = plain.create_receiver(6, "127.0.0.1", None)
    assert wait_for(lambda: nowhere.poll() == KVPoll.Failed)
    assert nowhere.failure().kind == TransferErrorKind.BOOTSTRAP
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    refused = plain.create_receiver(7, "127.0.0.1", dead_port)
    assert wait_for(lambda: refused.poll() == KVPoll.Failed)
    assert refused.failure().kind == TransferErrorKind.PEER_UNREACHABLE


def test_registration_mismatch_fails_the_room(managers):
    prefill = managers("prefill")
    decode = managers("decode", args=make_args(page_size=8))
    receiver = decode.create_receiver(8, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert receiver.failure().kind == TransferErrorKind.PROTOCOL and "page_size" in str(receiver.failure())
    other = managers("decode", backend=create_backend("tcp"))
    receiver = other.create_receiver(9, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert "transfer backend 'tcp'" in str(receiver.failure())


def test_kvargs_validation():
    args = make_args()
    assert args.num_pages == 16 and args.num_aux_slots == 4 and args.aux_slot_bytes == 32
    with pytest.raises(ValueError, match="differ in length"):
        KVArgs([1, 2], [8], [4, 4], [], [], [], 4)
    with pytest.raises(ValueError, match="not a multiple"):
        KVArgs([1, 2], [8, 9], [4, 4], [], [], [], 4)
    with pytest.raises(ValueError, match="even count"):
        KVArgs([1], [8], [4], [], [], [], 4)
    with pytest.raises(ValueError, match="page_size"):
        KVArgs([1, 2], [8, 8], [4, 4], [], [], [], 0)
    assert KVArgs([1, 2], [8, 8], [4, 4], [], [], [], 1).num_aux_slots == 0


def test_fake_backend_moves_nothing():
    backend = FakeBackend()
    buf = np.zeros(8, np.uint8)
    backend.register([(int(buf.ctypes.data), 8)])
    peer = backend.connect(b"anything")
    handle = backend.write(peer, [(1, 2, 3)])
    assert backend.poll(handle) == WriteState.DONE and backend.error(handle) is None
    assert backend.bytes_written == 3 and not buf.any()


def test_a_quiesced_that_overtakes_the_prefills_abort_still_frees_the_room(managers, monkeypatch):
    """Without fences (the fake backend, like shm, nixl and mooncake) the decode frees a failed room's
    pages only once the prefill says ``Quiesced``. The prefill's monitor thread may send that before the
    thread that aborted the room has sent its ``Abort``: the decode keeps it, and the room is quiesced
    once the ``Abort`` arrives (before, it waited for a ``Quiesced`` that never came again)."""
    import transfer.sender_rooms as sender_rooms

    plain_flush = sender_rooms.flush

    def late_flush(outbox):  # the aborting thread is descheduled between its lock and its send
        if outbox and threading.current_thread() is threading.main_thread():
            time.sleep(0.3)
        plain_flush(outbox)

    _prefill, _decode, sender, receiver = open_pair(managers)
    monkeypatch.setattr(sender_rooms, "flush", late_flush)
    sender.abort("the prefill's own failure")
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed, 5.0)
    assert receiver.failure().kind == TransferErrorKind.ABORTED
    assert wait_for(lambda: receiver.quiesced, 5.0), "the room's pages would never go back"


@pytest.mark.parametrize("host", ["a" * 64 + ".example", "a..b"])
def test_a_prefill_address_that_cannot_be_connected_to_fails_the_room_at_once(managers, host):
    """A host name that does not even encode (a label over 63 characters, an empty label) raises
    ValueError, not OSError, on the bootstrap thread: the room waited for bootstrap_s, failed by nobody."""
    decode = managers("decode")
    receiver = decode.create_receiver(5, host, 4000)
    assert wait_for(lambda: receiver.poll() == KVPoll.Failed, timeout_s=2.0)
    assert host[:20] in str(receiver.failure())


def test_a_broken_data_path_is_replaced_not_kept(managers):
    """The data connection breaking under a live control connection (a reset, a peer marked dead): the room
    in flight fails, and the pair does not stay broken: the prefill closes the control connection, so the
    decode registers again and gets a fresh data path (every later room failed with the old error)."""
    import socket

    prefill, decode, sender, receiver = open_pair(managers, room=1, backend_name="tcp")
    sender.send([0], last=True, aux=b"a")
    assert wait_for(lambda: receiver.poll() == KVPoll.Success)
    for peer in list(prefill.backend._peers.values()):  # the data connection breaks (ss -K, a reset...)
        peer.sock.shutdown(socket.SHUT_RDWR)
    sender2 = prefill.create_sender(2)
    receiver2 = decode.create_receiver(2, *prefill.control_address)
    assert wait_for(lambda: receiver2.poll() == KVPoll.WaitingForInput)
    receiver2.send_metadata([6], 2)
    assert wait_for(lambda: sender2.poll() == KVPoll.WaitingForInput)
    sender2.send([1], last=True, aux=b"b")
    assert wait_for(lambda: receiver2.poll() == KVPoll.Failed)
    assert receiver2.failure().kind == TransferErrorKind.PEER_GONE
    for room in (3, 4):  # the next rooms go through on a new data path
        s = prefill.create_sender(room)
        r = decode.create_receiver(room, *prefill.control_address)
        assert wait_for(lambda r=r: r.poll() in (KVPoll.WaitingForInput, KVPoll.Failed))
        assert r.poll() == KVPoll.WaitingForInput, r.failure()
        r.send_metadata([7 + room], 3)
        assert wait_for(lambda s=s: s.poll() == KVPoll.WaitingForInput)
        s.send([2], last=True, aux=b"c")
        assert wait_for(lambda r=r: r.poll() in (KVPoll.Success, KVPoll.Failed))
        assert r.poll() == KVPoll.Success, (room, r.failure())


class _Brittle(FakeBackend):
    """A backend that does not fence, whose writes of some rooms stay pending or fail as on a dead data path."""

    def __init__(self) -> None:
        super().__init__()
        self.held: set[int] = set()  # rooms whose writes stay pending
        self.broken: set[int] = set()  # rooms whose writes fail as on a dead data path

    def write(self, peer, blocks, fence=UNFENCED):
        handle = super().write(peer, blocks, fence)
        with self._lock:
            if fence.room in self.held:
                self._writes[handle] = WriteState.PENDING
            elif fence.room in self.broken:
                self._writes[handle] = WriteState.FAILED
                self._errors[handle] = TransferError(TransferErrorKind.PEER_GONE, "fake: the data path broke")
        return handle

    def settle(self):
        with self._lock:
            for handle, state in self._writes.items():
                if state == WriteState.PENDING:
                    self._writes[handle] = WriteState.DONE

    def pending(self) -> int:
        with self._lock:
            return sum(1 for state in self._writes.values() if state == WriteState.PENDING)


def test_a_broken_link_closes_only_once_its_writes_are_out(managers):
    """A backend that does not fence: the decode takes the control connection's close as the end of every
    write of its rooms. So the prefill closing a link for a broken data path waits until no write to that
    decode is in flight (here room 1's, held pending while room 2's write fails); then it closes it."""
    backend = _Brittle()
    backend.held, backend.broken = {1}, {2}
    prefill, decode, sender1, receiver1 = open_pair(managers, room=1, pages=(3,), backend=backend)
    sender2 = prefill.create_sender(2)
    receiver2 = decode.create_receiver(2, *prefill.control_address)
    assert wait_for(lambda: receiver2.poll() == KVPoll.WaitingForInput)
    receiver2.send_metadata([6], 2)
    assert wait_for(lambda: sender2.poll() == KVPoll.WaitingForInput)
    sender1.send([0], last=True, aux=b"a")  # held on the wire
    sender2.send([1], last=True, aux=b"b")  # fails: the data path broke
    assert wait_for(lambda: receiver2.poll() == KVPoll.Failed)
    time.sleep(0.5)  # monitor ticks: the link must stay up while room 1's write is out
    assert receiver1.poll() == KVPoll.WaitingForInput and not receiver1.quiesced
    backend.settle()  # room 1's write lands: the room completes, then the link closes
    assert wait_for(lambda: receiver1.poll() == KVPoll.Success)
    receiver3 = decode.create_receiver(3, *prefill.control_address)  # registers again on a new connection
    sender3 = prefill.create_sender(3)
    assert wait_for(lambda: receiver3.poll() == KVPoll.WaitingForInput)
    receiver3.send_metadata([9], 3)
    assert wait_for(lambda: sender3.poll() == KVPoll.WaitingForInput)
    sender3.send([2], last=True, aux=b"c")
    assert wait_for(lambda: receiver3.poll() == KVPoll.Success), receiver3.failure()
    assert prefill.backend is backend and len(backend._peers) == 1  # the old data peer was dropped


def test_nothing_is_written_to_a_broken_link_while_it_closes(managers, monkeypatch):
    """The monitor picks a broken link to close (no write to its decode in flight) under the lock, and
    closes its channel outside it. A room of that link that the scheduler sends in between must not be
    written: its decode takes the close as the end of every write and gives the room's pages out again."""
    from transfer.channel import ControlChannel

    backend = _Brittle()
    backend.held, backend.broken = {3}, {2}  # room 3's write would stay on the wire
    prefill, decode = managers("prefill", backend=backend), managers("decode")
    senders, receivers = {}, {}
    for room, page in ((2, 6), (3, 9)):
        senders[room] = prefill.create_sender(room)
        receivers[room] = decode.create_receiver(room, *prefill.control_address)
        assert wait_for(lambda room=room: receivers[room].poll() == KVPoll.WaitingForInput)
        receivers[room].send_metadata([page], room)
        assert wait_for(lambda room=room: senders[room].poll() == KVPoll.WaitingForInput)
    close, sent = ControlChannel.close, []

    def close_after_a_send(channel, error=None):  # (the scheduler thread's send, just before the close)
        if error is not None and "data path broke" in error.message and not sent:
            senders[3].send([2], last=True, aux=b"c")
            sent.append(backend.pending())
        close(channel, error)

    monkeypatch.setattr(ControlChannel, "close", close_after_a_send)
    senders[2].send([1], last=True, aux=b"b")  # fails: the data path broke, the link is closed
    assert wait_for(lambda: receivers[3].poll() == KVPoll.Failed)
    assert sent == [0], "a write went out on the link being closed"
    # (quiesced once the decode has run heartbeat_timeout_s since the close: a dead writer's last bytes)
    assert senders[3].poll() == KVPoll.Failed and wait_for(lambda: receivers[3].quiesced, 10)
    assert backend.pending() == 0


def test_a_page_list_whose_decode_then_disconnects_fails_the_later_sender_at_once(managers):
    """The decode's page list came before the prefill's scheduler made the room's sender, and then the
    decode's control connection closed (it crashed, restarted): the sender, made a moment later, fails
    at once as the decode gone, as after an abort, not at its bootstrap timeout for a page list that
    cannot come."""
    prefill, decode = managers("prefill"), managers("decode")
    receiver = decode.create_receiver(5, *prefill.control_address)
    assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
    receiver.send_metadata([1, 2], 0)
    assert wait_for(lambda: 5 in prefill._prefill.rooms._requests)
    for channel in list(decode._decode._by_channel):
        channel.sock.shutdown(2)
    assert wait_for(lambda: not prefill._prefill._links)
    sender = prefill.create_sender(5)
    assert sender.poll() == KVPoll.Failed, "the sender waits for a page list from a decode that is gone"
    assert sender.failure().kind == TransferErrorKind.PEER_GONE


def test_a_backend_refusing_to_register_is_the_error_told_and_is_closed() -> None:
    """(A prefill's manager then raised "cannot join thread before it is started", hiding the backend's
    reason, e.g. that tcp moves host memory only, and left the backend open.)"""
    from kvunit import make_args

    from transfer import KVManager, TransferError, TransferErrorKind
    from transfer.fake import FakeBackend

    class Refuses(FakeBackend):
        closed = False

        def register(self, regions):  # type: ignore[no-untyped-def]
            raise TransferError(TransferErrorKind.PROTOCOL, "moves host memory only")

        def close(self) -> None:
            Refuses.closed = True
            super().close()

    with pytest.raises(TransferError, match="host memory only"):
        KVManager("prefill", make_args(), Refuses())
    assert Refuses.closed


def test_a_prefill_closing_lets_its_writes_settle_before_its_connections_close() -> None:
    """A rolling restart: the prefill's manager closes with a write on the wire. A decode without fences
    takes the control connection's close as the end of every write of its rooms, so the prefill waits (a
    bounded while) for its writes to settle and says ``Quiesced`` first. Before: it closed the connections
    at once, and the decode gave the pages back while the write could still land."""
    from transfer import KVManager, KVTimeouts

    class Held(FakeBackend):
        def write(self, peer, blocks, fence=UNFENCED):  # type: ignore[no-untyped-def]
            handle = super().write(peer, blocks, fence)
            with self._lock:
                self._writes[handle] = WriteState.PENDING
            return handle

        def settle(self) -> None:
            with self._lock:
                for handle, state in self._writes.items():
                    if state == WriteState.PENDING:
                        self._writes[handle] = WriteState.DONE

        def pending(self) -> bool:
            with self._lock:
                return WriteState.PENDING in self._writes.values()

    timeouts = KVTimeouts(bootstrap_s=30, waiting_s=30, transfer_s=30, heartbeat_interval_s=0.2,
                          heartbeat_timeout_s=2.0)
    held = Held()
    prefill = KVManager("prefill", make_args(), held, timeouts=timeouts)
    decode = KVManager("decode", make_args(), FakeBackend(), timeouts=timeouts)
    try:
        sender, receiver = open_room(prefill, decode, 1, [3, 4], 1)
        sender.send([0, 1], last=True, aux=b"x")  # (on the wire until ``settle``)
        seen: list[bool] = []

        def watch() -> None:
            if wait_for(lambda: receiver.quiesced, 10):
                seen.append(held.pending())

        watcher = threading.Thread(target=watch)
        watcher.start()
        closer = threading.Thread(target=prefill.close)
        closer.start()
        time.sleep(0.5)
        held.settle()
        closer.join(10)
        watcher.join(10)
        assert seen == [False], "the decode took its pages back while the prefill's write was still pending"
    finally:
        prefill.close()
        decode.close()
