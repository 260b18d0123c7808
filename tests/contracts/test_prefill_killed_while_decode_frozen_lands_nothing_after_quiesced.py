"""A prefill killed while its KV was on the wire to a frozen decode: once the decode resumes and calls the
room quiesced, no byte of that room may land any more (its pages go to another request)."""

from __future__ import annotations

import signal
import time

import msgspec
from kvpeer import Shape

from transfer import KVPoll

READY = (KVPoll.WaitingForInput, KVPoll.Failed)
BIG = Shape(page_size=16, num_kv_heads=8, head_dim=512)  # 256 KiB pages: 48 of them are 72 MiB


def test_a_killed_prefills_bytes_still_in_flight_land_before_the_room_is_quiesced(backend_name, spawn_peer):
    prefill = spawn_peer("prefill", backend_name, shape=BIG, seed=21)
    decode = spawn_peer("decode", backend_name, shape=BIG)
    host, port = prefill.info["control"]
    decode.call("create_receiver", room=90, host=host, port=port)
    assert decode.wait(90, READY)["state"] == KVPoll.WaitingForInput
    prefill.call("create_sender", room=90)
    decode.call("send_metadata", room=90, pages=list(range(48)), aux_index=0)
    assert prefill.wait(90, READY)["state"] == KVPoll.WaitingForInput
    decode.signal(signal.SIGSTOP)
    try:
        prefill.call("send", room=90, pages=list(range(16, 64)), last=True)
        time.sleep(1.0)  # what the kernel takes of it waits in the two sockets' buffers
        prefill.kill()
        # asked while frozen: the decode answers as soon as it runs again
        decode._cmd.write(msgspec.json.encode({"op": "changed_after_quiesced", "room": 90, "timeout_s": 30,
                                               "watch_s": 2.0}) + b"\n")
    finally:
        decode.signal(signal.SIGCONT)
    seen = decode._read(90)
    assert seen["quiesced"], seen
    assert seen["changed_bytes"] == 0, f"{seen['changed_bytes']} bytes landed after the room was quiesced"
