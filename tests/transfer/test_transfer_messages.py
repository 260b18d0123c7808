"""Control messages: round trips, framing over a real socket pair, malformed input."""

from __future__ import annotations

import socket
import struct
import threading

import msgspec
import pytest

from transfer import TransferError, TransferErrorKind
from transfer.messages import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    FrameReader,
    Ping,
    Pong,
    Quiesced,
    Register,
    RegisterAck,
    RoomRequest,
    RoomStatus,
    decode_body,
    encode_frame,
)

MESSAGES = [
    Register(PROTOCOL_VERSION, "tcp", b"127.0.0.1:5", [1, 2], [64, 64], [16, 16], [3], [40], [4], 16, "bfloat16"),
    RegisterAck(True),
    RegisterAck(False, "page_size 8, this prefill uses 16", "protocol"),
    RoomRequest(2**63 - 1, [5, 6, 7, 100_000], 3),
    RoomStatus(9, True, aux_len=12),
    RoomStatus(9, False, "timeout", "room 9: too slow"),
    Abort(4, "client went away"),
    Quiesced(4),
    Ping(123),
    Pong(123),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frame = encode_frame(msg)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert decode_body(frame[4:]) == msg


def test_frames_over_a_socket_pair():
    a, b = socket.socketpair()
    with a, b:
        for msg in MESSAGES:
            a.sendall(encode_frame(msg))
        reader = FrameReader(b)
        assert [reader.read() for _ in MESSAGES] == MESSAGES
        a.shutdown(socket.SHUT_WR)
        assert reader.read() is None  # clean end of stream


def test_frames_in_any_split_are_read_whole_and_in_order():
    """The reader buffers what arrives: frames split byte by byte, several in one segment, one larger than a
    single read takes, and a stream ending right behind the last frame all come out whole, in order."""
    big = RoomRequest(1, list(range(200_000)), 0)  # (~1 MB: many of the reader's recvs)
    stream = b"".join(encode_frame(m) for m in [*MESSAGES, big, *MESSAGES])
    cuts = [1, 2, 3, 4, 5, 9, 17, 400, 4096, 1 << 20]  # then the rest in one go
    a, b = socket.socketpair()
    with a, b:
        def write() -> None:
            at = 0
            for size in cuts:
                a.sendall(stream[at : at + size])
                at += size
            a.sendall(stream[at:])
            a.shutdown(socket.SHUT_WR)

        writer = threading.Thread(target=write)
        writer.start()
        reader = FrameReader(b)
        got = [reader.read() for _ in range(2 * len(MESSAGES) + 1)]
        assert got == [*MESSAGES, big, *MESSAGES]
        assert reader.read() is None
        writer.join()


def test_eof_mid_frame_is_a_broken_connection():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(encode_frame(Ping(1))[:5])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionResetError):
            FrameReader(b).read()


def test_oversized_and_garbage_frames_are_protocol_errors():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))
        with pytest.raises(TransferError) as info:
            FrameReader(b).read()
        assert info.value.kind == TransferErrorKind.PROTOCOL
    with pytest.raises(TransferError, match="undecodable"):
        decode_body(b"\x93\xa3bad\x01\x02")
    with pytest.raises(TransferError):
        decode_body(msgspec.msgpack.encode(["room", "not-an-int", [], 0]))


def test_new_optional_fields_keep_old_peers_working():
    # an older peer's RoomStatus without aux_len/kind/reason still decodes (fields go last with defaults)
    assert decode_body(msgspec.msgpack.encode(["status", 5, True])) == RoomStatus(5, True)


def test_error_kind_parse():
    assert TransferErrorKind.parse("peer_gone") == TransferErrorKind.PEER_GONE
    assert TransferErrorKind.parse("something-new") == TransferErrorKind.PROTOCOL
    error = TransferError(TransferErrorKind.TIMEOUT, "room 3: slow")
    assert str(error) == "timeout: room 3: slow" and error.kind == TransferErrorKind.TIMEOUT
