"""A worker added through the admin API is connected, probed and reconnected by background tasks that live as
long as the worker: their log lines must not carry the request id of the admin request that added it (hours
later, an operator searching the logs for that id would find a worker's lost connection, and a search for the
lost connection would lead to an unrelated request)."""

from __future__ import annotations

import json
import time

import httpx
from pdtest import start_worker

SIM = ("--engine", "sim", "--num-pages", "256", "--page-size", "4")


def _entries(cluster) -> list[dict]:  # type: ignore[no-untyped-def]
    name = next(getattr(p, "name", "") for p in cluster.procs.procs if getattr(p, "name", "").startswith("gateway-"))
    return [json.loads(line) for line in cluster.procs.log(name).splitlines() if line.startswith("{")]


def _wait_for(cluster, text: str, timeout_s: float = 20) -> dict:  # type: ignore[no-untyped-def, type-arg]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in _entries(cluster) if text in e["message"]]
        if found:
            return found[-1]
        time.sleep(0.1)
    raise AssertionError(f"no log line with {text!r}: {_entries(cluster)[-10:]}")


def test_an_added_workers_background_log_lines_carry_no_request_id(sim_cluster, procs) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(gateway_args=("--log-format", "json", "--log-level", "info", "--health-interval-s", "0.3"))
    extra = start_worker(procs, "decode", *SIM, "--transfer", "tcp", bootstrap=cluster.bootstrap_url,
                         name="extra-decode")
    added = httpx.post(f"{cluster.base_url}/workers", json={"url": extra.url, "role": "decode"},
                       headers={"x-request-id": "admin-add-7"}, timeout=10)
    assert added.status_code == 201, added.text
    assert _wait_for(cluster, "added decode worker")["request_id"] == "admin-add-7"  # (the request's own line)
    _wait_for(cluster, f"connected to decode worker {extra.url}")
    extra.proc.kill()
    extra.proc.wait()
    lost = _wait_for(cluster, f"lost connection to decode worker {extra.url}")
    assert lost["request_id"] == "-", lost
    tagged = [e for e in _entries(cluster) if e["request_id"] == "admin-add-7"]
    assert [e["message"] for e in tagged] == [f"added decode worker {extra.url}"], tagged
