"""Two processes, real sockets: a prefill in a child writes paged KV into this process's decode pool."""

from __future__ import annotations

import time

import numpy as np
from kvpeer import pattern

from transfer import KVPoll


def wait_for(handle, states, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while handle.poll() not in states and time.monotonic() < deadline:
        time.sleep(0.002)
    return handle.poll()


def test_prefill_child_writes_into_local_decode(backend_name, spawn_peer, local_manager):
    prefill = spawn_peer("prefill", backend_name, seed=11)
    decode = local_manager("decode", backend_name)
    host, port = prefill.info["control"]
    room = 2**62 + 5
    prefill.call("create_sender", room=room)
    receiver = decode.manager.create_receiver(room, host, port)
    assert wait_for(receiver, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
    assert not receiver.metadata_sent
    dst_pages, src_pages = [9, 3, 4, 5, 40, 41], [0, 1, 2, 7, 8, 20]
    receiver.send_metadata(dst_pages, aux_index=2)
    assert receiver.metadata_sent and receiver.poll() == KVPoll.WaitingForInput
    status = prefill.call("wait", room=room, states=[int(KVPoll.WaitingForInput), 0], timeout_s=20)
    assert status["state"] == KVPoll.WaitingForInput and status["num_dst_pages"] == 6
    prefill.call("send", room=room, pages=src_pages[:4], last=False)
    prefill.call("send", room=room, pages=src_pages[4:], last=True, aux=b"first-token:42".hex())
    assert wait_for(receiver, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success, receiver.failure()
    assert receiver.aux_len == len(b"first-token:42")
    pool = decode.pool
    for b in range(2 * pool.num_layers):
        for src, dst in zip(src_pages, dst_pages, strict=True):
            assert np.array_equal(pool.page_view(b, dst), pattern(11, b, src, pool.page_bytes))
        for untouched in set(range(pool.num_pages)) - set(dst_pages):
            assert not pool.page_view(b, untouched).any()
    assert bytes(pool.aux[2, :14]) == b"first-token:42" and not pool.aux[2, 14:].any()
    assert not np.delete(pool.aux, 2, axis=0).any()
    assert prefill.call("wait", room=room, states=[4], timeout_s=10)["state"] == KVPoll.Success
    receiver.release()
    prefill.call("release", room=room)
    assert decode.manager.num_rooms() == 0 and prefill.call("num_rooms") == 0
