"""``pd_gateway_worker_failures_total`` counts the failures the gateway holds against SGLang workers too.

The relay (``gateway/sglang_relay.py``) feeds each SGLang worker's breaker from what it sees (a 5xx, no
answer, a decode silent past the first-token timeout), as the native path does from its workers' errors;
the native path counts every such failure in ``pd_gateway_worker_failures_total{worker,role,code}``. The
relay counted none: a fleet of SGLang workers showed its breakers open
(``pd_gateway_worker_breaker_opened_total``) on zero failures, and an alert on the failure rate never fired.
The stand-in workers (``sglang_standin.py``) fail on cue.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from pdtest import Procs, free_port, start_gateway, wait_http_ok


def start_standin(procs: Procs, role: str, log: Path) -> str:
    port = free_port()
    proc = procs.start(f"standin-{role}-{port}", "tests/integration/sglang_standin.py", "--role", role,
                       "--port", str(port), "--log", str(log))
    wait_http_ok(f"http://127.0.0.1:{port}/health", 30, proc)
    return f"http://127.0.0.1:{port}"


def samples(port: int, name: str) -> dict[str, float]:
    """``name``'s samples by their label text."""
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name:
            out[head[len(name):]] = float(value)
    return out


def total(port: int, name: str, **labels: str) -> float:
    return sum(v for k, v in samples(port, name).items() if all(f'{a}="{b}"' in k for a, b in labels.items()))


def test_failures_blamed_on_sglang_workers_are_counted(procs: Procs, tmp_path: Path) -> None:
    prefill = start_standin(procs, "prefill", tmp_path / "p.jsonl")
    decode = start_standin(procs, "decode", tmp_path / "d.jsonl")
    port = start_gateway(procs, "--prefill", prefill, "--decode", decode, "--max-retries", "0",
                         "--breaker-failures", "3", "--breaker-cooldown-s", "60", "--first-token-timeout-s", "0.5")
    url = f"http://127.0.0.1:{port}/generate"
    assert httpx.post(url, json={"text": "fine"}, timeout=30).status_code == 200
    assert httpx.post(url, json={"text": "PREFILL_400"}, timeout=30).status_code == 400  # the request's fault
    assert httpx.post(url, json={"text": "DECODE_429"}, timeout=30).status_code == 429  # busy: nobody's fault
    assert total(port, "pd_gateway_worker_failures_total") == 0

    assert httpx.post(url, json={"text": "PREFILL_500"}, timeout=30).status_code == 502
    assert total(port, "pd_gateway_worker_failures_total", worker=prefill, role="prefill", code="internal") == 1
    for _ in range(2):
        assert httpx.post(url, json={"text": "DECODE_500"}, timeout=30).status_code == 502
    assert total(port, "pd_gateway_worker_failures_total", worker=decode, role="decode", code="internal") == 2
    # a decode silent past the first-token timeout, its prefill done: its third failure in a row opens its breaker
    assert httpx.post(url, json={"text": "DECODE_WAITS", "stream": True}, timeout=30).status_code == 504
    assert total(port, "pd_gateway_worker_failures_total", worker=decode, role="decode", code="timeout") == 1
    assert total(port, "pd_gateway_worker_breaker_opened_total", worker=decode, role="decode") == 1
    # every failure counted once, each under its worker: three of the decode's (what opened its breaker), one of
    # the prefill's, and nothing else
    assert total(port, "pd_gateway_worker_failures_total", role="decode") == 3
    assert total(port, "pd_gateway_worker_failures_total") == 4
    codes = samples(port, "pd_gateway_worker_failures_total")
    assert all('code="internal"' in k or 'code="timeout"' in k for k in codes), codes

    # a worker removed through the admin API takes its series with it (URLs may never come back: pod IPs)
    removed = httpx.delete(f"http://127.0.0.1:{port}/workers", params={"url": prefill}, timeout=10)
    assert removed.status_code == 202, removed.text
    deadline = time.monotonic() + 10
    while total(port, "pd_gateway_worker_failures_total", worker=prefill):
        assert time.monotonic() < deadline, samples(port, "pd_gateway_worker_failures_total")
        time.sleep(0.1)
    assert total(port, "pd_gateway_worker_failures_total", worker=decode) == 3
