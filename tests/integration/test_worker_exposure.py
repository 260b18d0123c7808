"""Security review: what a peer with no key can make a worker do over its ports (the HTTP side and the native
protocol take no key)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import httpx
from pdtest import start_bootstrap, start_worker


def test_an_unauthenticated_generate_does_not_send_the_registry_token_elsewhere(procs) -> None:  # type: ignore[no-untyped-def]
    """``POST /generate`` on a decode's HTTP port takes ``bootstrap_host``/``bootstrap_port`` from the body and the
    decode asks that host for the prefill's topology, with ``Authorization: Bearer <--bootstrap-token>``: one
    request with no key hands the registry's write token to any host (which may then PUT /route: take over a
    prefill's rank)."""
    registry = start_bootstrap(procs, "--token", "s3cret", "--token-scope", "writes")
    decode = start_worker(procs, "decode", "--engine", "sim", "--num-pages", "64", "--page-size", "4",
                          "--bootstrap-token", "s3cret", bootstrap=registry)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(20)
    heads: list[bytes] = []

    def accept() -> None:
        try:
            conn, _ = listener.accept()
            conn.settimeout(5)
            heads.append(conn.recv(65536))
            conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        r = httpx.post(f"http://127.0.0.1:{decode.http_port}/generate", timeout=60, json={
            "text": "hi", "sampling_params": {"max_new_tokens": 2}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": listener.getsockname()[1], "bootstrap_room": 12345})
        thread.join(timeout=30)
    finally:
        listener.close()
    assert r.status_code != 200
    assert not any(b"s3cret" in head for head in heads), heads


def test_a_huge_first_frame_on_the_native_port_is_refused_at_its_length(procs) -> None:  # type: ignore[no-untyped-def]
    """Before its ``Hello`` a peer may announce a frame of up to 64 MiB, which the worker buffers whole and then
    decodes (a ``Submit`` of 60 M token ids took the worker from 68 MB to ~600 MB resident), per connection, with
    no key. A ``Hello`` is a few bytes: a first frame over a small bound should be refused on its length."""
    worker = start_worker(procs, "decode", "--engine", "sim", "--num-pages", "64", "--page-size", "4")
    with socket.create_connection(("127.0.0.1", worker.port), timeout=5) as sock:
        sock.sendall(struct.pack("!I", 60_000_000))  # (the length prefix only)
        sock.settimeout(3)
        started = time.monotonic()
        try:
            answer = sock.recv(4096)
        except TimeoutError:
            answer = None
        assert answer is not None and time.monotonic() - started < 3, \
            "the worker waits for a 60 MB first frame from a peer that has not said Hello"
