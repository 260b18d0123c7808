"""An ``accept()`` that fails for a moment (the process out of file descriptors: EMFILE under a burst of
connections; or one of the network errors Linux passes on from a pending connection) must not end a
listener's accept thread: the prefill's control port (every decode that connects later, or again, would wait
its bootstrap timeout for a registration nobody reads) and the tcp backend's data port (every later data
connection stalls) stayed dead until the worker restarted, while it looked healthy."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import time
from collections.abc import Iterator

from kvunit import make_args, wait_for, warm_room

from transfer import KVManager, KVPoll, KVTimeouts
from transfer.netaddr import split_host_port
from transfer.tcp import TcpBackend

QUICK = KVTimeouts(bootstrap_s=5.0, waiting_s=10.0, transfer_s=5.0, heartbeat_interval_s=0.2,
                   heartbeat_timeout_s=3.0)


@contextlib.contextmanager
def _out_of_fds() -> Iterator[None]:
    """No free file descriptor in this process for a moment (EMFILE for any new one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(int(fd) for fd in os.listdir("/proc/self/fd")) + 16, hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _connect_while_out_of_fds(address: tuple[str, int]) -> socket.socket:
    """A connection the listener's accept() meets while the process has no descriptor to give it."""
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with _out_of_fds():
        client.connect(address)  # (the kernel completes the handshake; accept() fails with EMFILE)
        time.sleep(0.5)
    return client


def test_the_prefills_control_port_accepts_again_after_a_moment_out_of_fds() -> None:
    prefill = KVManager("prefill", make_args(), TcpBackend(), timeouts=QUICK)
    decode = KVManager("decode", make_args(), TcpBackend(), timeouts=QUICK)
    client = None
    try:
        client = _connect_while_out_of_fds(prefill.control_address)
        receiver = decode.create_receiver(1, *prefill.control_address)
        assert wait_for(lambda: receiver.poll() != KVPoll.Bootstrapping, 8)
        assert receiver.poll() == KVPoll.WaitingForInput, receiver.failure()
        warm_room(prefill, decode, room=2)
    finally:
        if client is not None:
            client.close()
        prefill.close()
        decode.close()


def test_the_tcp_data_port_accepts_again_after_a_moment_out_of_fds() -> None:
    prefill = KVManager("prefill", make_args(), TcpBackend(), timeouts=QUICK)
    decode = KVManager("decode", make_args(), TcpBackend(), timeouts=QUICK)
    client = None
    try:
        address = split_host_port(decode.backend.endpoint().decode())
        client = _connect_while_out_of_fds(address)
        warm_room(prefill, decode)  # (its data connection is accepted after the moment passed)
    finally:
        if client is not None:
            client.close()
        prefill.close()
        decode.close()
