"""Contract: failures end rooms fast, with the right kind, and leave both processes usable.

Abort from either side mid-transfer, a peer SIGKILLed mid-transfer, a peer frozen with SIGSTOP (the
heartbeat turns silence into TIMEOUT), and recovery: a new room (or a new peer process) works after.
"""

from __future__ import annotations

import signal
import time

import numpy as np
from kvpeer import FAST, Shape, expected_kv, fill, pool_kv, wait_for

from transfer import FencesWrites, KVPoll, TransferErrorKind

DONE = (KVPoll.Success, KVPoll.Failed)
READY = (KVPoll.WaitingForInput, KVPoll.Failed)
# a dead peer is noticed at once (EOF); a frozen one after the heartbeat timeout, plus a loaded machine
DETECT_S = FAST.heartbeat_timeout_s + 8.0


def _open_room(prefill_peer, receiver_manager, room, dst_pages, aux_index=0):
    host, port = prefill_peer.info["control"]
    receiver = receiver_manager.create_receiver(room, host, port)
    assert wait_for(receiver, READY) == KVPoll.WaitingForInput, receiver.failure()
    prefill_peer.call("create_sender", room=room)
    receiver.send_metadata(dst_pages, aux_index)
    assert prefill_peer.wait(room, READY)["state"] == KVPoll.WaitingForInput
    return receiver


def _wait_quiesced(receiver, timeout_s=DETECT_S):
    deadline = time.monotonic() + timeout_s
    while not receiver.quiesced and time.monotonic() < deadline:
        time.sleep(0.002)
    return receiver.quiesced


def _full_room(prefill_peer, decode, room, seed):
    """A complete, verified room: proves the connection (or a new one) works."""
    before = pool_kv(decode.pool)
    dst, src = [50, 51, 20], [4, 5, 6]
    receiver = _open_room(prefill_peer, decode.manager, room, dst)
    prefill_peer.call("send", room=room, pages=src, last=True)
    assert wait_for(receiver, DONE) == KVPoll.Success, receiver.failure()
    assert np.array_equal(pool_kv(decode.pool), expected_kv(prefill_peer.shape, seed, src, dst, base=before))
    receiver.release()
    prefill_peer.call("release", room=room)


def test_prefill_abort_mid_transfer(backend_name, spawn_peer, local_manager):
    prefill = spawn_peer("prefill", backend_name, seed=1)
    decode = local_manager("decode", backend_name)
    receiver = _open_room(prefill, decode.manager, 1, [1, 2, 3, 4])
    prefill.call("send", room=1, pages=[7, 8], last=False)
    prefill.call("abort", room=1, reason="client went away")
    assert wait_for(receiver, DONE, DETECT_S) == KVPoll.Failed
    error = receiver.failure()
    assert error is not None and error.kind == TransferErrorKind.ABORTED
    assert "room 1" in str(error) and "client went away" in str(error)
    status = prefill.call("poll", room=1)
    assert status["state"] == KVPoll.Failed and status["kind"] == "aborted"
    prefill.call("send", room=1, pages=[9], last=True)  # ignored once Failed, no exception
    assert _wait_quiesced(receiver)
    receiver.release()
    prefill.call("release", room=1)
    _full_room(prefill, decode, 2, seed=1)
    assert decode.manager.num_rooms() == 0 and prefill.call("num_rooms") == 0


def test_decode_abort_mid_transfer(backend_name, spawn_peer, local_manager):
    prefill = spawn_peer("prefill", backend_name, seed=2)
    decode = local_manager("decode", backend_name)
    receiver = _open_room(prefill, decode.manager, 10, [5, 6, 7])
    prefill.call("send", room=10, pages=[1], last=False)
    receiver.abort("decode out of memory")
    assert receiver.poll() == KVPoll.Failed and receiver.failure().kind == TransferErrorKind.ABORTED
    # the first chunk may still be in flight: its pages are safe to reuse once the prefill says so
    assert _wait_quiesced(receiver)
    status = prefill.wait(10, (KVPoll.Failed, KVPoll.Success), DETECT_S)
    assert status["state"] == KVPoll.Failed and status["kind"] == "aborted"
    # the decode's reason, or (a fencing backend) its closed fence refusing the chunk before the Abort came
    assert "decode out of memory" in status["message"] or "fenced" in status["message"], status
    receiver.release()
    prefill.call("release", room=10)
    _full_room(prefill, decode, 11, seed=2)


def test_prefill_killed_mid_transfer(backend_name, spawn_peer, local_manager):
    prefill = spawn_peer("prefill", backend_name, seed=3)
    decode = local_manager("decode", backend_name)
    receiver = _open_room(prefill, decode.manager, 20, [10, 11, 12, 13])
    prefill.call("send", room=20, pages=[0, 1], last=False)
    prefill.signal(signal.SIGKILL)
    assert wait_for(receiver, DONE, DETECT_S) == KVPoll.Failed
    error = receiver.failure()
    assert error is not None and error.kind in (TransferErrorKind.PEER_GONE, TransferErrorKind.TIMEOUT), error
    assert "room 20" in str(error)
    # The prefill is gone: quiesced, at once or (a fencing backend whose data thread was taking a write in
    # when the connection broke) as soon as that write is out; Failed may come a moment before it.
    assert _wait_quiesced(receiver)
    receiver.release()
    prefill.kill()
    # the decode's manager survives and talks to a fresh prefill process
    _full_room(spawn_peer("prefill", backend_name, seed=4), decode, 21, seed=4)
    assert decode.manager.num_rooms() == 0


def test_decode_killed_mid_transfer(backend_name, spawn_peer, local_manager):
    prefill = local_manager("prefill", backend_name)
    fill(prefill.pool, seed=6)
    host, port = prefill.manager.control_address
    decode = spawn_peer("decode", backend_name)
    sender = prefill.manager.create_sender(30)
    decode.call("create_receiver", room=30, host=host, port=port)
    assert decode.wait(30, READY)["state"] == KVPoll.WaitingForInput
    decode.call("send_metadata", room=30, pages=list(range(40)), aux_index=0)
    assert wait_for(sender, READY) == KVPoll.WaitingForInput
    sender.send(list(range(20)), last=False)
    decode.signal(signal.SIGKILL)
    decode.kill()
    sender.send(list(range(20, 40)), last=True)  # may already be Failed (ignored) or still going
    assert wait_for(sender, DONE, DETECT_S) == KVPoll.Failed
    error = sender.failure()
    assert error is not None and error.kind in (TransferErrorKind.PEER_GONE, TransferErrorKind.TIMEOUT), error
    sender.release()
    assert prefill.manager.num_rooms() == 0
    # a new decode process registers with the same prefill manager and gets its KV
    decode2 = spawn_peer("decode", backend_name)
    sender = prefill.manager.create_sender(31)
    decode2.call("create_receiver", room=31, host=host, port=port)
    assert decode2.wait(31, READY)["state"] == KVPoll.WaitingForInput
    decode2.call("send_metadata", room=31, pages=[3, 2, 1], aux_index=1)
    assert wait_for(sender, READY) == KVPoll.WaitingForInput
    sender.send([7, 8, 9], last=True, aux=b"ok")
    assert wait_for(sender, DONE) == KVPoll.Success, sender.failure()
    assert decode2.wait(31, DONE)["state"] == KVPoll.Success
    kv, aux = decode2.read_memory()
    assert np.array_equal(kv, expected_kv(decode2.shape, 6, [7, 8, 9], [3, 2, 1]))
    assert bytes(aux[1, :2]) == b"ok"


def test_prefill_frozen_times_out(backend_name, spawn_peer, local_manager):
    prefill = spawn_peer("prefill", backend_name, seed=7)
    decode = local_manager("decode", backend_name)
    receiver = _open_room(prefill, decode.manager, 40, [1, 2])
    prefill.signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        assert wait_for(receiver, DONE, DETECT_S) == KVPoll.Failed
        error = receiver.failure()
        assert error is not None and error.kind == TransferErrorKind.TIMEOUT, error
        assert time.monotonic() - started >= FAST.heartbeat_timeout_s * 0.5
        assert "heartbeat" in str(error)
    finally:
        prefill.signal(signal.SIGCONT)
    receiver.release()
    _full_room(spawn_peer("prefill", backend_name, seed=8), decode, 41, seed=8)


# pages of 256 KiB: a room of 48 pages is 72 MiB, still on the wire when the prefill is frozen
BIG = Shape(page_size=16, num_kv_heads=8, head_dim=512)


def test_prefill_frozen_mid_write_lands_nothing_once_quiesced(backend_name, spawn_peer, local_manager):
    """A prefill frozen mid-write, given up on by the decode, then resumed: no byte of its room lands
    after the decode called the room quiesced (its pages would be another request's by then). A
    fencing backend that cuts silent writers (tcp) quiesces at once, with the prefill still frozen; the
    others hold the pages until the resumed prefill's writes are over (shm: a writer frozen mid-copy
    cannot be cut off from shared memory; its fence mark clears once it resumes and stops)."""
    prefill = spawn_peer("prefill", backend_name, shape=BIG, seed=12)
    decode = local_manager("decode", backend_name, shape=BIG)
    receiver = _open_room(prefill, decode.manager, 70, list(range(48)))
    prefill.call("send", room=70, pages=list(range(16, 64)), last=True)
    prefill.signal(signal.SIGSTOP)
    try:
        assert receiver.poll() != KVPoll.Success, "the room was written before the freeze: nothing tested"
        assert wait_for(receiver, DONE, DETECT_S) == KVPoll.Failed
        error = receiver.failure()
        assert error is not None and error.kind == TransferErrorKind.TIMEOUT, error
        quiet_while_frozen = _wait_quiesced(receiver, timeout_s=3.0)
        backend = decode.manager.backend
        if isinstance(backend, FencesWrites) and getattr(backend, "CUTS_SILENT_WRITERS", True):
            assert quiet_while_frozen, "a fencing backend that cuts needs nothing from the frozen prefill"
        snapshot = pool_kv(decode.pool) if quiet_while_frozen else None
    finally:
        prefill.signal(signal.SIGCONT)
    if snapshot is None:
        assert _wait_quiesced(receiver), "the resumed prefill never confirmed that its writes are over"
        snapshot = pool_kv(decode.pool)
    time.sleep(1.0)  # what the resumed prefill still had on the wire or queued would land now
    assert np.array_equal(pool_kv(decode.pool), snapshot), "a write landed after the room was quiesced"
    receiver.release()
    prefill.call("release", room=70)
    _full_room(prefill, decode, 71, seed=12)  # the resumed prefill and the decode work together again


def test_a_decode_frozen_mid_write_gets_nothing_once_it_calls_the_room_quiesced(backend_name, spawn_peer,
                                                                                 local_manager):
    """A decode frozen while its room's KV is being written: the prefill gives up on it (no heartbeat) and
    fails the room. Once resumed, the decode calls the room quiesced and may give its pages out again, so
    nothing may land in them from then on: a backend that does not fence writes keeps the connection (the
    decode's "every write is over") until the writes on the wire are; it closed it at once and tens of MB
    landed afterwards (Mooncake, NIXL)."""
    prefill = local_manager("prefill", backend_name, shape=BIG)
    fill(prefill.pool, seed=5)
    host, port = prefill.manager.control_address
    decode = spawn_peer("decode", backend_name, shape=BIG)
    sender = prefill.manager.create_sender(60)
    decode.call("create_receiver", room=60, host=host, port=port)
    assert decode.wait(60, READY)["state"] == KVPoll.WaitingForInput
    decode.call("send_metadata", room=60, pages=list(range(48)), aux_index=0)
    assert wait_for(sender, READY) == KVPoll.WaitingForInput
    decode.signal(signal.SIGSTOP)
    try:
        sender.send(list(range(16, 64)), last=True)
        wait_for(sender, DONE, DETECT_S)
        time.sleep(0.5)
    finally:
        decode.signal(signal.SIGCONT)
    seen = decode.call("changed_after_quiesced", room=60, timeout_s=60, watch_s=2.0, reply_timeout_s=120)
    assert seen["quiesced"], seen
    assert seen["changed_bytes"] == 0, f"{seen['changed_bytes']} bytes landed after the room was quiesced"
    sender.release()


def test_decode_frozen_times_out(backend_name, spawn_peer, local_manager):
    prefill = local_manager("prefill", backend_name)
    fill(prefill.pool, seed=9)
    host, port = prefill.manager.control_address
    decode = spawn_peer("decode", backend_name)
    sender = prefill.manager.create_sender(50)
    decode.call("create_receiver", room=50, host=host, port=port)
    assert decode.wait(50, READY)["state"] == KVPoll.WaitingForInput
    decode.call("send_metadata", room=50, pages=list(range(64)), aux_index=0)
    assert wait_for(sender, READY) == KVPoll.WaitingForInput
    decode.signal(signal.SIGSTOP)
    try:
        sender.send(list(range(64)), last=True)
        state = wait_for(sender, DONE, DETECT_S)
        if state == KVPoll.Success and getattr(prefill.manager.backend, "WRITES_WITHOUT_TARGET", False):
            # one-sided writes that need no CPU of the target (shm): the bytes are in the frozen decode's
            # memory and its RoomStatus waits in the socket; it sees Success and every byte once resumed
            decode.signal(signal.SIGCONT)
            assert decode.wait(50, DONE)["state"] == KVPoll.Success
            assert np.array_equal(decode.read_memory()[0], expected_kv(decode.shape, 9, list(range(64)),
                                                                       list(range(64))))
        else:
            assert state == KVPoll.Failed
            error = sender.failure()
            assert error is not None and error.kind == TransferErrorKind.TIMEOUT, error
    finally:
        decode.signal(signal.SIGCONT)
    sender.release()
    assert prefill.manager.num_rooms() == 0
