"""A data path that stalls under a room that then fails (its client gave up before ``transfer_s``: the gateway
aborts both sides). The stuck write leaves its room for the prefill's graveyard, still in the peer's thread's
hands: it must still be timed as a stall, or every room queued behind it to that decode (never started, so never
timed) waits for the decode's ``waiting_s``, and so does every new room for that decode.
"""

from __future__ import annotations

import pytest
from kvunit import StallingTcp, make_args, open_room, wait_for, warm_room

from transfer import KVManager, KVPoll, KVTimeouts
from transfer.shm import ShmBackend
from transfer.tcp import TcpBackend


@pytest.mark.parametrize("fencing", [True, False], ids=["fencing-decode", "decode-without-fences"])
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_stalled_write_whose_room_was_aborted_still_frees_the_rooms_behind_it(side: str, fencing: bool) -> None:
    backend = StallingTcp()
    # (without fences: the same tcp path behind the shm wrapper, which does not pass fences on)
    prefill = KVManager("prefill", make_args(), backend if fencing else ShmBackend(backend, same_host=False),
                        timeouts=KVTimeouts(bootstrap_s=10.0, waiting_s=60.0, transfer_s=0.5,
                                            heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0))
    decode_backend = TcpBackend() if fencing else ShmBackend("tcp", same_host=False)
    decode = KVManager("decode", make_args(), decode_backend, timeouts=KVTimeouts(
        bootstrap_s=10.0, waiting_s=60.0, transfer_s=30.0, heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0))
    try:
        warm_room(prefill, decode)
        backend.stall.set()
        stuck, stuck_rx = open_room(prefill, decode, 2, [1, 2], 0)
        stuck.send([3, 4], last=True)
        handle = stuck._writes[0].handle
        assert wait_for(lambda: prefill.backend.started_at(handle, 0.0) is not None, 5)  # in the peer thread's hands
        # the client gives up before transfer_s: the gateway aborts the request on both workers
        (stuck if side == "prefill" else stuck_rx).abort("client went away")
        assert wait_for(lambda: stuck.poll() == KVPoll.Failed and stuck_rx.poll() == KVPoll.Failed, 5)
        behind, behind_rx = open_room(prefill, decode, 3, [5, 6], 1)
        behind.send([5, 6], last=True)
        assert wait_for(lambda: behind.poll() == KVPoll.Failed, 10), (
            "a room queued behind a stalled write of an aborted room waited for the decode's waiting_s")
        assert wait_for(lambda: behind_rx.poll() == KVPoll.Failed and behind_rx.quiesced, 10)
        if fencing:  # (without, the stuck write may still land: its room's pages wait for it, by design)
            assert wait_for(lambda: stuck_rx.quiesced, 10)
            assert wait_for(lambda: backend.cut.is_set(), 5), "the stuck write was never cut off"
    finally:
        prefill.close()
        decode.close()
