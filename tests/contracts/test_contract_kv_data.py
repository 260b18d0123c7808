"""Contract: paged KV moves byte-exact between two real processes, for every backend.

Non-contiguous pages on both sides, several layers (K and V buffers), aux data, chunked sends, many
rooms at once, in both directions (the child is the prefill or the decode). Every byte of the decode's
memory is compared with what it must hold, untouched pages included.
"""

from __future__ import annotations

import numpy as np
from kvpeer import Shape, expected_kv, fill, pool_kv, wait_for

from transfer import KVPoll

DONE = (KVPoll.Success, KVPoll.Failed)


def test_prefill_child_chunked_into_local_decode(backend_name, spawn_peer, local_manager):
    prefill = spawn_peer("prefill", backend_name, seed=11)
    decode = local_manager("decode", backend_name)
    host, port = prefill.info["control"]
    room = 2**63 - 1  # the largest room id the gateway may draw
    receiver = decode.manager.create_receiver(room, host, port)  # the decode may come first
    assert wait_for(receiver, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
    assert not receiver.metadata_sent
    # runs that are consecutive on one side only, on both sides, and single pages
    dst_pages = [9, 3, 4, 5, 40, 41, 42, 17, 18, 63]
    src_pages = [0, 1, 2, 3, 8, 9, 10, 30, 29, 5]
    receiver.send_metadata(dst_pages, aux_index=2)
    assert receiver.metadata_sent and receiver.poll() == KVPoll.WaitingForInput
    prefill.call("create_sender", room=room)  # the page list arrived before the sender existed
    status = prefill.wait(room, (KVPoll.WaitingForInput, KVPoll.Failed))
    assert status["state"] == KVPoll.WaitingForInput and status["num_dst_pages"] == len(dst_pages)
    prefill.call("send", room=room, pages=src_pages[:3], last=False)
    prefill.call("send", room=room, pages=src_pages[3:4], last=False)
    prefill.call("send", room=room, pages=[], last=False)  # an empty chunk is allowed
    prefill.call("send", room=room, pages=src_pages[4:], last=True, aux=b"first-token:42".hex())
    assert wait_for(receiver, DONE) == KVPoll.Success, receiver.failure()
    assert receiver.aux_len == 14
    assert np.array_equal(pool_kv(decode.pool), expected_kv(prefill.shape, 11, src_pages, dst_pages))
    aux = decode.pool.aux
    assert bytes(aux[2, :14]) == b"first-token:42" and not aux[2, 14:].any()
    assert not np.delete(aux, 2, axis=0).any()
    assert prefill.wait(room, DONE)["state"] == KVPoll.Success
    receiver.release()
    prefill.call("release", room=room)
    assert decode.manager.num_rooms() == 0 and prefill.call("num_rooms") == 0


def test_local_prefill_into_decode_child(backend_name, spawn_peer, local_manager):
    prefill = local_manager("prefill", backend_name)
    fill(prefill.pool, seed=5)
    decode = spawn_peer("decode", backend_name)
    host, port = prefill.manager.control_address
    sender = prefill.manager.create_sender(77)
    assert sender.poll() == KVPoll.Bootstrapping and sender.num_dst_pages is None
    decode.call("create_receiver", room=77, host=host, port=port)
    assert decode.wait(77, (KVPoll.WaitingForInput, KVPoll.Failed))["state"] == KVPoll.WaitingForInput
    dst_pages, src_pages = [60, 61, 62, 63, 0, 1, 7], [10, 11, 12, 13, 50, 51, 52]
    decode.call("send_metadata", room=77, pages=dst_pages, aux_index=7)
    assert wait_for(sender, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
    assert sender.num_dst_pages == 7
    sender.send(src_pages[:4], last=False)
    assert sender.poll() in (KVPoll.Transferring, KVPoll.Success)
    sender.send(src_pages[4:], last=True, aux=bytes(range(64)))  # a full aux slot
    assert wait_for(sender, DONE) == KVPoll.Success, sender.failure()
    status = decode.wait(77, DONE)
    assert status["state"] == KVPoll.Success and status["aux_len"] == 64
    kv, aux = decode.read_memory()
    assert np.array_equal(kv, expected_kv(decode.shape, 5, src_pages, dst_pages))
    assert bytes(aux[7]) == bytes(range(64)) and not aux[:7].any()
    sender.release()
    sender.release()  # idempotent
    assert prefill.manager.num_rooms() == 0


def test_concurrent_rooms_share_one_connection(backend_name, spawn_peer, local_manager):
    prefill = spawn_peer("prefill", backend_name, seed=3)
    decode = local_manager("decode", backend_name)
    host, port = prefill.info["control"]
    rng = np.random.default_rng(0)
    free = [int(p) for p in rng.permutation(64)]
    rooms = {room: (free[i * 6 : (i + 1) * 6], [int(p) for p in rng.choice(64, 6, replace=False)])
             for i, room in enumerate(range(1000, 1008))}
    receivers = {room: decode.manager.create_receiver(room, host, port) for room in rooms}
    for room in rooms:
        prefill.call("create_sender", room=room)
    for room, receiver in receivers.items():
        assert wait_for(receiver, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
        receiver.send_metadata(rooms[room][0], aux_index=room % 8)
    for room in rooms:  # first chunk of every room, then the rest: the rooms interleave
        assert prefill.wait(room, (KVPoll.WaitingForInput, KVPoll.Failed))["state"] == KVPoll.WaitingForInput
        prefill.call("send", room=room, pages=rooms[room][1][:2], last=False)
    for room in rooms:
        prefill.call("send", room=room, pages=rooms[room][1][2:], last=True, aux=f"room {room}".encode().hex())
    for receiver in receivers.values():
        assert wait_for(receiver, DONE) == KVPoll.Success, receiver.failure()
    expected = None
    for dst, src in rooms.values():
        expected = expected_kv(prefill.shape, 3, src, dst, base=expected)
    assert np.array_equal(pool_kv(decode.pool), expected)
    for room in rooms:
        text = f"room {room}".encode()
        assert bytes(decode.pool.aux[room % 8, : len(text)]) == text
        receivers[room].release()
        prefill.call("release", room=room)
    assert decode.manager.num_rooms() == 0 and prefill.call("num_rooms") == 0


def test_many_small_blocks_in_flight(backend_name, spawn_peer, local_manager):
    """Thousands of blocks per chunk and several chunks in flight at once (Mooncake's tcp transport
    refuses more than 2048 entries in flight: the backend must split and throttle)."""
    shape = Shape(num_layers=30, num_pages=256, page_size=1, num_kv_heads=1, head_dim=16, num_aux_slots=2)
    prefill = local_manager("prefill", backend_name, shape=shape)
    fill(prefill.pool, seed=13)
    decode = spawn_peer("decode", backend_name, shape=shape)
    host, port = prefill.manager.control_address
    sender = prefill.manager.create_sender(5)
    decode.call("create_receiver", room=5, host=host, port=port)
    assert decode.wait(5, (KVPoll.WaitingForInput, KVPoll.Failed))["state"] == KVPoll.WaitingForInput
    dst_pages = list(range(0, 256, 2))  # every other page: no run merges, 128 runs x 60 buffers
    src_pages = list(range(255, 0, -2))
    decode.call("send_metadata", room=5, pages=dst_pages, aux_index=1)
    assert wait_for(sender, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
    for offset in range(0, 128, 40):  # chunks of 2400 blocks, posted back to back
        sender.send(src_pages[offset : offset + 40], last=offset + 40 >= 128)
    assert wait_for(sender, DONE, 60) == KVPoll.Success, sender.failure()
    assert decode.wait(5, DONE)["state"] == KVPoll.Success
    kv, _ = decode.read_memory()
    assert np.array_equal(kv, expected_kv(shape, 13, src_pages, dst_pages))
