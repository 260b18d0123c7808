"""HTTP abuse at the transport level, against a real gateway (and a worker's HTTP port): huge bodies and
heads, slow bodies and heads, silent connections, bytes that are not HTTP, clients that leave mid-body.

Each is a clear 4xx with an OpenAI-shaped JSON body (or the connection ends, where nobody is left to
answer), the gateway's memory stays bounded (a 50 MB body is refused without being buffered), and the
gateway keeps serving everyone else meanwhile and afterwards. Body-level abuse (invalid UTF-8, deep
nesting, wrong JSON types) is in tests/integration/test_api_hygiene.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
from pdtest import SimCluster
from raw_http import read_to_close

HEAD_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 5.0
LIMITS = ("--header-timeout-s", str(HEAD_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S))
BIG = 50 * 1024 * 1024
GENEROUS_S = 30.0  # no test waits on a server timer for longer than this


def rss_peak_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):  # the most the process has ever held
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def gateway_pid(cluster: SimCluster) -> int:
    return next(p.pid for p in cluster.procs.procs if p.name.startswith("gateway"))  # type: ignore[attr-defined]


def exchange(port: int, chunks: list[bytes], *, pause_s: float = 0.0, timeout_s: float = GENEROUS_S) -> bytes:
    """Send ``chunks`` (``pause_s`` apart, stopping if the server closes), then read until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except OSError:
                break
            time.sleep(pause_s)
        return read_to_close(sock)


def status_and_error(response: bytes) -> tuple[int, dict[str, object]]:
    """The status and OpenAI ``error`` object of a raw JSON error response."""
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert isinstance(error["message"], str) and error["message"] and error["type"], error
    return int(response[9:12]), error


def gone(cluster: SimCluster) -> float:
    """Completions the gateway counted as 499 (the client left)."""
    for line in httpx.get(f"{cluster.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith('pd_gateway_requests_total{route="completions",status="499"}'):
            return float(line.rpartition(" ")[2])
    return 0.0


def serves(cluster: SimCluster) -> None:
    r = httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": "still here?", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text


def chunks_of(total: int, size: int = 1024 * 1024) -> Iterator[bytes]:
    block = b"x" * size
    for _ in range(total // size):
        yield block


def test_huge_bodies_and_heads_are_refused_in_bounded_memory(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster(gateway_args=LIMITS)
    pid = gateway_pid(cluster)
    serves(cluster)
    peak = rss_peak_bytes(pid)
    with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
        for path in ("/v1/chat/completions", "/v1/completions", "/generate", "/workers"):
            declared = http.post(path, content=b"x" * BIG)  # Content-Length: refused before reading
            chunked = http.post(path, content=chunks_of(BIG))  # no length: refused once past the limit
            for r in (declared, chunked):
                assert r.status_code == 413, (path, r.status_code, r.text[:200])
                assert r.json()["error"]["type"] == "invalid_request_error"
        serves(cluster)
    start = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
    heads = [
        [start + b"x-big: ", *(b"a" * 65536 for _ in range(160))],  # one 10 MB header, sent in pieces
        [start, *(b"x-h%d: v\r\n" % i for i in range(20000))],  # many small ones
        [b"GET /health?" + b"q" * (2 * 1024 * 1024) + b" HTTP/1.1\r\n"],  # a 2 MB request line
    ]
    for chunks in heads:
        status, error = status_and_error(exchange(cluster.gateway_port, chunks))
        assert status == 431 and "request head exceeds" in str(error["message"]), error
    # A whole head over the limit (64 KiB) in one send, so most likely in one read (such a head was let through)
    body = b'{"prompt": "hi", "max_tokens": 2}'
    for head in (b"GET /v1/models HTTP/1.1\r\nhost: x\r\n", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)):
        for size, want in ((70_000, 431), (60_000, 200)):
            request = head + b"x-big: " + b"a" * size + b"\r\nconnection: close\r\n\r\n"
            request += body if head.startswith(b"POST") else b""
            response = exchange(cluster.gateway_port, [request])
            assert response.startswith(b"HTTP/1.1 %d" % want), (head[:20], size, response[:300])
    # ... and over the limit in two reads neither of which is (the last read of a head was not counted), also
    # behind a pipelined request (a read that ends a request is not counted either)
    ok = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    big = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 100_000 + b"\r\nconnection: close\r\n\r\n"
    for parts in ([big[:50_000], big[50_000:]], [ok + big[:40_000], big[40_000:80_000], big[80_000:]]):
        response = exchange(cluster.gateway_port, parts, pause_s=0.3)
        assert b"HTTP/1.1 431" in response and b"HTTP/1.1 200 OK\r\n" * (len(parts) - 2) in response, \
            response[:300]
    grown = rss_peak_bytes(pid) - peak
    assert grown < 32 * 1024 * 1024, f"the gateway's peak memory grew by {grown / 2**20:.0f} MiB"
    serves(cluster)
    # the worker's HTTP port has the same limit on heads
    worker = cluster.decodes[0]
    status, _ = status_and_error(exchange(worker.http_port, [b"GET /health HTTP/1.1\r\nx-big: " + b"a" * 300_000]))
    assert status == 431
    assert worker.get("/health") == {"status": "ok", "role": "decode"}


def test_slow_heads_and_bodies_are_cut_off_while_others_are_served(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster(gateway_args=LIMITS)
    port = cluster.gateway_port
    answers: dict[str, bytes] = {}

    def client(name: str, chunks: list[bytes], pause_s: float) -> None:
        answers[name] = exchange(port, chunks, pause_s=pause_s)

    head = b"GET /health HTTP/1.1\r\nhost: x\r\n"
    slow = [head[i:i + 2] for i in range(0, len(head), 2)]  # two bytes at a time, never the final blank line
    threads = [threading.Thread(target=client, args=(f"silent-{i}", [], 0.0)) for i in range(20)]
    threads += [threading.Thread(target=client, args=(f"slow-{i}", slow, 0.2)) for i in range(5)]
    for t in threads:
        t.start()
    for _ in range(3):
        serves(cluster)  # while 25 connections hold back their heads
    for t in threads:
        t.join(GENEROUS_S)
        assert not t.is_alive(), "the gateway kept a connection that never sent its head"
    for name, answer in answers.items():
        status, error = status_and_error(answer)
        assert status == 408 and "head did not arrive" in str(error["message"]), (name, error)
    # A 413 is answered at once from Content-Length; a client that then goes on sending the body slowly is
    # disconnected after --body-timeout-s (the gateway used to read and discard it as long as it came).
    refused = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n" % BIG)
    with socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S) as sock:
        sock.sendall(refused)
        got = b""
        while b"\r\n\r\n" not in got or not got.endswith(b"}"):
            got += sock.recv(65536)
        assert status_and_error(got)[0] == 413
        deadline = time.monotonic() + GENEROUS_S
        closed = False
        while not closed and time.monotonic() < deadline:
            try:
                sock.sendall(b"x" * 100)
                sock.settimeout(0.2)
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
        assert closed, "the gateway kept reading a refused body"
    serves(cluster)


def test_slow_body_is_408_and_frees_its_slot(sim_cluster: Callable[..., SimCluster]) -> None:
    """With one request at a time, a client dribbling its body holds the slot only until --body-timeout-s."""
    cluster = sim_cluster(gateway_args=(*LIMITS, "--max-concurrent-requests", "1"))
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n"
    answer: list[bytes] = []
    slow = threading.Thread(target=lambda: answer.append(exchange(cluster.gateway_port, [head] + [b" "] * 100,
                                                                  pause_s=0.1)))
    slow.start()
    time.sleep(0.3)  # (let it take the slot first; the test holds either way)
    serves(cluster)  # queued behind the slow body, then served
    slow.join(GENEROUS_S)
    assert not slow.is_alive()
    status, error = status_and_error(answer[0])
    assert status == 408 and "body did not arrive" in str(error["message"]), error
    assert b"connection: close" in answer[0].lower()


def test_not_http_clients_leaving_mid_body_and_wrong_methods(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster(gateway_args=LIMITS)
    port = cluster.gateway_port
    for garbage in (b"\x00\x01\x02\x03 hello\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"):
        status, _ = status_and_error(exchange(port, [garbage]))
        assert status == 400
    # a client leaving mid-body is counted as 499 (it used to be logged as an internal error, a 500)
    before = gone(cluster)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"prompt\""
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(head)
            time.sleep(0.1)
    deadline = time.monotonic() + GENEROUS_S
    while gone(cluster) < before + 3:
        assert time.monotonic() < deadline, httpx.get(f"{cluster.base_url}/metrics").text
        time.sleep(0.1)
    assert 'status="500"' not in httpx.get(f"{cluster.base_url}/metrics").text
    serves(cluster)
    # 405 names the allowed methods (Allow), on the raw generation routes and Starlette's alike
    with httpx.Client(base_url=cluster.base_url, timeout=30) as http:
        for method, path, allowed in (("GET", "/v1/chat/completions", {"POST"}), ("PUT", "/generate", {"POST"}),
                                      ("PATCH", "/workers", {"GET", "HEAD", "POST", "DELETE"}),
                                      ("POST", "/health", {"GET", "HEAD"}), ("DELETE", "/v1/models", {"GET", "HEAD"})):
            r = http.request(method, path)
            assert r.status_code == 405, (method, path, r.text)
            assert {m.strip() for m in r.headers["allow"].split(",")} == allowed, (method, path, r.headers)
            assert r.json()["error"]["type"] == "invalid_request_error"
    log = cluster.procs.log(f"gateway-{port}")
    assert "Traceback" not in log, log[-3000:]


def test_keep_alive_timeout_closes_idle_connections_only(sim_cluster: Callable[..., SimCluster]) -> None:
    """``--keep-alive-timeout-s``: a connection idle between requests for longer is closed, on the
    generation routes (the gateway's own cycle) and the others (uvicorn's ASGI cycle) alike; one whose
    requests keep coming, or whose stream outlasts the timeout, is not."""
    keep_alive_s = 0.6
    cluster = sim_cluster(gateway_args=(*LIMITS, "--keep-alive-timeout-s", str(keep_alive_s)),
                          decode_args=("--engine-option", "decode_step_s=0.2"))
    completion = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    stream = json.dumps({"prompt": "hi", "max_tokens": 8, "stream": True}).encode()  # ~1.6 s: past the timeout
    requests = {
        "completion": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%b" % (len(completion), completion),
        "stream": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%b" % (len(stream), stream),
        "health": b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n",
    }

    def answer(sock: socket.socket, name: str) -> None:
        sock.sendall(requests[name])
        got = b""
        end = b"0\r\n\r\n" if name == "stream" else b"}"
        while not (b"\r\n\r\n" in got and got.endswith(end)):
            data = sock.recv(65536)
            assert data, f"{name}: the connection closed before the answer was complete: {got[-200:]!r}"
            got += data
        assert got.startswith(b"HTTP/1.1 200"), got[:200]

    def closed_within(sock: socket.socket, limit_s: float) -> float:
        """Seconds until the server closed ``sock`` (fails past ``limit_s``)."""
        start = time.monotonic()
        sock.settimeout(limit_s)
        try:
            assert sock.recv(1) == b"", "the server sent something unasked"
        except ConnectionResetError:
            pass
        except TimeoutError:
            raise AssertionError(f"an idle connection was kept for over {limit_s}s") from None
        return time.monotonic() - start

    for name in requests:
        with socket.create_connection(("127.0.0.1", cluster.gateway_port), timeout=GENEROUS_S) as sock:
            started = time.monotonic()
            for _ in range(4):  # requests 0.4 s apart over 1.6 s: each gap shorter than the timeout
                answer(sock, name)
                time.sleep(0.4)
            sock.settimeout(GENEROUS_S)
            answer(sock, name)  # still open, though it has lived for more than twice the timeout
            assert time.monotonic() - started > 2 * keep_alive_s
            idle_s = closed_within(sock, GENEROUS_S)
            assert keep_alive_s * 0.8 <= idle_s, (name, idle_s)
    serves(cluster)
