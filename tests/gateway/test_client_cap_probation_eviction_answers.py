"""At the connection cap with every probation slot taken by a connection whose request head is still due, a newcomer
closes the oldest of them: that one is answered 503 ``too_many_connections`` (retryable: a router or our SGLang relay
tries again, and does not hold it against the server) rather than closed unanswered, which a client cannot tell
from a server that died (our relay and SGLang's router counted it as the worker's failure, and their breakers
opened on a healthy fleet under a burst past the cap)."""

from __future__ import annotations

import json

from pdtest import Procs, start_gateway, start_worker
from raw_http import connect, read_reply

from gateway.http_connections import PROBATION_SLOTS


def test_a_probation_connection_closed_for_a_newcomer_is_answered_503(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim")
    port = start_gateway(procs, "--worker", worker.url, "--max-client-connections", "1")
    admitted = connect(port)  # silent: holds the one admitted slot
    waiting = [connect(port) for _ in range(PROBATION_SLOTS)]  # silent: every probation slot, heads still due
    newcomer = connect(port)  # the oldest waiting one makes room for it
    try:
        status, headers, body = read_reply(waiting[0])
        assert status == 503, body
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert headers["retry-after"] == "1" and headers["connection"] == "close"
    finally:
        for sock in (admitted, *waiting, newcomer):
            sock.close()
