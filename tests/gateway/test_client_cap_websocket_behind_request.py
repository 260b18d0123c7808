"""A WebSocket upgrade pipelined behind a request still being answered on the same connection (a gateway at its
client connection cap, ``gateway/http_connections.py``). uvicorn hands the transport to its WebSocket protocol at
once; that protocol refuses the upgrade (the gateway has no WebSocket route) and closes the connection. The
request in flight must see its client gone then: its generation is aborted on the worker, and the gateway's open
requests fall to zero. Before the fix only the connection's slot was given back (``handle_websocket_upgrade``):
the HTTP protocol's ``connection_lost`` never ran, so its request never learnt of the disconnect and went on
generating, holding the worker's sequence and the gateway's admission, to its last token."""

from __future__ import annotations

import json
import time

from pdtest import Procs, start_gateway, start_worker
from raw_http import HANG_GUARD_S, connect, is_closed, metric, metrics

STREAM = json.dumps({"model": "default", "prompt": "hello", "max_tokens": 2000, "stream": True,
                     "ignore_eos": True}).encode()
UPGRADE = (b"GET /v1/realtime HTTP/1.1\r\nhost: server\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
           b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n")


def test_a_request_in_flight_sees_its_client_gone_when_an_upgrade_behind_it_closes_the_connection(
        procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim", "--engine-option", "decode_step_s=0.05")
    port = start_gateway(procs, "--worker", worker.url, "--max-client-connections", "4")
    with connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(STREAM), STREAM))
        sock.settimeout(HANG_GUARD_S)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200"), "the stream did not start"
        sock.sendall(UPGRADE)  # (behind the stream: 2000 tokens at 50 ms each, 100 s to go)
        assert is_closed(sock, HANG_GUARD_S)
    deadline = time.monotonic() + 10.0
    while True:
        text = metrics(port)
        active = metric(text, "pd_gateway_worker_active_requests", worker=worker.url, role="both")
        admitted = metric(text, "pd_gateway_client_connections", slot="admitted")
        if active == 0 and admitted <= 1:  # (the scrape's own connection)
            break
        assert time.monotonic() < deadline, (
            f"the stream went on after its connection closed: {active} requests open on the worker, "
            f"{admitted} client connections admitted")
        time.sleep(0.1)
