"""A client still uploading its request body holds no admission slot."""

from __future__ import annotations

import socket
import time

import httpx

PROMPT = [ord(c) for c in "A slow upload must not hold a slot."]


def test_a_slow_upload_does_not_hold_an_admission_slot(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    # One request served at once, a short queue wait: a client that sent its head and part of its body
    # (a slow link, or on purpose) must not keep every other request out until its body timeout.
    cluster = sim_cluster(gateway_args=("--max-concurrent-requests", "1", "--queue-timeout-s", "2"))
    body = b'{"prompt": "hello there", "max_tokens": 2}'
    port = int(cluster.base_url.rsplit(":", 1)[1])
    slow = socket.create_connection(("127.0.0.1", port))
    try:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body[:5])
        time.sleep(0.3)  # (its head has been read: the gateway waits for the rest of its body)
        started = time.monotonic()
        r = httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, (r.status_code, r.text, f"after {time.monotonic() - started:.1f}s")
        slow.sendall(body[5:])  # the slow client's request is then served too
        slow.settimeout(20)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = slow.recv(65536)
            if not chunk:
                break
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    finally:
        slow.close()
    cluster.wait_pools_full()
