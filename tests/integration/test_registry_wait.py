"""A prefill started before its bootstrap registry waits for it (an orchestrator starts pods in any order).

It used to give up after 30 s and exit, so under Kubernetes a registry that came up later left its prefills in a
crash loop with a growing back-off. Now, by default, it waits for as long as it takes: its native port stays
closed (no gateway selects it, no decode is sent to it) and ``/health`` answers 503 "starting"; once the registry
answers, it registers and serves. ``--registry-wait-s N`` bounds the wait (then it exits, saying why).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import httpx
import pytest
from pdtest import Procs, free_port, start_gateway, start_worker, wait_http_ok


def _health(port: int) -> tuple[int, dict[str, object]] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return None


def _listens(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_a_prefill_waits_for_a_registry_that_starts_later(procs: Procs) -> None:
    registry_port, port, http_port = free_port(), free_port(), free_port()
    registry = f"http://127.0.0.1:{registry_port}"
    prefill = procs.start("prefill", "-m", "workers.cli", "--role", "prefill", "--engine", "sim", "--port", str(port),
                          "--http-port", str(http_port), "--bootstrap", registry, "--num-pages", "64",
                          "--page-size", "4", "--log-level", "warning")
    deadline = time.monotonic() + 60
    while (answer := _health(http_port)) is None:  # (its HTTP port opens before it registers)
        assert prefill.poll() is None and time.monotonic() < deadline, procs.log("prefill")
        time.sleep(0.1)
    assert answer == (503, {"status": "starting", "role": "prefill"}), answer
    time.sleep(32)  # (past the 30 s after which it used to give up and exit)
    assert prefill.poll() is None, procs.log("prefill")
    assert "not registered with" in procs.log("prefill"), procs.log("prefill")  # (said every 10 s)
    assert _health(http_port) == (503, {"status": "starting", "role": "prefill"})
    assert not _listens(port), "the native port took connections before the prefill was registered"

    procs.start("registry", "-m", "bootstrap.cli", "--host", "127.0.0.1", "--port", str(registry_port))
    wait_http_ok(f"http://127.0.0.1:{http_port}/health", 60, prefill)
    decode = start_worker(procs, "decode", "--engine", "sim", "--num-pages", "64", "--page-size", "4",
                          bootstrap=registry)
    gateway = start_gateway(procs, "--prefill", f"pd://127.0.0.1:{port}", "--decode", decode.url)
    with httpx.Client(base_url=f"http://127.0.0.1:{gateway}", timeout=60) as http:
        r = http.post("/v1/completions", json={"model": "default", "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200, r.text


def test_a_bounded_wait_ends_with_a_reason(procs: Procs) -> None:
    registry = f"http://127.0.0.1:{free_port()}"
    prefill = procs.start("prefill", "-m", "workers.cli", "--role", "prefill", "--engine", "sim",
                          "--port", str(free_port()), "--http-port", str(free_port()), "--bootstrap", registry,
                          "--registry-wait-s", "2", "--log-level", "warning")
    assert prefill.wait(90) != 0
    log = procs.log("prefill")
    assert "could not register" in log and registry in log, log
