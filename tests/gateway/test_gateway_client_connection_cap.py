"""The cap on the gateway's client connections (``gateway --max-client-connections``, ``gateway/http_connections.py``)
on real gateway and worker processes and raw sockets:

1. With the cap (8) held by silent clients and a flood of more, the gateway holds at most cap + probation slots of
   them (its open sockets counted in /proc), closes the excess, still answers its probes (``/health``,
   ``/readiness``, ``/metrics``) and refuses a completion 503 ``too_many_connections`` (OpenAI-shaped,
   ``Retry-After``); once the silent clients leave, it serves completions again.
2. At the cap, an idle kept-alive connection is closed to make room for a new one, whose completion (the
   gateway's own HTTP cycle) is served.
3. By default the cap is three quarters of ``ulimit -n``: a gateway whose open-file limit is small, flooded with more
   connections than that limit, still connects to a worker that starts meanwhile and becomes ready (without the
   cap, its descriptors are all taken by the flood).
4. A drain (SIGTERM) at the cap: the open stream runs to its end, the held connections are closed, the gateway
   exits.
5. ``--max-client-connections`` as applied: given, or derived from admission's limits, never over three quarters of
   ``ulimit -n``; a negative one is refused.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import httpx
import pytest
from pdtest import Procs, free_port, start_gateway, start_worker, wait_http_ok
from raw_http import HANG_GUARD_S, connect, flood_past_cap, is_closed, metric, metrics, once, request

from gateway import http_connections
from gateway.cli import CONNECTION_HEADROOM, client_connection_cap
from gateway.http_connections import PROBATION_SLOTS
from gateway.runtime import GatewayConfig

CAP = 8
COMPLETION = json.dumps({"model": "default", "prompt": "hello", "max_tokens": 3}).encode()


def _gateway_pid(procs: Procs, port: int) -> int:
    return next(p.pid for p in procs.procs if getattr(p, "name", "") == f"gateway-{port}")


def test_the_cap_holds_under_a_flood_and_the_probes_get_through(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim")
    port = start_gateway(procs, "--worker", worker.url, "--max-client-connections", str(CAP))
    pid = _gateway_pid(procs, port)
    held, flood = flood_past_cap(port, pid, CAP, PROBATION_SLOTS, "pd_gateway_client_connections")
    try:
        for probe in ("/health", "/readiness"):
            status, headers, body = once(port, "GET", probe)
            assert status == 200, (probe, body)
            assert headers["connection"] == "close"  # (a probation connection serves one probe)
        status, headers, body = once(port, "POST", "/v1/completions", COMPLETION)
        assert status == 503, body
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections" and error["type"] == "service_unavailable", error
        assert "--max-client-connections" in error["message"]
        assert headers["retry-after"] == "1" and headers["connection"] == "close"
        assert headers["content-type"] == "application/json"
        assert metric(metrics(port), "pd_gateway_client_connections_refused_total") >= 1
    finally:
        for sock in held + flood:
            sock.close()
    # The silent clients gone, the gateway serves completions again
    deadline = time.monotonic() + HANG_GUARD_S
    while metric(metrics(port), "pd_gateway_client_connections", slot="admitted") != 1:  # (the probe's own)
        assert time.monotonic() < deadline, "the closed connections were not released"
        time.sleep(0.05)
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=COMPLETION, timeout=HANG_GUARD_S,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3, reply.text


def test_at_the_cap_an_idle_keep_alive_connection_makes_room(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim")
    port = start_gateway(procs, "--worker", worker.url, "--max-client-connections", "2",
                         "--keep-alive-timeout-s", "600")
    with connect(port) as older, connect(port) as newer:
        assert request(older, "GET", "/health")[0] == 200
        assert request(newer, "GET", "/health")[0] == 200  # both idle now, kept alive: the cap is full
        with connect(port) as third:
            status, headers, body = request(third, "POST", "/v1/completions", COMPLETION)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3, body
        assert headers.get("connection") != "close"
        assert is_closed(older, HANG_GUARD_S)  # the one idle longest made room
        assert not is_closed(newer, 0.0)
        assert request(newer, "POST", "/v1/completions", COMPLETION)[0] == 200  # the other one still serves
    assert metric(metrics(port), "pd_gateway_client_connections_evicted_total") == 1


def test_a_flood_past_a_small_open_file_limit_leaves_room_to_reach_a_worker(procs: Procs) -> None:
    nofile = 256  # (the default cap: three quarters of it, 192)
    worker_port, port = free_port(), free_port()
    argv = ["gateway", "--worker", f"pd://127.0.0.1:{worker_port}", "--port", str(port), "--log-level", "warning",
            "--startup-timeout-s", "0", "--header-timeout-s", "120"]  # (the flood's silent sockets stay open)
    code = (f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile})); "
            f"sys.argv = {argv!r}; runpy.run_module('gateway.cli', run_name='__main__')")
    gateway = procs.start(f"gateway-{port}", "-c", code)
    wait_http_ok(f"http://127.0.0.1:{port}/health", 60, gateway)  # (up, not ready: its worker is not there yet)
    assert metric(metrics(port), "pd_gateway_client_connections_limit") == nofile * 3 // 4
    flood = [connect(port) for _ in range(nofile + 32)]  # silent, more than the gateway has descriptors
    try:
        worker = _start_worker_on(procs, worker_port)
        assert worker.poll() is None
        # The gateway connects to it (a new descriptor) and turns ready; its probes answer on probation
        deadline = time.monotonic() + 60
        while True:
            try:
                status = once(port, "GET", "/readiness")[0]
            except OSError:
                status = 0
            if status == 200:
                break
            assert time.monotonic() < deadline, "the flooded gateway did not reach its worker"
            assert gateway.poll() is None, procs.log(f"gateway-{port}")[-3000:]
            time.sleep(0.2)
        assert metric(metrics(port), "pd_gateway_client_connections", slot="admitted") == nofile * 3 // 4
    finally:
        for sock in flood:
            sock.close()
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=COMPLETION, timeout=HANG_GUARD_S,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text


def _start_worker_on(procs: Procs, native_port: int) -> subprocess.Popen[bytes]:
    http_port = free_port()
    proc = procs.start(f"both-{native_port}", "-m", "workers.cli", "--role", "both", "--engine", "sim", "--port",
                       str(native_port), "--http-port", str(http_port), "--log-level", "warning")
    wait_http_ok(f"http://127.0.0.1:{http_port}/health", 120, proc)
    return proc


def test_a_drain_at_the_cap_ends_the_stream_closes_the_held_connections_and_exits(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim", "--engine-option", "decode_step_s=0.05")
    port = start_gateway(procs, "--worker", worker.url, "--max-client-connections", "4", "--drain-timeout-s", "120",
                         "--keep-alive-timeout-s", "120", "--header-timeout-s", "120")
    gateway = next(p for p in procs.procs if getattr(p, "name", "") == f"gateway-{port}")
    stream = connect(port)  # admitted first: the stream's
    body = json.dumps({"model": "default", "prompt": "hello", "max_tokens": 40, "stream": True}).encode()
    stream.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                   b"content-length: %d\r\n\r\n%s" % (len(body), body))
    received = stream.recv(65536)
    assert received.startswith(b"HTTP/1.1 200"), received
    held = [connect(port) for _ in range(3)]  # silent, admitted: the cap is full
    probation = [connect(port) for _ in range(PROBATION_SLOTS)]
    try:
        assert metric(metrics(port), "pd_gateway_client_connections", slot="admitted") == 4
        gateway.send_signal(signal.SIGTERM)
        while b"data: [DONE]" not in received:  # the stream runs to its end
            chunk = stream.recv(65536)
            assert chunk, f"the stream was cut: {received[-500:]!r}"
            received += chunk
        assert b'"finish_reason":"length"' in received
        assert gateway.wait(HANG_GUARD_S) in (0, -signal.SIGTERM), "the gateway did not exit after its drain"
        assert all(is_closed(sock, HANG_GUARD_S) for sock in [stream, *held])
    finally:
        for sock in [stream, *held, *probation]:
            sock.close()


def test_the_cap_as_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_connections.resource, "getrlimit", lambda _: (4096, 4096))
    workers = ("pd://127.0.0.1:1",)
    assert client_connection_cap(GatewayConfig(worker=workers)) == 3072  # (no concurrency limit: 3/4 of 4096)
    assert client_connection_cap(GatewayConfig(worker=workers, max_concurrent_requests=64, max_queued_requests=100)) \
        == 64 + 100 + CONNECTION_HEADROOM
    assert client_connection_cap(GatewayConfig(worker=workers, max_client_connections=100)) == 100
    assert client_connection_cap(GatewayConfig(worker=workers, max_client_connections=5000)) == 3072
    with pytest.raises(ValueError, match="max_client_connections"):
        GatewayConfig(worker=workers, max_client_connections=-1)
