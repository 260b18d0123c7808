"""The tcp data port with the workers' key (``TcpBackend.set_kv_keys``, ``transfer.auth``): a connection the
listener accepted before the key was set (its accept thread runs from the constructor on, and a worker makes its
KV manager, which sets the key, only after the backend) proved nothing. Before, such a connection was served
without a proof for its whole life: once the memory was registered, its batches were written into the KV pool."""

from __future__ import annotations

import ctypes
import socket
import struct

import pytest
from kvunit import wait_for

from transfer.auth import derive
from transfer.tcp import TcpBackend

pytestmark = pytest.mark.timeout(60)


def _batch(dst: int, payload: bytes) -> bytes:
    return struct.pack(">QQQI", 1, 7, 0, 1) + struct.pack(">QQ", dst, len(payload)) + payload


def test_a_connection_accepted_before_the_key_was_set_writes_nothing() -> None:
    buf = (ctypes.c_ubyte * 64)()
    dst = ctypes.addressof(buf)
    target = TcpBackend("127.0.0.1")  # (listening and accepting already: its key comes later)
    host, port = target.endpoint().decode().rsplit(":", 1)
    payload = b"POISONED-KV-PAGE"
    try:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            assert wait_for(lambda: len(target._inbound) == 1, 5)  # accepted, before the key
            target.set_kv_keys(derive("fleet-key"))  # (as KVManager does, then registers the pool)
            target.register([(dst, 64)])
            try:
                sock.sendall(_batch(dst, payload))
                answer = sock.recv(9, socket.MSG_WAITALL)
            except OSError:
                answer = b""
            assert answer != struct.pack(">QB", 1, 0), "an unproven connection's batch was acknowledged"
        assert bytes(buf[:len(payload)]) == bytes(len(payload))
    finally:
        target.close()
