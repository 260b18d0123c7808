"""``--gateway-timeout-s`` is accepted as any positive, finite number of seconds: a long one (a week, for a link
that may be silent for days) must still let gateways connect. The kernel caps the keep-alive settings it is turned
into (``TCP_KEEPIDLE``/``TCP_KEEPINTVL`` at most 32767 s); a value past them made every gateway connection fail
its setup, the worker unusable though healthy. Real worker and gateway processes."""

from __future__ import annotations

import socket

import httpx
from pdtest import Procs, start_gateway, start_worker

from transfer.netaddr import watch_peer

WEEK_S = 7 * 86400.0


def test_watch_peer_takes_a_long_timeout() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        watch_peer(sock, WEEK_S)  # (raised EINVAL)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1


def test_a_worker_with_a_week_long_gateway_timeout_serves_a_gateway(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim", "--gateway-timeout-s", str(WEEK_S))
    gateway = start_gateway(procs, "--worker", worker.url)  # (waits for /readiness: the worker connected)
    reply = httpx.post(f"http://127.0.0.1:{gateway}/v1/completions",
                       json={"model": "sim", "prompt": "hello", "max_tokens": 4}, timeout=30)
    assert reply.status_code == 200, reply.text
