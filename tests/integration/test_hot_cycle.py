"""The generation routes on the gateway's own HTTP cycle (gateway/hot_cycle.py), at the byte level, against
a real gateway over sim workers: HTTP/1.1 as a client may speak it (pipelining, ``Expect: 100-continue``,
chunked request bodies, HTTP/1.0), request ids and the gatekeeper's refusals on these routes, and streams
whose middle chunks are written from the worker connection's callback arriving whole and in order.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httptools
from pdtest import SimCluster
from sim_reference import expected_tokens, text_of

PROMPT = [ord(c) for c in "Hot cycle: the gateway answers on its own."]
TIMEOUT_S = 30.0


class _Responses:
    """Responses parsed off one connection, in order: (status, headers, body)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[tuple[int, dict[str, str], bytes]] = []
        self._headers: dict[str, str] = {}
        self._body = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), self._headers, self._body))
        self._headers, self._body = {}, b""


def talk(port: int, data: bytes, num_responses: int, *, then: bytes = b"") -> tuple[list[Any], bytes]:
    """Send ``data`` (and ``then`` once something came back), read ``num_responses`` responses (or until the
    server closes); returns them and every byte read."""
    raw = b""
    parsed = _Responses()
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(data)
        while len(parsed.done) < num_responses:
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
            if then and b"100 Continue" in raw:
                sock.sendall(then)
                then = b""
                raw = raw.split(b"\r\n\r\n", 1)[1]  # the interim response is not one of ours to parse
                chunk = raw
            parsed.parser.feed_data(chunk)
    return parsed.done, raw


def post(path: str, body: dict[str, Any], headers: dict[str, str] | None = None, version: str = "1.1") -> bytes:
    data = json.dumps(body).encode()
    head = [f"POST {path} HTTP/{version}", "Host: x", "Content-Type: application/json",
            f"Content-Length: {len(data)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


def sse_text(body: bytes, key: str) -> str:
    events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    text = ""
    for event in events[:-1]:
        choice = json.loads(event)["choices"][0]
        text += (choice["delta"].get("content") or "") if key == "delta" else choice["text"]
    return text


def test_pipelined_requests_ids_and_refusals(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster(gateway_args=("--api-key", "sekret"))
    port, auth = cluster.gateway_port, {"Authorization": "Bearer sekret"}
    want = text_of(expected_tokens(PROMPT, 24))
    # Three requests in one write: answered in order, each whole, each with its own id.
    data = b"".join([
        post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24}, {**auth, "X-Request-Id": "first"}),
        post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "stream": True}, {**auth, "X-Request-Id": "2nd"}),
        post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
             {**auth, "X-Request-Id": "third"}),
    ])
    (first, second, third), _ = talk(port, data, 3)
    assert [r[0] for r in (first, second, third)] == [200, 200, 200]
    assert [r[1]["x-request-id"] for r in (first, second, third)] == ["first", "2nd", "third"]
    assert json.loads(first[2])["choices"][0]["text"] == want
    assert second[1]["content-type"].startswith("text/event-stream") and second[1]["transfer-encoding"] == "chunked"
    assert sse_text(second[2], "text") == want
    assert json.loads(third[2])["usage"]["completion_tokens"] == 5

    # The gatekeeper's refusal on a generation route: 401 naming the key, an id, the connection kept.
    (refused, again), _ = talk(port, post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}) +
                               post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, auth), 2)
    assert refused[0] == 401 and refused[1]["www-authenticate"] == "Bearer"
    assert json.loads(refused[2])["error"]["code"] == "invalid_api_key" and len(refused[1]["x-request-id"]) == 32
    assert again[0] == 200

    # A bad body is the responder's 400, on this cycle as on the ASGI one.
    ((bad_status, _, bad_body),), _ = talk(port, post("/v1/chat/completions", {"messages": "nope"}, auth), 1)
    assert bad_status == 400 and json.loads(bad_body)["error"]["param"] == "messages"
    cluster.wait_pools_full()


def test_continue_chunked_bodies_and_http_1_0(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster()
    port = cluster.gateway_port
    want = text_of(expected_tokens(PROMPT, 8))
    body = json.dumps({"prompt": PROMPT, "max_tokens": 8}).encode()

    # Expect: 100-continue: the body is sent only after the interim response.
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n").encode()
    ((status, _, answer),), _ = talk(port, head, 1, then=body)
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == want
    # Refused before the body was asked for: the client may never send it, so the connection closes
    # (kept open, the client's next request would be read as that body).
    too_large = head.replace(b"Content-Length: %d" % len(body), b"Content-Length: 10000000")
    (refused,), _ = talk(port, too_large, 2)  # (2: read until the server closes)
    assert refused[0] == 413 and refused[1]["connection"] == "close", refused

    # A chunked request body, in three chunks.
    parts = [body[:5], body[5:20], body[20:]]
    chunked = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    ((status, _, answer),), _ = talk(port, head + chunked, 1)
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == want

    # HTTP/1.0: the answer says it closes, and it does (the read ends without a timeout).
    ((status, headers, answer),), _ = talk(port, post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8},
                                                       version="1.0"), 2)
    assert status == 200 and headers["connection"] == "close" and json.loads(answer)["choices"][0]["text"] == want
    # An HTTP/1.0 client cannot read chunked framing: its stream is the events as they are, ending when
    # the connection closes.
    _, raw = talk(port, post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "stream": True},
                             version="1.0"), 1)
    head, _, events = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower(), head
    assert b"connection: close" in head.lower() and events.startswith(b"data: {"), raw[:300]
    assert sse_text(events, "text") == want
    cluster.wait_pools_full()


def test_many_concurrent_streams_arrive_whole_and_in_order(sim_cluster: Callable[..., SimCluster]) -> None:
    """Middle chunks go from the worker connection's callback straight to each client's socket: with 16 streams
    sharing one decode's frames, every stream is exactly the reference text, with one [DONE]."""
    cluster = sim_cluster()
    port = cluster.gateway_port
    want = text_of(expected_tokens(PROMPT, 48))
    socks = [socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) for _ in range(16)]
    try:
        for sock in socks:
            sock.sendall(post("/v1/completions", {"prompt": PROMPT, "max_tokens": 48, "stream": True}))
        for sock in socks:
            parsed = _Responses()
            while not parsed.done:
                chunk = sock.recv(65536)
                assert chunk, "the gateway closed a stream early"
                parsed.parser.feed_data(chunk)
            status, _, body = parsed.done[0]
            assert status == 200 and sse_text(body, "text") == want
            assert body.count(b"data: [DONE]") == 1
    finally:
        for sock in socks:
            sock.close()
    cluster.wait_pools_full()


def test_a_client_leaving_mid_stream_with_a_request_pipelined_behind(sim_cluster: Callable[..., SimCluster]) -> None:
    """The stream being answered (not the newest request on its connection) learns that its client left:
    its generation is aborted (499, pages back) and the worker connections, whose callback writes the
    stream's chunks, are unharmed: the next requests are served."""
    cluster = sim_cluster(decode_args=("--engine-option", "decode_step_s=0.01"))  # 200 tokens: 2 s at least
    port = cluster.gateway_port
    before = gone_499(cluster)
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(post("/v1/completions", {"prompt": PROMPT, "max_tokens": 200, "stream": True}) +
                     post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}))
        seen = b""
        while seen.count(b"data: ") < 5:  # the stream is flowing
            chunk = sock.recv(65536)
            assert chunk, seen
            seen += chunk
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
    deadline_s = time.monotonic() + TIMEOUT_S
    while gone_499(cluster) < before + 1:
        assert time.monotonic() < deadline_s, "the stream's request was not ended as 499"
        time.sleep(0.1)
    for _ in range(3):
        ((status, _, answer),), _ = talk(port, post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8}), 1)
        assert status == 200 and json.loads(answer)["choices"][0]["text"] == text_of(expected_tokens(PROMPT, 8))
    cluster.wait_pools_full()


def test_garbage_pipelined_behind_a_stream_closes_only_that_connection(
        sim_cluster: Callable[..., SimCluster]) -> None:
    """Bytes that are not HTTP, pipelined behind a stream still going out: that connection is closed (the
    400 cannot go in the middle of the stream), and nothing else is harmed. (The 400 was written into the
    stream and the connection half-closed; the stream's next chunk, written from the decode connection's
    callback, raised there and dropped the gateway's connection to the decode: every other stream on it
    failed.)"""
    import threading

    cluster = sim_cluster(decode_args=("--engine-option", "decode_step_s=0.01"))  # 150 tokens: 1.5 s at least
    port = cluster.gateway_port
    bystander: list[Any] = []
    thread = threading.Thread(target=lambda: bystander.append(
        talk(port, post("/v1/completions", {"prompt": PROMPT, "max_tokens": 150, "stream": True}), 1)))
    thread.start()
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(post("/v1/completions", {"prompt": PROMPT, "max_tokens": 150, "stream": True}))
        seen = b""
        while seen.count(b"data: ") < 5:  # the stream is flowing
            chunk = sock.recv(65536)
            assert chunk, seen
            seen += chunk
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n\x00\x01 not http\r\n\r\n")
        try:
            while chunk := sock.recv(65536):
                seen += chunk
        except OSError:
            pass
    assert b"HTTP/1.1 400" not in seen, "a refusal written into the middle of a stream"
    # Nor is it sent while an earlier request is still unanswered: the client would read it as that answer.
    whole = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 50})
    answers, raw = talk(port, whole + b"\x00\x01 not http\r\n\r\n", 1)
    assert answers == [] and b"HTTP/1.1 400" not in raw, raw[:200]
    thread.join(TIMEOUT_S)
    ((status, _, body),), _ = bystander[0]
    assert status == 200 and sse_text(body, "text") == text_of(expected_tokens(PROMPT, 150)), body[-300:]
    ((status, _, answer),), _ = talk(port, post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8}), 1)
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == text_of(expected_tokens(PROMPT, 8))
    assert "lost connection" not in cluster.procs.log(next(
        n for n in (p.name for p in cluster.procs.procs) if n.startswith("gateway")))
    cluster.wait_pools_full()


def test_a_large_body_is_not_counted_as_the_next_pipelined_head(sim_cluster: Callable[..., SimCluster]) -> None:
    """A read holding a request's 70 KB body and the start of the next request's head: only the head's own
    bytes count against --max-header-bytes (64 KiB), so both are answered (the whole read was counted:
    431, and the first request's answer was lost)."""
    cluster = sim_cluster()
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    first = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "user": "x" * 70_000})
    parsed = _Responses()
    with socket.create_connection(("127.0.0.1", cluster.gateway_port), timeout=TIMEOUT_S) as sock:
        sock.sendall(first + health[:10])
        time.sleep(0.3)  # (two reads: the second head's start comes with the first request's body)
        sock.sendall(health[10:])
        while len(parsed.done) < 2 and (chunk := sock.recv(65536)):
            parsed.parser.feed_data(chunk)
    assert [status for status, _, _ in parsed.done] == [200, 200], parsed.done
    # ...while a head over the limit is refused, also one sent whole on a fresh connection (larger than a
    # read: the limit holds to within one read)
    huge = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 600_000 + b"\r\n\r\n"
    ((status, _, _),), _ = talk(cluster.gateway_port, huge, 1)
    assert status == 431


def test_a_body_declared_too_large_is_a_413_without_queueing(sim_cluster: Callable[..., SimCluster]) -> None:
    """A Content-Length over --max-body-bytes is a 413 at once, also while every admission slot is taken (it
    waited for a slot in the queue, then got the queue's 429: a client told to retry what can never pass)."""
    import threading

    cluster = sim_cluster(decode_args=("--engine-option", "decode_step_s=0.01"),
                          gateway_args=("--max-concurrent-requests", "1", "--max-queued-requests", "1",
                                        "--queue-timeout-s", "1", "--max-body-bytes", "4096"))
    port = cluster.gateway_port
    busy = threading.Thread(target=talk, args=(  # (300 tokens: 3 s at least, longer than the queue's wait)
        port, post("/v1/completions", {"prompt": PROMPT, "max_tokens": 300, "stream": True}), 1))
    busy.start()
    time.sleep(0.5)  # (the one slot is taken)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    ((status, _, body),), _ = talk(port, head + b"Content-Length: 10000000\r\n\r\n", 1)
    assert status == 413 and "exceeds 4096 bytes" in json.loads(body)["error"]["message"], (status, body)
    busy.join(TIMEOUT_S)
    cluster.wait_pools_full()


def gone_499(cluster: SimCluster) -> float:
    reply = talk(cluster.gateway_port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 1)[0][0][2].decode()
    for line in reply.splitlines():
        if line.startswith('pd_gateway_requests_total{route="completions",status="499"}'):
            return float(line.rpartition(" ")[2])
    return 0.0


def test_bodies_prepared_on_a_thread_answer_as_on_the_loop(sim_cluster: Callable[..., SimCluster]) -> None:
    """``--prepare-thread-bytes`` low enough that every generation request here is prepared on a thread
    (a stream's first step included, which starts in the read's callback): pipelined whole and streamed
    answers are the reference text, in order, a bad body is its 400 and an unknown model its 404."""
    cluster = sim_cluster(gateway_args=("--prepare-thread-bytes", "64"))
    port = cluster.gateway_port
    want = text_of(expected_tokens(PROMPT, 24))
    data = b"".join([
        post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "stream": True}, {"X-Request-Id": "s"}),
        post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24}, {"X-Request-Id": "w"}),
        post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 40}], "max_tokens": 5}),
        post("/v1/chat/completions", {"messages": [{"role": "nobody", "content": "hi " * 40}]}),
        post("/v1/completions", {"model": "not-this-one", "prompt": PROMPT, "max_tokens": 2}),
    ])
    responses, _ = talk(port, data, 5)
    assert [r[0] for r in responses] == [200, 200, 200, 400, 404]
    stream, whole, chat, bad, unknown = responses
    assert [stream[1]["x-request-id"], whole[1]["x-request-id"]] == ["s", "w"]
    assert sse_text(stream[2], "text") == want and json.loads(whole[2])["choices"][0]["text"] == want
    assert json.loads(chat[2])["usage"]["completion_tokens"] == 5
    assert json.loads(bad[2])["error"]["param"] == "messages[0].role"
    assert json.loads(unknown[2])["error"]["code"] == "model_not_found"
    cluster.wait_pools_full()


UPGRADE_H2C = {"Connection": "Upgrade, HTTP2-Settings", "Upgrade": "h2c", "HTTP2-Settings": "AAMAAABkAARAAAAAAAIAAAAA"}


def test_an_upgrade_the_gateway_does_not_speak_is_served_as_http_1_1(sim_cluster: Callable[..., SimCluster]) -> None:
    """``Upgrade: h2c`` (``curl --http2``, several Java clients by default): the server may ignore it and must
    then serve the request as HTTP/1.1 (RFC 9110 7.8), its body included; httptools stops at the end of such
    a head, so the gateway read these bodies as empty (400) and the bytes after them as a new request."""
    cluster = sim_cluster()
    port = cluster.gateway_port
    want = text_of(expected_tokens(PROMPT, 6))
    body = json.dumps({"prompt": PROMPT, "max_tokens": 6}).encode()
    chunked_body = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in (body[:7], body[7:])) + b"0\r\n\r\n"
    upgrade = "".join(f"{k}: {v}\r\n" for k, v in UPGRADE_H2C.items()).encode()
    data = b"".join([
        post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6}, UPGRADE_H2C),  # Content-Length
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n%b\r\n%b" % (upgrade, chunked_body),
        b"GET /health HTTP/1.1\r\nHost: x\r\n" + upgrade + b"\r\n",
        post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "stream": True}),  # and one without
    ])
    responses, raw = talk(port, data, 4)
    assert b"101 Switching" not in raw
    assert [r[0] for r in responses] == [200, 200, 200, 200], responses
    assert [json.loads(r[2])["choices"][0]["text"] for r in responses[:2]] == [want, want]
    assert json.loads(responses[2][2])["status"] in ("ok", "degraded")
    assert sse_text(responses[3][2], "text") == want

    # The body in a write of its own after the head (as Ktor sends it): still this request's.
    head, _, rest = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6}, UPGRADE_H2C).partition(b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(head + b"\r\n\r\n")
        time.sleep(0.3)
        sock.sendall(rest)
        parsed, got = _Responses(), b""
        while not parsed.done:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
            parsed.parser.feed_data(chunk)
    ((status, _, answer),) = parsed.done
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == want, answer
    cluster.wait_pools_full()


def test_an_http_1_0_client_expecting_100_continue_gets_no_interim_response(
        sim_cluster: Callable[..., SimCluster]) -> None:
    """HTTP/1.0 has no interim responses: its ``Expect: 100-continue`` is ignored (RFC 9110 10.1.1), on the
    generation routes (the gateway's own cycle) and on the others (uvicorn's)."""
    cluster = sim_cluster()
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode()
    for path in ("/v1/completions", "/workers"):  # (the gateway's own cycle; uvicorn's, reading the body)
        head = (f"POST {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n").encode()
        _, raw = talk(cluster.gateway_port, head + body, 2)  # (read until it closes)
        assert raw.startswith(b"HTTP/1.1 ") and b"100 Continue" not in raw, raw[:200]
        assert not raw.startswith(b"HTTP/1.1 5"), raw[:300]
