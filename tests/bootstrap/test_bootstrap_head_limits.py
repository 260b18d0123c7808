"""The registry (standalone and embedded in a prefill) reads a client's request head under the gateway's
limits: a head of any size is not buffered before the token check (431), whether or not a token is set."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
from pdtest import Procs, free_port, start_bootstrap, wait_http_ok


def _big_header_status(base: str) -> int:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        reply = sock.recv(4096)
    return int(reply.split(b" ", 2)[1])


def test_a_huge_request_head_is_refused(tmp_path: Path) -> None:
    procs = Procs(tmp_path)
    try:
        standalone = start_bootstrap(procs, "--token", "s3cret")
        port = free_port()
        prefill = procs.start("prefill", "-m", "workers.cli", "--role", "prefill", "--engine", "sim", "--port", "0",
                              "--http-port", str(free_port()), "--bootstrap-embedded", str(port))
        embedded = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{embedded}/health", 60, prefill)
        for base in (standalone, embedded):
            assert _big_header_status(base) == 431
            assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # (still serving)
    finally:
        procs.stop_all()
