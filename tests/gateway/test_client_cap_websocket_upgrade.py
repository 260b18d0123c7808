"""A WebSocket upgrade on the gateway's capped client port (``gateway/http_connections.py``) gives its slot back when
the connection ends: uvicorn hands the transport to its WebSocket protocol (``handle_websocket_upgrade``), so the HTTP
protocol's ``connection_lost`` never runs for it. Before the fix each upgrade attempt (the gateway has no WebSocket
route: refused 403 and closed at once) kept an admitted slot for good: ``--max-client-connections`` of them, from
any client, and the gateway answered every later request 503 ``too_many_connections``, for ever. The worker's HTTP
port (``pd-worker --max-http-connections``) shares the code, and had the same leak."""

from __future__ import annotations

import json
import time

from pdtest import Procs, start_gateway, start_worker
from raw_http import HANG_GUARD_S, connect, is_closed, metric, metrics, once

CAP = 3
COMPLETION = json.dumps({"model": "default", "prompt": "hello", "max_tokens": 3}).encode()
UPGRADE = (b"GET /v1/realtime HTTP/1.1\r\nhost: server\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
           b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n")


def _upgrade_past_the_cap(port: int, gauge: str) -> None:
    for _ in range(CAP + 1):
        with connect(port) as sock:
            sock.sendall(UPGRADE)
            reply = sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 "), reply  # (refused: no such WebSocket route)
            assert is_closed(sock, HANG_GUARD_S)
    deadline = time.monotonic() + HANG_GUARD_S
    while metric(metrics(port), gauge, slot="admitted") > 1:  # (the scrape's own)
        assert time.monotonic() < deadline, "the upgraded connections kept their slots after they closed"
        time.sleep(0.05)


def test_websocket_upgrades_do_not_keep_the_gateways_admitted_slots(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim")
    port = start_gateway(procs, "--worker", worker.url, "--max-client-connections", str(CAP))
    _upgrade_past_the_cap(port, "pd_gateway_client_connections")
    status, _, body = once(port, "POST", "/v1/completions", COMPLETION)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3, body


def test_websocket_upgrades_do_not_keep_the_workers_admitted_slots(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim", "--max-http-connections", str(CAP))
    _upgrade_past_the_cap(worker.http_port, "pd_worker_http_connections")
    status, _, body = once(worker.http_port, "GET", "/v1/models")  # (no probe: an admitted connection's request)
    assert status == 200, body
