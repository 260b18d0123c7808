"""Hypothesis fuzzing of a real registry process (``pd-bootstrap``) over raw loopback sockets.

Each example is one connection carrying bytes that are not HTTP, or an HTTP request to any route with
a body that is random JSON, a valid registration with one field set to anything, random bytes, a body
cut short (the client leaves mid-body) or one declared larger than ``--max-body-bytes``. Whatever it
was: no 5xx, an error from the app is JSON ``{"error": {...}}``, and the registry then still serves a
good registration and its lookup on another connection. Examples are derandomized.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import httpx
from conftest import RegistryProc, rank_body, topology
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MAX_BODY_BYTES = 16384
ROUTES = ["/route", "/register_dp_rank", "/query_dp_ranks", "/health", "/instances", "/metrics", "/nope"]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = sorted(rank_body())
MUTATED_RANKS = st.builds(lambda field, value, instance: {**rank_body(instance_id=instance), field: value},
                          st.sampled_from([*FIELDS, "instance_id"]), JSON_VALUES, st.text(max_size=6))
BODIES = st.one_of(
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    MUTATED_RANKS.map(lambda v: json.dumps(v).encode()),
    st.builds(lambda room, rank: json.dumps({"bootstrap_room": room, "dp_rank": rank}).encode(), JSON_VALUES,
              JSON_VALUES),
    st.builds(lambda rooms: json.dumps({"bootstrap_rooms": rooms}).encode(), JSON_VALUES),
    st.binary(max_size=64),
)


def _request(method: str, path: str, body: bytes, declared: int | None = None) -> bytes:
    length = len(body) if declared is None else declared
    head = f"{method} {path} HTTP/1.1\r\nhost: registry\r\ncontent-type: application/json\r\n"
    return f"{head}content-length: {length}\r\n\r\n".encode() + body


REQUESTS = st.one_of(
    st.binary(max_size=128),  # not HTTP
    st.builds(_request, st.sampled_from(["GET", "PUT", "POST", "DELETE", "PATCH"]), st.sampled_from(ROUTES), BODIES),
    st.builds(lambda body, extra: _request("PUT", "/route", body, len(body) + extra), BODIES,
              st.integers(1, 100)),  # cut short
    st.builds(lambda path: _request("PUT", path, b"{}", MAX_BODY_BYTES * 1000), st.sampled_from(ROUTES)),
)
GOOD = rank_body(instance_id="fuzz-good", rank_port=45678)


def _exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)  # a cut-short body ends here
        except OSError:
            return b""
        out = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except OSError:
                return out
            if not chunk:
                return out
            out += chunk


def _check(response: bytes) -> None:
    if not response.startswith(b"HTTP/1.1 "):
        return  # nothing came back (the client is gone as far as the server knows)
    status = int(response[9:12])
    assert status < 500, response[:400]
    head, _, body = response.partition(b"\r\n\r\n")
    if status >= 400 and b"application/json" in head:
        error = json.loads(body)["error"]
        assert error["message"] and error["type"] and error["code"], error


def test_registry_survives_hostile_requests(start_registry: Callable[..., RegistryProc]) -> None:
    registry = start_registry("--ttl-s", "0", "--max-body-bytes", str(MAX_BODY_BYTES))
    http = httpx.Client(base_url=registry.url, timeout=10)

    @settings(max_examples=150, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=REQUESTS)
    def one_connection(data: bytes) -> None:
        _check(_exchange(registry.port, data))
        for path in ("/health", "/instances", "/metrics"):  # (the listings show what the fuzzer registered)
            assert http.get(path).status_code == 200, path
        r = http.put("/route", json=GOOD)
        assert r.status_code == 200, r.text
        found = topology(registry.url, "fuzz-good")
        assert found.status_code == 200, found.text

    one_connection()
    lookup: dict[str, Any] = {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0,
                              "instance_id": "fuzz-good"}
    assert http.get("/route", params=lookup).json() == {"rank_ip": "127.0.0.1", "rank_port": 45678}
    http.close()
    assert registry.proc is not None and registry.proc.stderr is not None
    registry.proc.terminate()
    registry.proc.wait(10)
    log = registry.proc.stderr.read().decode(errors="replace")
    assert "Traceback" not in log, log[-3000:]  # no error went unhandled
