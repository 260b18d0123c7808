"""A prefill frozen for good mid-write must not hold the decode's pages for good over a backend that does not fence
writes (mooncake, nixl): the decode fails the room at the heartbeat, and once it has run ``quarantine_s`` with no
``Quiesced`` from the silent prefill it calls the room quiesced (its pages may go back to the pool), counts it and
closes the connection, the prefill still frozen. Before ``quarantine_s`` the pages stayed quarantined until the
prefill resumed or died. After SIGCONT the pair works again over a fresh connection."""

from __future__ import annotations

import dataclasses
import signal
import time

import pytest
from kvpeer import FAST, Shape, wait_for

from transfer import FencesWrites, KVPoll, TransferErrorKind

BIG = Shape(page_size=16, num_kv_heads=8, head_dim=512)  # (as the contract suite's frozen-writer tests: MiBs a room)
DONE = (KVPoll.Success, KVPoll.Failed)
READY = (KVPoll.WaitingForInput, KVPoll.Failed)
QUARANTINE_S = 3.0
BOUNDED = dataclasses.replace(FAST, quarantine_s=QUARANTINE_S)


def _wait_quiesced(receiver, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not receiver.quiesced and time.monotonic() < deadline:
        time.sleep(0.01)
    return receiver.quiesced


def test_a_prefill_frozen_for_good_releases_the_rooms_pages_at_quarantine_s(backend_name, spawn_peer,
                                                                              local_manager):
    decode = local_manager("decode", backend_name, shape=BIG, timeouts=BOUNDED)
    if isinstance(decode.manager.backend, FencesWrites) and getattr(decode.manager.backend, "CUTS_SILENT_WRITERS",
                                                                    True):
        pytest.skip("a fencing backend that cuts silent writers quiesces at once (the contract suite checks it)")
    if backend_name == "shm":
        pytest.skip("shm fences or waits for its writer in shared memory: not this bound")
    prefill = spawn_peer("prefill", backend_name, shape=BIG, seed=3)
    host, port = prefill.info["control"]
    receiver = decode.manager.create_receiver(80, host, port)
    assert wait_for(receiver, READY) == KVPoll.WaitingForInput, receiver.failure()
    prefill.call("create_sender", room=80)
    receiver.send_metadata(list(range(48)), 0)
    assert prefill.wait(80, READY)["state"] == KVPoll.WaitingForInput
    prefill.call("send", room=80, pages=list(range(16, 64)), last=True)
    prefill.signal(signal.SIGSTOP)
    try:
        assert receiver.poll() != KVPoll.Success, "the room was written before the freeze: nothing tested"
        assert wait_for(receiver, DONE, FAST.heartbeat_timeout_s + 8.0) == KVPoll.Failed
        error = receiver.failure()
        assert error is not None and error.kind == TransferErrorKind.TIMEOUT, error
        assert not receiver.quiesced, "quiesced before quarantine_s with the prefill frozen: nothing tested"
        # (hang guard only: the bound is the decode's running time, QUARANTINE_S plus a heartbeat or two)
        assert _wait_quiesced(receiver, QUARANTINE_S + 30.0), "the frozen prefill held the room's pages past the bound"
        assert decode.manager.counters.num_rooms_unquiesced_released == 1
        receiver.release()
        assert decode.manager.num_rooms() == 0
    finally:
        prefill.signal(signal.SIGCONT)
    prefill.call("release", room=80)
    # the resumed prefill and the decode work together again (a fresh connection)
    again = decode.manager.create_receiver(81, host, port)
    assert wait_for(again, READY) == KVPoll.WaitingForInput, again.failure()
    prefill.call("create_sender", room=81)
    again.send_metadata([50, 51], 1)
    assert prefill.wait(81, READY)["state"] == KVPoll.WaitingForInput
    prefill.call("send", room=81, pages=[4, 5], last=True)
    assert wait_for(again, DONE) == KVPoll.Success, again.failure()
