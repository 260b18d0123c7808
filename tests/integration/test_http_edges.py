"""The gateway's HTTP layer as a raw-socket client exercises it: disconnects behind a paused read, pipelined
requests' body timeouts, bytes after a close request once an upgrade was ignored, and the status a request the
protocol refused itself is counted as. Each found by review (2026-12-05), each failing before its fix."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

from pdtest import SimCluster
from test_hot_cycle import PROMPT, post, talk

SLOW = ("--engine-option", "decode_step_s=0.01")  # 400 tokens: 4 s at least


def counts(cluster: SimCluster) -> dict[str, float]:
    reply = talk(cluster.gateway_port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 1)[0][0][2].decode()
    out = {}
    for line in reply.splitlines():
        if line.startswith('pd_gateway_requests_total{route="completions"'):
            out[line.split('status="')[1].split('"')[0]] = float(line.rpartition(" ")[2])
        if line.startswith("pd_gateway_active_requests "):
            out["active"] = float(line.rpartition(" ")[2])
    return out


def wait_for(cluster: SimCluster, what: Callable[[dict[str, float]], bool], within_s: float) -> dict[str, float]:
    deadline = time.monotonic() + within_s
    while True:
        c = counts(cluster)
        if what(c) or time.monotonic() > deadline:
            return c
        time.sleep(0.1)


def long_whole(pad: int = 0) -> bytes:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}).encode() + b" " * pad
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


def leave_after(port: int, data: bytes, wait_s: float = 0.5) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(data)
        time.sleep(wait_s)


def test_client_leaving_a_whole_request_with_a_body_over_64k_is_aborted(
        sim_cluster: Callable[..., SimCluster]) -> None:
    """A disconnect must abort the generation whatever the body size. With a body under 64 KiB it does (499
    at once); over uvicorn's HIGH_WATER_LIMIT the protocol's on_body pauses reading and HotCycle.read_body
    never resumes it, so the EOF is not seen: the generation runs to its end and counts as a 200."""
    cluster = sim_cluster(decode_args=SLOW)
    port = cluster.gateway_port
    for pad in (0, 70_000):
        before = counts(cluster)
        leave_after(port, long_whole(pad))
        after = wait_for(cluster, lambda c, b=before: c.get("499", 0) > b.get("499", 0), 2.0)
        assert after.get("499", 0) == before.get("499", 0) + 1, (pad, before, after)
        assert after.get("200", 0) == before.get("200", 0), (pad, before, after)
        wait_for(cluster, lambda c: c["active"] == 0, 10.0)


def test_client_leaving_with_a_request_pipelined_behind_a_whole_answer(
        sim_cluster: Callable[..., SimCluster]) -> None:
    """The answer being computed (not the newest request on its connection) must learn that its client
    left (http_protocol's doc: 'a disconnect reaches every unanswered cycle'). Reading is paused while a
    request is pipelined behind it, so the EOF is never read and the generation runs to its end."""
    cluster = sim_cluster(decode_args=SLOW)
    before = counts(cluster)
    leave_after(cluster.gateway_port, long_whole() + post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}))
    after = wait_for(cluster, lambda c: c.get("499", 0) > before.get("499", 0), 2.0)
    assert after["active"] == 0 and after.get("200", 0) == before.get("200", 0), (before, after)
    wait_for(cluster, lambda c: c["active"] == 0, 10.0)


def test_a_pipelined_request_whose_body_is_late_gets_408_like_a_lone_one(
        sim_cluster: Callable[..., SimCluster]) -> None:
    """A lone request whose body does not come within --body-timeout-s is answered 408. Pipelined behind a
    whole answer, on_response_complete arms the connection's 'body' timer for it (self.cycle is the newest
    cycle), which closes the connection first: no answer, and the request counts as 499."""
    cluster = sim_cluster(gateway_args=("--body-timeout-s", "2"))
    port = cluster.gateway_port
    late = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    lone, _ = talk(port, late, 1)
    assert [r[0] for r in lone] == [408]
    pipelined, raw = talk(port, post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}) + late, 2)
    assert [r[0] for r in pipelined] == [200, 408], raw[-300:]


def test_a_body_with_broken_chunk_framing_counts_as_the_400_it_is_answered(
        sim_cluster: Callable[..., SimCluster]) -> None:
    """The protocol answers 400 invalid_http; the cycle is told 'disconnected' and counts a 499."""
    cluster = sim_cluster()
    before = counts(cluster)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n"
    with socket.create_connection(("127.0.0.1", cluster.gateway_port), timeout=10) as sock:
        sock.sendall(head)
        time.sleep(0.3)
        sock.sendall(b"zz\r\n")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400 ")
    after = wait_for(cluster, lambda c: c != before, 2.0)
    assert after.get("499", 0) == before.get("499", 0), (before, after)
    assert after.get("400", 0) == before.get("400", 0) + 1, (before, after)


H2C = "Upgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"


def test_after_an_ignored_h2c_upgrade_a_close_request_with_bytes_behind_is_still_answered(
        sim_cluster: Callable[..., SimCluster]) -> None:
    """_feed re-creates the parser without uvicorn's lenient_data_after_close: bytes after a
    'Connection: close' request are then a parse error, _refuse disconnects every unanswered cycle and
    the client gets no answer at all, not even to the requests before. Without the h2c upgrade first,
    the same bytes get both answers."""
    cluster = sim_cluster()
    port = cluster.gateway_port
    first = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    close = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, {"Connection": "close"})
    behind = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    plain, _ = talk(port, first + close + behind, 3)
    assert [r[0] for r in plain] == [200, 200]
    upgraded = first.replace(b"Host: x\r\n", b"Host: x\r\n" + H2C.encode())
    answers, raw = talk(port, upgraded + close + behind, 3)
    assert [r[0] for r in answers] == [200, 200], raw



def test_client_leaving_with_a_get_pipelined_behind_a_stream_waiting_for_its_first_token(
        sim_cluster: Callable[..., SimCluster]) -> None:
    """A stream still waiting for its first token, with a ``GET`` pipelined behind it (a request for the ASGI app),
    must learn that its client left. uvicorn pauses reading when it queues an ASGI cycle; the stream's cycle had
    read its body before (its start is eager: in the callback that completed its body), so nothing resumed reading:
    the client's EOF went unseen until the first token's write failed, seconds later."""
    cluster = sim_cluster(prefill_args=("--engine-option", "prefill_token_s=0.15"))  # ~6 s to the first token
    before = counts(cluster)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4, "stream": True}).encode()
    stream = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
    leave_after(cluster.gateway_port, stream + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    after = wait_for(cluster, lambda c: c.get("499", 0) > before.get("499", 0), 3.0)
    assert after.get("499", 0) == before.get("499", 0) + 1, (before, after)
    assert after.get("200", 0) == before.get("200", 0), (before, after)
    wait_for(cluster, lambda c: c["active"] == 0, 10.0)
