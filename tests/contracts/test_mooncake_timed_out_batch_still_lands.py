"""Mooncake's own transfer timeout (``MC_TRANSFER_TIMEOUT``) is not the end of a batch's bytes: the engine call
answers -1, but the engine goes on moving the batch, and once the target runs again (a decode frozen, a path that
cleared) every byte lands. The decode, which does not fence Mooncake's writes, takes the prefill's ``Quiesced`` (or
the control connection's close) as the end of every write of the room: none of them may land after it.

Real engines, both peers in child processes; needs a private network namespace (Mooncake binds 0.0.0.0).
"""

from __future__ import annotations

import signal
import time

import pytest
from kvpeer import FAST, PeerProcess, Shape, skip_reason

from transfer import KVPoll

READY = (KVPoll.WaitingForInput, KVPoll.Failed)
DONE = (KVPoll.Success, KVPoll.Failed)
BIG = Shape(page_size=16, num_kv_heads=8, head_dim=512)  # 256 KiB pages: 48 pages x 6 buffers = 72 MiB


def test_a_batch_mooncake_timed_out_lands_nothing_after_the_decode_calls_the_room_quiesced():
    if reason := skip_reason("mooncake"):
        pytest.skip(reason)
    env = {"MC_TRANSFER_TIMEOUT": "5"}  # (the least Mooncake takes; 30 s by default)
    peers = []
    try:
        # (one turn of the whole room: what the engine call had in hand when it timed out goes on landing)
        prefill = PeerProcess("prefill", "mooncake", BIG, FAST, seed=5, env=env, options={"turn_bytes": str(96 << 20)})
        peers.append(prefill)
        decode = PeerProcess("decode", "mooncake", BIG, FAST, env=env)
        peers.append(decode)
        host, port = prefill.info["control"]
        prefill.call("create_sender", room=60)
        decode.call("create_receiver", room=60, host=host, port=port)
        assert decode.wait(60, READY)["state"] == KVPoll.WaitingForInput
        decode.call("send_metadata", room=60, pages=list(range(48)), aux_index=0)
        assert prefill.wait(60, READY)["state"] == KVPoll.WaitingForInput
        decode.signal(signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            prefill.call("send", room=60, pages=list(range(16, 64)), last=True)
            assert prefill.wait(60, DONE, timeout_s=20)["state"] == KVPoll.Failed
            time.sleep(max(0.0, frozen + 8.0 - time.monotonic()))  # past the engine's own timeout (5 s)
        finally:
            decode.signal(signal.SIGCONT)
        seen = decode.call("changed_after_quiesced", room=60, timeout_s=60, watch_s=2.0, reply_timeout_s=120)
        assert seen["quiesced"], seen
        assert seen["changed_bytes"] == 0, f"{seen['changed_bytes']} bytes landed after the room was quiesced"
    finally:
        for peer in peers:
            peer.kill()
