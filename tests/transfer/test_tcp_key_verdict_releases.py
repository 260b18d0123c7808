"""The tcp data port's verdict on a connection's proof of the workers' key (``transfer.tcp``, ``transfer.auth``)
between keyed workers of two releases: the one before the verdict (its data port sends a nonce, reads the 32-byte
proof and then batches; its connecting side sends the proof and its first batch at once and reads acks) and this
one. A rolling restart of a keyed tcp fleet has both at once.

- A connecting side of the earlier release (a prefill not restarted yet) writing to a data port of this one: its
  batch lands and its ack is the first thing it reads. Before, the port put its verdict byte in front of the ack:
  the earlier side read it as the ack's first byte (a wrong sequence number), so every write failed PEER_GONE,
  with its bytes already in the decode's memory.
- A connecting side of this release reaching a data port of the earlier one: connected, its writes land. Before,
  the earlier port read the proof, sent no verdict (it has none), and waited for a batch while ``connect``
  waited for the verdict: PEER_UNREACHABLE after ``connect_timeout_s``, every registration refused.
- Whichever the release, a wrong key is still refused before any byte lands.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import threading

import pytest
from kvunit import wait_for

from transfer import TransferError, TransferErrorKind, WriteState
from transfer.auth import NONCE_BYTES, PROOF_BYTES, KVKeys, data_proof, derive, is_valid, new_nonce
from transfer.tcp import TcpBackend

pytestmark = pytest.mark.timeout(60)

_HEADER = struct.Struct(">QQQI")
_ENTRY = struct.Struct(">QQ")
_ACK = struct.Struct(">QB")


def _keys(key: str) -> KVKeys:
    keys = derive(key)
    assert keys is not None
    return keys


def _batch(seq: int, dst: int, payload: bytes) -> bytes:
    return _HEADER.pack(seq, 7, 1, 1) + _ENTRY.pack(dst, len(payload)) + payload


def test_an_earlier_release_writer_is_acked_with_no_verdict_in_front() -> None:
    keys = _keys("fleet-key")
    target = TcpBackend("127.0.0.1")
    target.set_kv_keys(keys)
    buf = (ctypes.c_ubyte * 64)()
    dst = ctypes.addressof(buf)
    target.register([(dst, 64)])
    host, port = target.endpoint().decode().rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            nonce = sock.recv(NONCE_BYTES, socket.MSG_WAITALL)
            # that release's connecting side: the proof and its first batch at once, then its ack
            sock.sendall(data_proof(keys, nonce) + _batch(1, dst, b"first batch"))
            assert _ACK.unpack(sock.recv(_ACK.size, socket.MSG_WAITALL)) == (1, 0)
            assert bytes(buf[:11]) == b"first batch"
            sock.sendall(_batch(2, dst, b"second"))
            assert _ACK.unpack(sock.recv(_ACK.size, socket.MSG_WAITALL)) == (2, 0)
        assert target.num_peers_refused == 0
    finally:
        target.close()


class _EarlierDataPort:
    """A keyed tcp data port of the earlier release: a nonce, the 32-byte proof (a wrong one: closed), then
    batches, each acked ``(seq, 0)`` after its bytes went into ``buf``."""

    def __init__(self, keys: KVKeys, size: int = 64) -> None:
        self.keys = keys
        self.buf = bytearray(size)
        self.refused = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}".encode()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with sock:
                nonce = new_nonce()
                sock.sendall(nonce)
                proof = sock.recv(PROOF_BYTES, socket.MSG_WAITALL)
                if not is_valid(data_proof(self.keys, nonce), proof):
                    self.refused += 1
                    continue  # (closed)
                while head := sock.recv(_HEADER.size, socket.MSG_WAITALL):
                    seq, _, _, count = _HEADER.unpack(head)
                    for _ in range(count):
                        dst, length = _ENTRY.unpack(sock.recv(_ENTRY.size, socket.MSG_WAITALL))
                        self.buf[dst:dst + length] = sock.recv(length, socket.MSG_WAITALL)
                    sock.sendall(_ACK.pack(seq, 0))

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(5)


def test_a_writer_of_this_release_reaches_an_earlier_releases_data_port() -> None:
    port = _EarlierDataPort(_keys("fleet-key"))
    writer = TcpBackend("127.0.0.1", options={"connect_timeout_s": 2.0})
    writer.set_kv_keys(_keys("fleet-key"))
    src = ctypes.create_string_buffer(b"kv bytes", 8)
    writer.register([(ctypes.addressof(src), 8)])
    try:
        peer = writer.connect(port.endpoint)
        handle = writer.write(peer, [(ctypes.addressof(src), 16, 8)])
        assert wait_for(lambda: writer.poll(handle) != WriteState.PENDING, 10)
        assert writer.poll(handle) == WriteState.DONE, writer.error(handle)
        assert bytes(port.buf[16:24]) == b"kv bytes"
        writer.disconnect(peer)
    finally:
        writer.close()
        port.close()


def test_a_wrong_key_is_refused_whichever_the_release() -> None:
    port = _EarlierDataPort(_keys("fleet-key"))  # the earlier release's port: refused, nothing landed
    writer = TcpBackend("127.0.0.1", options={"connect_timeout_s": 2.0})
    writer.set_kv_keys(_keys("other-key"))
    src = ctypes.create_string_buffer(b"kv bytes", 8)
    writer.register([(ctypes.addressof(src), 8)])
    try:
        try:
            peer = writer.connect(port.endpoint)
        except TransferError as exc:  # (it tells nothing: the connection closed)
            assert exc.kind in (TransferErrorKind.PEER_UNREACHABLE, TransferErrorKind.PEER_GONE), exc
        else:
            handle = writer.write(peer, [(ctypes.addressof(src), 16, 8)])
            assert wait_for(lambda: writer.poll(handle) != WriteState.PENDING, 10)
            assert writer.poll(handle) == WriteState.FAILED
        assert bytes(port.buf) == bytes(64)
        assert port.refused >= 1
        target = TcpBackend("127.0.0.1")  # this release's port: refused at connect, PROTOCOL
        target.set_kv_keys(_keys("fleet-key"))
        try:
            with pytest.raises(TransferError) as refused:
                writer.connect(target.endpoint())
            assert refused.value.kind == TransferErrorKind.PROTOCOL, refused.value
            assert target.num_peers_refused == 1 and writer.num_refused_by_peers == 1
        finally:
            target.close()
    finally:
        writer.close()
        port.close()
