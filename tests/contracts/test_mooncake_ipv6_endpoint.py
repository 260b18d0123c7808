"""Mooncake advertised on an IPv6 address: its P2P handshake cannot reach a session named ``addr:port`` with an
IPv6 literal (0.3.13.post1: "failed to get IP address of peer server ::1:16261 ... use IPv4 address instead", in
brackets too), so a worker so configured would start, register and then fail every decode's registration. It must
either work or refuse at start-up, saying why. Real engines; needs a private network namespace (Mooncake binds
0.0.0.0) with IPv6 on loopback.
"""

from __future__ import annotations

import ctypes
import socket
import time

import pytest
from kvpeer import skip_reason

from transfer import TransferError, WriteState, create_backend


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("host, advertise_host", [("::1", None), ("::", "::1"), ("[::1]", None)])
def test_mooncake_on_ipv6_works_or_refuses_at_start(host, advertise_host):
    if reason := skip_reason("mooncake"):
        pytest.skip(reason)
    if not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    made = []
    try:
        try:
            writer = create_backend("mooncake", host=host, advertise_host=advertise_host)
        except (TransferError, ValueError) as exc:
            assert "IPv6" in str(exc), exc  # refused at start-up, saying why
            return
        made.append(writer)
        target = create_backend("mooncake", host=host, advertise_host=advertise_host)
        made.append(target)
        src, dst = (ctypes.c_ubyte * 4096)(), (ctypes.c_ubyte * 4096)()
        ctypes.memset(src, 0x5A, 4096)
        writer.register([(ctypes.addressof(src), 4096)])
        target.register([(ctypes.addressof(dst), 4096)])
        peer = writer.connect(target.endpoint())  # raised PEER_UNREACHABLE: the engine cannot parse the session
        handle = writer.write(peer, [(ctypes.addressof(src), ctypes.addressof(dst), 4096)])
        deadline = time.monotonic() + 30
        while writer.poll(handle) == WriteState.PENDING and time.monotonic() < deadline:
            time.sleep(0.005)
        assert writer.poll(handle) == WriteState.DONE, writer.error(handle)
        assert bytes(dst) == bytes(src)
    finally:
        for backend in made:
            backend.close()
