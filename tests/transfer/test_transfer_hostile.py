"""What a client that reaches a prefill's ports without being a decode can do: nothing that lasts. Its tcp
data port takes no writes (a prefill only sends KV: before, any batch inside its registered memory landed,
e.g. in prefix-cache pages other requests read), and a page list longer than the decode's pool is refused
before any per-id work (before, a forged list of millions held the manager's lock for a second and was
kept for ``bootstrap_s``)."""

from __future__ import annotations

import ctypes
import socket
import struct

import pytest
from kvunit import make_args, wait_for

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


def test_a_page_list_longer_than_the_decodes_pool_is_refused_at_once() -> None:
    args = make_args()
    prefill = KVManager("prefill", args, FakeBackend(), timeouts=KVTimeouts())
    sock = socket.create_connection(prefill.control_address)
    try:
        sock.sendall(encode_frame(Register(
            PROTOCOL_VERSION, "fake", FakeBackend().endpoint(), args.kv_ptrs, args.kv_data_lens, args.kv_item_lens,
            args.aux_ptrs, args.aux_data_lens, args.aux_item_lens, args.page_size, args.kv_dtype)))
        reader = FrameReader(sock)
        ack = reader.read()
        assert isinstance(ack, RegisterAck) and ack.ok, ack
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
        sender = prefill.create_sender(7)
        receiver = decode.create_receiver(7, *prefill.control_address)
        assert wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
        receiver.send_metadata([2, 3], 0)
        assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.send([0, 1], last=True, aux=b"xy")
        assert wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed))
        assert receiver.poll() == KVPoll.Success, receiver.failure()
    finally:
        prefill.close()
        decode.close()
