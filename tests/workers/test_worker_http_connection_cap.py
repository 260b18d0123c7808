"""The cap on a worker's HTTP connections (``pd-worker --max-http-connections``, ``workers/http_connections.py``)
and the bound on its idle keep-alive connections (``--http-keep-alive-timeout-s``), on real worker processes and
raw sockets:

1. With the cap (8) held by silent clients and a flood of more, the worker holds at most cap + probation slots of
   them (its open sockets counted in /proc), closes the excess, still answers its probes (``/health``,
   ``/metrics``) and refuses other requests 503 ``too_many_connections`` (OpenAI-shaped, ``Retry-After``); a
   gateway still serves completions over the native port meanwhile; once the silent clients leave, the HTTP
   side serves ``/generate`` again.
2. At the cap, an idle kept-alive connection is closed to make room for a new one (which is served).
3. An idle kept-alive connection is closed after ``--http-keep-alive-timeout-s``.
4. ``ConnectionCap.admit`` with every probation slot serving a probe refuses at once; bad settings are refused.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from pdtest import Procs, start_gateway, start_worker
from raw_http import HANG_GUARD_S, connect, flood_past_cap, is_closed, metric, metrics, once, request

from gateway import http_connections as shared_connections  # (the cap's logic, shared with the gateway's)
from workers import http_connections
from workers.config import ConfigError, WorkerConfig
from workers.http_connections import PROBATION_SLOTS, ConnectionCap, fitted_cap

CAP = 8


GENERATE = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 3}}).encode()


def test_the_cap_holds_under_a_flood_and_probes_and_the_native_port_get_through(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim", "--max-http-connections", str(CAP))
    port, pid = worker.http_port, worker.proc.pid
    held, flood = flood_past_cap(port, pid, CAP, PROBATION_SLOTS, "pd_worker_http_connections")
    try:
        status, headers, body = once(port, "GET", "/health")
        assert status == 200 and json.loads(body)["status"] == "ok", body
        assert headers["connection"] == "close"  # (a probation connection serves one probe)
        status, _, body = once(port, "GET", "/get_load")  # (an SGLang router's poll: answered too)
        assert status == 200, body
        status, headers, body = once(port, "POST", "/generate", GENERATE)
        assert status == 503, body
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections" and error["type"] == "service_unavailable", error
        assert "--max-http-connections" in error["message"]
        assert headers["retry-after"] == "1" and headers["connection"] == "close"
        assert headers["content-type"] == "application/json"
        refused = metric(metrics(port), "pd_worker_http_connections_refused_total")
        assert refused >= 1

        # The native protocol (the gateway's path to the worker) is not behind the HTTP cap
        gateway = start_gateway(procs, "--worker", worker.url)
        reply = httpx.post(f"http://127.0.0.1:{gateway}/v1/completions", timeout=HANG_GUARD_S,
                           json={"model": "default", "prompt": "hello", "max_tokens": 3})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3, reply.text
    finally:
        for sock in held + flood:
            sock.close()
    # The silent clients gone, the HTTP side serves generations again
    deadline = time.monotonic() + HANG_GUARD_S
    while metric(metrics(port), "pd_worker_http_connections", slot="admitted") != 1:  # (the probe's own)
        assert time.monotonic() < deadline, "the closed connections were not released"
        time.sleep(0.05)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD_S) as client:
        assert client.get("/health").status_code == 200
        reply = client.post("/generate", content=GENERATE, headers={"content-type": "application/json"})
        assert reply.status_code == 200 and len(reply.json()["output_ids"]) == 3, reply.text


def test_at_the_cap_an_idle_keep_alive_connection_makes_room(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim", "--max-http-connections", "2",
                          "--http-keep-alive-timeout-s", "600")
    port = worker.http_port
    with connect(port) as older, connect(port) as newer:
        assert request(older, "GET", "/health")[0] == 200
        assert request(newer, "GET", "/health")[0] == 200  # both idle now, kept alive: the cap is full
        third = connect(port)
        status, headers, body = request(third, "POST", "/generate", GENERATE)
        third.close()
        assert status == 200 and len(json.loads(body)["output_ids"]) == 3, body
        assert headers.get("connection") != "close"
        assert is_closed(older, HANG_GUARD_S)  # the one idle longest made room
        assert not is_closed(newer, 0.0)
        assert request(newer, "GET", "/liveness")[0] == 200  # the other one still serves
    assert metric(metrics(port), "pd_worker_http_connections_evicted_total") == 1


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim", "--http-keep-alive-timeout-s", "0.5")
    with connect(worker.http_port) as sock:
        status, headers, _ = request(sock, "GET", "/health")
        assert status == 200 and headers.get("connection") != "close"
        assert is_closed(sock, HANG_GUARD_S)


@dataclass(eq=False)
class _Conn:
    """What ``ConnectionCap`` reads of a connection."""

    is_idle: bool = False
    idle_deadline: float = 0.0
    is_waiting_or_refused: bool = False
    is_refused: bool = False
    closed: list[bool] = field(default_factory=list)
    answered: list[bool] = field(default_factory=list)

    def _answer_busy(self, *, linger: bool) -> None:  # (the 503, then the close)
        self.answered.append(linger)
        self.closed.append(True)

    @property
    def transport(self) -> Any:
        conn = self

        class _Transport:
            def close(self) -> None:
                conn.closed.append(True)

        return _Transport()


def test_every_probation_slot_serving_a_probe_refuses_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_connections, "IDLE_SCAN_INTERVAL_S", 0.0)  # (each admission looks for an idle one)
    cap = ConnectionCap(1)
    busy = _Conn()
    assert cap.admit(busy) == "admitted"  # type: ignore[arg-type]
    probes = [_Conn() for _ in range(PROBATION_SLOTS)]  # each serving a probe: not to be closed
    assert [cap.admit(c) for c in probes] == ["probation"] * PROBATION_SLOTS  # type: ignore[arg-type]
    assert cap.admit(_Conn()) == "refused" and cap.num_refused == 1  # type: ignore[arg-type]
    assert not any(c.closed for c in (busy, *probes))
    probes[3].is_waiting_or_refused = True  # its head still due: answered 503 and closed for the next one
    assert cap.admit(_Conn()) == "probation" and probes[3].closed and cap.num_refused == 2  # type: ignore[arg-type]
    assert probes[3].answered == [False]  # (not closed unanswered: a client would take that for a dead server)
    idle = _Conn(is_idle=True)
    cap.release(busy)  # type: ignore[arg-type]
    assert cap.admit(idle) == "admitted"  # type: ignore[arg-type]
    assert cap.admit(_Conn()) == "admitted" and idle.closed and cap.num_evicted == 1  # type: ignore[arg-type]
    assert b"too_many_connections" in cap.refusal([])


def test_bad_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="max_http_connections"):
        WorkerConfig(max_http_connections=-1)
    assert WorkerConfig(max_http_connections=0).max_http_connections == 0  # (automatic: --max-requests + 256)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="gateway_timeout_s"):
            WorkerConfig(gateway_timeout_s=bad)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="http_keep_alive_timeout_s"):
            WorkerConfig(http_keep_alive_timeout_s=bad)
    monkeypatch.setattr(shared_connections.resource, "getrlimit", lambda _: (1024, 4096))
    assert fitted_cap(1024) == 256 and fitted_cap(100) == 100  # (a quarter of ulimit -n at most)


def test_the_soft_open_file_limit_is_raised_to_the_hard_one(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = {"now": (1024, 65536)}
    monkeypatch.setattr(shared_connections.resource, "getrlimit", lambda _: limits["now"])
    monkeypatch.setattr(shared_connections.resource, "setrlimit", lambda _, value: limits.__setitem__("now", value))
    assert http_connections.raise_open_file_limit() == 65536
    assert fitted_cap(4352) == 4352  # (4096 requests + 256: no longer cut to a quarter of 1024)

