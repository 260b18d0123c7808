"""``pd_gateway_requests_total`` counts every request of a route the gateway ends, once, with the status it ended
with, on a real gateway over sim workers (raw sockets: the framing is the point). Found by review (2026-12-06):
a broken chunked body answered 400 in the read of its head was not counted at all; a request whose connection
the gateway closed (garbage pipelined behind it) was counted as the client's 499; a GET on a generation route
(405) was not counted."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import httpx
from pdtest import SimCluster
from raw_http import read_to_close
from test_gateway_sglang import Fleet, eventually, fleet  # noqa: F401 (the SGLang stand-ins' fixture)
from test_hot_cycle import PROMPT, post

SLOW = ("--engine-option", "decode_step_s=0.01")  # 400 tokens: 4 s at least
GENEROUS_S = 30.0  # a hang guard only


def counts(cluster: SimCluster, route: str) -> dict[str, float]:
    """``route``'s requests by status, and the gateway's active requests (``active``)."""
    out = {}
    for line in httpx.get(f"{cluster.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'pd_gateway_requests_total{{route="{route}"'):
            out[line.split('status="')[1].split('"')[0]] = float(line.rpartition(" ")[2])
        if line.startswith("pd_gateway_active_requests "):
            out["active"] = float(line.rpartition(" ")[2])
    return out


def changed(cluster: SimCluster, route: str, before: dict[str, float], status: str) -> dict[str, float]:
    """The counts once ``status`` has grown past ``before`` (or the hang guard has passed)."""
    deadline = time.monotonic() + GENEROUS_S
    while True:
        now = counts(cluster, route)
        if now.get(status, 0) > before.get(status, 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if k != "active" and v != before.get(k, 0)}


def test_a_broken_chunked_body_in_the_read_of_its_head_counts_as_its_400(
        sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\n{\"pro\r\nzz\r\n")
    for parts in ([request], [request[:-4], request[-4:]]):  # one read (the gap), then head and body apart
        before = counts(cluster, "completions")
        with socket.create_connection(("127.0.0.1", cluster.gateway_port), timeout=GENEROUS_S) as sock:
            for i, part in enumerate(parts):
                if i:
                    time.sleep(0.3)
                sock.sendall(part)
            answer = read_to_close(sock)
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        after = changed(cluster, "completions", before, "400")
        assert delta(before, after) == {"400": 1}, (len(parts), before, after)


def test_a_request_whose_connection_the_gateway_closes_counts_444_not_499(
        sim_cluster: Callable[..., SimCluster]) -> None:
    """A valid request still being answered, then bytes that are not HTTP on its connection: the gateway cannot
    answer them (the answer would be read as the request's), so it closes the connection, on purpose."""
    cluster = sim_cluster(decode_args=SLOW)
    for stream in (False, True):
        body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": stream}
        valid = post("/v1/completions", body)
        before = counts(cluster, "completions")
        with socket.create_connection(("127.0.0.1", cluster.gateway_port), timeout=GENEROUS_S) as sock:
            sock.sendall(valid)
            deadline = time.monotonic() + GENEROUS_S
            while counts(cluster, "completions").get("active", 0) < 1:  # the valid one is being answered
                assert time.monotonic() < deadline
                time.sleep(0.02)
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            answer = read_to_close(sock)
        assert b"HTTP/1.1 400" not in answer, answer[:300]  # (no answer that could be taken for the request's)
        after = changed(cluster, "completions", before, "444")
        assert delta(before, after) == {"444": 1}, (stream, before, after)
        cluster.wait_pools_full()  # the request was aborted on its workers


def test_a_get_on_a_generation_route_counts_its_405(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster()
    for path, route in (("/v1/chat/completions", "chat"), ("/generate", "generate")):
        before = counts(cluster, route)
        r = httpx.get(f"{cluster.base_url}{path}", timeout=10)
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
        assert json.loads(r.text)["error"]["type"] == "invalid_request_error"
        after = changed(cluster, route, before, "405")
        assert delta(before, after) == {"405": 1}, (path, before, after)


# -- over SGLang workers: the requests go through uvicorn's ASGI cycle and the relay ----------------------------
def test_relayed_requests_count_the_status_the_gateway_ended_them_with(fleet: Fleet) -> None:  # noqa: F811
    port = int(fleet.base_url.rpartition(":")[2])

    def generate(status: str) -> float:
        lines = httpx.get(f"{fleet.base_url}/metrics", timeout=10).text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines
                   if line.startswith(f'pd_gateway_requests_total{{route="generate",status="{status}"}}'))

    # a broken chunked body in the read of its head: answered 400 by the protocol, counted 400 (was 499)
    before = {s: generate(s) for s in ("400", "499")}
    with socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"tex\r\nzz\r\n")
        assert read_to_close(sock).startswith(b"HTTP/1.1 400 ")
    deadline = time.monotonic() + GENEROUS_S
    while generate("400") == before["400"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (generate("400"), generate("499")) == (before["400"] + 1, before["499"])

    # a stream being relayed, then bytes that are not HTTP: the gateway closes the connection, counted 444
    text = "DECODE_WAITS HEAD_FIRST closed by the gateway"
    body = json.dumps({"text": text, "stream": True}).encode()
    before = {s: generate(s) for s in ("444", "499")}
    with socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        (entry,) = eventually(lambda: [e for e in fleet.entries(fleet.decode_log) if e["text"] == text])
        assert eventually(lambda: [e for e in fleet.entries(fleet.decode_log, "waiting")
                                   if e["bootstrap_room"] == entry["bootstrap_room"]])  # (its head went out)
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        read_to_close(sock)
    deadline = time.monotonic() + GENEROUS_S
    while generate("444") == before["444"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (generate("444"), generate("499")) == (before["444"] + 1, before["499"])
