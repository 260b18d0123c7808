"""What a client that reaches a prefill's ports without being a decode can do: nothing that lasts. Its tcp
data port takes no writes (a prefill only sends KV: before, any batch inside its registered memory landed,
e.g. in prefix-cache pages other requests read), and a page list longer than the decode's pool is refused
before any per-id work (before, a forged list of millions held the manager's lock for a second and was
kept for ``bootstrap_s``), nor is one naming a page past the decode's pool. Also the tcp data port's side of a
fence closed while a batch of the room is being received: the rest of the batch is drained, not written."""

from __future__ import annotations

import ctypes
import socket
import struct
from typing import Any

import numpy as np
import pytest
from kvunit import make_args, open_room, wait_for

from transfer import KVManager, KVPoll, KVTimeouts
from transfer.fake import FakeBackend
from transfer.messages import (
    PROTOCOL_VERSION,
    FrameReader,
    Quiesced,
    Register,
    RegisterAck,
    RoomRequest,
    RoomStatus,
    encode_frame,
)
from transfer.tcp import TcpBackend

pytestmark = pytest.mark.timeout(60)


def test_a_prefills_tcp_data_port_takes_no_writes() -> None:
    args = make_args()
    backend = TcpBackend("127.0.0.1")
    prefill = KVManager("prefill", args, backend, timeouts=KVTimeouts())
    try:
        host, port = backend.endpoint().decode().rsplit(":", 1)
        dst, payload = args.kv_ptrs[0], b"POISONED-KV-PAGE"
        before = ctypes.string_at(dst, len(payload))
        with socket.create_connection((host, int(port))) as sock:  # no Register, no room, no fence
            for seq, room in ((1, 12345), (2, 0)):
                sock.sendall(struct.pack(">QQQI", seq, room, 1, 1) + struct.pack(">QQ", dst, len(payload)) + payload)
                got_seq, status = struct.unpack(">QB", sock.recv(9, socket.MSG_WAITALL))
                assert (got_seq, status) == (seq, 2)  # fenced (the connection stays usable)
        assert ctypes.string_at(dst, len(payload)) == before
    finally:
        prefill.close()


def _registered(prefill: KVManager, args: Any) -> tuple[socket.socket, FrameReader]:
    """A decode's control connection to ``prefill``, registered (as a fake backend with ``args``' buffers)."""
    sock = socket.create_connection(prefill.control_address)
    sock.sendall(encode_frame(Register(
        PROTOCOL_VERSION, "fake", FakeBackend().endpoint(), args.kv_ptrs, args.kv_data_lens, args.kv_item_lens,
        args.aux_ptrs, args.aux_data_lens, args.aux_item_lens, args.page_size, args.kv_dtype)))
    reader = FrameReader(sock)
    ack = reader.read()
    assert isinstance(ack, RegisterAck) and ack.ok, ack
    return sock, reader


def test_a_page_list_longer_than_the_decodes_pool_is_refused_at_once() -> None:
    args = make_args()
    prefill = KVManager("prefill", args, FakeBackend(), timeouts=KVTimeouts())
    sock, reader = _registered(prefill, args)
    try:
        sock.sendall(encode_frame(RoomRequest(7, [0] * (args.num_pages + 1), 0, 1)))
        status = reader.read()
        assert isinstance(status, RoomStatus) and status.room == 7 and not status.ok
        assert status.kind == "range_rejected" and f"{args.num_pages} pages" in status.reason, status
        assert isinstance(reader.read(), Quiesced)
        waiting = prefill.create_sender(9)  # a request waiting for its page list: failed by one it cannot take
        sock.sendall(encode_frame(RoomRequest(9, [0] * (args.num_pages + 1), 0, 1)))
        assert wait_for(lambda: waiting.poll() == KVPoll.Failed, 5)
        waiting.release()
        # one as long as the pool is a page list like any other: kept for the room's sender
        sock.sendall(encode_frame(RoomRequest(8, [0] * args.num_pages, 0, 1)))
        sender = prefill.create_sender(8)
        try:
            assert wait_for(lambda: sender.request is not None, 5)  # (the reader thread attaches it)
            assert len(sender.request.page_ids) == args.num_pages
        finally:
            sender.release()
    finally:
        sock.close()
        prefill.close()


def test_a_page_id_one_past_the_decodes_pool_is_refused() -> None:
    """Page ids run from 0 to ``num_pages - 1``: a list naming ``num_pages`` is refused (range_rejected, and the
    room's waiting sender fails), as it would write one page past the decode's KV buffer, into whatever
    follows it (the next layer's buffer, in a pool allocated in one piece). The last page is a page like any
    other."""
    args = make_args()
    prefill = KVManager("prefill", args, FakeBackend(), timeouts=KVTimeouts())
    sock, reader = _registered(prefill, args)
    try:
        waiting = prefill.create_sender(7)
        sock.sendall(encode_frame(RoomRequest(7, [args.num_pages - 1, args.num_pages], 0, 1)))
        status = reader.read()
        assert isinstance(status, RoomStatus) and status.room == 7 and not status.ok
        assert status.kind == "range_rejected" and f"[{args.num_pages}]" in status.reason, status
        assert isinstance(reader.read(), Quiesced)
        assert wait_for(lambda: waiting.poll() == KVPoll.Failed, 5)
        waiting.release()
        sock.sendall(encode_frame(RoomRequest(8, [0, args.num_pages - 1], 0, 1)))
        sender = prefill.create_sender(8)
        try:
            assert wait_for(lambda: sender.request is not None, 5)
            request = sender.request
            assert request is not None and request.page_ids == [0, args.num_pages - 1]
        finally:
            sender.release()
    finally:
        sock.close()
        prefill.close()


def test_a_tcp_batch_whose_fence_closes_after_its_first_block_writes_no_more() -> None:
    """A decode closes a room's fence (the room failed or was aborted) while the tcp data port receives a
    batch of three blocks of it: the block being received finishes, the fence is checked again before each
    later block, and once closed the rest of the batch is drained into scratch and answered fenced (status
    2), so nothing more lands in pages the decode may already have handed to another request; the listener
    hears when the batch is out, and the connection keeps serving open fences. The test sends half of the
    first block and waits to see it in memory, so the receiver is past the batch's admission and inside
    that block when the fence closes."""
    size = 64
    dst = np.zeros(3 * size, dtype=np.uint8)
    blocks = [bytes([i + 1]) * size for i in range(3)]
    heard: list[tuple[int, int]] = []
    backend = TcpBackend("127.0.0.1")
    try:
        base = int(dst.ctypes.data)
        backend.register([(base, dst.nbytes)])
        backend.set_fence_listener(lambda room, generation: heard.append((room, generation)))
        backend.open_fence(3, 1)
        host, port = backend.endpoint().decode().rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            entries = b"".join(struct.pack(">QQ", base + i * size, size) for i in range(3))
            sock.sendall(struct.pack(">QQQI", 1, 3, 1, 3) + entries + blocks[0][: size // 2])
            assert wait_for(lambda: dst[: size // 2].tobytes() == blocks[0][: size // 2], 10)
            assert backend.close_fence(3, 1, cut=False) is False, "a batch of the room is being received"
            sock.sendall(blocks[0][size // 2 :] + blocks[1] + blocks[2])
            assert struct.unpack(">QB", sock.recv(9, socket.MSG_WAITALL)) == (1, 2)  # fenced
            assert dst[:size].tobytes() == blocks[0] and not dst[size:].any(), "blocks after the close landed"
            assert wait_for(lambda: heard == [(3, 1)], 10)
            backend.open_fence(4, 1)
            sock.sendall(struct.pack(">QQQI", 2, 4, 1, 1) + struct.pack(">QQ", base + size, size) + blocks[1])
            assert struct.unpack(">QB", sock.recv(9, socket.MSG_WAITALL)) == (2, 0)
            assert dst[size : 2 * size].tobytes() == blocks[1] and not dst[2 * size :].any()
    finally:
        backend.close()


def test_a_decode_on_a_backend_that_does_not_fence_still_takes_its_writes() -> None:
    """The prefill shuts its door by turning fencing on; a tcp backend whose owner never does (a decode on a plain
    ``ShmBackend(network="tcp")``, which does not pass fences on) takes writes as before (the first version of
    the fix refused every write of a backend without an open fence, and such a decode failed every room)."""
    from transfer.base import FencesWrites
    from transfer.shm import ShmBackend

    quick = KVTimeouts(bootstrap_s=5.0, waiting_s=5.0, transfer_s=5.0, heartbeat_interval_s=0.1,
                       heartbeat_timeout_s=2.0)
    backend = ShmBackend("tcp", same_host=False)
    assert not isinstance(backend, FencesWrites)
    prefill = KVManager("prefill", make_args(), ShmBackend("tcp", same_host=False), timeouts=quick)
    decode = KVManager("decode", make_args(), backend, timeouts=quick)
    try:
        sender, receiver = open_room(prefill, decode, 7, [2, 3], 0)
        sender.send([0, 1], last=True, aux=b"xy")
        assert wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed))
        assert receiver.poll() == KVPoll.Success, receiver.failure()
    finally:
        prefill.close()
        decode.close()
