"""A probe on a connection let in on probation at the gateway's client connection cap
(``gateway/http_connections.py``) is served and the connection closed after its answer, even when the client
pipelined another request behind it on that connection. Before the fix the request behind it was refused while the
probe's answer had not gone out yet, which closed the connection with neither answered: the probe of a healthy
gateway at its cap failed."""

from __future__ import annotations

import json

from pdtest import Procs, start_gateway, start_worker
from raw_http import HANG_GUARD_S, connect, metric, metrics, read_reply


def test_a_probe_with_a_request_pipelined_behind_it_is_answered_on_probation(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim")
    port = start_gateway(procs, "--worker", worker.url, "--max-client-connections", "1", "--header-timeout-s", "60")
    with connect(port) as held:  # silent: holds the one admitted slot
        for behind in (b"GET /health HTTP/1.1\r\nhost: gateway\r\n\r\n",
                       b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-length: 2\r\n\r\n{}"):
            with connect(port) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: gateway\r\n\r\n" + behind)
                status, headers, body = read_reply(sock)
                assert status == 200 and json.loads(body)["status"] == "ok", body
                assert headers["connection"] == "close"
                sock.settimeout(HANG_GUARD_S)
                assert sock.recv(65536) == b""  # (closed after the probe's answer: the one behind it unanswered)
        assert metric(metrics(port), "pd_gateway_client_connections", slot="admitted") == 1
        held.sendall(b"GET /health HTTP/1.1\r\nhost: gateway\r\n\r\n")
        assert read_reply(held)[0] == 200
