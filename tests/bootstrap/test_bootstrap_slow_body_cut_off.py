"""The registry bounds the time a client may take to send a request body, as the gateway does (its
``--body-timeout-s``): a client that sends a head and then trickles (or never sends) its body gets a 408 and
its connection is closed, instead of holding it, and a file descriptor of the registry (or of the prefill
that embeds it), for ever. The registry's token does not help when it is not set (the default) or covers
only writes."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
from pdtest import Procs, start_bootstrap


def _slow_body_reply(base: str, wait_s: float) -> tuple[bytes, float]:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(b"PUT /route HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n{\"a")  # (3 of the 100 bytes announced, then nothing)
        started = time.monotonic()
        reply = b""
        try:
            while chunk := sock.recv(4096):  # (to the end: the registry closes the connection)
                reply += chunk
        except TimeoutError:
            pass
        return reply, time.monotonic() - started


def test_a_body_that_does_not_arrive_is_a_408_and_the_connection_closes(tmp_path: Path) -> None:
    procs = Procs(tmp_path)
    try:
        base = start_bootstrap(procs, "--body-timeout-s", "1")
        reply, waited_s = _slow_body_reply(base, 15.0)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"body_timeout" in reply and waited_s < 10, (reply[:300], waited_s)
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # (still serving)
    finally:
        procs.stop_all()
