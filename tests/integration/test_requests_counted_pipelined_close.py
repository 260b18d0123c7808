"""``pd_gateway_requests_total`` counts a request pipelined behind one still being answered when the client closes
the connection: both are the client's 499 (the queued one was never started, and was counted nowhere), as the
gateway's own close counts both 444 (``test_requests_counted``). Real gateway over sim workers, raw sockets."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from pdtest import SimCluster
from test_hot_cycle import PROMPT, post
from test_requests_counted import GENEROUS_S, SLOW, counts, delta


def test_a_pipelined_request_left_when_the_client_closes_counts_499(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster(decode_args=SLOW)
    first = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True})
    second = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    before = counts(cluster, "completions")
    with socket.create_connection(("127.0.0.1", cluster.gateway_port), timeout=GENEROUS_S) as sock:
        sock.sendall(first)
        deadline = time.monotonic() + GENEROUS_S
        while counts(cluster, "completions").get("active", 0) < 1:  # the first is being answered
            assert time.monotonic() < deadline
            time.sleep(0.02)
        sock.sendall(second)  # queued behind it
        time.sleep(0.3)
    deadline = time.monotonic() + 5.0
    while True:
        after = counts(cluster, "completions")
        if delta(before, after).get("499", 0) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert delta(before, after) == {"499": 2}, (before, after)
    cluster.wait_pools_full()
